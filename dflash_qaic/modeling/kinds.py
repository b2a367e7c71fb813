"""Targets whose layers come in kinds (sliding and full attention) that differ in window, RoPE
table, head count and head size: gpt-oss and Gemma 4 (modeling/gpt_oss.py, modeling/gemma4.py).

The program contract is the dense target's (modeling/target.py: the same inputs, outputs and
one key / value cache per layer, [rows, kvh_i, ctx, hd_i], each layer its own kvh_i and hd_i).
Per call, each kind's attention inputs are built once and shared by every layer of that kind:

    Call(kind) = cos/sin [b, s, hd_kind]            from the kind's RoPE table, by position
                 mask   [b, 1, g_kind·s, L]         key slot j visible iff j <= position and,
                                                    sliding, j > position − window (HF's
                                                    sliding_window_causal), as attention's rows
                 slots, rows, reads                 as modeling/target.py (reads per kv head count)

    x = embed(input_ids) · embed_scale;  per layer: x, k, v = layer(x, calls[layer.kind], k, v)
    logits = softcap(norm(x) · head)      softcap(l) = c · tanh(l / c) when the config has c

next_tokens, hidden_states and the retained caches as the dense target.

Ring caches. A sliding layer of window W whose calls have at most S rows keeps R + 1 slots,
R = W + S − 1 (a static axis, contract.TargetIO.ring_slots): position p in slot p mod R, a padding
row (−1) in slot R, never read. The query at Q reads all R slots; slot j holds
h = Q − ((Q − j) mod R) and is visible iff Q − W < h and h >= 0. That is exact whenever every
position below the call was written in order (the runtime does so): a visible h is at least
Q − W + 1, and any other position in slot j is h ± a multiple of R, so either older than the
window or at least Q − W + 1 + R >= Q + S, past every row of the call, rejected verify rows
included. A call's memory and reads are R slots whatever the context (docs/DESIGN.md, Layer
kinds). Without a bound on the rows (max_rows None) or when R + 1 >= ctx_len, a sliding layer
keeps a ctx_len cache and the window is applied by the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_qaic.contract import (
    BATCH_INDEX,
    COMP_CTX_LENGTHS,
    DRAFT_Q_IDS,
    DRAFT_Q_PROBS,
    HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    POSITION_IDS,
    SAMPLING_INPUTS,
    TOKEN_BITMASK,
    past_key,
    past_value,
)
from dflash_qaic.contract import retained as retained_name
from dflash_qaic.modeling.layers import MASK_VALUE, RopeTable, embed_rows
from dflash_qaic.modeling.ops import cache_reads, cache_rows, cache_slots
from dflash_qaic.modeling.sampler import mask_logits, sample_next_tokens, token_allowed
from dflash_qaic.modeling.target import ExportTarget

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class Call:
    """One layer kind's attention inputs for this call (module docstring)."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor | None
    reads: torch.Tensor | None
    mask: torch.Tensor


@dataclass(frozen=True)
class Kind:
    """What a layer kind's attention needs: its window (None: full), RoPE table, head counts,
    and for a sliding kind its ring (R: positions held, `ring_size`; None: a ctx_len cache)."""

    window: int | None
    rope: str  # the name of the target's RopeTable buffer module for this kind
    n_heads: int
    n_kv_heads: int
    ring: int | None = None


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


