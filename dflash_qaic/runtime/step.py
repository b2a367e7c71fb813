"""The calls the engine makes: a prompt's batch-1 prefill (`Prefill`), and the step over every
slot, speculative (`DFlashStep`: verify, accept, draft) or the target alone (`DecodeStep`).
docs/DESIGN.md, Algorithm and Runtime.

What a step reads of each slot lives in `SlotState`, arrays with a row per slot (cache row),
so a step fills its inputs and accepts with array operations over the rows; Python work per
step is per sequence (committing its tokens), never per slot × sequence. A step is given the
slots that take part (`rows`, ascending) and their sequences in the same order; every other
row is an *inactive row* (batch_index -1 and every position -1, contract.py).

Verify length: each step verifies the first n rows of the block, n from the target's verify
lengths, picked by `StepCosts.best_length` from the draft's confidences (and, greedy, the
measured call costs). Any n is lossless: a step commits the accepted proposals and one target
token whatever n is.

Sampling is decided inside the target program; the host writes each sampled row's uniforms,
taken from the request's own table at the positions the row decides (`Sequence.fill_uniforms`).
A greedy call takes the specialization that runs the sampler on one row only
(`ShapePlan.sample_len`).

A program call that raises is re-raised as `CallFailed`, naming the sequences of that call, so
the engine fails those and no others.
"""

from __future__ import annotations

import time

import numpy as np

from dflash_qaic import contract
from dflash_qaic.runtime.buffers import PrefillBuffers, StepBuffers
from dflash_qaic.runtime.stats import StepCosts, timed_call


class CallFailed(Exception):
    """A program call raised: `seqs` are the sequences it served, `cause` what it raised."""

    def __init__(self, kind: str, seqs: list, cause: BaseException):
        super().__init__(f"the {kind} call failed: {type(cause).__name__}: {cause}")
        self.seqs, self.cause = seqs, cause


def call(kind: str, program, feeds: dict, seqs: list, costs=None, rows: int = 0) -> dict:
    try:
        return timed_call(kind, program, feeds, seqs, costs, rows)
    except Exception as e:
        raise CallFailed(kind, seqs, e) from e


def check_committed(kind: str, out: dict, rows: np.ndarray, committed, seqs: list) -> None:
    """A hybrid target commits its recurrent state inside the call and says how many positions
    (`num_committed`, docs/DESIGN.md, Hybrid targets): it must be what the host commits, or the
    state no longer matches the tokens. Program and host apply one rule, so this never fires
    unless one of them is broken; then the call's sequences fail, not a silent divergence."""
    count = out.get(contract.NUM_COMMITTED)
    if count is not None and not np.array_equal(count[rows], committed + 0 * count[rows]):
        raise CallFailed(
            kind,
            seqs,
            RuntimeError(
                f"the target committed {count[rows].tolist()} positions of its recurrent state, "
                f"the host {np.broadcast_to(committed, count[rows].shape).tolist()}"
            ),
        )


class SlotState:
    """Per slot, what its next step reads: the anchor (the last committed token), its position,
    the draft's proposals for the positions after it and their confidences."""

    def __init__(self, slots: int, block_size: int):
        self.anchor = np.zeros(slots, np.int64)
        self.start = np.zeros(slots, np.int64)
        self.proposals = np.zeros((slots, block_size - 1), np.int64)
        self.confidence = np.ones((slots, block_size - 1), np.float32)  # the draft's


def out_of_room(start: int, rows: int, ctx_len: int) -> bool:
    """Whether a call of `rows` rows from `start` would need positions ≥ ctx_len − 1 (the padding
    slot's and beyond, contract.py)."""
    return start + rows > contract.max_positions(ctx_len)


