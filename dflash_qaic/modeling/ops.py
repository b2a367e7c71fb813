"""AI100 custom KV-cache ops: `CtxScatter` and `CtxScatterCB` (domain `com.qualcomm.cloud`, v1).

Each op is a `torch.autograd.Function`: `forward` is plain eager torch, `symbolic` emits a call to
an ONNX function of the same name whose body is standard ONNX (ScatterND / GatherND). The AI100
compiler recognises the call by name and domain; ONNX Runtime simply runs the body.

Cache layout: [batch, n_kv_heads, ctx_len, head_dim], one slot per absolute position.

Padding: a row with position -1 must never change a slot that can later be read. `cache_slots`
maps -1 to the padding slot `ctx_len - 1` with a plain `Where` *before* the custom op, so the op
only ever sees in-range indices and both backends do the same thing: on the device the compiled
CtxScatter writes slot ctx_len - 1, in ONNX Runtime the ScatterND body writes slot ctx_len - 1.
No real token is ever placed there (the runtime stops a sequence at ctx_len - 1 positions, see
`contract.max_positions`), and a key slot is visible only to queries with position >= its index,
so no valid query ever reads it. Several padding rows may write it in one call; ScatterND leaves
the winner unspecified, which is harmless because nobody reads it.

Continuous batching (`CtxScatterCB`, QEfficient's name and argument order): the cache has
`full_batch_size` rows and each call row writes the cache row its `batch_index` names. An
inactive row (batch_index -1, every position -1) is mapped by `cache_rows` to cache row 0 with
a plain `Where` before the op, and its positions to the padding slot, so it writes only row 0's
padding slot: never read, on the card or on ONNX Runtime (whose ScatterND would otherwise wrap -1
to the last row, and which rejects out-of-range indices where the card drops them). Active rows
hold distinct batch indices (one sequence per cache row), so their real writes never collide.
Reads are one plain Gather of the call's rows' windows (`cache_reads`); an inactive row reads
row 0 and its outputs are ignored.
"""

from __future__ import annotations

import onnxscript
import torch
from onnxscript import opset17 as op
from torch.nn import functional as F

QAIC_DOMAIN = "com.qualcomm.cloud"
_qaic = onnxscript.values.Opset(QAIC_DOMAIN, 1)


def cache_slots(position_ids: torch.Tensor, ctx_len: int | torch.Tensor) -> torch.Tensor:
    """Slot each row writes: its position, or the padding slot ctx_len - 1 for position -1."""
    return torch.where(position_ids < 0, ctx_len - 1, position_ids)


def ring_slots(position_ids: torch.Tensor, start: torch.Tensor, M: int) -> torch.Tensor:
    """Slot each context row writes in a ring of M + 1 slots (a sliding layer of window M + 1):
    position mod M for the positions a query of this call can see, start − M … start − 1 (start
    [b, 1], the block's first position), else the ring's padding slot M. So a call of more than
    M rows writes each ring slot once, with its last rows (ScatterND leaves the order of
    duplicate indices unspecified), and −1 rows, rows too old for the block and rows at or past
    it write only the padding slot, which no query reads (docs/DESIGN.md, Sliding drafts)."""
    keep = (position_ids >= 0) & (position_ids >= start - M) & (position_ids < start)
    return torch.where(keep, torch.remainder(position_ids, M), M)


def ring_held(start: torch.Tensor, slots: torch.Tensor, M: int) -> torch.Tensor:
    """The position ring slot s holds when the block starts at `start` [b, 1] -> [b, n]: the
    latest position ≡ s (mod M) below start, (start − 1) − ((start − 1 − s) mod M); negative
    when the sequence is too short to have written it (then it holds nothing of this
    sequence). Exact when every position below start was written in order, as the runtime
    does (docs/DESIGN.md, Sliding drafts)."""
    return (start - 1) - torch.remainder(start - 1 - slots[None, :], M)


def cache_rows(batch_index: torch.Tensor) -> torch.Tensor:
    """Cache row of each call row: batch_index [b, 1], or row 0 for an inactive row (-1)."""
    return torch.where(batch_index < 0, 0, batch_index)


def cache_reads(rows, window, kv_heads: int, ctx_len: int):
    """What attention reads, computed once per call. Without continuous batching (rows None):
    the window [L] (None: every slot). With it: the flat index of each (call row, kv head, window
    slot) into a cache viewed as [N·kv_heads·ctx_len, hd], [b, kv_heads, L], so that one Gather
    copies just the call's rows' windows (a Gather of the window over all N cache rows followed
    by one of the call's rows copies N/b times more: 8× for a batch-1 prefill on 8 rows)."""
    if rows is None:
        return window
    slots = torch.arange(ctx_len) if window is None else window  # [L]
    heads = torch.arange(kv_heads)[:, None]  # [kvh, 1]
    return (rows[:, :, None] * kv_heads + heads) * ctx_len + slots  # [b, kvh, L]


# ---------------------------------------------------------------- ONNX function bodies


