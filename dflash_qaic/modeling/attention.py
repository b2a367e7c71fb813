"""The attention layer kinds of a target (docs/DESIGN.md, Seams and Layer kinds): softmax
attention over a KV cache, with the variants the families need as options of one module
(per-head q/k RMSNorm, a weightless v norm, k = v, learned sinks), or output-gated with partial
RoPE (Qwen3.5's full-attention layers). Each retains a key and a value cache per layer,
[rows, kv_heads, slots, head_dim]: slots = ctx_len, or a sliding layer's ring (R + 1).

    q, k, v = proj(h); (q_norm / k_norm per head); RoPE at position      # [b, heads, s, hd]
    cache_k, cache_v = CtxScatter(cache, slots, k / v)                    # [b, kvh, L, hd]
    out = o_proj(softmax(q·kᵀ · scale + mask [‖ sink]) · v)     # the one core, `softmax_attention`

An attention layer has a kind (`AttentionKind`: full or sliding, its RoPE table, its head
shape, its ring); the target builds each kind's `AttentionCall` once per call (modeling/target.py).

Ring caches (a sliding kind of window W whose calls have at most S rows). The layer keeps R + 1
slots, R = W + S − 1 (a static axis, contract.TargetIO.ring_slots): position p in slot p mod R,
a padding row (−1) in slot R, never read. The query at Q reads all R slots; slot j holds
h = Q − ((Q − j) mod R) and is visible iff Q − W < h and h >= 0. That is exact whenever every
position below the call was written in order (the runtime does so): a visible h is at least
Q − W + 1, and any other position in slot j is h ± a multiple of R, so either older than the
window or at least Q − W + 1 + R >= Q + S, past every row of the call, rejected verify rows
included. Without a bound on the rows (max_rows None) or when R + 1 >= ctx_len, a sliding layer
keeps a ctx_len cache and the window is applied by the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_qaic import state
from dflash_qaic.families.base import FULL_ATTENTION
from dflash_qaic.modeling.layers import MASK_VALUE, RMSNorm, apply_rope, frozen, frozen_linear
from dflash_qaic.modeling.ops import cache_reads, read_cache, update_cache


@dataclass(frozen=True)
class AttentionKind:
    """What a layer kind's attention needs: its window (None: full), the name of its RoPE table
    (a RopeTable module of the target), head counts, and for a sliding kind its ring (R:
    positions held, `ring_size`; None: a ctx_len cache)."""

    window: int | None
    rope: str
    n_heads: int
    n_kv_heads: int
    ring: int | None = None


@dataclass
class AttentionCall:
    """One attention kind's inputs of a call, shared by its layers: cos/sin [b, s, hd], slots
    [b, s] (where each row's K/V goes), rows [b, 1] or None (continuous batching), reads
    (ops.cache_reads), the additive mask [b, 1, g*s, L] and whether the call is a tree's
    (docs/DESIGN.md, Tree verification: the caches are written after acceptance)."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor | None
    reads: torch.Tensor | None
    mask: torch.Tensor
    tree: bool = False


def ring_size(window: int | None, max_rows: int | None, ctx_len: int) -> int | None:
    """R = W + S − 1 for a sliding layer of window W and calls of at most S rows: a call's
    queries see W − 1 positions before it and its own S, so R positions (slot = position mod R,
    plus the padding slot R) hold every visible key; None when a ring would not be smaller than
    the ctx_len cache (module docstring)."""
    if window is None or max_rows is None:
        return None
    R = window + max_rows - 1
    return R if R + 1 < ctx_len else None


def ring_mask(position_ids: torch.Tensor, R: int, window: int) -> torch.Tensor:
    """[b, s, R] bool: ring slot j visible to the query at position Q. Slot j holds
    h = Q − ((Q − j) mod R), the latest position ≡ j (mod R) up to Q (module docstring), and is
    visible iff Q − W < h (h <= Q by construction) and h >= 0 (this sequence wrote it)."""
    pos = position_ids[..., None]  # [b, s, 1]
    held = pos - torch.remainder(pos - torch.arange(R), R)  # [b, s, R]
    return (held > pos - window) & (held >= 0)


def visible_keys(position_ids, window, tree_mask, ctx_len: int):
    """(kv_index [L], visible [b, s, L] bool), shared by every attention kind of a call: key
    slot j is visible to a query iff j <= its position: causal within the call, stale slots
    after a rejection hidden, and a padding row (position -1) sees nothing. A tree call: the
    prefix below the root's position, then the tree's rows ([b, s, L + s])."""
    kv_index = window if window is not None else torch.arange(ctx_len)  # [L]
    visible = kv_index <= position_ids[..., None]  # [b, s, L]
    if tree_mask is not None:
        prefix = kv_index < position_ids[:, :1, None]  # [b, 1, L]
        prefix = prefix & (position_ids[..., None] >= 0)  # [b, s, L]
        visible = torch.cat([prefix, tree_mask != 0], dim=-1)  # [b, s, L + s]
    return kv_index, visible


def kind_call(kind, cos, sin, slots, rows, position_ids, window, visible, ctx_len: int):
    """One attention kind's AttentionCall: a full kind sees `visible` (`visible_keys`); a
    sliding kind also hides keys W or more positions back (HF's sliding_window_causal), from a
    ring of R + 1 slots when it has one (module docstring, Ring caches)."""
    kv_index, v = visible
    width = ctx_len
    if kind.ring is not None:  # slot = position mod R; −1 -> the ring's padding slot R
        R = kind.ring
        v = ring_mask(position_ids, R, kind.window)  # [b, s, R]
        slots = torch.where(position_ids < 0, R, torch.remainder(position_ids, R))
        window, width = torch.arange(R), R + 1
    elif kind.window is not None:
        v = v & (kv_index > position_ids[..., None] - kind.window)
    # the additive mask, once per call, laid out as attention's rows (kv head's g query heads
    # folded into the row axis, see `softmax_attention`): [b, 1, g*s, L]
    g = kind.n_heads // kind.n_kv_heads
    mask = (~v).to(torch.float32) * MASK_VALUE  # [b, s, L]: 0 or MASK_VALUE
    mask = torch.cat([mask] * g, dim=1)[:, None]
    reads = cache_reads(rows, window, kind.n_kv_heads, width)  # shared by the kind's layers
    return AttentionCall(cos, sin, slots, rows, reads, mask)


class Attention(nn.Module):
    """Softmax attention. Options, read from the Hugging Face module: per-head RMSNorm on q and
    k before RoPE (Qwen3, Gemma 4; Llama and gpt-oss have none), a weightless v norm (Gemma 4),
    no v_proj (Gemma 4's full layers with attention_k_eq_v: v is the raw k), a learned sink logit
    per head (gpt-oss). Its kv heads come from k_proj (a layer kind may have its own). MiniMax-M2:
    q/k RMSNorm over the whole projection (all heads at once) and RoPE on the first
    `rotary_dim` of each head."""

    def __init__(
        self, hf: nn.Module, n_heads: int, kind: str = FULL_ATTENTION, rotary_dim: int = 0
    ):
        super().__init__()
        self.kind = kind  # its AttentionKind's name (the target's `kinds`)
        self.n_heads, self.head_dim = n_heads, hf.head_dim
        self.n_kv_heads = hf.k_proj.out_features // hf.head_dim
        self.scale = hf.scaling
        self.q_proj = frozen_linear(hf.q_proj)
        self.k_proj = frozen_linear(hf.k_proj)
        self.v_proj = frozen_linear(hf.v_proj) if hf.v_proj is not None else None  # None: v = k
        self.o_proj = frozen_linear(hf.o_proj)
        qk_norm = getattr(hf, "q_norm", None) is not None
        self.q_norm = RMSNorm.from_hf(hf.q_norm) if qk_norm else None
        self.k_norm = RMSNorm.from_hf(hf.k_norm) if qk_norm else None
        # the norms span every head's projection (MiniMax-M2), not one head
        self.whole_norm = qk_norm and hf.q_norm.weight.shape[-1] != hf.head_dim
        # RoPE on the leading rotary_dim of each head only (0 or head_dim: all of it)
        self.rotary_dim = rotary_dim if 0 < rotary_dim < hf.head_dim else None
        v_norm = getattr(hf, "v_norm", None)  # weightless (Gemma 4)
        self.v_eps = float(v_norm.eps) if v_norm is not None else None
        self.sinks = None
        if getattr(hf, "sinks", None) is not None:  # [nh] held by kv head and group
            g = n_heads // self.n_kv_heads
            self.sinks = frozen(hf.sinks.view(1, self.n_kv_heads, g, 1, 1))

    def state(self, i: int, rows: str, ring: int | None) -> state.StateSpec:
        """What layer i keeps between calls (state.py): key and value caches, a ring of R + 1
        slots for a sliding kind with a ring (`ring` = R), else ctx_len slots."""
        if ring:
            return state.SlidingWindowSpec(i, rows, self.n_kv_heads, self.head_dim, ring + 1)
        return state.FullAttentionSpec(i, rows, self.n_kv_heads, self.head_dim)

    def forward(self, x, call, cache_k, cache_v):
        # x [b, s, H]; call: the target's Call, of which this layer reads its kind's
        # AttentionCall; cache_k/cache_v [b, kvh, L, hd], or [N, kvh, L, hd] (continuous batching)
        c = call.attention[self.kind]
        b, s, _ = x.shape
        nh, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x)  # [b, s, nh·hd]
        q = (self.q_norm(q) if self.whole_norm else q).view(b, s, nh, hd)
        k = self.k_proj(x)  # [b, s, kvh·hd]
        k = (self.k_norm(k) if self.whole_norm else k).view(b, s, kvh, hd)
        v = k if self.v_proj is None else self.v_proj(x).view(b, s, kvh, hd)
        if self.v_eps is not None:
            v = RMSNorm.normalize(v, self.v_eps)
        v = v.transpose(1, 2)  # [b, kvh, s, hd]
        if self.q_norm is not None and not self.whole_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rope(q.transpose(1, 2), c)  # [b, nh, s, hd]
        k = self.rope(k.transpose(1, 2), c)  # [b, kvh, s, hd]
        dims = (b, s, nh, kvh, hd)
        out, cache_k, cache_v, pending = attend_call(
            q, k, v, dims, self.scale, c, cache_k, cache_v, self.sinks
        )
        return self.o_proj(out), cache_k, cache_v, pending

    def rope(self, x: torch.Tensor, c: AttentionCall) -> torch.Tensor:
        """RoPE on x [b, h, s, hd]: every dim, or the first rotary_dim (the rest passes)."""
        rd = self.rotary_dim
        if rd is None:
            return apply_rope(x, c.cos, c.sin, self.head_dim)
        return torch.cat([apply_rope(x[..., :rd], c.cos, c.sin, rd), x[..., rd:]], dim=-1)


