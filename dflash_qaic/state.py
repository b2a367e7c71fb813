"""Typed retained state: what each layer kind keeps between calls, and one slot's copy of it.

A program's retained buffers (its caches and recurrent states) are declared here, per layer, by
a *state spec* (docs/DESIGN.md, Seams: a layer kind owns its state), as vLLM's
`kv_cache_interface` types its caches. A spec says:

- its buffers: names and shapes in the contract's symbols, rows first (`full_batch_size` rows
  with continuous batching, else one per call row), the dtype the graph and the host hold;
- its on-card precision for a compile profile's KV dtype (`card_dtype`);
- how one slot row is read and written: a cache indexed by absolute position up to a position
  (`slot_axis`), a ring or a recurrent state whole;
- whether it *rolls*: a later position overwrites what an earlier one wrote (a ring's slots, a
  recurrent state), so a copy is only valid at the position it was taken at, never cut shorter.

Everything else is derived from the specs: the I/O contract's retained tensors
(contract.TargetIO.kv / DraftIO.kv), the manifest's `state` record, the backends' in-place
binding and per-slot read/write, the compiler's custom I/O, the fp16 check and the projection's
cost model. No buffer is recognised by its name.

`SlotState` is the host's copy of one slot's retained rows (numpy, per buffer, up to a
position; and the draft's pending context features), with a versioned byte form (`to_bytes`,
`from_bytes`: a JSON header and raw arrays, no pickle). It is what moves a sequence between
cache rows, and later between a prefill and a decode program and in and out of a prefix cache.

This module imports numpy and the standard library only: the contract, the manifest, the
runtime, the compiler and the bench all import it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

# The contract's symbols (contract.py re-exports them): rows of a call, rows of every cache with
# continuous batching, and the context length (the slots of a positional cache).
BATCH = "batch_size"
FULL_BATCH = "full_batch_size"
CTX = "ctx_len"
RETAINED_SUFFIX = "_RetainedState"


def rows_symbol(continuous_batching: bool) -> str:
    """The rows of a retained buffer: a cache row per slot, or one per call row."""
    return FULL_BATCH if continuous_batching else BATCH


def retained(name: str) -> str:
    """The output a retained buffer is returned as (QEfficient's convention)."""
    return name + RETAINED_SUFFIX


def _per_layer(prefix: str):
    """The name of a layer's buffer: `<prefix>.<i>` (the graph's input name)."""

    def name(i: int) -> str:
        return f"{prefix}.{i}"

    name.__name__ = name.__qualname__ = prefix
    return name


# Buffer names, per layer i (the exporters take them from here, through the contract).
past_key = _per_layer("past_key")  # attention keys [rows, kv_heads, slots, head_dim]
past_value = _per_layer("past_value")  # attention values, the same shape
past_state = _per_layer("past_state")  # Gated DeltaNet state [rows, v_heads, k_dim, v_dim]
past_conv = _per_layer("past_conv")  # Gated DeltaNet conv window [rows, conv_dim, kernel - 1]
past_latent = _per_layer("past_latent")  # MLA latent [rows, 1, ctx_len, kv_lora_rank]
past_rope = _per_layer("past_rope")  # MLA decoupled rope key [rows, 1, ctx_len, rope_dim]


@dataclass(frozen=True)
class Buffer:
    """One retained tensor: its name, shape (rows first) and host dtype; `slot_axis` is its
    axis of slots (None: a recurrent state, read and written whole); a row reads and writes the
    slots below a position along it, or, for a ring, its `window` live slots whatever the
    position (the ring's padding slot after them is never read)."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str = "float32"
    slot_axis: int | None = None
    window: int | None = None

    def bind(self, symbols: dict) -> tuple[int, ...]:
        return tuple(symbols[d] if isinstance(d, str) else d for d in self.shape)

    def row(self, array: np.ndarray, row: int, upto: int) -> np.ndarray:
        """A view of `row` of `array` (this buffer, all rows): its slots below `upto` (a ring:
        its live window), or the whole row of a buffer without slots."""
        if self.slot_axis is None:
            return array[row]
        index = [row] + [slice(None)] * (array.ndim - 1)
        index[self.slot_axis] = slice(0, upto if self.window is None else self.window)
        return array[tuple(index)]


@dataclass(frozen=True)
class StateSpec:
    """What one layer retains (the base of every kind). `layer`: the layer's index in its
    program; `rows`: the rows symbol (`rows_symbol`)."""

    layer: int
    rows: str

    kind: ClassVar[str] = ""
    rolls: ClassVar[bool] = False  # a later position overwrites an earlier one's entry
    # the compile profile's KV dtype applies (True), or a float kept at fp16 under an integer
    # KV format (a recurrent state is rewritten whole every call: MX int8 would compound)
    quantizable: ClassVar[bool] = True

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        raise NotImplementedError

    def card_dtype(self, kv_dtype: str) -> str:
        """The on-card precision of this state's buffers under a profile's KV dtype."""
        block_format = kv_dtype.startswith("mx")  # MX: a shared exponent per block
        return "float16" if block_format and not self.quantizable else kv_dtype

    def to_json(self) -> dict:
        """The manifest's record of this spec: its kind, layer and buffers."""
        return {
            "kind": self.kind,
            "layer": self.layer,
            "rolls": self.rolls,
            "buffers": [
                {
                    "name": b.name,
                    "shape": list(b.shape),
                    "dtype": b.dtype,
                    "slot_axis": b.slot_axis,
                    **({"window": b.window} if b.window is not None else {}),
                }
                for b in self.buffers
            ],
        }


@dataclass(frozen=True)
class FullAttentionSpec(StateSpec):
    """A full-attention layer: key and value [rows, kv_heads, ctx_len, head_dim], slot =
    absolute position (the last one the padding slot, contract.py)."""

    kv_heads: int = 1
    head_dim: int = 1
    kind: ClassVar[str] = "full_attention"

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        shape = (self.rows, self.kv_heads, CTX, self.head_dim)
        return (
            Buffer(past_key(self.layer), shape, slot_axis=2),
            Buffer(past_value(self.layer), shape, slot_axis=2),
        )


@dataclass(frozen=True)
class SlidingWindowSpec(StateSpec):
    """A sliding layer's ring: key and value [rows, kv_heads, slots, head_dim], `slots` = the
    window's R live slots (position mod R) + the ring's padding slot (docs/DESIGN.md, Sliding
    drafts). Only the window is live: a row reads and writes its R slots, whatever the
    position."""

    kv_heads: int = 1
    head_dim: int = 1
    slots: int = 2
    kind: ClassVar[str] = "sliding_window"
    rolls: ClassVar[bool] = True

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        shape = (self.rows, self.kv_heads, self.slots, self.head_dim)
        live = self.slots - 1
        return (
            Buffer(past_key(self.layer), shape, slot_axis=2, window=live),
            Buffer(past_value(self.layer), shape, slot_axis=2, window=live),
        )


@dataclass(frozen=True)
class GatedDeltaNetSpec(StateSpec):
    """A Gated DeltaNet layer: the recurrent state [rows, v_heads, k_head_dim, v_head_dim] and
    the conv window [rows, conv_dim, kernel − 1] (its last inputs), read and written whole."""

    v_heads: int = 1
    k_head_dim: int = 1
    v_head_dim: int = 1
    conv_dim: int = 1
    conv_window: int = 1
    kind: ClassVar[str] = "gated_deltanet"
    rolls: ClassVar[bool] = True
    quantizable: ClassVar[bool] = False

    @classmethod
    def of(cls, layer: int, rows: str, dims: tuple[int, ...]) -> GatedDeltaNetSpec:
        """From the contract's state_dims (v_heads, k_head_dim, v_head_dim, conv_dim, kernel − 1)."""
        return cls(layer, rows, *dims)

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        return (
            Buffer(
                past_state(self.layer),
                (self.rows, self.v_heads, self.k_head_dim, self.v_head_dim),
            ),
            Buffer(past_conv(self.layer), (self.rows, self.conv_dim, self.conv_window)),
        )


@dataclass(frozen=True)
class LatentAttentionSpec(StateSpec):
    """A latent (MLA) layer's compressed cache (modeling/mla.py): the latent
    [rows, 1, ctx_len, kv_lora_rank] and the decoupled RoPE key [rows, 1, ctx_len, rope_dim],
    slot = absolute position: kv_lora_rank + rope_dim values per token. The axis of one "head"
    keeps the cache ops' [rows, heads, slots, dim] layout (CtxScatter / CtxScatterCB)."""

    kv_lora_rank: int = 1
    rope_dim: int = 1
    kind: ClassVar[str] = "latent_attention"

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        return (
            Buffer(past_latent(self.layer), (self.rows, 1, CTX, self.kv_lora_rank), slot_axis=2),
            Buffer(past_rope(self.layer), (self.rows, 1, CTX, self.rope_dim), slot_axis=2),
        )


KINDS = {
    c.kind: c
    for c in (FullAttentionSpec, SlidingWindowSpec, GatedDeltaNetSpec, LatentAttentionSpec)
}


def buffers_of(specs) -> list[Buffer]:
    """Every retained buffer of `specs`, in order (a program's retained I/O)."""
    return [b for s in specs for b in s.buffers]


def retained_inputs(inputs: list[str], outputs: list[str], specs=None) -> list[str]:
    """The retained inputs of a program with these input and output names: those its state
    specs declare (ValueError unless each is an input with its `_RetainedState` output);
    without specs, the inputs the I/O pairs with a retained output."""
    outs = set(outputs)
    if specs is None:
        return [n for n in inputs if retained(n) in outs]
    names = [b.name for b in buffers_of(specs)]
    bad = [n for n in names if n not in inputs or retained(n) not in outs]
    if bad:
        raise ValueError(f"the state specs declare {bad}, which the program does not retain")
    return names


def card_dtypes(specs, kv_dtype: str) -> dict[str, str]:
    """Buffer name -> on-card precision (the compiler's custom I/O)."""
    return {b.name: s.card_dtype(kv_dtype) for s in specs for b in s.buffers}


def rolls(specs) -> bool:
    """Whether any state of `specs` rolls (its copy holds at its position only)."""
    return any(s.rolls for s in specs)


# ---------------------------------------------------------------------------------------------
# one slot's retained rows on the host

MAGIC = b"DFQSLOT"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<7sBI")  # magic, version, header length


class SlotStateError(ValueError):
    """A slot state that does not fit a program, or bytes that are not a slot state."""


@dataclass
class SlotState:
    """One slot's retained rows on the host: per buffer name its row (the rows axis dropped;
    a positional buffer up to `upto` slots), `upto` the positions held (slots < upto), and
    `context` the host-side rows a program still owes the slot (the draft's pending context
    features and their positions), `meta` free-form JSON (role, …)."""

    upto: int
    arrays: dict[str, np.ndarray]
    context: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """Version 1: magic b"DFQSLOT", a version byte, a little-endian u32 header length, a
        UTF-8 JSON header (upto, meta, and per array its group, name, dtype, shape, offset,
        nbytes), then the arrays' little-endian C-order bytes."""
        entries, blobs, offset = [], [], 0
        for group, arrays in (("arrays", self.arrays), ("context", self.context)):
            for name, a in arrays.items():
                a = np.ascontiguousarray(a, a.dtype.newbyteorder("<"))
                entries.append(
                    {
                        "group": group,
                        "name": name,
                        "dtype": a.dtype.str,
                        "shape": list(a.shape),
                        "offset": offset,
                        "nbytes": a.nbytes,
                    }
                )
                blobs.append(a.tobytes())
                offset += a.nbytes
        header = json.dumps({"upto": self.upto, "meta": self.meta, "arrays": entries}).encode()
        return _HEADER.pack(MAGIC, FORMAT_VERSION, len(header)) + header + b"".join(blobs)

    @classmethod
    def from_bytes(cls, data: bytes) -> SlotState:
        if len(data) < _HEADER.size:
            raise SlotStateError("not a slot state: shorter than its header")
        magic, version, n = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise SlotStateError(f"not a slot state (magic {magic!r}, expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise SlotStateError(
                f"slot state format version {version}; this dflash-qaic reads {FORMAT_VERSION}"
            )
        try:
            header = json.loads(data[_HEADER.size : _HEADER.size + n])
        except ValueError as e:
            raise SlotStateError(f"slot state header is not JSON: {e}") from e
        body = memoryview(data)[_HEADER.size + n :]
        try:
            out = cls(int(header["upto"]), {}, {}, dict(header.get("meta", {})))
            for e in header["arrays"]:
                lo, hi = e["offset"], e["offset"] + e["nbytes"]
                if hi > len(body):
                    raise SlotStateError(f"slot state truncated in {e['name']}")
                if e["group"] not in ("arrays", "context"):
                    raise SlotStateError(f"slot state array {e['name']} in group {e['group']!r}")
                a = np.frombuffer(body[lo:hi], np.dtype(e["dtype"])).reshape(e["shape"])
                getattr(out, e["group"])[e["name"]] = a.astype(a.dtype.newbyteorder("="))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, SlotStateError):
                raise
            raise SlotStateError(f"slot state header is malformed: {e!r}") from e
        return out

    def same(self, other: SlotState) -> bool:
        """Byte-identical: the same positions, buffers and bytes."""
        return self.to_bytes() == other.to_bytes()


def read_rows(specs, arrays: dict[str, np.ndarray], row: int, upto: int) -> dict:
    """Copies of `row` of every buffer of `specs` (`arrays`: buffer name -> all rows)."""
    return {b.name: b.row(arrays[b.name], row, upto).copy() for s in specs for b in s.buffers}


def write_rows(specs, arrays: dict[str, np.ndarray], row: int, state: SlotState) -> None:
    """`state`'s rows into `row` of every buffer of `specs`, shapes checked (a positional
    buffer's slots from `state.upto` on are left as they were: never read below that position)."""
    want = {b.name for s in specs for b in s.buffers}
    if set(state.arrays) != want:
        raise SlotStateError(
            f"the slot state holds {sorted(state.arrays)}, the program retains {sorted(want)}: "
            "it was read from a program of another shape"
        )
    for s in specs:
        for b in s.buffers:
            dst = b.row(arrays[b.name], row, state.upto)
            src = state.arrays[b.name]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise SlotStateError(
                    f"{b.name}: the slot state's row is {src.dtype}{list(src.shape)}, the "
                    f"program's is {dst.dtype}{list(dst.shape)} (up to {state.upto})"
                )
            dst[...] = src
