"""The DFlash draft in plain PyTorch (docs/DESIGN.md, Algorithm), loading the published
checkpoint format.

    ctx   = hidden_norm(fc(concat(target features)))         # [b, n, H]  (done by the target program)
    h     = embed([anchor, MASK, …, MASK]) · input_scale     # [b, B, H]
    per layer:
        x      = input_layernorm(h)
        q      = rope(q_norm(q_proj(x)))                      # queries from the block only
        k, v   = [rope(k_norm(k_proj(ctx))) ; rope(k_norm(k_proj(x)))], [v_proj(ctx) ; v_proj(x)]
        h      = h + o_proj(attention(q, k, v))               # b16: no mask, every key visible
        h      = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h)) · output_multiplier (softcapped); row j predicts position start + j.

The draft knobs of published drafts (docs/DESIGN.md, Draft knobs) change a few of these lines:
q/k/v/o biases (`attention_bias`); a learned per-head sink logit joining each softmax and then
dropped (`attention_sink_bias`); RoPE on interleaved pairs (`is_neox_style: false`); a separate
mask embedding replacing embed[MASK]; a reduced draft vocabulary: the draft's own head over
`draft_vocab_size` tokens, its proposals mapped to target ids d + d2t[d] in the program.

Layers follow the config (`DraftConfig.layer_attention`): a sliding layer is causal inside the
block (unless `is_causal` says otherwise) and sees a key only within `sliding_window` of the
query; in the program its cache is a ring of `sliding_window` slots (docs/DESIGN.md, Sliding
drafts). The layers are written so that context K/V can come from anywhere: computed from the
whole context here (`DFlashDraft.forward`), or read from a static cache in the export module.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dflash_qaic.checkpoints import DraftConfig
from dflash_qaic.contract import (
    BATCH_INDEX,
    COMP_CTX_LENGTHS,
    CONFIDENCE_TOPK,
    DRAFT_CONFIDENCE,
    DRAFT_PAIR_LOGPROBS,
    DRAFT_Q_IDS,
    DRAFT_Q_PROBS,
    DRAFT_RANDOM_U,
    DRAFT_TOKENS,
    DRAFT_TOP_IDS,
    DRAFT_TOP_LOGPROBS,
    INPUT_IDS,
    LOGITS,
    POSITION_IDS,
    POSITION_IDS_TARGET,
    TARGET_HIDDEN,
    TEMPERATURE,
    past_key,
    past_value,
)
from dflash_qaic.contract import retained as retained_name
from dflash_qaic.drafts import read_mask_embedding, read_vocab_map
from dflash_qaic.modeling.layers import (
    MASK_VALUE,
    MLP,
    RMSNorm,
    Rope,
    RopeTable,
    apply_rope,
    embed_rows,
    frozen,
    vocab_tables,
)
from dflash_qaic.modeling.ops import (
    cache_reads,
    cache_rows,
    cache_slots,
    ring_held,
    ring_slots,
    update_cache,
)
from dflash_qaic.modeling.penalties import proposal_logits

__all__ = [
    "CandidateSelector",
    "DFlashDraft",
    "DraftAttention",
    "DraftLayer",
    "DynamicCausalConv",
    "ExportDraft",
    "apply_rope",
    "interleaved_table",
]


def interleaved_table(t: torch.Tensor) -> torch.Tensor:
    """A half-split cos/sin table [..., hd] (frequency i at i and hd/2 + i) -> the interleaved
    layout's (frequency i at 2i and 2i + 1), for `is_neox_style: false`."""
    hd = int(t.shape[-1])
    return t[..., : hd // 2].repeat_interleave(2, dim=-1)


def rotate_pairs(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The interleaved layout's rotate_half: (x0, x1, x2, x3, …) -> (−x1, x0, −x3, x2, …)."""
    pairs = x.unflatten(-1, (head_dim // 2, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def rope(x: torch.Tensor, cos, sin, head_dim: int, interleaved: bool) -> torch.Tensor:
    """RoPE of x [b, heads, s, hd] in either layout (cos/sin already in that layout)."""
    if not interleaved:
        return apply_rope(x, cos, sin, head_dim)
    return x * cos[:, None] + rotate_pairs(x, head_dim) * sin[:, None]


class DraftAttention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        H, hd = c.hidden_size, c.head_dim
        self.n_heads, self.n_kv, self.hd = c.num_heads, c.num_kv_heads, hd
        bias = bool(getattr(c, "attention_bias", False))  # q/k/v/o biases (`attention_bias`)
        self.q_proj = nn.Linear(H, c.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(H, c.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(H, c.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(c.num_heads * hd, H, bias=bias)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)
        self.interleaved = not getattr(c, "is_neox_style", True)  # a plain attribute
        self.attention_sink_bias = None  # `attention_sink_bias`: one logit per query head
        if getattr(c, "attention_sink_bias", False):
            self.attention_sink_bias = nn.Parameter(torch.zeros(c.num_heads))

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K/V rows of x [b, n, H] at the positions of cos/sin -> k, v [b, n_kv, n, hd]."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv, self.hd).transpose(1, 2)
        return rope(k, cos, sin, self.hd, self.interleaved), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_mask=None, blk_mask=None):
        """x [b, B, H] (normed block); ctx_k/ctx_v [b, n_kv, n, hd] already roped;
        ctx_mask: optional additive [b, 1, 1 or g·B, n] (0 visible, large negative hidden);
        blk_mask: optional additive [g·B, B] over the block's own keys (`block_mask`)."""
        b, B, _ = x.shape
        nh, kvh, hd = self.n_heads, self.n_kv, self.hd
        q = self.q_norm(self.q_proj(x).view(b, B, nh, hd)).transpose(1, 2)
        q = rope(q, cos, sin, hd, self.interleaved)  # [b, nh, B, hd]
        blk_k, blk_v = self.kv(x, cos, sin)  # the block's own K/V: used here, never cached
        # GQA without repeating K/V: query head h uses kv head h // g, so each kv head's g query
        # heads are folded into the row axis, [b, nh, B, hd] -> [b, kvh, g*B, hd]. The context
        # and the block are scored apart and only the scores are joined: neither the cached
        # keys nor the values are ever copied (a repeat or a concat of K/V copies the window
        # every layer, every call). q is scaled first (fp16: unscaled products are sqrt(hd)×).
        q = q.reshape(b, kvh, (nh // kvh) * B, hd) * hd**-0.5
        s_ctx = q @ ctx_k.transpose(-1, -2)  # [b, kvh, g*B, n]
        if ctx_mask is not None:
            s_ctx = s_ctx + ctx_mask  # block keys are always visible
        s_blk = q @ blk_k.transpose(-1, -2)  # [b, kvh, g*B, B]
        if blk_mask is not None:
            s_blk = s_blk + blk_mask  # a causal / windowed layer
        parts = [s_ctx, s_blk]
        if self.attention_sink_bias is not None:  # the sink column of row (head, t), then
            g = nh // kvh  # dropped: a row's weights sum to 1 − p_sink. The weight enters by an
            # Add with a batch-shaped zero (a Reshape of it alone would be constant-folded by the
            # exporter into a tensor with no checkpoint source)
            sink = x.new_zeros(b, 1) + self.attention_sink_bias  # [b, nh]
            sink = sink.view(b, kvh, g, 1).expand(b, kvh, g, B)
            parts.append(sink.reshape(b, kvh, g * B, 1))
        scores = torch.cat(parts, dim=-1)  # [b, kvh, g*B, n + B (+ 1)]
        if scores.dtype == torch.float32:  # a Python branch: an fp32 graph gets no Casts
            probs = scores.softmax(dim=-1)
        else:  # training below fp32: the softmax in fp32
            probs = scores.float().softmax(dim=-1).to(scores.dtype)
        n = ctx_k.shape[2]
        ctx = probs[..., :n] @ ctx_v
        # the block's columns (before the sink's, when there is one: without, the plain slice
        # keeps a sink-less draft's graph as it was)
        blk = probs[..., n:] if self.attention_sink_bias is None else probs[..., n : n + B]
        out = ctx + blk @ blk_v  # [b, kvh, g*B, hd]
        out = out.reshape(b, nh, B, hd).transpose(1, 2).reshape(b, B, nh * hd)
        return self.o_proj(out)


def block_mask(B: int, g: int, causal: bool, window: int | None) -> torch.Tensor | None:
    """Additive mask over the block's own keys, rows folded as the queries are ([g·B, B]: row
    r is block row r % B): key j visible to row i iff (not causal or j ≤ i) and, with a window,
    i − j < window (and, not causal, j − i < window). None when every key is visible (b16).
    Built in Python: a constant of the graph."""

    def visible(i: int, j: int) -> bool:
        if causal:
            return j <= i and (window is None or i - j < window)
        return window is None or abs(i - j) < window

    rows = [[0.0 if visible(i, j) else MASK_VALUE for j in range(B)] for i in range(B)]
    if all(v == 0.0 for row in rows for v in row):
        return None
    return torch.tensor(rows * g)


def window_mask(held: torch.Tensor, block_positions: torch.Tensor, window: int, g: int):
    """Additive mask of context keys at positions `held` [b, n] (−1 or below: no key) for a
    windowed layer's queries at `block_positions` [b, B] -> [b, 1, g·B, n]: key p visible to
    query Q iff p ≥ 0 and Q − p < window (context keys precede the block: causal holds)."""
    visible = (held[:, None, :] >= 0) & (block_positions[:, :, None] - held[:, None, :] < window)
    return torch.where(visible, 0.0, MASK_VALUE)[:, None].repeat(1, 1, g, 1)


def causal_conv(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """DFlash-2's causal conv over the block's positions, one kernel per position and channel:
    out[t, c] = Σ_o kernel[t, o, c] · x[t − o, c]   (x before the block is 0)
    x [b, B, H]; kernel [b, B, K, H]. All K shifts of the block in one MatMul with a constant
    [B·K, B] 0/1 matrix (row t·K + o reads row t − o), then one product and one sum: a few
    graph nodes, whatever K is (a Pad or Slice sized from the traced shape would leave the
    graph's shapes unresolved)."""
    B, H, K = int(x.shape[1]), int(x.shape[2]), int(kernel.shape[2])  # static: no Shape ops
    shifts = torch.tensor(
        [[float(j == t - o) for j in range(B)] for t in range(B) for o in range(K)]
    )  # [B·K, B], row t·K + o reads row t − o; an offset ≥ B is all zeros (before the block)
    xs = (shifts.to(x.dtype) @ x).view(-1, B, K, H)  # [b, B, K, H]
    return (kernel * xs).sum(2)


class DynamicCausalConv(nn.Module):
    """DFlash-2's grouped dynamic conv around one sub-block (attention or MLP) of a draft
    layer: `prepare` convolves the sub-block's input x, `finish` its output, with kernels
    base_kernel[0 | 1] + a per-position part projected from x, shared by each group of G
    channels: kernel [b, B, 2, K, H] = base [2, K, H] + repeat_G(kernel_projection(x))."""

    def __init__(self, H: int, K: int, G: int):
        super().__init__()
        self.H, self.K, self.G = H, K, G  # plain ints: static dims in the graph
        self.base_kernel = nn.Parameter(torch.zeros(2, K, H))  # [2, K, H]
        self.kernel_projection = nn.Linear(H, 2 * K * (H // G), bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, H = int(x.shape[1]), self.H  # plain ints: no Shape ops in the graph
        dyn = self.kernel_projection(x).view(-1, B, 2, self.K, H // self.G, 1)
        # the weight enters by an Add with the input's part (a Slice of it alone would be
        # constant-folded by the exporter into a tensor with no checkpoint source)
        kernel = (dyn * x.new_ones(self.G)).view(-1, B, 2, self.K, H)  # each group's G channels
        kernel = kernel + self.base_kernel  # [b, B, 2, K, H]
        return causal_conv(x, kernel[:, :, 0]), kernel[:, :, 1]

    def finish(self, y: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        return causal_conv(y, kernel)


def walk(choice: torch.Tensor) -> torch.Tensor:
    """choice [b, n, k]: row j's candidate after predecessor a is choice[:, j, a] (row 0 reads
    a = 0, the anchor) -> the path's candidate index of every row, [b, n]:
    index_j = f_j(f_{j−1}(… f_0(0))), f_j = choice[:, j]. Computed as prefix compositions by
    doubling: after step s, row j holds f_j ∘ … ∘ f_{max(0, j−2^(s+1)+1)}; ⌈log2 n⌉ steps of one
    Gather each (composition is a Gather: (g ∘ h)(a) = g[h[a]]), no per-row slices."""
    n, k = int(choice.shape[1]), int(choice.shape[2])
    identity = torch.arange(k, device=choice.device).expand_as(choice)  # [b, n, k]
    prefix, step = choice, 1
    while step < n:
        earlier = torch.cat([identity[:, :step], prefix[:, : n - step]], dim=1)  # row j − step
        prefix = prefix.gather(-1, earlier)  # row j: (its maps) ∘ (row j − step's maps)
        step *= 2
    return prefix[:, :, 0]  # every map applied to the anchor's index 0


#: the selector's smallest temperature: fp16's smallest normal, 2^-14 (below it, T would round to
#: 0 on the card); q at T ≤ this is the argmax up to score gaps of ~1e-3, and the target's
#: q-aware verify reads the q returned, so sampling stays lossless
MIN_TEMPERATURE = 2.0**-14


class CandidateSelector(nn.Module):
    """DFlash-2's selector: walks the block left to right over each row's top-k logits,
    scoring candidate c after predecessor p as unary(c) + ⟨pred(p) · proj(h), succ(c)⟩ and
    keeping the best (greedy), or drawing from softmax(scores / T) (sampling). No control flow
    in a graph: the rows' choices are computed for every predecessor at once, then composed."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        V, r = int(c.vocab_size), c.selector_rank
        self.top_k = c.selector_top_k
        self.hidden_projection = nn.Linear(c.hidden_size, r, bias=False)
        self.predecessor_codebook = nn.Embedding(V, r)
        self.successor_codebook = nn.Embedding(V, r)

    def scores(self, hidden, logits, anchor, k: int):
        """(cand [b, n, k]: each row's k most likely ids, scores [b, n, k(prev), k]: each
        candidate's score after each of the previous row's, row 0's after the anchor)."""
        unary, cand = logits.topk(k, dim=-1)  # [b, n, k]
        proj = self.hidden_projection(hidden)  # [b, n, r]
        succ = self.successor_codebook(cand)  # [b, n, k, r]
        # the predecessor codes: the anchor's for row 0, row j−1's candidates' for row j
        copies = torch.ones(k, 1, dtype=proj.dtype, device=proj.device)  # [k, 1]
        pred = torch.cat(
            [
                self.predecessor_codebook(anchor)[:, None, None, :] * copies,
                self.predecessor_codebook(cand[:, :-1]),
            ],
            dim=1,
        )  # [b, n, k, r] (row 0: k copies of the anchor's)
        query = pred * proj[:, :, None, :]  # [b, n, k, r]
        scores = unary[:, :, None, :] + query @ succ.transpose(-1, -2)  # [b, n, k(prev), k]
        return cand, scores

    def pair_logprobs(self, hidden, logits, anchor, k: int):
        """log q of each of a row's first k candidates after each of the previous row's
        [b, n, k, k] (contract.DRAFT_PAIR_LOGPROBS; fp16-safe: log_softmax subtracts the max)."""
        return self.scores(hidden, logits, anchor, k)[1].log_softmax(-1)

    def forward(self, hidden, logits, anchor, temperature=None, random_u=None):
        """hidden [b, n, H] (normed draft rows 1 … B−1), logits [b, n, V], anchor [b] ->
        the greedy path [b, n]. With temperature [b] and random_u [b, n] (uniforms in [0, 1)):
        rows of temperature > 0 draw each step from q = softmax(scores / T) (the inverse CDF
        over the k candidates), the others take the argmax (q one-hot there); returns
        (path [b, n], candidates [b, n, k], q [b, n, k]).

        The walk is sequential only through the chosen index: every row's scores for every
        predecessor among the previous row's candidates are one batched product, so is the
        choice each predecessor leads to (argmax, or the draw with that row's uniform); the walk
        itself composes those choices (`walk`): few graph nodes, each of which costs a fixed
        time on a device."""
        k = min(self.top_k, int(logits.shape[-1]))  # a plain int: static dims in the graph
        cand, scores = self.scores(hidden, logits, anchor, k)  # [b, n, k], [b, n, k(prev), k]
        choice = scores.argmax(-1)  # [b, n, k]: the greedy candidate after each predecessor
        sampling = temperature is not None
        if sampling:
            hot = temperature[:, None, None] > 0  # [b, 1, 1]
            t = torch.where(hot, temperature[:, None, None], 1.0)[..., None]  # [b, 1, 1, 1]
            # fp16-stable at any temperature: the max is subtracted before the division (each
            # entry ≤ 0, so a small T sends the others towards −inf, never past +65504), and T
            # is at least fp16's smallest normal (a smaller T would divide by fp16's 0)
            t = t.clamp(min=MIN_TEMPERATURE)
            z = (scores - scores.amax(-1, keepdim=True)) / t  # [b, n, k, k], ≤ 0
            q_all = z.softmax(-1)  # [b, n, k, k]
            c = q_all.cumsum(-1)  # the first candidate whose cumulative q exceeds u · Σq
            above = c > random_u[:, :, None, None] * c[..., -1:]
            drawn = torch.where(above[..., -1], above.to(torch.int32).argmax(-1), k - 1)
            choice = torch.where(hot, drawn, choice)  # [b, n, k]
        index = walk(choice)  # [b, n]
        path = cand.gather(-1, index[..., None])[..., 0]  # [b, n]
        if not sampling:
            return path
        ks = torch.arange(k, device=cand.device)
        one_hot = (ks == index[..., None]).to(q_all.dtype)  # [b, n, k]: the chosen candidates
        prev = torch.cat([(ks == 0).to(q_all.dtype).expand_as(one_hot[:, :1]), one_hot[:, :-1]], 1)
        q = (prev[:, :, None, :] @ q_all)[:, :, 0]  # [b, n, k]: each row's q after its choice
        return path, cand, torch.where(hot[..., 0][..., None], q, one_hot)


def sample_top_k(logits, k: int, temperature, random_u):
    """A DFlash draft's sampled proposals (contract.DRAFT_SAMPLE_TOP_K): logits [b, n, V],
    temperature [b], random_u [b, n] -> (tokens [b, n], candidates [b, n, k], q [b, n, k]).
    Rows of temperature > 0 draw from q = softmax(top-k logits / T) by the inverse CDF over the
    k candidates; the others take the argmax (q one-hot on it). Each row's draw is independent
    of the others' (a DFlash block is proposed in parallel), so q is the proposal's law."""
    k = min(k, int(logits.shape[-1]))
    top, cand = logits.topk(k, dim=-1)  # [b, n, k], descending
    hot = temperature[:, None, None] > 0  # [b, 1, 1]
    t = torch.where(hot, temperature[:, None, None], 1.0).clamp(min=MIN_TEMPERATURE)
    q = ((top - top[..., :1]) / t).softmax(-1)  # fp16-safe: every entry ≤ 0 before exp
    c = q.cumsum(-1)
    above = c > random_u[..., None] * c[..., -1:]
    drawn = torch.where(above[..., -1], above.to(torch.int32).argmax(-1), k - 1)  # [b, n]
    first = (torch.arange(k, device=logits.device) == 0).to(q.dtype).expand_as(q)
    index = torch.where(hot[..., 0], drawn, 0)
    q = torch.where(hot, q, first)
    return cand.gather(-1, index[..., None])[..., 0], cand, q


def top_logprobs(logits, k: int):
    """logits [b, n, V] -> (the k most likely ids [b, n, k], their log-probabilities under the
    full softmax [b, n, k], descending). log p = l − l_max − log Σ exp(l − l_max): every term
    ≤ 1, so fp16 holds the sum unless the distribution is near-uniform over more than 65504
    tokens (the sampler's caveat, docs/DESIGN.md, Sampling)."""
    top, ids = logits.topk(min(k, int(logits.shape[-1])), dim=-1)
    mx = top[..., :1]
    return ids, top - mx - torch.log(torch.exp(logits - mx).sum(-1, keepdim=True))


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig, i: int = 0):
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.causal, self.window = c.layer_attention(i)  # plain attributes: no state dict entry
        self.attention_conv = self.mlp_conv = None  # DFlash-2: a conv around each sub-block
        if c.dflash2:
            H, K, G = c.hidden_size, c.conv_kernel_size, c.conv_group_size
            self.attention_conv = DynamicCausalConv(H, K, G)
            self.mlp_conv = DynamicCausalConv(H, K, G)

    def forward(self, h, cos, sin, ctx_k, ctx_v, ctx_mask=None, blk_mask=None):
        if self.attention_conv is None:  # DFlash
            a = self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask)
            h = h + a
            return h + self.mlp(self.post_attention_layernorm(h))
        x, dyn = self.attention_conv.prepare(self.input_layernorm(h))  # DFlash-2
        a = self.self_attn(x, cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask)
        h = h + self.attention_conv.finish(a, dyn)
        x, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), dyn)


class DFlashDraft(nn.Module):
    """The draft's own tensors (fc, hidden_norm, layers, norm). Embedding and head are the
    target's and are passed in (`embed_weight`, `head_weight`)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        H = c.hidden_size
        self.fc = nn.Linear(len(c.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.rope = Rope.from_config(c.raw)
        self.candidate_selector = CandidateSelector(c) if c.dflash2 else None
        # a reduced draft vocabulary: the draft's own head (its ids mapped by `vocab_map`)
        dv = getattr(c, "draft_vocab_size", None)
        self.lm_head = nn.Linear(H, dv, bias=False) if dv is not None else None
        self._extras = None

    def extras(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(target id of every draft id [draft_vocab_size] or None, the separate mask embedding
        [H] or None), read from the checkpoint's files once (drafts.py)."""
        if self._extras is None:
            self._extras = (read_vocab_map(self.config), read_mask_embedding(self.config))
        return self._extras

    @classmethod
    def from_checkpoint(cls, c: DraftConfig, state: dict[str, torch.Tensor]) -> DFlashDraft:
        model = cls(c)
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}  # read_vocab_map
        model.load_state_dict(state, strict=True)
        return model.float().eval()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """concat of target layer outputs [b, n, k·H] -> context feature [b, n, H]."""
        return self.hidden_norm(self.fc(features))

    def embed(self, block_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        e = F.embedding(block_ids, embed_weight)
        mask_row = self.extras()[1]
        if mask_row is not None:  # the separate mask embedding replaces embed[MASK]
            e = torch.where((block_ids == self.config.mask_token_id)[..., None], mask_row, e)
        return e * self.config.input_embedding_scale

    def forward(self, ctx, ctx_positions, block_emb, block_positions) -> torch.Tensor:
        """ctx [b, n, H] fused features; block_emb [b, B, H] -> normed block hidden [b, B, H]."""
        ccos, csin = self.rope(ctx_positions)
        cos, sin = self.rope(block_positions)
        if not self.config.is_neox_style:
            ccos, csin, cos, sin = map(interleaved_table, (ccos, csin, cos, sin))
        B, g = block_emb.shape[1], self.config.num_heads // self.config.num_kv_heads
        h = block_emb
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.kv(ctx, ccos, csin)  # no input_layernorm on ctx
            w = layer.window
            ctx_mask = None if w is None else window_mask(ctx_positions, block_positions, w, g)
            blk_mask = block_mask(B, g, layer.causal, w)
            h = layer(h, cos, sin, ctx_k, ctx_v, ctx_mask, blk_mask)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Logits over the draft's vocabulary (reduced: its own head, `head_weight` unused)."""
        if self.lm_head is not None:
            head_weight = self.lm_head.weight
        logits = F.linear(hidden, head_weight) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def propose(self, features, ctx_positions, block_ids, block_positions, embed_w, head_w):
        """Greedy proposals for block rows 1 … B−1 from raw target features: [b, B−1]."""
        h = self.forward(
            self.fuse(features), ctx_positions, self.embed(block_ids, embed_w), block_positions
        )
        logits = self.logits(h[:, 1:], head_w)
        if self.candidate_selector is not None:  # DFlash-2: the selector's path
            return self.candidate_selector(h[:, 1:], logits, block_ids[:, 0])
        vocab_map = self.extras()[0]
        tokens = logits.argmax(-1)
        return tokens if vocab_map is None else vocab_map[tokens]  # target ids


class ExportDraft(nn.Module):
    """The draft program: KV injection into a static cache, block forward, proposals.

    Inputs follow `contract.DraftIO`. Each call:
      1. writes K/V of the new context rows (`target_hidden`, already fused by the target
         program) into every layer's cache at `position_ids_target` (−1 → the padding slot);
         a ring layer (a sliding layer whose window W is below ctx_len, or a full layer under
         a context window of N = W − 1 positions) at position mod (W − 1) in a ring of W slots
         (`ops.ring_slots`);
      2. runs the block `[anchor, MASK…]` at `position_ids` against every cached slot below the
         block start (a ring layer: the slots holding positions within its window, `ring_held`)
         plus the block's own K/V (bidirectional in b16 layers, else `block_mask`; the block K/V
         are not persisted);
      3. returns argmax of the target's head over rows 1 … B−1 (with the extended sampling
         inputs: of the logits adjusted as the target's, `proposal_logits`), with `confidence` the softmax
         over the CONFIDENCE_TOPK largest logits at the argmax (contract.DRAFT_CONFIDENCE),
         and the updated caches.
    """

    #: a DFlash draft exported to sample its proposals (set by the exporter: its q's candidates)
    q_top_k = 0
    #: top-k ids and log-probabilities returned per proposal row (set by the exporter; 0: none)
    top_k = 0
    pair_k = 0  # a DFlash-2 draft with top_k: its selector's pairwise log q (contract.py)
    #: the target's extended sampling inputs (set by the exporter): the logits are adjusted as
    #: the target's will be before any proposal (modeling/penalties.py: proposal_logits)
    extended = False

    def __init__(
        self,
        draft: DFlashDraft,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        ctx_len: int,
        emit_logits: bool = False,
        continuous_batching: bool = False,
        comp_ctx: bool = True,
        confidence: bool = True,
        context_window: int | None = None,
    ):
        """context_window: a full layer attends only to the last N injected context positions
        (a ring of N + 1 slots; None: every one). The target verifies, so it is lossless."""
        super().__init__()
        self.continuous_batching = continuous_batching
        self.comp_ctx = comp_ctx
        self.confidence = confidence
        self.c = draft.config
        self.layers, self.norm = draft.layers, draft.norm
        self.candidate_selector = draft.candidate_selector  # DFlash-2 (None: argmax)
        self.rope = RopeTable.from_rope(draft.rope, ctx_len)
        if not self.c.is_neox_style:  # interleaved RoPE: the same tables, laid out by pairs
            self.rope = RopeTable(
                interleaved_table(self.rope.cos), interleaved_table(self.rope.sin)
            )
        # head_t [H, V]; a tied head is also the embedding table (embed is then None)
        self.own_head = draft.lm_head is not None  # a reduced vocabulary: the draft's own head
        if self.own_head:  # head_t [H, Vd]; the embedding stays the target's
            self.tied = False
            self.head_t = frozen(draft.lm_head.weight.detach().float().t().contiguous())
            self.embed = frozen(embed_weight)
        else:
            self.tied, self.head_t, self.embed = vocab_tables(embed_weight, head_weight)
        vocab_map, mask_row = draft.extras()
        inverse = None
        if vocab_map is not None:  # draft id -> target id, and target id -> draft id (or Vd)
            V, Vd = int(embed_weight.shape[0]), int(vocab_map.shape[0])
            inverse = torch.full((V,), Vd, dtype=torch.int64)
            inverse[vocab_map] = torch.arange(Vd)
        self.register_buffer("vocab_map", vocab_map, persistent=False)  # None: no map
        self.register_buffer("vocab_inverse", inverse, persistent=False)
        self.register_buffer("mask_row", mask_row, persistent=False)  # None: embed[MASK]
        self.ctx_len = ctx_len
        self.emit_logits = emit_logits
        # per layer, its ring's slots (0: a ctx_len cache): a sliding layer's window, a full
        # layer's context_window + 1 (the last N positions, then the padding slot), each when
        # below ctx_len (else every key is in it: a full cache, the same mask)
        w, n = self.c.sliding_window, context_window
        slide = w if w is not None and w < ctx_len else 0
        full = n + 1 if n is not None and n + 1 < ctx_len else 0
        self.rings = [slide if layer.window is not None else full for layer in self.layers]

    def cache_slots(self) -> tuple[int, ...]:
        """Per layer: the ring's slots, or 0 for a full-context cache (contract.DraftIO)."""
        return tuple(self.rings) if any(self.rings) else ()

    def ring_views(self, pos_t, start, window, rows, block_positions, g: int) -> dict:
        """(ring slots, sliding) -> (the slots this call's context rows write [b, s], what
        attention reads, the context mask): a ring of R slots is written by position mod R − 1
        and read at ≤ R − 1 slots (`ring_held` derives the position each holds); a sliding
        layer's queries see the keys within its window, a full layer's every held key (a
        window of R + B covers them all)."""
        views = {}
        for R, layer in zip(self.rings, self.layers):
            sliding = layer.window is not None
            if not R or (R, sliding) in views:
                continue
            M = R - 1
            slots = ring_slots(pos_t, start, M)  # [b, s]
            index = window[:M] if window is not None else torch.arange(M)  # [Lr]
            reads = cache_reads(rows, index, self.c.num_kv_heads, R)
            wide = R if sliding else R + int(block_positions.shape[1])
            mask = window_mask(ring_held(start, index, M), block_positions, wide, g)
            views[R, sliding] = (slots, reads, mask)
        return views

    def forward(self, *inputs: torch.Tensor):
        # the contract's inputs (DraftIO), bound by the names the exporter gives them
        # (exporter/onnx_export.py sets input_names and output_names):
        # target_hidden [b, s, H], position_ids_target [b, s], input_ids, position_ids [b, B];
        # batch_index [b, 1] with continuous batching (caches [N, n_kv, ctx, hd]);
        # comp_ctx_lengths = 0 … L-1, the cached slots attention reads; past_key.i, past_value.i
        x = dict(zip(self.input_names, inputs, strict=True))
        target_hidden, position_ids_target = x[TARGET_HIDDEN], x[POSITION_IDS_TARGET]
        input_ids, position_ids = x[INPUT_IDS], x[POSITION_IDS]
        rows = cache_rows(x[BATCH_INDEX]) if self.continuous_batching else None  # -1 -> row 0
        window = x[COMP_CTX_LENGTHS] if self.comp_ctx else None
        kv = [n for i in range(len(self.layers)) for n in (past_key(i), past_value(i))]
        past = [x[n] for n in kv]
        slots = cache_slots(position_ids_target, self.ctx_len)  # [b, s]
        ccos, csin = self.rope(position_ids_target)  # [b, s, hd]
        cos, sin = self.rope(position_ids)  # [b, B, hd]
        # Cached slot i is visible iff i < block start; this hides the padding slot
        # (ctx_len − 1) and every stale slot at or past the block after a rollback.
        start = position_ids[:, :1]  # [b, 1]
        kv_index = (window if window is not None else torch.arange(self.ctx_len))[None, :]  # [1, L]
        ctx_mask = torch.where(kv_index < start, 0.0, MASK_VALUE)[:, None, None, :]  # [b,1,1,L]

        reads = cache_reads(rows, window, self.c.num_kv_heads, self.ctx_len)  # once per call
        g = self.c.num_heads // self.c.num_kv_heads
        rings = self.ring_views(position_ids_target, start, window, rows, position_ids, g)
        h = embed_rows(input_ids, self.head_t, self.embed)
        if self.mask_row is not None:  # a separate mask embedding replaces embed[MASK]
            h = torch.where((input_ids == self.c.mask_token_id)[..., None], self.mask_row, h)
        h = h * self.c.input_embedding_scale  # [b, B, H]
        retained = []
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(target_hidden, ccos, csin)  # [b, n_kv, s, hd]
            if self.rings[i]:
                at, read, mask = rings[self.rings[i], layer.window is not None]
            else:
                (at, read), mask = (slots, reads), ctx_mask
            cache_k, keys = update_cache(past[2 * i], rows, at, k, read)  # [b, n_kv, L, hd]
            cache_v, values = update_cache(past[2 * i + 1], rows, at, v, read)
            blk_mask = block_mask(input_ids.shape[1], g, layer.causal, layer.window)
            h = layer(h, cos, sin, keys, values, mask, blk_mask)
            retained += [cache_k, cache_v]

        hidden = self.norm(h[:, 1:])  # [b, B−1, H]
        logits = (hidden @ self.head_t) * self.c.output_multiplier  # [b, B−1, V]
        if self.c.final_logit_softcapping:
            cap = self.c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        if self.extended:  # penalties, logit bias, bad words, min_tokens: as the target's rows
            logits = proposal_logits(logits, x, input_ids, position_ids, int(logits.shape[-1]))
        draft_tokens, conf, logits, q = self.propose(x, hidden, logits, input_ids)
        out = {DRAFT_TOKENS: draft_tokens, DRAFT_CONFIDENCE: conf, LOGITS: logits, **q}
        out.update((retained_name(n), t) for n, t in zip(kv, retained, strict=True))
        return tuple(out[n] for n in self.output_names)  # the contract's outputs, by name

    def propose(self, x: dict, hidden, logits, input_ids):
        """(draft_tokens [b, B−1], confidence or None, logits, q: the sampled path's q, the
        tree's candidates) from the block's hidden states and logits [b, B−1, V]."""
        q = {}
        if self.candidate_selector is None and TEMPERATURE in x:  # sampled: block verification
            draft_tokens, q[DRAFT_Q_IDS], q[DRAFT_Q_PROBS] = sample_top_k(
                logits, self.q_top_k, x[TEMPERATURE], x[DRAFT_RANDOM_U]
            )
        elif self.candidate_selector is None:
            draft_tokens = logits.argmax(-1)  # [b, B−1]
        elif TEMPERATURE in x:  # DFlash-2 exported for sampling: a sampled path and its q
            draft_tokens, q[DRAFT_Q_IDS], q[DRAFT_Q_PROBS] = self.candidate_selector(
                hidden, logits, input_ids[:, 0], x[TEMPERATURE], x[DRAFT_RANDOM_U]
            )
        else:  # DFlash-2: the selector's greedy path from the anchor
            draft_tokens = self.candidate_selector(hidden, logits, input_ids[:, 0])
        conf = None
        if self.confidence:  # 1 / Σ exp(top_i − top_0) over the k largest: terms ≤ 1, fp16-safe
            k = min(CONFIDENCE_TOPK, logits.shape[-1])
            top = logits.topk(k, dim=-1).values  # [b, B−1, k]
            conf = 1.0 / torch.exp(top - top[..., :1]).sum(-1)  # [b, B−1]
        if self.top_k:  # the tree's candidates: top-k ids and log-probabilities
            q[DRAFT_TOP_IDS], q[DRAFT_TOP_LOGPROBS] = top_logprobs(logits, self.top_k)
            if self.pair_k:  # DFlash-2: its selector ranks each branch after its parent
                anchor = input_ids[:, 0]
                q[DRAFT_PAIR_LOGPROBS] = self.candidate_selector.pair_logprobs(
                    hidden, logits, anchor, self.pair_k
                )
        if self.vocab_map is not None:  # a reduced vocabulary: every id out is a target id
            draft_tokens = self.vocab_map[draft_tokens]
            for name in (DRAFT_Q_IDS, DRAFT_TOP_IDS):
                if name in q:
                    q[name] = self.vocab_map[q[name]]
            if LOGITS in self.output_names:  # over the target's vocabulary, MASK_VALUE elsewhere
                hidden_col = torch.full_like(logits[..., :1], MASK_VALUE)
                logits = torch.cat([logits, hidden_col], dim=-1)[..., self.vocab_inverse]
        return draft_tokens, conf, logits, q
