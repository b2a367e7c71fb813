"""The calls the engine makes: a prompt's batch-1 prefill (`Prefill`), and the step over every
slot, speculative (`DFlashStep`: verify, accept, draft) or the target alone (`DecodeStep`).
docs/DESIGN.md, Algorithm and Runtime.

What a step reads of each slot lives in `SlotState`, arrays with a row per slot (cache row),
so a step fills its inputs and accepts with array operations over every row at once; Python
work per step is per sequence (committing its tokens), never per slot × sequence. A slot that
does not step is an *inactive row* (batch_index -1 and every position -1, contract.py) by
construction: `join` and `leave` set its row when a sequence starts or stops stepping, so a
step never masks rows. A step is given the slots that step (`rows`, ascending) and their
sequences in the same order.

Seams for other target forms: a target that returns more per call (a hybrid's committed count,
`check_committed`) is checked where the call returns; a new per-row input is a buffer in
runtime/buffers.py filled here beside ids and positions.

Verify length: each step verifies the first n rows of the block, n from the target's verify
lengths: greedy, the call's n picked by `StepCosts.best_length` from the draft's confidences
and the measured call costs; sampled, each row's own n from its own confidences alone
(`StepCosts.row_lengths`; its rows past it are padding), so a seeded row's tokens never depend
on its neighbours. Any n is lossless: a step commits the accepted proposals and one target
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
from dflash_qaic.runtime.grammar import StepMasks
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
    the draft's proposals for the positions after it and their confidences. A slot that does
    not step (`alive` False) has start -1 and offsets 0, so the positions a call computes for
    every row at once, start + offsets, are all -1 on its row: an inactive row by construction,
    set when a sequence joins or leaves the steps, never per step."""

    def __init__(self, slots: int, block_size: int):
        self.alive = np.zeros(slots, bool)
        self.anchor = np.zeros(slots, np.int64)
        self.start = np.full(slots, contract.PAD_POSITION, np.int64)
        self.offsets = np.zeros((slots, block_size), np.int64)  # 0 … B−1 on a live row
        self.proposals = np.zeros((slots, block_size - 1), np.int64)
        self.confidence = np.ones((slots, block_size - 1), np.float32)  # the draft's
        # a DFlash-2 draft's q of the proposals (candidates, probabilities), when it returns it
        self.q_ids: np.ndarray | None = None
        self.q_probs: np.ndarray | None = None
        # a draft exported with --draft-top-k: each proposal row's top-k ids and log-probabilities
        # (contract.DRAFT_TOP_IDS / DRAFT_TOP_LOGPROBS), what a tree verifier builds from
        self.top_ids: np.ndarray | None = None
        self.top_logprobs: np.ndarray | None = None
        self.top_pair: np.ndarray | None = None  # a DFlash-2 draft's (DRAFT_PAIR_LOGPROBS)

    def keep_q(self, out: dict, rows) -> None:
        """Store the q (and top-k) a draft call returned for `rows` (allocated at the first)."""
        top = out.get(contract.DRAFT_TOP_IDS)
        if top is not None:
            if self.top_ids is None:
                n = len(self.alive)
                self.top_ids = np.zeros((n, *top.shape[1:]), np.int64)
                self.top_logprobs = np.zeros((n, *top.shape[1:]), np.float32)
            self.top_ids[rows] = top
            self.top_logprobs[rows] = out[contract.DRAFT_TOP_LOGPROBS]
            pair = out.get(contract.DRAFT_PAIR_LOGPROBS)
            if pair is not None:
                if self.top_pair is None:
                    self.top_pair = np.zeros((len(self.alive), *pair.shape[1:]), np.float32)
                self.top_pair[rows] = pair
        ids = out.get(contract.DRAFT_Q_IDS)
        if ids is None:
            return
        if self.q_ids is None:
            n = len(self.alive)
            self.q_ids = np.zeros((n, *ids.shape[1:]), np.int64)
            self.q_probs = np.zeros((n, *ids.shape[1:]), np.float32)
        self.q_ids[rows] = ids
        self.q_probs[rows] = out[contract.DRAFT_Q_PROBS]


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
        constrained = last and seq.constraint is not None  # structured output: the first token
        if constrained:
            seq.constraint.mask(c.mask[0, n - 1])
        out = call("prefill", self.target, b.window(c.feeds[s], lo + n), [seq])
        if constrained:
            c.mask[0, n - 1] = -1
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
            if seq.reason is None and out_of_room(P, 1, self.plan.ctx_len):
                seq.reason = "ctx_len"  # no slot left even for its anchor

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
        if b.draft_u is not None:  # the proposals for positions end + 1 … end + B − 1
            seq.fill_draft_uniforms(b.draft_u[0], end + 1)
        out = call("draft_prefill", self.draft, b.window(d.feeds, end), [seq])
        seq.pending = 0
        if first is not None:
            self.state.keep_q(out, slice(slot, slot + 1))
            self.state.proposals[slot] = out[contract.DRAFT_TOKENS][0]
            conf = out.get(contract.DRAFT_CONFIDENCE)
            if conf is not None:
                self.state.confidence[slot] = conf[0]


