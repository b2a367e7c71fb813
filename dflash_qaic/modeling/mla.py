"""Multi-head latent attention (MLA; DeepSeek-V3, Kimi K2.x, Moonlight, GLM-4.7-Flash) as a layer
kind: its cache is one compressed latent and one shared RoPE key per token, read once per call.
See docs/DESIGN.md, Latent attention.

Hugging Face's `DeepseekV3Attention` (the oracle) expands the latent into per-head keys and values:

    q            = q_b(q_a_norm(q_a(h)))  or  q_proj(h)              # [b, s, nh, dn + dr]
    q_nope, q_pe = split(q, [dn, dr])
    c, k_pe      = split(kv_a(h), [r, dr]);  c = kv_a_norm(c)         # [b, s, r], [b, s, dr]
    q_pe, k_pe   = RoPE(q_pe), RoPE(k_pe)        # decoupled: the rope part only (interleaved
                                                 # pairs when `rope_interleave`)
    k_h = [W_UK_h · c, k_pe];  v_h = W_UV_h · c  # kv_b = [W_UK; W_UV] per head: [nh, dn + dv, r]
    out = o_proj(softmax((q_h · k_h) · scale + mask) · v_h)          # v_head_dim dv ≠ dn + dr

This module computes the same in the absorbed form, in every call (prefill, verify, decode), so a
call reads the latent cache once and never expands it per head:

    q_lat = q_nope · W_UK_h                 # [b, nh, s, r]: W_UK folded into the query
    cache_c, cache_pe = CtxScatter(c, k_pe) # [rows, 1, L, r], [rows, 1, L, dr]: the latent cache
    p     = softmax((q_lat · cᵀ + q_pe · k_peᵀ) · scale + mask)       # [b, nh, s, L]
    out   = o_proj((p · c) · W_UVᵀ)          # W_UV applied after attention over the latent

q_nope · k_nope = q_nope · (W_UK c) = (q_nope W_UK) · c, and p · (W_UV c) = W_UV (p · c): the same
values, r + dr numbers cached per token per layer (576 at DeepSeek-V3's shape) instead of
2 · nh · (dn + dr). W_UK and W_UV are the per-head row blocks of the checkpoint's
`kv_b_proj.weight` ([nh·(dn + dv), r] read as [nh, dn + dv, r]); the streaming export writes
each from those rows of the checkpoint (families/deepseek_v3.py, `weight_parts`), nothing
multiplied: the absorption is in the order of the products, not in new weights.

scale: (dn + dr)^−½, times mscale² of DeepSeek's YaRN when `mscale_all_dim` is set, exactly as
transformers computes it (`yarn_apply_mscale`; read from the Hugging Face module's `scaling`); the
RoPE table's own YaRN attention factor is in its cos/sin, as for every other layer.

All heads share the one latent "kv head": the layer's attention kind has n_kv_heads = 1, so the
call's mask [b, 1, nh·s, L] is the full-attention kind's (modeling/attention.py, `kind_call`).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_qaic import state
from dflash_qaic.families.base import FULL_ATTENTION
from dflash_qaic.modeling.attention import AttentionCall
from dflash_qaic.modeling.layers import RMSNorm, apply_rope, frozen, frozen_linear
from dflash_qaic.modeling.ops import read_cache, update_cache


class LatentAttention(nn.Module):
    """MLA in the absorbed form (module docstring), from a Hugging Face `DeepseekV3Attention`
    (or a family's module of the same fields: q_proj or q_a_proj / q_a_layernorm / q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, scaling)."""

    kind = FULL_ATTENTION
    n_kv_heads = 1  # the latent is shared by every head
    derived_params = ("w_uk", "w_uv")  # parts of one checkpoint tensor (exporter/weights.py)

    def __init__(self, hf: nn.Module, n_heads: int, rope_interleave: bool):
        super().__init__()
        self.n_heads = n_heads
        self.nope, self.rope = int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim)
        self.rank, self.v_dim = int(hf.kv_lora_rank), int(hf.v_head_dim)
        self.head_dim = self.rope  # the RoPE table's width (attention_kinds)
        self.scale = float(hf.scaling)
        self.interleave = bool(rope_interleave)
        self.q_proj = frozen_linear(hf.q_proj) if hf.q_proj is not None else None
        if self.q_proj is None:  # q through its LoRA: q_b(norm(q_a(h)))
            self.q_a_proj = frozen_linear(hf.q_a_proj)
            self.q_a_layernorm = RMSNorm.from_hf(hf.q_a_layernorm)
            self.q_b_proj = frozen_linear(hf.q_b_proj)
        self.kv_a_proj_with_mqa = frozen_linear(hf.kv_a_proj_with_mqa)
        self.kv_a_layernorm = RMSNorm.from_hf(hf.kv_a_layernorm)
        # kv_b_proj [nh·(dn + dv), r] viewed [nh, dn + dv, r]: W_UK = [:, :dn], W_UV = [:, dn:],
        # held apart (a slice of a weight in the graph would be folded into a copy)
        w = hf.kv_b_proj.weight.view(n_heads, self.nope + self.v_dim, self.rank)
        self.w_uk = frozen(w[:, : self.nope])  # [nh, dn, r]
        self.w_uv = frozen(w[:, self.nope :])  # [nh, dv, r]
        self.o_proj = frozen_linear(hf.o_proj)

    def state(self, i: int, rows: str, ring: int | None) -> state.StateSpec:
        """What layer i keeps (state.py): the latent and the RoPE key, ctx_len slots."""
        return state.LatentAttentionSpec(i, rows, self.rank, self.rope)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, H] -> q [b, nh, s, dn + dr]."""
        b, s, _ = x.shape
        q = (
            self.q_proj(x)
            if self.q_proj is not None
            else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        )
        return q.view(b, s, self.n_heads, self.nope + self.rope).transpose(1, 2)

    def rotate(self, x: torch.Tensor, c: AttentionCall) -> torch.Tensor:
        """RoPE on the rope part x [b, h, s, dr]; interleaved pairs (x0, x1), (x2, x3), … are
        first laid out as halves, which is transformers' `apply_rotary_pos_emb_interleave`."""
        if self.interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, c.cos, c.sin, self.rope)

    def forward(self, x, call, cache_c, cache_pe):
        # x [b, s, H]; cache_c [rows, 1, L, r], cache_pe [rows, 1, L, dr] (rows: b, or N with
        # continuous batching) -> (out [b, s, H], cache_c, cache_pe, pending)
        c = call.attention[self.kind]
        b, s, _ = x.shape
        nh, dn, r = self.n_heads, self.nope, self.rank
        q = self.query(x)
        q_nope, q_pe = q[..., :dn], self.rotate(q[..., dn:], c)  # [b, nh, s, dn], [.., dr]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # [b, 1, s, r]
        k_pe = self.rotate(k_pe[:, None], c)  # [b, 1, s, dr]
        q_lat = q_nope @ self.w_uk  # [b, nh, s, dn] @ [nh, dn, r] -> [b, nh, s, r]
        pending = None
        if c.tree:  # the committed prefix as it came in, then the call's own rows
            lat = torch.cat([read_cache(cache_c, c.rows, c.reads), latent], dim=2)
            pe = torch.cat([read_cache(cache_pe, c.rows, c.reads), k_pe], dim=2)
            pending = (latent, k_pe)
        else:
            cache_c, lat = update_cache(cache_c, c.rows, c.slots, latent, c.reads)  # [b,1,L,r]
            cache_pe, pe = update_cache(cache_pe, c.rows, c.slots, k_pe, c.reads)
        out = latent_attention(q_lat, q_pe, lat, pe, self.scale, c.mask)  # [b, nh, s, r]
        # W_UV after attention: [nh, dv, r] @ [b, nh, r, s] -> [b, nh, dv, s]
        out = (self.w_uv @ out.transpose(2, 3)).permute(0, 3, 1, 2)  # [b, s, nh, dv]
        return self.o_proj(out.reshape(b, s, nh * self.v_dim)), cache_c, cache_pe, pending


def latent_attention(q_lat, q_pe, lat, pe, scale: float, mask) -> torch.Tensor:
    """softmax((q_lat · latᵀ + q_pe · peᵀ) · scale + mask) · lat, every head over the one latent:
    q_lat [b, nh, s, r], q_pe [b, nh, s, dr]; lat [b, 1, L, r], pe [b, 1, L, dr]; mask additive
    [b, 1, nh·s, L] -> [b, nh, s, r]. The heads are folded into the row axis (one kv head)."""
    b, nh, s, r = q_lat.shape
    q_lat = q_lat.reshape(b, 1, nh * s, r) * scale
    q_pe = q_pe.reshape(b, 1, nh * s, q_pe.shape[-1]) * scale
    scores = q_lat @ lat.transpose(2, 3) + q_pe @ pe.transpose(2, 3) + mask  # [b, 1, nh·s, L]
    return (scores.softmax(dim=-1) @ lat).view(b, nh, s, r)