class Prefill:
    """A prompt, one chunk per call at batch 1 into its slot's cache row: the target's chunk
    (of the prefill length `contract.plan_prefill` picks for the rest of the prompt), then
    (DFlash) the chunk's features to the draft. The first token is the target's choice at the
    last prompt row; the last draft call also proposes the first block."""

    def __init__(self, plan, target, draft, bufs: PrefillBuffers, state: SlotState, dflash: bool):
        self.plan, self.target, self.draft, self.bufs, self.state = plan, target, draft, bufs, state
        self.dflash = dflash
        self.next_rows = plan.block_size if dflash else 1  # the first step's rows from the end
        self._arange_b = np.arange(plan.block_size, dtype=np.int64)
        self._row0 = np.zeros(1, np.int64)

    def chunk(self, seq) -> None:
        b, ids, slot = self.bufs, seq.req.ids, seq.slot
        lo, P = seq.prefilled, len(ids)
        L = contract.plan_prefill(P - lo, self.plan.prefill_lengths)
        n = min(L, P - lo)
        last = lo + n == P
        c = b.chunk[L]  # ids, pos: [1, L]
        c.ids[0, :n] = ids[lo : lo + n]
        c.ids[0, n:] = 0
        c.pos[0, :n] = np.arange(lo, lo + n)
        c.pos[0, n:] = contract.PAD_POSITION
        b.bidx[0, 0] = slot
        # only the last chunk's last row is sampled: the chunks before it take the greedy Prefill
        s = self.plan.sample_len(L, seq.uniforms is None or not last)
        b.sampling.set_row(0, seq.req.sampling)
        seq.fill_uniforms(b.sampling.u[s][0], lo + 1)
        out = call("prefill", self.target, b.window(c.feeds[s], lo + n), [seq])
        check_committed("prefill", out, self._row0, n, [seq])
        first = int(out[contract.NEXT_TOKENS][0, n - 1]) if last else None
        if last:
            seq.t_first = time.perf_counter()  # the first token exists from here on
        if self.dflash:
            self._draft_context(seq, out[contract.HIDDEN_STATES][0, :n], lo, n, first)
        seq.prefilled = lo + n
        if last:
            seq.t_dec = time.perf_counter()
            self.state.anchor[slot], self.state.start[slot] = first, P
            seq.commit([first], step=False)
            if seq.reason is None and out_of_room(P, self.next_rows, self.plan.ctx_len):
                seq.reason = "ctx_len"

    def _draft_context(self, seq, hidden: np.ndarray, lo: int, n: int, first) -> None:
        """Queue a chunk's features (positions lo … lo+n-1) for the draft; one DraftPrefill call
        takes up to D = draft_prefill_rows[-1] rows (several target chunks), so the block it
        also runs, wasted on every call but the last, runs ⌈P / D⌉ times, not once per chunk; a
        call takes the smallest DraftPrefill that holds its rows. The last call's block starts
        at the prompt's end: its proposals are the first step's."""
        plan, b, slot = self.plan, self.bufs, seq.slot
        ctx, ctx_pos = b.context(slot)  # [1, D, H], [1, D]
        k = seq.pending
        ctx[0, k : k + n] = hidden
        ctx_pos[0, k : k + n] = np.arange(lo, lo + n)
        seq.pending = k = k + n
        end, P = lo + n, len(seq.req.ids)
        if first is None and k + min(plan.prefill_seq_len, P - end) <= plan.draft_prefill_rows[-1]:
            return  # the next chunk still fits
        rows = next(r for r in plan.draft_prefill_rows if r >= k)  # the smallest that holds them
        ctx_pos[0, k:] = contract.PAD_POSITION
        b.blk_ids[0, 0] = b.mask_id if first is None else first  # bidx: set by chunk()
        np.add(self._arange_b, end, out=b.blk_pos[0])
        d = b.draft_prefill(slot, rows)
        out = call("draft_prefill", self.draft, b.window(d.feeds, end), [seq])
        seq.pending = 0
        if first is not None:
            self.state.proposals[slot] = out[contract.DRAFT_TOKENS][0]
            conf = out.get(contract.DRAFT_CONFIDENCE)
            if conf is not None:
                self.state.confidence[slot] = conf[0]


class _Step:
    """What the DFlash and decode steps share: the slot state, the buffers over every slot and
    the inactive rows."""

    def __init__(self, plan, target, draft, bufs: StepBuffers, state: SlotState):
        self.plan, self.target, self.draft, self.bufs, self.state = plan, target, draft, bufs, state
        self.slot_ids = np.arange(plan.cache_rows, dtype=np.int64)
        self._arange_b = np.arange(plan.block_size, dtype=np.int64)
        self.active = np.zeros(plan.cache_rows, bool)  # rows of the current call

    def _rows(self, rows: np.ndarray) -> np.ndarray:
        """Mark `rows` active; batch_index: its own cache row for each, -1 for the others."""
        self.active.fill(False)
        self.active[rows] = True
        np.copyto(self.bufs.bidx[:, 0], np.where(self.active, self.slot_ids, contract.INACTIVE_ROW))
        return ~self.active

    def _target(self, kind, n: int, c, rows, seqs, costs=None) -> dict:
        """The target call `c` ([N, n] ids and positions filled) with each sampled row's
        uniforms; reads every slot up to the furthest row's last position."""
        sampled = [s for s in seqs if s.uniforms is not None]
        s = self.plan.sample_len(n, not sampled)
        u = self.bufs.sampling.u[s]
        for seq in sampled:
            seq.fill_uniforms(u[seq.slot], int(self.state.start[seq.slot]) + 1)
        needed = int(self.state.start[rows].max()) + n
        return call(kind, self.target, self.bufs.window(c.feeds[s], needed), seqs, costs, n)