def attend_call(q, k, v, dims, scale, c: AttentionCall, cache_k, cache_v, sinks=None):
    """Write k, v into the caches and attend: q [b, nh, s, hd]; k, v [b, kvh, s, hd]; dims
    (b, s, nh, kvh, hd); c the kind's AttentionCall -> (out [b, s, nh*hd], cache_k, cache_v,
    pending). A tree program's call (docs/DESIGN.md, Tree verification) attends to the committed
    prefix read from the caches as they came in, then to its own rows (mask [b, 1, g*s, L + s]:
    the prefix by position, the rows by the tree mask), and leaves the caches unwritten:
    `pending` (k, v) is written once the call has accepted its path (target.py, `accept_path`)."""
    if not c.tree:
        cache_k, keys = update_cache(cache_k, c.rows, c.slots, k, c.reads)  # [b, kvh, L, hd]
        cache_v, values = update_cache(cache_v, c.rows, c.slots, v, c.reads)
        out = softmax_attention(q, keys, values, dims, scale, c.mask, sinks)
        return out, cache_k, cache_v, None
    keys = torch.cat([read_cache(cache_k, c.rows, c.reads), k], dim=2)  # [b, kvh, L + s, hd]
    values = torch.cat([read_cache(cache_v, c.rows, c.reads), v], dim=2)
    out = softmax_attention(q, keys, values, dims, scale, c.mask, sinks)
    return out, cache_k, cache_v, (k, v)