class _Step:
    """What the DFlash and decode steps share: the slot state, the buffers over every slot, and
    a slot joining or leaving the steps (its row turns live or inactive in every call)."""

    def __init__(self, plan, target, draft, bufs: StepBuffers, state: SlotState):
        self.plan, self.target, self.draft, self.bufs, self.state = plan, target, draft, bufs, state
        self._arange_b = np.arange(plan.block_size, dtype=np.int64)
        #: positions a sequence may hold: 0 … max_pos − 1 (the padding slot is the last one)
        self.max_pos = contract.max_positions(plan.ctx_len)
        bufs.bidx.fill(contract.INACTIVE_ROW)
        # structured output: the constrained rows' token masks (runtime/grammar.py)
        self.masks = StepMasks(state, [*bufs.verify.values(), bufs.decode], plan.block_size)

    def join(self, slot: int) -> None:
        """The slot's sequence steps from now on (its anchor and start set by its prefill)."""
        self.state.alive[slot] = True
        self.state.offsets[slot] = self._arange_b
        self.bufs.bidx[slot, 0] = slot

    def leave(self, slot: int) -> None:
        st = self.state
        st.alive[slot] = False
        st.offsets[slot] = 0
        st.start[slot] = contract.PAD_POSITION
        self.bufs.bidx[slot, 0] = contract.INACTIVE_ROW

    def _target(self, kind, n: int, c, seqs, costs=None, fill=None) -> dict:
        """The target call `c` ([N, n] ids and positions filled) with each sampled row's
        uniforms (`fill(seq, its rows of random_u)`; by default those of positions start + 1
        …); reads every slot up to the furthest row's last position."""
        sampled = [s for s in seqs if s.uniforms is not None]
        s = self.plan.sample_len(n, not sampled)
        u = self.bufs.sampling.u[s]
        for seq in sampled:
            if fill is not None:
                fill(seq, u[seq.slot])
            else:
                start = int(self.state.start[seq.slot]) + 1
                seq.fill_uniforms(u[seq.slot], start, kind == "verify")
        needed = min(int(self.state.start.max()) + n, self.max_pos)  # rows past it are padding
        return call(kind, self.target, self.bufs.window(c.feeds[s], needed), seqs, costs, n)


