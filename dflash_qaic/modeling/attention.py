"""The attention layer kinds of a target (docs/DESIGN.md, Seams): softmax attention over a KV
cache, plain (Qwen3, Llama) or output-gated with partial RoPE (Qwen3.5's full-attention layers).
Each retains a key and a value cache per layer, [rows, kv_heads, ctx_len, head_dim].

    q, k, v = proj(h); (q_norm / k_norm per head); RoPE at position      # [b, heads, s, hd]
    cache_k, cache_v = CtxScatter(cache, slots, k / v)                    # [b, kvh, ctx, hd]
    out = o_proj(softmax(q·kᵀ + mask) · v)   # key slot j visible iff j <= position, j < L
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_qaic.contract import past_key, past_value
from dflash_qaic.modeling.layers import RMSNorm, apply_rope, frozen_linear
from dflash_qaic.modeling.ops import read_cache, update_cache


class Attention(nn.Module):
    """Softmax attention (Qwen3: per-head RMSNorm on q and k before RoPE; Llama: none)."""

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

    @staticmethod
    def retained(i: int) -> tuple[str, str]:
        """The buffers layer i keeps between calls: its key and value caches."""
        return past_key(i), past_value(i)

    def forward(self, x, call, cache_k, cache_v):
        # x [b, s, H]; call: the call's cos/sin [b, s, hd], slots [b, s], rows [b, 1] or None,
        # reads (ops.cache_reads) and additive mask [b, 1, g*s, L] (modeling/target.py, Call);
        # cache_k/cache_v [b, kvh, ctx, hd], or [N, kvh, ctx, hd] with continuous batching
        cos, sin = call.attention[:2]
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
        out, cache_k, cache_v, pending = attend_call(
            q, k, v, dims, self.scale, call, cache_k, cache_v
        )
        return self.o_proj(out), cache_k, cache_v, pending


def attend(q, k, v, dims, scale, slots, rows, reads, mask, cache_k, cache_v):
    """Write k, v into the caches and attend: q [b, nh, s, hd]; k, v [b, kvh, s, hd]; dims
    (b, s, nh, kvh, hd); the rest as `Attention.forward` takes them. Returns
    (out [b, s, nh*hd], cache_k, cache_v). Shared by every attention layer of a target."""
    cache_k, keys = update_cache(cache_k, rows, slots, k, reads)  # keys [b, kvh, L, hd]
    cache_v, values = update_cache(cache_v, rows, slots, v, reads)
    return softmax_attention(q, keys, values, dims, scale, mask), cache_k, cache_v


def attend_call(q, k, v, dims, scale, call, cache_k, cache_v):
    """`attend` with the call's slots, rows, reads and mask (modeling/target.py, Call) ->
    (out, cache_k, cache_v, pending). A tree program's call (docs/DESIGN.md, Tree
    verification) attends to the committed prefix read from the caches as they came in, then
    to its own rows (mask [b, 1, g*s, L + s]: the prefix by position, the rows by the tree
    mask), and leaves the caches unwritten: `pending` (k, v) is written once the call has
    accepted its path (target.py, `accept_path`)."""
    _, _, slots, rows, reads, mask = call.attention
    if not call.tree:
        return (*attend(q, k, v, dims, scale, slots, rows, reads, mask, cache_k, cache_v), None)
    keys = torch.cat([read_cache(cache_k, rows, reads), k], dim=2)  # [b, kvh, L + s, hd]
    values = torch.cat([read_cache(cache_v, rows, reads), v], dim=2)
    return softmax_attention(q, keys, values, dims, scale, mask), cache_k, cache_v, (k, v)


def softmax_attention(q, keys, values, dims, scale, mask):
    """softmax(q·kᵀ · scale + mask) · v: q [b, nh, s, hd]; keys, values [b, kvh, L, hd]; mask
    additive, [b, 1, g*s, L] -> [b, s, nh*hd]."""
    b, s, nh, kvh, hd = dims
    # GQA without repeating the cache: query head h uses kv head h // g, so fold each kv
    # head's g query heads into the row axis: [b, nh, s, hd] -> [b, kvh, g*s, hd].
    g = nh // kvh
    q = q.reshape(b, kvh, g * s, hd) * scale
    # one broadcast Add over the kv-head axis (a per-layer Where over [b, kvh, g, s, L] was
    # the graph's most expensive op on ONNX Runtime); a hidden score becomes score - 2048,
    # whose exp is exactly 0 in fp16 and fp32 whenever the row sees any key
    probs = (q @ keys.transpose(2, 3) + mask).softmax(dim=-1)  # [b, kvh, g*s, L]
    out = (probs @ values).view(b, nh, s, hd)  # [b, nh, s, hd]
    return out.transpose(1, 2).reshape(b, s, nh * hd)


class GatedAttention(nn.Module):
    """Hugging Face's `Qwen3_5Attention`: q_proj yields the query and an output gate; q/k
    zero-centred RMSNorm; RoPE on the first `rotary_dim` of each head; output · sigmoid(gate)."""

    def __init__(self, hf: nn.Module, n_heads: int, n_kv_heads: int, rotary_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hf.head_dim
        self.rotary_dim = rotary_dim
        self.scale = hf.scaling
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, frozen_linear(getattr(hf, name)))
        self.q_norm = RMSNorm.from_hf(hf.q_norm, zero_centred=True)
        self.k_norm = RMSNorm.from_hf(hf.k_norm, zero_centred=True)

    retained = staticmethod(Attention.retained)

    def forward(self, h, call, cache_k, cache_v):
        cos, sin = call.attention[:2]
        b, s, _ = h.shape
        nh, kvh, hd, rd = self.n_heads, self.n_kv_heads, self.head_dim, self.rotary_dim
        q, gate = self.q_proj(h).view(b, s, nh, 2 * hd).split([hd, hd], dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # [b, nh, s, hd]
        k = self.k_norm(self.k_proj(h).view(b, s, kvh, hd)).transpose(1, 2)
        v = self.v_proj(h).view(b, s, kvh, hd).transpose(1, 2)  # [b, kvh, s, hd]
        q = torch.cat([apply_rope(q[..., :rd], cos, sin, rd), q[..., rd:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :rd], cos, sin, rd), k[..., rd:]], dim=-1)
        dims = (b, s, nh, kvh, hd)
        out, cache_k, cache_v, pending = attend_call(
            q, k, v, dims, self.scale, call, cache_k, cache_v
        )
        out = out * torch.sigmoid(gate.reshape(b, s, nh * hd))
        return self.o_proj(out), cache_k, cache_v, pending


def rotary_dim(cfg) -> int:
    """The leading part of each head RoPE turns (`partial_rotary_factor` of head_dim)."""
    rp = getattr(cfg, "rope_parameters", None) or {}
    factor = rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return int(cfg.head_dim * factor)