def softmax_attention(q, keys, values, dims, scale, mask, sinks=None):
    """softmax(q·kᵀ · scale + mask) · v: q [b, nh, s, hd]; keys, values [b, kvh, L, hd]; mask
    additive, [b, 1, g*s, L] -> [b, s, nh*hd]. sinks [1, kvh, g, 1, 1] (gpt-oss): a per-head
    logit joins the softmax and its share is dropped, Σ_j p_j = 1 − p_sink."""
    b, s, nh, kvh, hd = dims
    # GQA without repeating the cache: query head h uses kv head h // g, so fold each kv
    # head's g query heads into the row axis: [b, nh, s, hd] -> [b, kvh, g*s, hd].
    g = nh // kvh
    q = q.reshape(b, kvh, g * s, hd) * scale
    # one broadcast Add over the kv-head axis (a per-layer Where over [b, kvh, g, s, L] was
    # the graph's most expensive op on ONNX Runtime); a hidden score becomes score - 2048,
    # whose exp is exactly 0 in fp16 and fp32 whenever the row sees any key
    scores = q @ keys.transpose(2, 3) + mask  # [b, kvh, g*s, L]
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:  # the sink column of row (head, t): g blocks of s rows per kv head; the sinks are
        # held [1, kvh, g, 1, 1] (reshaping the weight itself would be constant-folded)
        sink = sinks.expand(b, kvh, g, s, 1).reshape(b, kvh, g * s, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    out = (probs @ values).view(b, nh, s, hd)  # [b, nh, s, hd]
    return out.transpose(1, 2).reshape(b, s, nh * hd)


class GatedAttention(nn.Module):
    """Hugging Face's `Qwen3_5Attention`: q_proj yields the query and an output gate; q/k
    zero-centred RMSNorm; RoPE on the first `rotary_dim` of each head; output · sigmoid(gate)."""

    kind = FULL_ATTENTION

    def __init__(self, hf: nn.Module, n_heads: int, n_kv_heads: int, rotary_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hf.head_dim
        self.rotary_dim = rotary_dim
        self.scale = hf.scaling
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, frozen_linear(getattr(hf, name)))
        self.q_norm = RMSNorm.from_hf(hf.q_norm, zero_centred=True)
        self.k_norm = RMSNorm.from_hf(hf.k_norm, zero_centred=True)

    state = Attention.state

    def forward(self, h, call, cache_k, cache_v):
        c = call.attention[self.kind]
        b, s, _ = h.shape
        nh, kvh, hd, rd = self.n_heads, self.n_kv_heads, self.head_dim, self.rotary_dim
        q, gate = self.q_proj(h).view(b, s, nh, 2 * hd).split([hd, hd], dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # [b, nh, s, hd]
        k = self.k_norm(self.k_proj(h).view(b, s, kvh, hd)).transpose(1, 2)
        v = self.v_proj(h).view(b, s, kvh, hd).transpose(1, 2)  # [b, kvh, s, hd]
        q = torch.cat([apply_rope(q[..., :rd], c.cos, c.sin, rd), q[..., rd:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :rd], c.cos, c.sin, rd), k[..., rd:]], dim=-1)
        dims = (b, s, nh, kvh, hd)
        out, cache_k, cache_v, pending = attend_call(q, k, v, dims, self.scale, c, cache_k, cache_v)
        out = out * torch.sigmoid(gate.reshape(b, s, nh * hd))
        return self.o_proj(out), cache_k, cache_v, pending


def rotary_dim(cfg) -> int:
    """The leading part of each head RoPE turns (`partial_rotary_factor` of head_dim)."""
    rp = getattr(cfg, "rope_parameters", None) or {}
    factor = rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(head_dim * factor)