class ChainVerifier:
    """The host's side of one verify call, chain-shaped (docs/DESIGN.md, Seams: verifiers):
    `fill` writes the call's rows, `call` runs it, `accept` reads how many proposals each row
    keeps, `commit` moves the slot state on and commits each sequence's tokens. Another
    verification (a block rule, a tree) replaces this object, not the step.

    Row r verifies [anchor_r, proposals_r[:n−1]] at start_r … start_r+n−1 (row j's parent is
    row j − 1, its cache slot its position); acc_r = leading proposals equal to the target's
    choice; it commits them and the target's token after them."""

    def __init__(self, step: DFlashStep):
        self.step = step
        plan = step.plan
        self._same = {n: np.zeros((plan.cache_rows, n), bool) for n in step.lengths}
        self._lens = np.zeros(plan.cache_rows, np.int64)  # each row's verify length this step

    def length(self, rows: np.ndarray, seqs: list) -> tuple[int, np.ndarray | None, list]:
        """The call's verify length n; per sampled row its own (None when greedy), and the
        sampled rows' slots."""
        s, st = self.step, self.step.state
        n, own, sampled = self.step.plan.block_size, None, []
        if len(s.lengths) > 1:
            sampled = [q.slot for q in seqs if q.uniforms is not None]
            if sampled:  # each sampled row its own length, the call the longest of them
                own = s.costs.row_lengths(s.lengths, st.confidence[sampled])
                n = int(own.max())
            else:
                n = s.costs.best_length(s.lengths, st.confidence[rows])
        return n, own, sampled

    def fill(self, rows: np.ndarray, seqs: list):
        """The verify call's inputs over every slot; returns (n, the call)."""
        s, st, b = self.step, self.step.state, self.step.bufs
        cons = s.masks.propose(seqs) if s.masks.on else ()  # fills and cuts proposals
        n, own, sampled = self.length(rows, seqs)
        c = b.verify[n]  # ids, pos: [N, n]
        c.ids[:, 0] = st.anchor
        c.ids[:, 1:] = st.proposals[:, : n - 1]
        np.add(st.start[:, None], st.offsets[:, :n], out=c.pos)  # inactive rows: all -1
        np.copyto(c.pos, contract.PAD_POSITION, where=c.pos >= s.max_pos)  # past the end
        self._lens.fill(n)
        if own is not None:  # a sampled row's rows past its own length are padding
            self._lens[sampled] = own
            np.copyto(c.pos, contract.PAD_POSITION, where=s._arange_b[:n] >= self._lens[:, None])
        if cons:
            s.masks.verify(cons, c, n)
        if b.q and st.q_ids is not None:  # the draft's q of these proposals: q-aware verify
            np.copyto(b.q[contract.DRAFT_Q_IDS], st.q_ids)
            np.copyto(b.q[contract.DRAFT_Q_PROBS], st.q_probs)
        return n, c

    def call(self, n: int, c, seqs: list) -> dict:
        return self.step._target("verify", n, c, seqs, self.step.costs)

    def accept(self, n: int, c, out: dict) -> np.ndarray:
        """acc [N]: the leading proposals equal to the target's choice (the first False of
        `same`, whose last column is always False), every row at once."""
        st, choice, same = self.step.state, out[contract.NEXT_TOKENS], self._same[n]
        np.equal(st.proposals[:, : n - 1], choice[:, : n - 1], out=same[:, : n - 1])
        same[:, : n - 1] &= c.pos[:, 1:] >= 0  # a proposal at a padding position is not taken
        return same.argmin(axis=1)

    def commit(self, rows, seqs: list, n: int, out: dict, acc: np.ndarray) -> list:
        """Move every row on by its acc + 1 tokens, the draft's context to those rows, each
        sequence's tokens committed; returns the sequences that go on."""
        s, st, d = self.step, self.step.state, self.step.bufs.draft
        choice = out[contract.NEXT_TOKENS]  # [N, n]
        if contract.NUM_COMMITTED in out:  # a hybrid target's own count must agree
            check_committed("verify", out, rows, acc[rows] + 1, seqs)
        k = acc + 1  # committed tokens per row: the draft's context rows
        k *= st.alive
        m = min(n, s.plan.block_size)  # a tree's path is at most B rows (its depths < B)
        d.ctx[:, :m] = out[contract.HIDDEN_STATES][:, :m]
        np.add(st.start[:, None], s._arange_b, out=d.ctx_pos)  # from the anchor's position
        np.copyto(d.ctx_pos, contract.PAD_POSITION, where=s._arange_b >= k[:, None])
        st.start += k
        st.anchor[:] = choice[s.bufs.slot_ids, acc]
        tokens, accepted = choice.tolist(), acc.tolist()
        s.furthest = int(st.start.max())
        full = s.furthest >= s.max_pos  # some row has no slot left for its anchor
        going = []
        for seq in seqs:  # per sequence: its tokens (the accepted ones, then the target's)
            r = seq.slot
            seq.verified.append(int(self._lens[r]))
            seq.commit(tokens[r][: accepted[r] + 1], step=True)
            if seq.reason is None and full and st.start[r] >= s.max_pos:
                seq.reason = "ctx_len"  # positions ≥ ctx_len − 1 have no slot (contract.py)
            if seq.reason is None:
                going.append(seq)
            else:  # an inactive row in the draft call
                s.leave(r)
                d.ctx_pos[r] = contract.PAD_POSITION
        if len(going) < len(seqs):
            s.furthest = int(st.start.max())
        return going


class BlockVerifier(ChainVerifier):
    """Block verification (docs/DESIGN.md, Block verification): the target program decides
    how many proposals each row keeps jointly and returns it (contract.NUM_ACCEPTED); the
    row's committed tokens are its first acc + 1 choices as in the chain."""

    def accept(self, n: int, c, out: dict) -> np.ndarray:
        return out[contract.NUM_ACCEPTED].astype(np.int64, copy=False)


