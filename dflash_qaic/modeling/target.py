"""The target LLM as one export-friendly program: prefill, verify and decode in one forward.

Built from a loaded Hugging Face `Qwen3ForCausalLM` or `LlamaForCausalLM`: only its weights and
its rotary tables are used; the forward is ours (static KV cache, masks from positions only).

    slots  = position, or the padding slot ctx_len - 1 for position -1        # [b, s]
    x      = embed(input_ids)                                                  # [b, s, H]
    per layer i:
        q, k, v = proj(input_layernorm(x)); (Qwen3: q_norm/k_norm per head); RoPE at position
        cache_k[i], cache_v[i] = CtxScatter(cache, slots, k / v)               # [b, kvh, ctx, hd]
        x += o_proj(softmax(q·kᵀ, key slot j visible iff j <= position) · v)   # over the full cache
        x += mlp(post_attention_layernorm(x))
    logits      = lm_head(norm(x))                                                 # [b, s, V]
    next_tokens = argmax(logits) where temperature == 0, else the lossless sample  # [b, s]
    hidden      = hidden_norm(fc(concat(taps)))      # [b, s, H], the draft's context feature

Sampling (`sample_next_tokens`, REFERENCE.md §3): p = softmax(logits / T) restricted by top-k and
top-p. Row j's proposal d is the next row's input token (when that row exists and is not
padding); it is kept with probability p(d), else row j samples from p with d removed; a row
without a proposal samples from p. The host's "accept while next_tokens[j] == proposal" then
commits exactly the lossless speculative-sampling output, and a decode call (no proposal) is
plain sampling from p. The random numbers come from the host (`random_u`).

Taps follow Hugging Face's `output_hidden_states`: layer id j is `hidden_states[j + 1]`, the raw
output of decoder layer j, except the last layer, whose entry is taken after the final norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from dflash_qaic.checkpoints import fp16_fc_scale
from dflash_qaic.contract import SAMPLING_INPUTS
from dflash_qaic.modeling.ops import cache_slots, ctx_scatter

# Score of a masked key slot: large enough to vanish in softmax, finite in fp16 (max 65504), so a
# row that sees nothing (padding, position -1) gets a uniform, finite average instead of NaN.
MASK_VALUE = -1.0e4

SUPPORTED_MODEL_TYPES = ("qwen3", "llama")


def _param(t: torch.Tensor) -> nn.Parameter:
    # .float() does not copy an fp32 tensor, so an fp32 HF model's weights are shared, not doubled.
    return nn.Parameter(t.detach().float(), requires_grad=False)


def _linear(hf: nn.Linear) -> nn.Linear:
    lin = nn.Linear(hf.in_features, hf.out_features, bias=hf.bias is not None, device="meta")
    lin.weight = _param(hf.weight)
    if hf.bias is not None:
        lin.bias = _param(hf.bias)
    return lin


class RMSNorm(nn.Module):
    """RMSNorm. Weights and activations are fp32 throughout this module, so it runs in fp32
    without explicit casts (which would only add Cast nodes to the graph)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = _param(weight)
        self.eps = float(eps)

    @classmethod
    def from_hf(cls, hf: nn.Module) -> RMSNorm:
        return cls(hf.weight, hf.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int):
    """x [b, heads, s, hd]; cos/sin [b, s, hd]. HF's rotate_half, with a static split point
    (a Python int, so the exported Slices are constant, not computed from Shape)."""
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def rope_tables(inv_freq: torch.Tensor, scaling: float, n_positions: int):
    """cos/sin [n_positions, hd] exactly as HF's rotary embedding computes them (fp32)."""
    pos = torch.arange(n_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float()[None, :]  # [n, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, hd]
    return emb.cos() * scaling, emb.sin() * scaling


def fp16_safe_fc_weight(fc_weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """fc.weight / s with s = max(sqrt(in_features) * max_row_norm / 128, 1) (QEfficient #995).

    Keeps fc's output inside fp16 range. The RMSNorm that follows is scale-invariant up to eps:
    hidden_norm(y / s) = w * y / sqrt(mean(y^2) + eps * s^2), i.e. the effective eps grows by s^2.
    That is negligible while mean(y^2) >> eps * s^2 (it is for real features); eps is kept as is.
    """
    s = fp16_fc_scale(fc_weight)
    w = fc_weight.detach().float()
    return (w / s if s > 1.0 else w), s


class MLP(nn.Module):
    def __init__(self, hf: nn.Module):
        super().__init__()
        self.gate_proj = _linear(hf.gate_proj)
        self.up_proj = _linear(hf.up_proj)
        self.down_proj = _linear(hf.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, hf: nn.Module, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hf.head_dim
        self.scale = hf.scaling
        self.q_proj = _linear(hf.q_proj)
        self.k_proj = _linear(hf.k_proj)
        self.v_proj = _linear(hf.v_proj)
        self.o_proj = _linear(hf.o_proj)
        qk_norm = getattr(hf, "q_norm", None) is not None  # Qwen3: per-head RMSNorm before RoPE
        self.q_norm = RMSNorm.from_hf(hf.q_norm) if qk_norm else None
        self.k_norm = RMSNorm.from_hf(hf.k_norm) if qk_norm else None

    def forward(self, x, cos, sin, slots, visible, cache_k, cache_v):
        # x [b, s, H]; cos/sin [b, s, hd]; slots [b, s]; visible [b, s, ctx] bool
        # cache_k/cache_v [b, kvh, ctx, hd]
        b, s, _ = x.shape
        nh, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(b, s, nh, hd)
        k = self.k_proj(x).view(b, s, kvh, hd)
        v = self.v_proj(x).view(b, s, kvh, hd).transpose(1, 2)  # [b, kvh, s, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin, hd)  # [b, nh, s, hd]
        k = apply_rope(k.transpose(1, 2), cos, sin, hd)  # [b, kvh, s, hd]

        cache_k = ctx_scatter(cache_k, slots, k)  # [b, kvh, ctx, hd]
        cache_v = ctx_scatter(cache_v, slots, v)

        # GQA without repeating the cache: query head h uses kv head h // g, so fold each kv
        # head's g query heads into the row axis: [b, nh, s, hd] -> [b, kvh, g*s, hd].
        g = nh // kvh
        q = q.reshape(b, kvh, g * s, hd) * self.scale
        scores = (q @ cache_k.transpose(2, 3)).view(b, kvh, g, s, -1)  # [b, kvh, g, s, ctx]
        scores = torch.where(visible[:, None, None], scores, MASK_VALUE)
        probs = scores.softmax(dim=-1).view(b, kvh, g * s, -1)  # [b, kvh, g*s, ctx]
        out = (probs @ cache_v).view(b, nh, s, hd)  # [b, nh, s, hd]
        out = out.transpose(1, 2).reshape(b, s, nh * hd)
        return self.o_proj(out), cache_k, cache_v


class DecoderLayer(nn.Module):
    def __init__(self, hf: nn.Module, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.input_layernorm = RMSNorm.from_hf(hf.input_layernorm)
        self.self_attn = Attention(hf.self_attn, n_heads, n_kv_heads)
        self.post_attention_layernorm = RMSNorm.from_hf(hf.post_attention_layernorm)
        self.mlp = MLP(hf.mlp)

    def forward(self, x, cos, sin, slots, visible, cache_k, cache_v):
        a, cache_k, cache_v = self.self_attn(
            self.input_layernorm(x), cos, sin, slots, visible, cache_k, cache_v
        )
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache_k, cache_v


# ---------------------------------------------------------------- sampling
#
# Precision (the compiler runs this in fp16). The math works on unnormalised weights
# w = exp((logit - max) / T) <= 1 (the most likely token has w = 1), never on normalised
# probabilities, and every comparison is made against sums computed in the same graph:
#   accept   u1 * sum(w) < w[d]                                   (p(d) = w[d] / sum(w))
#   sample   first index where cumsum(w') > u2 * sum(w')          (w' = w with d removed)
# so fp16 rounding of the sums moves a threshold but never sends the search off the end, and
# the search returns a token of positive weight even when a runtime rounds two uses of one
# value differently (ONNX Runtime's fp16 run does: it computes some ops in fp32 and drops
# casts), see `_first_above`.
# Sums and cumulative sums are hierarchical: the vocabulary is a tree of `levels` levels with
# `branch` ≈ V^(1/levels) <= 64 children per node (3 levels of 54 for V = 152k), and the inverse
# CDF descends it, choosing a child on the cumulative sum of its siblings' totals. A token then
# competes for fp16 resolution only with ~64 siblings per level. (A single running sum over V in
# fp16 drops every token whose weight is below ~2^-12 of the running total: most of a long
# tail.) Remaining caveat for large vocabularies in fp16: a node whose total is below ~2^-12 of
# its siblings' running sum is still rounded away, at most ~branch · 2^-12 ≈ 1.3% of the mass per
# level in the worst case; a numpy simulation of fp16 cumulative sums over V = 152k puts the
# total-variation error at ≈ 0.5–1% for 3 levels (vs ≈ 2–8% for 2 levels and ≈ 30–60% for one
# running sum). Weights below fp16's subnormal floor (~6e-8 of the top token's) are zero, and
# sum(w) overflows fp16 only for a near-uniform distribution over more than 65504 tokens.
# Keeping these nodes in fp32 (a node-precision override in the compiler) removes all of it.
# `random_u` itself arrives in fp16 on the device: p(d) and the inverse CDF are quantised to
# 2^-11 ≈ 5e-4.

# Largest uniform the sampler uses: 1 - 2**-11, exact in fp32 and fp16 (fp16 rounds a uniform
# just below 1 up to 1.0, which would make "u * mass < mass" false).
U_MAX = 1.0 - 2.0**-11
MAX_BRANCH = 64  # children per node of the vocabulary tree
# Most likely tokens the top-k / top-p thresholds are read from (QEfficient's on-device sampler
# bounds its candidates the same way, max_top_k_ids = 512): a TopK of 512 costs a small
# fraction of a sort of the vocabulary (≈ 1 ms vs ≈ 60 ms per row for V = 152k in ONNX Runtime).
SAMPLING_CANDIDATES = 512


def vocab_tree(vocab: int) -> tuple[int, int]:
    """(levels, branch): at least 2 levels, branch = ceil(V^(1/levels)) <= MAX_BRANCH."""
    levels = max(2, math.ceil(math.log(max(vocab, 2)) / math.log(MAX_BRANCH)))
    branch = max(2, math.ceil(vocab ** (1.0 / levels)))
    while branch**levels < vocab:  # float rounding of the root
        branch += 1
    return levels, branch


def _tree(x: torch.Tensor, vocab: int) -> torch.Tensor:
    """[b, s, V] -> [b, s, branch, …, branch] (levels axes, the root's children first), zero
    padded at the end (static Concat and Reshape, so every shape stays inferable)."""
    levels, branch = vocab_tree(vocab)
    if branch**levels > vocab:
        pad = branch**levels - vocab
        while pad > 0:  # a slice of x is at most V long
            n = min(pad, vocab)
            x = torch.cat([x, x[..., :n] * 0], dim=-1)
            pad -= n
    return x.view(x.shape[0], x.shape[1], *([branch] * levels))


def _untree(x: torch.Tensor, vocab: int) -> torch.Tensor:
    """Inverse of `_tree`: [b, s, branch, …] -> [b, s, V]."""
    return x.view(x.shape[0], x.shape[1], -1)[..., :vocab]


def _node_sums(x: torch.Tensor, vocab: int) -> list[torch.Tensor]:
    """Totals per tree level, leaves first: sums[0] = the leaves [b, s, n, …, n], sums[k] =
    totals of the level-k nodes [b, s, n, …] (levels - k axes). A total is the last entry of
    the cumulative sum of its children, the same op the descent uses."""
    sums = [_tree(x, vocab)]
    for _ in range(vocab_tree(vocab)[0] - 1):
        sums.append(sums[-1].cumsum(-1)[..., -1])
    return sums


def _exclusive(c: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum from an inclusive one (the same values, shifted by one)."""
    return torch.cat([c[..., :1] * 0, c[..., :-1]], dim=-1)


def _first_above(c: torch.Tensor, t: torch.Tensor, positive: torch.Tensor, n: int) -> torch.Tensor:
    """Index of the first entry of the cumulative sum c [b, s, n] that exceeds t [b, s] >= 0.

    That entry has a positive increment, so a zero-weight entry is never chosen. If rounding
    left no entry above t, the last entry of positive weight (`positive` [b, s, n] bool) is
    taken. Nothing here assumes that two uses of one value see the same rounding (a runtime
    may keep one consumer's copy in fp32 and round another's to fp16): the answer always has
    positive weight.
    """
    above = c > t[..., None]
    first = above.to(torch.int32).argmax(-1)
    idx = torch.arange(n, device=c.device)
    last = torch.where(positive, idx, 0).amax(-1)
    return torch.where(above[..., -1], first, last)


def _select(x: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
    """x [b, s, n, …] at the child marked by onehot [b, s, n] -> [b, s, …] (a sum of one term
    and zeros: exact in any precision)."""
    for _ in range(x.dim() - 3):
        onehot = onehot[..., None]
    return torch.where(onehot, x, 0.0).sum(2)


def inverse_cdf(x: torch.Tensor, u: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A token drawn from the unnormalised weights x [b, s, V] >= 0 by the uniform u [b, s]:
    the first token whose cumulative weight exceeds u · sum(x), found by descending the
    vocabulary tree. Returns (token [b, s] int64, sum(x) [b, s]); with sum(x) = 0, token 0."""
    levels, n = vocab_tree(vocab)
    sums = _node_sums(x, vocab)  # leaves first
    c = sums[-1].cumsum(-1)  # [b, s, n]: the root's children
    mass = c[..., -1]
    rest = u * mass  # >= 0
    token = None
    for level in range(levels - 1, -1, -1):
        nodes = sums[level]  # [b, s, n]: children of the node chosen so far
        if level < levels - 1:
            c = nodes.cumsum(-1)
        j = _first_above(c, rest, nodes > 0, n)  # [b, s]
        onehot = torch.arange(n, device=x.device) == j[..., None]  # [b, s, n]
        rest = (rest - torch.where(onehot, _exclusive(c), 0.0).sum(-1)).clamp(min=0.0)
        token = j if token is None else token * n + j
        sums = [_select(s, onehot) for s in sums[:level]] + sums[level:]
    return token, mass


def _tree_total(x: torch.Tensor, vocab: int) -> torch.Tensor:
    """sum(x) over the vocabulary [b, s], level by level."""
    return _node_sums(x, vocab)[-1].cumsum(-1)[..., -1]


def sampling_weights(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    vocab: int,
    candidates: int = SAMPLING_CANDIDATES,
) -> torch.Tensor:
    """Unnormalised target distribution after temperature, top-k and top-p.

    logits [b, s, V]; temperature, top_k, top_p [b] (top_k 0 = off, top_p >= 1 = off; a
    temperature of 0 is treated as 1 here, the caller takes the argmax for it).
    Returns w [b, s, V] >= 0 with p = w / sum(w) and w = 1 at the most likely token.
    Like Hugging Face's warpers, top-k keeps every token tied with the k-th, and top-p keeps the
    smallest head of the (top-k filtered) distribution whose mass reaches top_p.

    The thresholds come from the `candidates` most likely tokens (one TopK, not a sort of the
    vocabulary): top-k is exact for k <= candidates (a larger k counts as `candidates`; the
    runtime refuses one), top-p is exact whenever its head fits in the candidates, and a row
    whose head would not (top-k off, the candidates' mass below top_p) keeps the whole
    distribution, i.e. gains at most 1 - top_p of mass. With V <= candidates all is exact.
    Sampling itself always runs over the whole vocabulary.
    """
    n = min(candidates, vocab)
    t = torch.where(temperature > 0, temperature, 1.0)[:, None, None]  # [b, 1, 1]
    srt = logits.topk(n, dim=-1).values  # [b, s, n], descending
    top = srt[..., :1]  # [b, s, 1]
    rank = torch.arange(n, device=logits.device)
    k = top_k[:, None, None]  # [b, 1, 1]
    k_on = k > 0
    keep_k = (rank < k) | ~k_on  # [b, 1, n]
    e = torch.where(keep_k, torch.exp((srt - top) / t), 0.0)  # [b, s, n] sorted weights
    w_all = torch.exp((logits - top) / t)  # [b, s, V]
    # top-p's reference mass: the top-k head, or the whole vocabulary when top-k is off
    head = _tree_total(e, n)[..., None]  # [b, s, 1]
    mass = torch.where(k_on, head, _tree_total(w_all, vocab)[..., None])
    # mass ahead of each sorted candidate: the exclusive prefix of its siblings, per tree level
    sums = _node_sums(e, n)
    before = _exclusive(sums[0].cumsum(-1))
    for level in range(1, len(sums)):
        ahead = _exclusive(sums[level].cumsum(-1))
        for _ in range(level):
            ahead = ahead[..., None]
        before = before + ahead
    p = top_p[:, None, None]
    keep = keep_k & ((_untree(before, n) < p * mass) | (p >= 1.0))  # a prefix of the order
    # no filter at all, or a top-p head longer than the candidates: keep the whole vocabulary
    keep_all = ~k_on & ((p >= 1.0) | (head < p * mass))  # [b, s, 1]
    # the top token is always kept (the clamp covers a top_p that fp16 rounds to 0)
    n_keep = keep.sum(-1, keepdim=True).clamp(min=1)  # [b, s, 1]
    threshold = srt.gather(-1, n_keep - 1)  # smallest kept logit
    return torch.where((logits >= threshold) | keep_all, w_all, 0.0)


def sample_next_tokens(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    random_u: torch.Tensor,
    vocab: int,
    candidates: int = SAMPLING_CANDIDATES,
) -> torch.Tensor:
    """The token committed at every row under the lossless rule (REFERENCE.md §3).

    logits [b, s, V]; input_ids, position_ids [b, s]; temperature, top_k, top_p [b];
    random_u [b, s, 2] uniforms in [0, 1). Row j's proposal d is input_ids[j + 1] when row
    j + 1 exists and is not padding. With a proposal: d if u1 < p(d), else a sample (by u2)
    from p with d removed and renormalised, so a rejected row never returns d. Without one: a
    sample from p. Rows with temperature 0 return the argmax of the logits, exactly.
    p is `sampling_weights` (see there for `candidates`).
    """
    greedy = logits.argmax(dim=-1)  # [b, s]
    w = sampling_weights(logits, temperature, top_k, top_p, vocab, candidates)  # [b, s, V]
    u = random_u.clamp(0.0, U_MAX)
    u_accept, u_sample = u[..., 0], u[..., 1]  # [b, s]
    # proposal of row j: the next row's input token, if that row exists and is not padding
    proposal = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)  # [b, s]
    next_pos = torch.cat([position_ids[:, 1:], position_ids[:, :1] * 0 - 1], dim=1)
    has = next_pos >= 0  # [b, s]
    w_d = torch.where(has, w.gather(-1, proposal[..., None])[..., 0], 0.0)  # [b, s]
    total = _tree_total(w, vocab)  # [b, s]
    hit = (torch.arange(vocab, device=logits.device) == proposal[..., None]) & has[..., None]
    # a sample from p with d removed (from p itself where there is no proposal)
    sampled, mass = inverse_cdf(torch.where(hit, 0.0, w), u_sample, vocab)
    # an empty residual (all of p on d) can only mean d: accept it
    accept = has & ((u_accept * total < w_d) | (mass <= 0))
    chosen = torch.where(accept, proposal, sampled)
    return torch.where(temperature[:, None] == 0, greedy, chosen)


class ExportTarget(nn.Module):
    """forward(input_ids, position_ids, [temperature, top_k, top_p, random_u], *past) ->
    (next_tokens, hidden_states, [logits], *retained past), past as past_key.0, past_value.0, ...
    The sampling inputs are there when `sampling` (the default; see contract.TargetIO).
    """

    def __init__(
        self,
        embed: torch.Tensor,
        layers: Sequence[DecoderLayer],
        norm: RMSNorm,
        lm_head: nn.Linear,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        fc_weight: torch.Tensor,
        hidden_norm: RMSNorm,
        target_layer_ids: Sequence[int],
        emit_logits: bool = False,
        sampling: bool = True,
        sampling_candidates: int = SAMPLING_CANDIDATES,
    ):
        super().__init__()
        # The head is stored transposed, [H, V], and multiplied by directly. A tied head also
        # serves as the embedding (a Gather along V), so the V×H table is stored once; with
        # F.linear the exporter would fold a transposed copy next to the embedding (≈1.5 GB
        # more for Qwen3-4B).
        if lm_head.bias is not None:
            raise ValueError("an lm_head with a bias is not supported")
        self.tied = lm_head.weight.data_ptr() == embed.data_ptr()
        self.vocab_size = lm_head.out_features
        self.head_t = _param(lm_head.weight.detach().float().t().contiguous())  # [H, V]
        self.embed = None if self.tied else _param(embed)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.register_buffer("rope_cos", rope_cos, persistent=False)  # [ctx_len, hd]
        self.register_buffer("rope_sin", rope_sin, persistent=False)
        self.fc = nn.Linear(fc_weight.shape[1], fc_weight.shape[0], bias=False, device="meta")
        self.fc.weight = _param(fc_weight)
        self.hidden_norm = hidden_norm
        self.target_layer_ids = [int(j) for j in target_layer_ids]
        self.emit_logits = emit_logits
        self.sampling = sampling
        self.sampling_candidates = min(int(sampling_candidates), self.vocab_size)
        self.fc_scale = 1.0

    @property
    def ctx_len(self) -> int:
        return self.rope_cos.shape[0]

    @classmethod
    def from_hf(
        cls,
        hf_model: nn.Module,
        fc_weight: torch.Tensor,
        hidden_norm_weight: torch.Tensor,
        hidden_norm_eps: float,
        target_layer_ids: Sequence[int],
        ctx_len: int,
        emit_logits: bool = False,
        sampling: bool = True,
        sampling_candidates: int = SAMPLING_CANDIDATES,
    ) -> ExportTarget:
        cfg = hf_model.config
        _check_supported(hf_model, fc_weight, target_layer_ids)
        base = hf_model.model
        layers = [
            DecoderLayer(layer, cfg.num_attention_heads, cfg.num_key_value_heads)
            for layer in base.layers
        ]
        rotary = base.rotary_emb  # inv_freq / attention_scaling already hold any rope scaling
        cos, sin = rope_tables(rotary.inv_freq, float(rotary.attention_scaling), ctx_len)
        fc_w, fc_scale = fp16_safe_fc_weight(fc_weight)
        target = cls(
            embed=base.embed_tokens.weight,
            layers=layers,
            norm=RMSNorm.from_hf(base.norm),
            lm_head=hf_model.lm_head,  # tied or not: whatever HF's head holds
            rope_cos=cos,
            rope_sin=sin,
            fc_weight=fc_w,
            hidden_norm=RMSNorm(hidden_norm_weight, hidden_norm_eps),
            target_layer_ids=target_layer_ids,
            emit_logits=emit_logits,
            sampling=sampling,
            sampling_candidates=sampling_candidates,
        )
        target.fc_scale = fc_scale  # fc.weight was divided by this (1.0: unchanged)
        return target

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *rest: torch.Tensor):
        # input_ids, position_ids [b, s] int64 (position -1 = padding); with sampling, then
        # temperature, top_k, top_p [b] and random_u [b, s, 2]; then past[2i], past[2i+1]
        # = key / value cache of layer i [b, kvh, ctx, hd]
        n_sampling = len(SAMPLING_INPUTS) if self.sampling else 0
        sampling, past = rest[:n_sampling], rest[n_sampling:]
        ctx_len = self.ctx_len
        slots = cache_slots(position_ids, ctx_len)  # [b, s]; -1 -> padding slot ctx_len - 1
        rope_pos = position_ids.clamp(min=0)
        cos, sin = self.rope_cos[rope_pos], self.rope_sin[rope_pos]  # [b, s, hd]
        # key slot j is visible to a query iff j <= its position: causal within the call, stale
        # slots after a rejection hidden, and a padding row (position -1) sees nothing.
        kv_index = torch.arange(ctx_len, device=position_ids.device)
        visible = kv_index <= position_ids[..., None]  # [b, s, ctx]

        if self.tied:  # [H, V] gathered along V -> [H, b·s] -> [b, s, H]
            x = self.head_t.index_select(1, input_ids.reshape(-1)).t().reshape(*input_ids.shape, -1)
        else:
            x = F.embedding(input_ids, self.embed)  # [b, s, H]
        last = len(self.layers) - 1
        taps, retained = {}, []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, slots, visible, past[2 * i], past[2 * i + 1])
            retained += [k, v]
            if i in self.target_layer_ids and i != last:
                taps[i] = x  # raw decoder-layer output = HF hidden_states[i + 1]
        x = self.norm(x)  # [b, s, H]
        if last in self.target_layer_ids:
            taps[last] = x  # HF's last hidden_states entry is taken after the final norm

        logits = x @ self.head_t  # [b, s, V]
        if self.sampling:
            vocab = self.vocab_size
            next_tokens = sample_next_tokens(
                logits, input_ids, position_ids, *sampling, vocab, self.sampling_candidates
            )
        else:
            next_tokens = logits.argmax(dim=-1)  # [b, s] int64
        feats = torch.cat([taps[j] for j in self.target_layer_ids], dim=-1)  # [b, s, k*H]
        hidden = self.hidden_norm(self.fc(feats))  # [b, s, H]
        extra = (logits,) if self.emit_logits else ()
        return (next_tokens, hidden, *extra, *retained)


def _check_supported(hf_model: nn.Module, fc_weight: torch.Tensor, target_layer_ids) -> None:
    cfg = hf_model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported target model_type {cfg.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (only silu)")
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"sliding-window layers are not supported: {sorted(set(layer_types))}")
    rope_type = getattr(hf_model.model.rotary_emb, "rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} depends on sequence length; not supported")
    n_layers = cfg.num_hidden_layers
    ids = list(target_layer_ids)
    if not ids or any(not 0 <= j < n_layers for j in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids {ids} must be distinct layer ids in [0, {n_layers})")
    expected = (cfg.hidden_size, len(ids) * cfg.hidden_size)
    if tuple(fc_weight.shape) != expected:
        raise ValueError(f"fc weight shape {tuple(fc_weight.shape)} != {expected}")
