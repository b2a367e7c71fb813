"""Typed retained state (dflash_qaic/state.py): the specs per layer kind, what the contract, the
compiler and the manifest derive from them, and SlotState's byte form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_qaic import contract, state
from dflash_qaic.compiler.qpc import custom_io
from dflash_qaic.state import (
    FullAttentionSpec,
    GatedDeltaNetSpec,
    LatentAttentionSpec,
    SlidingWindowSpec,
    SlotState,
    SlotStateError,
)

ROWS = contract.FULL_BATCH


def test_specs_per_layer_kind():
    full = FullAttentionSpec(0, ROWS, kv_heads=2, head_dim=16)
    ring = SlidingWindowSpec(1, ROWS, kv_heads=2, head_dim=16, slots=9)
    gdn = GatedDeltaNetSpec.of(2, ROWS, (4, 8, 8, 40, 3))
    mla = LatentAttentionSpec(3, ROWS, kv_lora_rank=32, rope_dim=8)
    assert [b.shape for b in full.buffers] == [(ROWS, 2, contract.CTX, 16)] * 2
    assert [b.slot_axis for b in full.buffers] == [2, 2] and not full.rolls
    assert [b.shape for b in ring.buffers] == [(ROWS, 2, 9, 16)] * 2 and ring.rolls
    assert [(b.slot_axis, b.window) for b in ring.buffers] == [(2, 8)] * 2  # its live slots
    assert [b.name for b in gdn.buffers] == [contract.past_state(2), contract.past_conv(2)]
    assert [b.shape for b in gdn.buffers] == [(ROWS, 4, 8, 8), (ROWS, 40, 3)] and gdn.rolls
    assert [b.shape for b in mla.buffers] == [
        (ROWS, 1, contract.CTX, 32),
        (ROWS, 1, contract.CTX, 8),
    ]
    assert [b.slot_axis for b in mla.buffers] == [2, 2] and not mla.rolls
    # on-card precision: the profile's KV dtype, but a recurrent state stays fp16 under MXINT8
    assert full.card_dtype("mxint8") == ring.card_dtype("mxint8") == "mxint8"
    assert gdn.card_dtype("mxint8") == "float16" and gdn.card_dtype("bfloat16") == "bfloat16"
    assert set(state.KINDS) == {s.kind for s in (full, ring, gdn, mla)}


def test_contract_retained_io_is_the_specs():
    io = contract.TargetIO(
        4,
        2,
        16,
        64,
        100,
        continuous_batching=True,
        linear_layers=(0, 1),
        state_dims=(4, 8, 8, 40, 3),
    )
    kinds = [type(s) for s in io.state]
    assert kinds == [GatedDeltaNetSpec, GatedDeltaNetSpec, FullAttentionSpec, FullAttentionSpec]
    assert [s.name for s in io.kv] == [b.name for b in state.buffers_of(io.state)]
    # Gemma 4 style: per-layer heads and a ring on the sliding layers
    io = contract.TargetIO(2, 2, 16, 64, 100, layer_kv=(2, 16, 1, 32), ring_slots=(9, 0))
    assert [type(s) for s in io.state] == [SlidingWindowSpec, FullAttentionSpec]
    assert io.kv[0].shape == (contract.BATCH, 2, 9, 16) and io.kv[2].shape[1:] == (1, "ctx_len", 32)
    draft = contract.DraftIO(2, 2, 16, 64, 100, 4, ring_slots=(7, 0))
    assert [type(s) for s in draft.state] == [SlidingWindowSpec, FullAttentionSpec]


def test_custom_io_precision_from_the_specs():
    io = contract.TargetIO(3, 2, 16, 64, 100, linear_layers=(0,), state_dims=(4, 8, 8, 40, 3))
    entries = {e["IOName"]: e["Precision"] for e in custom_io(io, "mxint8")}
    assert entries[contract.past_state(0)] == entries[contract.retained(contract.past_conv(0))]
    assert entries[contract.past_state(0)] == "float16"
    assert entries[contract.retained(contract.past_key(1))] == "mxint8"
    assert len(entries) == 2 * len(io.kv)


def _slot(rng) -> SlotState:
    return SlotState(
        upto=5,
        arrays={
            "past_key.0": rng.standard_normal((2, 5, 4)).astype(np.float32),
            "past_state.1": rng.standard_normal((3, 2, 2)).astype(np.float16),
        },
        context={"target_hidden": rng.standard_normal((3, 8)).astype(np.float32)},
        meta={"role": "draft"},
    )


def test_slot_state_bytes_round_trip():
    rng = np.random.default_rng(0)
    s = _slot(rng)
    data = s.to_bytes()
    back = SlotState.from_bytes(data)
    assert back.upto == 5 and back.meta == {"role": "draft"}
    assert set(back.arrays) == set(s.arrays) and set(back.context) == {"target_hidden"}
    for name, a in s.arrays.items():
        assert back.arrays[name].dtype == a.dtype and np.array_equal(back.arrays[name], a)
    assert np.array_equal(back.context["target_hidden"], s.context["target_hidden"])
    assert back.to_bytes() == data and back.same(s)
    changed = SlotState.from_bytes(data)
    changed.arrays["past_key.0"][0, 0, 0] += 1
    assert not changed.same(s)


def _header(data: bytes, change) -> bytes:
    """`data` with its JSON header changed by `change(header)` (and re-packed)."""
    magic, version, n = state._HEADER.unpack_from(data)
    header = json.loads(data[state._HEADER.size : state._HEADER.size + n])
    change(header)
    text = json.dumps(header).encode()
    return state._HEADER.pack(magic, version, len(text)) + text + data[state._HEADER.size + n :]


@pytest.mark.parametrize(
    "mangle, match",
    [
        (lambda d: b"NOTSLOT" + d[7:], "not a slot state"),
        (lambda d: d[:7] + bytes([9]) + d[8:], "format version 9"),
        (lambda d: d[:-4], "truncated"),
        (lambda d: d[:5], "shorter than its header"),
        (lambda d: _header(d, lambda h: h["arrays"][-1].update(group="meta")), "group 'meta'"),
        (lambda d: _header(d, lambda h: h.pop("upto")), "malformed"),
    ],
)
def test_slot_state_bad_bytes_are_refused(mangle, match):
    data = _slot(np.random.default_rng(1)).to_bytes()
    with pytest.raises(SlotStateError, match=match):
        SlotState.from_bytes(mangle(data))


def test_rows_read_and_write_per_kind():
    """A positional cache moves up to the position, a ring and a recurrent state whole; a
    state of another shape is refused by name."""
    specs = [
        FullAttentionSpec(0, ROWS, kv_heads=1, head_dim=2),
        SlidingWindowSpec(1, ROWS, kv_heads=1, head_dim=2, slots=3),
        GatedDeltaNetSpec.of(2, ROWS, (1, 2, 2, 3, 2)),
    ]
    sym = {ROWS: 3, contract.CTX: 8}
    rng = np.random.default_rng(2)
    arrays = {
        b.name: rng.standard_normal(b.bind(sym)).astype(np.float32)
        for s in specs
        for b in s.buffers
    }
    slot = SlotState(4, state.read_rows(specs, arrays, 0, 4))
    assert slot.arrays["past_key.0"].shape == (1, 4, 2)  # up to position 4
    assert slot.arrays["past_key.1"].shape == (1, 2, 2)  # the ring's window, not its padding
    before = arrays["past_key.0"][2, :, 4:].copy()
    state.write_rows(specs, arrays, 2, slot)
    for name in arrays:
        a = arrays[name]
        if name in ("past_key.0", "past_value.0"):
            assert np.array_equal(a[2, :, :4], a[0, :, :4])
        elif name in ("past_key.1", "past_value.1"):
            assert np.array_equal(a[2, :, :2], a[0, :, :2]) and not np.array_equal(a[2], a[0])
        else:
            assert np.array_equal(a[2], a[0])
    assert np.array_equal(arrays["past_key.0"][2, :, 4:], before)  # past the position: as was
    with pytest.raises(SlotStateError, match="another shape"):
        state.write_rows(specs[:1], arrays, 1, slot)
    slot.arrays["past_key.1"] = slot.arrays["past_key.1"][:, :1]
    with pytest.raises(SlotStateError, match="past_key.1"):
        state.write_rows(specs, arrays, 1, slot)


def test_roles_declared_once():
    assert contract.ROLE_NAMES == ("target", "draft")
    assert contract.ROLES["target"].io is contract.TargetIO
    plan = contract.shape_plan(4, 16, 128)
    assert contract.ROLES["draft"].specializations(plan) == contract.draft_specializations(plan)


def test_manifest_lists_roles_and_state(exported):
    """The manifest lists its programs by role and records each one's state specs; a manifest
    written before either still reads, an unknown role or a state that disagrees is refused."""
    from dflash_qaic.artifacts.manifest import ArtifactsError, Manifest, load_json

    e = exported("qwen3", pair=dict(block_size=4), prefill_seq_len=8, ctx_len=64)
    raw = load_json(e.artifacts)
    assert raw["programs"] == ["target", "draft"]
    assert raw["draft"]["state"][0]["kind"] == "full_attention"
    m = Manifest.from_json(raw)
    assert m.roles == ("target", "draft") and m.program("draft") is m.draft
    old = json.loads(json.dumps(raw))
    del old["programs"]
    for role in ("target", "draft"):
        del old[role]["state"]
    assert Manifest.from_json(old) == m
    bad = json.loads(json.dumps(raw))
    bad["programs"] = ["target", "draft", "prefill"]
    with pytest.raises(ArtifactsError, match="`programs` must list distinct roles"):
        Manifest.from_json(bad)
    bad = json.loads(json.dumps(raw))
    bad["target"]["state"][0]["buffers"][0]["slot_axis"] = None
    with pytest.raises(ArtifactsError, match="target.state"):
        Manifest.from_json(bad)