def verifier(step: DFlashStep, rule: str) -> ChainVerifier:
    """The verifier of a target program's verify rule (contract.TargetIO.verify_rule)."""
    if rule == contract.TREE:
        from dflash_qaic.runtime.tree import TreeVerifier

        return TreeVerifier(step)
    return {contract.CHAIN: ChainVerifier, contract.BLOCK: BlockVerifier}[rule](step)


class DFlashStep(_Step):
    """One verify call over every slot (its `verifier`: fill, call, accept, commit), then one
    draft call over the rows that go on: the draft takes the features of each row's acc + 1
    committed rows as context and proposes the block [new anchor, MASK…]. Every array
    operation covers all rows at once (inactive rows compute harmless values that nothing
    reads); Python work is per sequence.

    At the end of the context a row verifies what is left: its positions past the last slot
    are padding (-1), so it accepts at most the proposals before them and commits up to the
    last position the context holds (docs/DESIGN.md, Runtime: the end of the context)."""

    def __init__(
        self, plan, target, draft, bufs, state, lengths, costs: StepCosts, rule=None, trees=()
    ):
        """lengths: the chain verify lengths a step picks from; trees: a tree step's row
        counts (EngineConfig.tree_sizes; rule contract.TREE)."""
        super().__init__(plan, target, draft, bufs, state)
        self.lengths, self.costs, self.trees = list(lengths), costs, list(trees)
        self.furthest = 0  # the largest start after the last verify
        self.verifier = verifier(self, rule or contract.CHAIN)

    def run(self, rows: np.ndarray, seqs: list) -> None:
        going = self.verify(rows, seqs)
        if going:
            self.propose(going)

    def verify(self, rows: np.ndarray, seqs: list) -> list:
        """The verify call and the commits; returns the sequences that go on, whose committed
        rows are now the draft's context."""
        v, st, d = self.verifier, self.state, self.bufs.draft
        n, c = v.fill(rows, seqs)
        out = v.call(n, c, seqs)
        going = v.commit(rows, seqs, n, out, v.accept(n, c, out))
        d.blk_ids[:, 0] = st.anchor
        np.add(st.start[:, None], st.offsets, out=d.blk_pos)  # inactive rows: all -1
        # near the end, block rows past the last slot propose what no verify will take: they
        # sit at the last position (the draft's tables and windows end there)
        np.minimum(d.blk_pos, self.max_pos - 1, out=d.blk_pos)
        return going

    def propose(self, seqs: list) -> None:
        """The draft call (context filled by verify): the next proposals of every live row."""
        st, d = self.state, self.bufs.draft
        feeds = self.bufs.window(d.feeds, self.furthest)  # the cached slots: below each block
        if self.bufs.draft_u is not None:  # each row's proposals: positions start + 1 …
            for seq in seqs:
                seq.fill_draft_uniforms(self.bufs.draft_u[seq.slot], int(st.start[seq.slot]) + 1)
        out = call("draft", self.draft, feeds, seqs, self.costs)
        st.keep_q(out, slice(None))
        st.proposals[:] = out[contract.DRAFT_TOKENS]
        conf = out.get(contract.DRAFT_CONFIDENCE)
        if conf is not None:
            st.confidence[:] = conf


class DecodeStep(_Step):
    """The target alone: one decode call over every slot, one token per row."""

    def run(self, rows: np.ndarray, seqs: list) -> None:
        st, c = self.state, self.bufs.decode  # ids, pos: [N, 1]
        c.ids[:, 0] = st.anchor
        c.pos[:, 0] = st.start  # inactive rows: -1
        if self.masks.on:
            self.masks.decode(seqs, c)
        out = self._target("decode", 1, c, seqs)
        check_committed("decode", out, rows, 1, seqs)
        token = out[contract.NEXT_TOKENS][:, 0]  # [N]
        st.anchor[:] = token
        st.start += st.alive
        tokens = token.tolist()
        full = int(st.start.max()) + 1 > contract.max_positions(self.plan.ctx_len)
        for seq in seqs:
            seq.commit([tokens[seq.slot]], step=True)
            if (
                seq.reason is None
                and full
                and out_of_room(st.start[seq.slot], 1, self.plan.ctx_len)
            ):
                seq.reason = "ctx_len"
