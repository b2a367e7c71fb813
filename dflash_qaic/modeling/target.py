"""The target LLM as one export-friendly program: prefill, verify and decode in one forward.

Built from a loaded Hugging Face `Qwen3ForCausalLM` or `LlamaForCausalLM`: only its weights and
its rotary tables are used; the forward is ours (static KV cache, masks from positions only).

    slots  = position, or the padding slot ctx_len - 1 for position -1        # [b, s]
    x      = embed(input_ids)                                                  # [b, s, H]
    per layer i:
        q, k, v = proj(input_layernorm(x)); (Qwen3: q_norm/k_norm per head); RoPE at position
        cache_k[i], cache_v[i] = CtxScatter(cache, slots, k / v)               # [b, kvh, ctx, hd]
        x += o_proj(softmax(q·kᵀ + mask) · v)   # key slot j visible iff j <= position, j < L
        x += mlp(post_attention_layernorm(x))
    logits      = lm_head(norm(x))                                                 # [b, s, V]
    next_tokens = argmax(logits) where temperature == 0, else the lossless sample  # [b, s]
    hidden      = hidden_norm(fc(concat(taps)))      # [b, s, H], the draft's context feature

Sampling (`sample_next_tokens`, docs/DESIGN.md, Sampling): p = softmax(logits / T) restricted by top-k and
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

from dflash_qaic.checkpoints import SUPPORTED_TARGETS, UNSUPPORTED_ROPE_TYPES, fp16_fc_scale
from dflash_qaic.contract import (
    BATCH_INDEX,
    COMP_CTX_LENGTHS,
    DRAFT_Q_IDS,
    DRAFT_Q_PROBS,
    HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    NUM_ACCEPTED,
    POSITION_IDS,
    SAMPLING_INPUTS,
    TOKEN_BITMASK,
    past_key,
    past_value,
)
from dflash_qaic.contract import retained as retained_name
from dflash_qaic.modeling.layers import (
    MASK_VALUE,
    RMSNorm,
    Rope,
    RopeTable,
    apply_rope,
    embed_rows,
    frozen,
    frozen_linear,
    vocab_tables,
)
from dflash_qaic.modeling.moe import mlp_from_hf
from dflash_qaic.modeling.ops import cache_reads, cache_rows, cache_slots, update_cache
from dflash_qaic.modeling.sampler import (
    SAMPLING_CANDIDATES,
    mask_logits,
    sample_next_tokens,
    token_allowed,
)

SUPPORTED_MODEL_TYPES = tuple(SUPPORTED_TARGETS)


def fp16_safe_fc_weight(fc_weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """fc.weight / s with s = max(sqrt(in_features) * max_row_norm / 128, 1) (QEfficient #995).

    With inputs of |x| <= 1 (the taps are divided by their row's max |x| first, see
    `ExportTarget.fuse`), |fc(x)_i| <= |w_i| |x| / s <= 128 |x| / sqrt(in) <= 128: fc's output
    stays far inside fp16's range whatever the weights. hidden_norm is given the matching eps
    (sqrt(eps) / s), so the fused feature is exactly hidden_norm(fc(taps)).
    """
    s = fp16_fc_scale(fc_weight)
    w = fc_weight.detach().float()
    return (w / s if s > 1.0 else w), s


class Attention(nn.Module):
    def __init__(self, hf: nn.Module, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hf.head_dim
        self.scale = hf.scaling
        self.q_proj = frozen_linear(hf.q_proj)
        self.k_proj = frozen_linear(hf.k_proj)
        self.v_proj = frozen_linear(hf.v_proj)
        self.o_proj = frozen_linear(hf.o_proj)
        qk_norm = getattr(hf, "q_norm", None) is not None  # Qwen3: per-head RMSNorm before RoPE
        self.q_norm = RMSNorm.from_hf(hf.q_norm) if qk_norm else None
        self.k_norm = RMSNorm.from_hf(hf.k_norm) if qk_norm else None

    def forward(self, x, cos, sin, slots, rows, reads, mask, cache_k, cache_v):
        # x [b, s, H]; cos/sin [b, s, hd]; slots [b, s]; reads: the slots read (ops.cache_reads);
        # mask [b, 1, g*s, L] additive (0 visible, MASK_VALUE hidden); cache_k/cache_v [b, kvh, ctx, hd], or [N, kvh, ctx, hd] with
        # rows [b, 1] (continuous batching: the call's rows are gathered for attention)
        b, s, _ = x.shape
        nh, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(b, s, nh, hd)
        k = self.k_proj(x).view(b, s, kvh, hd)
        v = self.v_proj(x).view(b, s, kvh, hd).transpose(1, 2)  # [b, kvh, s, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin, hd)  # [b, nh, s, hd]
        k = apply_rope(k.transpose(1, 2), cos, sin, hd)  # [b, kvh, s, hd]
        dims = (b, s, nh, kvh, hd)
        out, cache_k, cache_v = attend(
            q, k, v, dims, self.scale, slots, rows, reads, mask, cache_k, cache_v
        )
        return self.o_proj(out), cache_k, cache_v


def attend(q, k, v, dims, scale, slots, rows, reads, mask, cache_k, cache_v):
    """Write k, v into the caches and attend: q [b, nh, s, hd]; k, v [b, kvh, s, hd]; dims
    (b, s, nh, kvh, hd); the rest as `Attention.forward` takes them. Returns
    (out [b, s, nh*hd], cache_k, cache_v). Shared by every attention layer of a target."""
    b, s, nh, kvh, hd = dims
    cache_k, keys = update_cache(cache_k, rows, slots, k, reads)  # keys [b, kvh, L, hd]
    cache_v, values = update_cache(cache_v, rows, slots, v, reads)

    # GQA without repeating the cache: query head h uses kv head h // g, so fold each kv
    # head's g query heads into the row axis: [b, nh, s, hd] -> [b, kvh, g*s, hd].
    g = nh // kvh
    q = q.reshape(b, kvh, g * s, hd) * scale
    # one broadcast Add over the kv-head axis (a per-layer Where over [b, kvh, g, s, L] was
    # the graph's most expensive op on ONNX Runtime); a hidden score becomes score - 2048,
    # whose exp is exactly 0 in fp16 and fp32 whenever the row sees any key
    probs = (q @ keys.transpose(2, 3) + mask).softmax(dim=-1)  # [b, kvh, g*s, L]
    out = (probs @ values).view(b, nh, s, hd)  # [b, nh, s, hd]
    return out.transpose(1, 2).reshape(b, s, nh * hd), cache_k, cache_v


class DecoderLayer(nn.Module):
    def __init__(self, hf: nn.Module, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.input_layernorm = RMSNorm.from_hf(hf.input_layernorm)
        self.self_attn = Attention(hf.self_attn, n_heads, n_kv_heads)
        self.post_attention_layernorm = RMSNorm.from_hf(hf.post_attention_layernorm)
        self.mlp = mlp_from_hf(hf.mlp)  # dense, or sparse MoE (modeling/moe.py)

    def forward(self, x, cos, sin, slots, rows, reads, mask, cache_k, cache_v):
        a, cache_k, cache_v = self.self_attn(
            self.input_layernorm(x), cos, sin, slots, rows, reads, mask, cache_k, cache_v
        )
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache_k, cache_v


class ExportTarget(nn.Module):
    """forward(*inputs) -> outputs, both as contract.TargetIO lists them and bound by name:
    input_ids, position_ids, [batch_index], [comp_ctx_lengths], [temperature, top_k, top_p,
    random_u], past_key.0, past_value.0, … -> next_tokens, hidden_states, [logits], the retained
    caches. The sampling inputs are there when `sampling` (the default), batch_index with
    `continuous_batching`, comp_ctx_lengths with `comp_ctx` (the default).
    """

    #: block verification (contract.BLOCK; set by the exporter): also returns num_accepted
    block_verify = False

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
        fc_scale: float = 1.0,
        continuous_batching: bool = False,
        comp_ctx: bool = True,
        token_bitmask: bool = False,
    ):
        super().__init__()
        self.continuous_batching = continuous_batching
        self.token_bitmask = token_bitmask  # structured output: contract.TOKEN_BITMASK
        self.comp_ctx = comp_ctx
        if lm_head.bias is not None:
            raise ValueError("an lm_head with a bias is not supported")
        self.vocab_size = lm_head.out_features
        # head_t [H, V]; a tied head is also the embedding table (embed is then None)
        self.tied, self.head_t, self.embed = vocab_tables(embed, lm_head.weight)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rope = RopeTable(rope_cos, rope_sin)  # [ctx_len, hd] each
        self.fc = nn.Linear(fc_weight.shape[1], fc_weight.shape[0], bias=False, device="meta")
        self.fc.weight = frozen(fc_weight)
        self.hidden_norm = hidden_norm
        self.target_layer_ids = [int(j) for j in target_layer_ids]
        self.emit_logits = emit_logits
        self.sampling = sampling
        self.sampling_candidates = min(int(sampling_candidates), self.vocab_size)
        self.fc_scale = float(fc_scale)  # fc_weight is fc.weight divided by this

    @property
    def ctx_len(self) -> int:
        return self.rope.cos.shape[0]

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
        continuous_batching: bool = False,
        token_bitmask: bool = False,
    ) -> ExportTarget:
        cfg = hf_model.config
        _check_supported(hf_model, fc_weight, target_layer_ids)
        base = hf_model.model
        layers = [
            DecoderLayer(layer, cfg.num_attention_heads, cfg.num_key_value_heads)
            for layer in base.layers
        ]
        rope = RopeTable.from_rope(Rope.from_hf(base.rotary_emb), ctx_len)
        fc_w, fc_scale = fp16_safe_fc_weight(fc_weight)
        target = cls(
            embed=base.embed_tokens.weight,
            layers=layers,
            norm=RMSNorm.from_hf(base.norm),
            lm_head=hf_model.lm_head,  # tied or not: whatever HF's head holds
            rope_cos=rope.cos,
            rope_sin=rope.sin,
            fc_weight=fc_w,
            hidden_norm=RMSNorm(hidden_norm_weight.shape[-1], hidden_norm_eps, hidden_norm_weight),
            target_layer_ids=target_layer_ids,
            emit_logits=emit_logits,
            sampling=sampling,
            sampling_candidates=sampling_candidates,
            fc_scale=fc_scale,
            continuous_batching=continuous_batching,
            token_bitmask=token_bitmask,
        )
        return target

    def forward(self, *inputs: torch.Tensor):
        # the contract's inputs (TargetIO), bound by the names the exporter gives them
        # (export/onnx_export.py sets input_names and output_names):
        # input_ids, position_ids [b, s] int64 (position -1 = padding); with continuous
        # batching, batch_index [b, 1]; comp_ctx_lengths [L] = 0 … L-1, the slots attention
        # reads; with sampling, temperature, top_k, top_p [b] and random_u [b, sample_len, 2];
        # past[2i], past[2i+1] = key / value cache of layer i [b or N, kvh, ctx, hd]
        x = x_in = dict(zip(self.input_names, inputs, strict=True))
        input_ids, position_ids = x[INPUT_IDS], x[POSITION_IDS]
        rows = cache_rows(x[BATCH_INDEX]) if self.continuous_batching else None  # -1 -> row 0
        window = x[COMP_CTX_LENGTHS] if self.comp_ctx else None  # [L]
        sampling = [x[n] for n in SAMPLING_INPUTS] if self.sampling else []
        q = {"q_ids": x[DRAFT_Q_IDS], "q_probs": x[DRAFT_Q_PROBS]} if DRAFT_Q_IDS in x else {}
        kv = [n for i in range(len(self.layers)) for n in (past_key(i), past_value(i))]
        past = [x[n] for n in kv]
        ctx_len = self.ctx_len
        slots = cache_slots(position_ids, ctx_len)  # [b, s]; -1 -> padding slot ctx_len - 1
        cos, sin = self.rope(position_ids)  # [b, s, hd]
        # key slot j is visible to a query iff j <= its position: causal within the call, stale
        # slots after a rejection hidden, and a padding row (position -1) sees nothing.
        kv_index = window if window is not None else torch.arange(ctx_len)  # [L]
        visible = kv_index <= position_ids[..., None]  # [b, s, L]
        # the additive mask, once per call, laid out as attention's rows (kv head's g query
        # heads folded into the row axis, see Attention): [b, 1, g*s, L]
        g = self.layers[0].self_attn.n_heads // self.layers[0].self_attn.n_kv_heads
        mask = (~visible).to(torch.float32) * MASK_VALUE  # [b, s, L]: 0 or MASK_VALUE
        mask = torch.cat([mask] * g, dim=1)[:, None]

        kvh = self.layers[0].self_attn.n_kv_heads
        reads = cache_reads(rows, window, kvh, ctx_len)  # once per call, shared by every layer
        x = embed_rows(input_ids, self.head_t, self.embed)  # [b, s, H]
        last = len(self.layers) - 1
        taps, retained = {}, []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, slots, rows, reads, mask, past[2 * i], past[2 * i + 1])
            retained += [k, v]
            if i in self.target_layer_ids and i != last:
                taps[i] = x  # raw decoder-layer output = HF hidden_states[i + 1]
        x = self.norm(x)  # [b, s, H]
        if last in self.target_layer_ids:
            taps[last] = x  # HF's last hidden_states entry is taken after the final norm

        logits = x @ self.head_t  # [b, s, V]
        if self.token_bitmask:  # structured output: only the grammar's tokens can be chosen
            allowed = token_allowed(x_in[TOKEN_BITMASK], self.vocab_size)
            logits, floor = mask_logits(logits, allowed)
            q["floor"] = floor
        accepted = {}
        if self.sampling:
            vocab = self.vocab_size
            next_tokens = sample_next_tokens(
                logits, input_ids, position_ids, *sampling, vocab, self.sampling_candidates, **q,
                **({"block": True} if self.block_verify else {}),
            )  # fmt: skip
            if self.block_verify:  # contract.BLOCK: the accepted count decided in the graph
                next_tokens, accepted[NUM_ACCEPTED] = next_tokens
        else:
            next_tokens = logits.argmax(dim=-1)  # [b, s] int64
        hidden = self.fuse(torch.cat([taps[j] for j in self.target_layer_ids], dim=-1))
        out = {NEXT_TOKENS: next_tokens, HIDDEN_STATES: hidden, LOGITS: logits, **accepted}
        out.update((retained_name(n), t) for n, t in zip(kv, retained, strict=True))
        return tuple(out[n] for n in self.output_names)  # the contract's outputs, by name

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(feats)), safe in fp16: feats [b, s, k*H] -> [b, s, H].

        The raw taps carry massive activations (thousands), so each row is divided by
        m = max(max|x|, 1) before fc; fc.weight is already divided by fc_scale, so |fc(x / m)|
        <= 128 (see fp16_safe_fc_weight). hidden_norm is scale-invariant given the matching
        eps, sqrt(eps) / (fc_scale * m), floored at 2^-24 (fp16's smallest value) so it never rounds
        to 0; the floor changes the result by under 1e-10 relative.
        """
        m = feats.abs().amax(-1, keepdim=True).clamp(min=1.0)  # [b, s, 1]
        eps_root = math.sqrt(self.hidden_norm.eps) / self.fc_scale
        return self.hidden_norm(self.fc(feats / m), (eps_root / m).clamp(min=2.0**-24))


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
    if rope_type in UNSUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} depends on sequence length; not supported")
    n_layers = cfg.num_hidden_layers
    ids = list(target_layer_ids)
    if not ids or any(not 0 <= j < n_layers for j in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids {ids} must be distinct layer ids in [0, {n_layers})")
    expected = (cfg.hidden_size, len(ids) * cfg.hidden_size)
    if tuple(fc_weight.shape) != expected:
        raise ValueError(f"fc weight shape {tuple(fc_weight.shape)} != {expected}")
