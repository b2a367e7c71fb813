"""Prefill/decode hand-off: a request's prompt state moved from a prefill engine to a decode
engine on the same artifacts (docs/DESIGN.md, Disaggregated prefill).

    prefill side   export(engine, manifest, ids) -> bytes
                   the target prefills the prompt's first P − 1 positions in a free cache row;
                   the payload is that row's target state up to P − 1 (`read_slot`) and the
                   draft's context: the fused target features of those positions
    decode side    admit(engine, manifest, request, payload) -> Sequence
                   at admission the row takes the target state (`write_slot`), the draft
                   rebuilds its cache from the features with its own draft prefill calls, and
                   the engine's prefill computes the last prompt token itself (its first token
                   and the first block's proposals), so no sampler state crosses

The payload is a SlotState (state.py: magic b"DFQSLOT", a version byte, a little-endian u32
header length, a JSON header, raw little-endian C-order arrays; no pickle) whose header's
`meta` says, under "handoff": the format version, both programs' sha256 from the manifest,
the target's state specs, the prompt's length and the sha256 of its token ids. The decode side
refuses a payload whose programs, specs or prompt differ from its own (`HandoffError`).
"""

from __future__ import annotations

import hashlib
import heapq

import numpy as np

from dflash_qaic import contract
from dflash_qaic.runtime.calls import check_committed
from dflash_qaic.runtime.step import fill_chunk
from dflash_qaic.state import SlotState, SlotStateError

__all__ = ["VERSION", "HandoffError", "admit", "export", "fingerprint", "parse", "queue_context"]

VERSION = 1
FEATURES, POSITIONS = "features", "positions"


class HandoffError(ValueError):
    """A payload this decode engine cannot take (format, programs, specs or prompt differ)."""


def fingerprint(manifest) -> dict:
    """What both sides must share: each program's ONNX sha256 (from the manifest's file
    records) and the target's state specs."""
    digests = {f.path: f.sha256 for f in manifest.files}
    return {
        "target_sha256": digests.get(manifest.target.onnx, ""),
        "draft_sha256": digests.get(manifest.draft.onnx, ""),
        "target_state": [s.to_json() for s in manifest.target.io.state or ()],
    }


def _prompt_sha(ids) -> str:
    return hashlib.sha256(np.asarray(ids, "<i8").tobytes()).hexdigest()


def export(engine, manifest, ids: list[int]) -> bytes:
    """The hand-off payload of prompt `ids` (P ≥ 1 tokens; one token hands off no position),
    prefilled in a free cache row of `engine` between two of its steps (the row is free again
    on return)."""
    P = len(ids)
    if P < 1:
        raise HandoffError("a hand-off needs a prompt of at least 1 token, got none")
    if not engine.free:
        raise HandoffError("no free cache row to prefill in: retry when a request ends")
    slot = engine.take_free()
    try:
        feats = _prefill_rows(engine, ids[: P - 1], slot)
        slot_state = engine.prefill.target.read_slot(slot, P - 1)
    finally:
        heapq.heappush(engine.free, slot)
    if feats is not None:
        slot_state.context = {FEATURES: feats, POSITIONS: np.arange(P - 1, dtype=np.int64)}
    slot_state.meta = {
        "handoff": {
            "version": VERSION,
            **fingerprint(manifest),
            "prompt_len": P,
            "prompt_sha256": _prompt_sha(ids),
        }
    }
    return slot_state.to_bytes()


def _prefill_rows(engine, ids: list[int], slot: int, lo: int = 0) -> np.ndarray | None:
    """The target's prefill chunks of `ids` from position `lo` (lo … len − 1) into cache row
    `slot`, greedy and unsampled; returns their fused features [len − lo, H] (None without a
    draft)."""
    pre = engine.prefill
    b, plan, n_ids, first = pre.bufs, pre.plan, len(ids), lo
    feats = np.zeros((n_ids - lo, b.H), np.float32) if pre.dflash else None
    b.sampling.set_row(0, None)
    while lo < n_ids:
        L = contract.plan_prefill(n_ids - lo, plan.prefill_lengths)
        n = min(L, n_ids - lo)
        c = fill_chunk(b, L, ids, lo, n, slot)
        s = plan.sample_len(L, True)
        out = pre.target.run(b.window(c.feeds[s], lo + n))
        check_committed("prefill", out, np.zeros(1, np.int64), n, [])
        if feats is not None:
            feats[lo - first : lo - first + n] = out[contract.HIDDEN_STATES][0, :n]
        lo += n
    return feats


def parse(manifest, ids: list[int], payload: bytes) -> SlotState:
    """The payload's slot state, checked against this side's manifest and the request's prompt
    (HandoffError naming what differs)."""
    try:
        st = SlotState.from_bytes(payload)
    except SlotStateError as e:
        raise HandoffError(f"not a hand-off payload: {e}") from e
    head = st.meta.get("handoff") if isinstance(st.meta, dict) else None
    if not isinstance(head, dict) or head.get("version") != VERSION:
        got = None if not isinstance(head, dict) else head.get("version")
        raise HandoffError(f"hand-off format version {got!r}; this side reads version {VERSION}")
    for key, mine in fingerprint(manifest).items():
        if head.get(key) != mine:
            raise HandoffError(
                f"the payload's {key} differs from these artifacts': prefill and decode must "
                "load the same artifacts directory (same export)"
            )
    if head.get("prompt_len") != len(ids) or head.get("prompt_sha256") != _prompt_sha(ids):
        raise HandoffError("the payload was prefilled for another prompt than this request's")
    if st.upto != len(ids) - 1:
        raise HandoffError(f"the payload holds {st.upto} positions, expected {len(ids) - 1}")
    return st


def admit(engine, manifest, req, payload: bytes | SlotState):
    """Queue `req` on the decode `engine` with its hand-off payload (its bytes, checked now, or
    what `parse` made of them for this prompt); at admission its row takes the payload
    (`enter`) and the engine's prefill computes the last prompt token. Returns its Sequence."""
    st = payload if isinstance(payload, SlotState) else parse(manifest, req.ids, payload)
    if engine.prefill.dflash and FEATURES not in st.context:
        raise HandoffError("the payload carries no draft context (prefilled without a draft)")
    seq = engine.add(req)
    seq.handoff = st
    return seq


def enter(engine, seq) -> None:
    """The payload into `seq`'s (newly taken) row: the target's rows by `write_slot`, the
    draft's context by draft prefill calls of at most D rows, leaving the last rows queued for
    the call that also takes the last prompt token (as an aggregated prefill ends)."""
    st, pre = seq.handoff, engine.prefill
    seq.handoff = None  # entered once; the memory goes with it
    pre.target.write_slot(seq.slot, st)
    seq.prefilled = st.upto
    if pre.dflash:
        queue_context(engine, seq, st.context[FEATURES], 0, 1)


def queue_context(engine, seq, feats: np.ndarray, first: int, room: int) -> None:
    """Features `feats` (positions first …) into `seq`'s draft context: DraftPrefill calls of
    at most D rows while the rest and the `room` rows of its next prefill chunk do not fit one
    call; the rest left queued for the call that also takes that chunk."""
    pre, k = engine.prefill, 0
    D = pre.context_rows
    while len(feats) - k + room > D:
        n = min(D, len(feats) - k)
        pre.queue(seq, feats[k : k + n], first + k, n)
        pre.flush(seq, first + k + n, None)
        k += n
    if k < len(feats):
        pre.queue(seq, feats[k:], first + k, len(feats) - k)