class QaicFunctions:
    """The ONNX functions; their names and domain are what the AI100 compiler matches on."""

    @onnxscript.script(_qaic, default_opset=op)
    def CtxScatter(data, position_ids, updates):
        # data [b, h, ctx, d]; position_ids [b, s], already in [0, ctx); updates [b, h, s, d]
        zero = op.Constant(value_ints=[0])
        one = op.Constant(value_ints=[1])
        b = op.Gather(op.Shape(data), zero)
        h = op.Gather(op.Shape(data), one)
        s = op.Gather(op.Shape(position_ids), one)
        idx_shape = op.Concat(b, h, s, one, axis=0)  # [b, h, s, 1]
        bi = op.Expand(op.Unsqueeze(op.Range(0, op.Squeeze(b), 1), [1, 2, 3]), idx_shape)
        hi = op.Expand(op.Unsqueeze(op.Range(0, op.Squeeze(h), 1), [0, 2, 3]), idx_shape)
        pi = op.Expand(op.Unsqueeze(position_ids, [1, 3]), idx_shape)
        indices = op.Concat(bi, hi, pi, axis=3)  # [b, h, s, 3]: (batch, head, slot)
        return op.ScatterND(data, indices, updates)

    @onnxscript.script(_qaic, default_opset=op)
    def CtxScatterCB(data, batch_index, position_ids, updates):
        # data [N, h, ctx, d]; batch_index [b, 1] in [0, N); position_ids [b, s] in [0, ctx);
        # updates [b, h, s, d]
        one = op.Constant(value_ints=[1])
        b = op.Gather(op.Shape(batch_index), op.Constant(value_ints=[0]))
        h = op.Gather(op.Shape(data), one)
        s = op.Gather(op.Shape(position_ids), one)
        idx_shape = op.Concat(b, h, s, one, axis=0)  # [b, h, s, 1]
        bi = op.Expand(op.Unsqueeze(batch_index, [2, 3]), idx_shape)
        hi = op.Expand(op.Unsqueeze(op.Range(0, op.Squeeze(h), 1), [0, 2, 3]), idx_shape)
        pi = op.Expand(op.Unsqueeze(position_ids, [1, 3]), idx_shape)
        indices = op.Concat(bi, hi, pi, axis=3)  # [b, h, s, 3]: (cache row, head, slot)
        return op.ScatterND(data, indices, updates)


# ---------------------------------------------------------------- torch ops


class CtxScatter(torch.autograd.Function):
    """cache[b, h, position_ids[b, s], :] = updates[b, h, s, :]; returns the new cache.

    position_ids must already be in [0, ctx_len): pass them through `cache_slots` first.
    """

    @staticmethod
    def forward(ctx, data: torch.Tensor, position_ids: torch.Tensor, updates: torch.Tensor):
        b, h, s, d = updates.shape
        index = position_ids[:, None, :, None].expand(b, h, s, d)
        return data.scatter(2, index, updates)

    @staticmethod
    def symbolic(g, data, position_ids, updates):
        out = g.onnxscript_op(QaicFunctions.CtxScatter, data, position_ids, updates)
        return out.setTypeAs(data)


class CtxScatterCB(torch.autograd.Function):
    """cache[batch_index[b], h, position_ids[b, s], :] = updates[b, h, s, :]; the new cache.

    batch_index and position_ids must already be in range: pass them through `cache_rows` and
    `cache_slots` first.
    """

    @staticmethod
    def forward(ctx, data, batch_index, position_ids, updates):
        b, h, s, d = updates.shape
        out = data.clone()
        rows = batch_index[:, 0]
        for r in range(b):  # eager reference only; the graph is one ScatterND
            index = position_ids[r][None, :, None].expand(h, s, d)
            out[rows[r]] = out[rows[r]].scatter(1, index, updates[r])
        return out

    @staticmethod
    def symbolic(g, data, batch_index, position_ids, updates):
        out = g.onnxscript_op(QaicFunctions.CtxScatterCB, data, batch_index, position_ids, updates)
        return out.setTypeAs(data)


def ctx_scatter(cache: torch.Tensor, slots: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    return CtxScatter.apply(cache, slots, updates)


def ctx_scatter_cb(cache, rows, slots, updates) -> torch.Tensor:
    return CtxScatterCB.apply(cache, rows, slots, updates)


def read_cache(cache, rows, reads) -> torch.Tensor:
    """The call's view [b, h, L, d] of `cache` (a tree program reads the prefix before it
    writes: `attention.attend_call`); rows, reads as `update_cache` takes them."""
    if rows is None:
        return cache if reads is None else cache[:, :, reads]
    return F.embedding(reads, cache.flatten(0, 2))  # [N·h·ctx, d] gathered -> [b, h, L, d]


def write_cache(cache, rows, slots, new) -> torch.Tensor:
    """`new` [b, h, s, d] written at `slots` [b, s] (cache rows `rows`, or None): the cache."""
    return (
        ctx_scatter(cache, slots, new) if rows is None else ctx_scatter_cb(cache, rows, slots, new)
    )


def update_cache(cache, rows, slots, new, reads=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write `new` [b, h, s, d] at `slots` [b, s] and return (the updated cache, the call's view
    of it [b, h, L, d]). rows [b, 1] (from `cache_rows`) with continuous batching, else None (the
    cache has one row per call row). reads: from `cache_reads` (None: every slot). The view is
    read from the updated cache, never from the input: that is what makes the in-place update
    safe (runtime/backends.py)."""
    cache = write_cache(cache, rows, slots, new)
    return cache, read_cache(cache, rows, reads)