class DFlashStep(_Step):
    """One verify call over every slot, then one draft call over the rows that go on.

    Row r verifies [anchor_r, proposals_r[:n−1]] at start_r … start_r+n−1; acc_r = leading
    proposals equal to the target's choice; it commits them and the target's token after them;
    the draft then takes the features of its acc_r + 1 committed rows as context and proposes
    the block [new anchor, MASK…]."""

    def __init__(self, plan, target, draft, bufs, state, lengths, costs: StepCosts):
        super().__init__(plan, target, draft, bufs, state)
        self.lengths, self.costs = list(lengths), costs

    def run(self, rows: np.ndarray, seqs: list) -> None:
        going = self.verify(rows, seqs)
        if going.any():
            self.propose(rows[going], [s for s, g in zip(seqs, going) if g])

    def verify(self, rows: np.ndarray, seqs: list) -> np.ndarray:
        """The verify call and the commits; returns which of `rows` go on (bool, per row)."""
        st, b = self.state, self.bufs
        sampled = any(s.uniforms is not None for s in seqs)
        n = self.costs.best_length(self.lengths, st.confidence[rows], sampled)
        c = b.verify[n]  # ids, pos: [N, n]
        idle = self._rows(rows)
        c.ids[:, 0] = st.anchor
        c.ids[:, 1:] = st.proposals[:, : n - 1]
        np.add(st.start[:, None], self._arange_b[:n], out=c.pos)
        c.ids[idle] = 0
        c.pos[idle] = contract.PAD_POSITION
        out = self._target("verify", n, c, rows, seqs, self.costs)
        choice = out[contract.NEXT_TOKENS][rows]  # [k, n]
        # acceptance: the leading proposals equal to the target's choice, per row
        acc = np.cumprod(st.proposals[rows, : n - 1] == choice[:, : n - 1], axis=1).sum(axis=1)
        check_committed("verify", out, rows, acc + 1, seqs)
        start = st.start[rows]  # [k]: the anchors' positions
        st.start[rows] = start + acc + 1
        st.anchor[rows] = choice[np.arange(len(rows)), acc]
        room = ~(
            (st.start[rows] + self.plan.block_size) > contract.max_positions(self.plan.ctx_len)
        )
        committed = choice.tolist()
        for i, seq in enumerate(seqs):  # per sequence: its tokens (the accepted ones, then one)
            seq.verified.append(n)
            seq.commit(committed[i][: acc[i] + 1], step=True)
            if seq.reason is None and not room[i]:
                seq.reason = "ctx_len"
        going = np.array([s.reason is None for s in seqs])
        # draft context: the committed rows' features at their positions, the rest padding
        d, g, k = b.draft, rows[going], acc[going] + 1
        d.ctx[g, :n] = out[contract.HIDDEN_STATES][g]
        d.ctx_pos[g] = np.where(
            self._arange_b < k[:, None], start[going][:, None] + self._arange_b, -1
        )
        d.blk_ids[g, 0] = st.anchor[g]
        return going

    def propose(self, rows: np.ndarray, seqs: list) -> None:
        """The draft call over `rows` (context filled by verify): their next proposals."""
        st, d = self.state, self.bufs.draft
        idle = self._rows(rows)
        np.add(st.start[:, None], self._arange_b, out=d.blk_pos)
        d.ctx_pos[idle] = contract.PAD_POSITION  # an inactive row writes only a padding slot
        d.blk_pos[idle] = contract.PAD_POSITION
        feeds = self.bufs.window(d.feeds, int(st.start[rows].max()))
        out = call("draft", self.draft, feeds, seqs, self.costs)
        st.proposals[rows] = out[contract.DRAFT_TOKENS][rows]
        conf = out.get(contract.DRAFT_CONFIDENCE)
        if conf is not None:
            st.confidence[rows] = conf[rows]


class DecodeStep(_Step):
    """The target alone: one decode call over every slot, one token per row."""

    def run(self, rows: np.ndarray, seqs: list) -> None:
        st, c = self.state, self.bufs.decode  # ids, pos: [N, 1]
        idle = self._rows(rows)
        c.ids[:, 0] = st.anchor
        c.pos[:, 0] = st.start
        c.ids[idle] = 0
        c.pos[idle] = contract.PAD_POSITION
        out = self._target("decode", 1, c, rows, seqs)
        token = out[contract.NEXT_TOKENS][rows, 0]  # [k]
        check_committed("decode", out, rows, 1, seqs)
        st.start[rows] += 1
        st.anchor[rows] = token
        room = ~((st.start[rows] + 1) > contract.max_positions(self.plan.ctx_len))
        for seq, t, ok in zip(seqs, token.tolist(), room):
            seq.commit([t], step=True)
            if seq.reason is None and not ok:
                seq.reason = "ctx_len"