def check_taps(cfg, fc_weight: torch.Tensor, target_layer_ids) -> None:
    """target_layer_ids distinct ids of the target's layers; fc [H, k·H] for k of them."""
    n_layers, ids = cfg.num_hidden_layers, [int(j) for j in target_layer_ids]
    if not ids or any(not 0 <= j < n_layers for j in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids {ids} must be distinct layer ids in [0, {n_layers})")
    expected = (cfg.hidden_size, len(ids) * cfg.hidden_size)
    if tuple(fc_weight.shape) != expected:
        raise ValueError(f"fc weight shape {tuple(fc_weight.shape)} != {expected}")


class KindTarget(ExportTarget):
    """ExportTarget whose layers have a `kind` (a key of `kinds`) and take
    (x, call: Call, cache_k, cache_v) -> (x, cache_k, cache_v)."""

    def __init__(
        self,
        *args,
        kinds: dict[str, Kind],
        ropes: dict[str, RopeTable],
        embed_scale: float = 1.0,
        final_logit_softcapping: float | None = None,
        **kw,
    ):
        super().__init__(*args, **kw)
        self.kinds = dict(kinds)
        for name, table in ropes.items():
            self.add_module(name, table)
        self.embed_scale = float(embed_scale)
        self.softcap = float(final_logit_softcapping) if final_logit_softcapping else None

    def calls(self, position_ids, rows, window) -> dict[str, Call]:
        ctx_len = self.ctx_len
        slots = cache_slots(position_ids, ctx_len)  # [b, s]
        kv_index = window if window is not None else torch.arange(ctx_len)  # [L]
        pos = position_ids[..., None]  # [b, s, 1]
        visible = kv_index <= pos  # [b, s, L]
        out = {}
        for name, k in self.kinds.items():
            at, reads = slots, cache_reads(rows, window, k.n_kv_heads, ctx_len)
            if k.ring is not None:  # slot = position mod R; −1 -> the ring's padding slot R
                R = k.ring
                v = ring_mask(position_ids, R, k.window)  # [b, s, R]
                at = torch.where(position_ids < 0, R, torch.remainder(position_ids, R))
                reads = cache_reads(rows, torch.arange(R), k.n_kv_heads, R + 1)
            elif k.window is not None:
                v = visible & (kv_index > pos - k.window)
            else:
                v = visible
            m = (~v).to(torch.float32) * MASK_VALUE  # [b, s, L or R]
            g = k.n_heads // k.n_kv_heads
            cos, sin = getattr(self, k.rope)(position_ids)  # [b, s, hd]
            out[name] = Call(
                cos=cos,
                sin=sin,
                slots=at,
                rows=rows,
                reads=reads,
                mask=torch.cat([m] * g, dim=1)[:, None],  # [b, 1, g*s, L or R]
            )
        return out

    def io_dims(self) -> dict:
        """The contract.TargetIO fields the layers decide: each layer's cache shape when they
        differ (`layer_kv`) and the sliding layers' rings (`ring_slots`)."""
        shapes = [(la.self_attn.n_kv_heads, la.self_attn.head_dim) for la in self.layers]
        kvh, hd = shapes[0]
        per_layer = tuple(d for s in shapes for d in s) if len(set(shapes)) > 1 else ()
        dims = dict(n_layers=len(self.layers), n_kv_heads=kvh, head_dim=hd)
        return dims | dict(layer_kv=per_layer, ring_slots=self.ring_slots())

    def ring_slots(self) -> tuple[int, ...]:
        """contract.TargetIO.ring_slots: per layer R + 1 for a ring, 0 for a ctx_len cache."""
        rings = [self.kinds[layer.kind].ring for layer in self.layers]
        return tuple(0 if r is None else r + 1 for r in rings) if any(rings) else ()

    def forward(self, *inputs: torch.Tensor):
        # the inputs and outputs of ExportTarget.forward, bound by name
        x = x_in = dict(zip(self.input_names, inputs, strict=True))
        input_ids, position_ids = x[INPUT_IDS], x[POSITION_IDS]
        rows = cache_rows(x[BATCH_INDEX]) if self.continuous_batching else None
        window = x[COMP_CTX_LENGTHS] if self.comp_ctx else None  # [L]
        sampling = [x[n] for n in SAMPLING_INPUTS] if self.sampling else []
        q = {"q_ids": x[DRAFT_Q_IDS], "q_probs": x[DRAFT_Q_PROBS]} if DRAFT_Q_IDS in x else {}
        kv = [n for i in range(len(self.layers)) for n in (past_key(i), past_value(i))]
        past = [x[n] for n in kv]
        calls = self.calls(position_ids, rows, window)
        x = embed_rows(input_ids, self.head_t, self.embed)  # [b, s, H]
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        last = len(self.layers) - 1
        taps, retained = {}, []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, calls[layer.kind], past[2 * i], past[2 * i + 1])
            retained += [k, v]
            if i in self.target_layer_ids and i != last:
                taps[i] = x  # HF hidden_states[i + 1]
        x = self.norm(x)
        if last in self.target_layer_ids:
            taps[last] = x

        logits = x @ self.head_t  # [b, s, V]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.token_bitmask:
            logits, floor = mask_logits(logits, token_allowed(x_in[TOKEN_BITMASK], self.vocab_size))
            q["floor"] = floor
        if self.sampling:
            next_tokens = sample_next_tokens(
                logits, input_ids, position_ids, *sampling, self.vocab_size,
                self.sampling_candidates, **q,
            )  # fmt: skip
        else:
            next_tokens = logits.argmax(dim=-1)
        hidden = self.fuse(torch.cat([taps[j] for j in self.target_layer_ids], dim=-1))
        out = {NEXT_TOKENS: next_tokens, HIDDEN_STATES: hidden, LOGITS: logits}
        out.update((retained_name(n), t) for n, t in zip(kv, retained, strict=True))
        return tuple(out[n] for n in self.output_names)
