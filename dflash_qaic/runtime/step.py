"""The calls the engine makes: a prompt's batch-1 prefill (`Prefill`), and the step over every
slot, speculative (`DFlashStep`: verify, accept, draft) or the target alone (`DecodeStep`).
docs/DESIGN.md, Algorithm and Runtime.

What a step reads of each slot lives in `SlotBook`, arrays with a row per slot (cache row),
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

Step policy (runtime/policy.py): after each step, each row going on drafts its next step or
decodes it. The rows that draft share one draft call; a row that decodes keeps its committed
rows' features in its slot's prompt-context buffer (the draft's context stays whole, so its
cache never holds a gap) and is a 1-row verify beside the drafting rows (its other rows
padding), or, when no row drafts, the step is one decode call. A row that drafts again after
decoding sends its waiting context and proposes its block with one DraftPrefill call, as at the
end of a prompt.

A program call that raises is re-raised as `CallFailed` (runtime/calls.py), naming the
sequences of that call, so the engine fails those and no others.
"""

from __future__ import annotations

import time

import numpy as np

from dflash_qaic import contract
from dflash_qaic.runtime.buffers import PrefillBuffers, StepBuffers
from dflash_qaic.runtime.calls import CallFailed, call, check_committed
from dflash_qaic.runtime.grammar import StepMasks
from dflash_qaic.runtime.policy import StepPolicy
from dflash_qaic.runtime.stats import StepCosts
from dflash_qaic.runtime.tree import TreeVerifier
from dflash_qaic.runtime.verifiers import BlockVerifier, ChainVerifier, Verifier, commit_rows

__all__ = ["VERIFIERS", "CallFailed", "DFlashStep", "DecodeStep", "Prefill", "SlotBook"]

#: the verifier of each verification rule object (contract.RULES): the program's rule decides it
VERIFIERS: dict[contract.VerifyRule, type] = {
    contract.CHAIN_RULE: ChainVerifier,
    contract.BLOCK_RULE: BlockVerifier,
    contract.TREE_RULE: TreeVerifier,
}


class SlotBook:
    """The host's book of every slot: what its next step reads, the anchor (the last committed
    token), its position, the draft's proposals for the positions after it and their
    confidences, and whether it decodes (`decoding`: the step policy's choice). A slot that does
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
        self.decoding = np.zeros(slots, bool)  # the row verifies its anchor alone this step
        # a DFlash-2 draft's q of the proposals (candidates, probabilities), when it returns it
        self.q_ids: np.ndarray | None = None
        self.q_probs: np.ndarray | None = None
        # a draft exported with --draft-top-k: each proposal row's top-k ids and log-probabilities
        # (contract.DRAFT_TOP_IDS / DRAFT_TOP_LOGPROBS), what a tree verifier builds from
        self.top_ids: np.ndarray | None = None
        self.top_logprobs: np.ndarray | None = None
        self.top_pair: np.ndarray | None = None  # a DFlash-2 draft's (DRAFT_PAIR_LOGPROBS)

    def keep(self, out: dict, rows, take=slice(None)) -> None:
        """Store the proposals, confidences and q a draft call returned: its rows `take` into
        the slots `rows`."""
        self.proposals[rows] = out[contract.DRAFT_TOKENS][take]
        conf = out.get(contract.DRAFT_CONFIDENCE)
        if conf is not None:
            self.confidence[rows] = conf[take]
        self.keep_q({k: v[take] for k, v in out.items() if k in _Q}, rows)

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


_Q = {
    contract.DRAFT_TOP_IDS,
    contract.DRAFT_TOP_LOGPROBS,
    contract.DRAFT_PAIR_LOGPROBS,
    contract.DRAFT_Q_IDS,
    contract.DRAFT_Q_PROBS,
}


def out_of_room(start: int, rows: int, ctx_len: int) -> bool:
    """Whether a call of `rows` rows from `start` would need positions ≥ ctx_len − 1 (the padding
    slot's and beyond, contract.py)."""
    return start + rows > contract.max_positions(ctx_len)


def fill_chunk(b: PrefillBuffers, L: int, ids, lo: int, n: int, slot: int):
    """The prefill call of length L filled with prompt positions lo … lo+n-1 into `slot`
    (the rest padding); returns it."""
    c = b.chunk[L]  # ids, pos: [1, L]
    c.ids[0, :n] = ids[lo : lo + n]
    c.ids[0, n:] = 0
    c.pos[0, :n] = np.arange(lo, lo + n)
    c.pos[0, n:] = contract.PAD_POSITION
    b.bidx[0, 0] = slot
    return c


class Prefill:
    """A prompt, one chunk per call at batch 1 into its slot's cache row: the target's chunk
    (of the prefill length `contract.plan_prefill` picks for the rest of the prompt), then
    (DFlash) the chunk's features to the draft. The first token is the target's choice at the
    last prompt row; the last draft call also proposes the first block."""

    def __init__(self, plan, target, draft, bufs: PrefillBuffers, state: SlotBook, dflash: bool):
        self.plan, self.target, self.draft, self.bufs, self.state = plan, target, draft, bufs, state
        self.dflash = dflash
        self._arange_b = np.arange(plan.block_size, dtype=np.int64)
        self._row0 = np.zeros(1, np.int64)
        #: seq -> whether it starts decoding without its first block (the step policy's
        #: `StepPolicy.lazy`, set by the engine; None: every prompt's last call proposes it)
        self.lazy = None

    def chunk(self, seq) -> None:
        b, ids, slot = self.bufs, seq.req.ids, seq.slot
        lo, P = seq.prefilled, len(ids)
        # a chunk ends at a prefix-cache mark (runtime/prefix.py: a rolling state saved there)
        stop = next((m for m in seq.marks if lo < m < P), P)
        L = contract.plan_prefill(stop - lo, self.plan.prefill_lengths)
        n = min(L, stop - lo)
        last = lo + n == P
        c = fill_chunk(b, L, ids, lo, n, slot)
        # only the last chunk's last row is sampled: the chunks before it take the greedy Prefill
        s = self.plan.sample_len(L, seq.uniforms is None or not last)
        b.sampling.set_row(0, seq.req.sampling, seq.req)
        seq.fill_uniforms(b.sampling.u[s][0], lo + 1)
        constrained = last and seq.constraint is not None  # structured output: the first token
        if constrained:
            seq.constraint.mask(c.mask[0, n - 1])
        lp, scoring = seq.logprobs, min(n, P - lo - 1)  # rows with a prompt token after them
        if lp is not None and lp.prompt is not None:  # prompt logprobs: each row scores the next
            c.scored[0, :scoring] = ids[lo + 1 : lo + 1 + scoring]
        out = call("prefill", self.target, b.window(c.feeds[s], lo + n), [seq])
        if constrained:
            c.mask[0, n - 1] = -1
        check_committed("prefill", out, self._row0, n, [seq])
        if lp is not None:
            lp.prompt_rows(out, c.scored[0], scoring)
            if last:  # the first token's
                lp.rows(out, 0, n - 1, 1)
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
        at the prompt's end: its proposals are the first step's. A sequence that starts
        decoding (`lazy`) has no first block: its context waits with the rows it decodes."""
        self.queue(seq, hidden, lo, n)
        end, P, plan = lo + n, len(seq.req.ids), self.plan
        if first is None and seq.pending + min(plan.prefill_seq_len, P - end) <= self.context_rows:
            return  # the next chunk still fits
        if first is not None and self.lazy is not None and self.lazy(seq):
            seq.lazy = True
            if seq.pending + plan.block_size <= self.context_rows:
                return  # sent when it drafts, or when its decoded rows fill the context
            first = None  # the context alone (the proposals are not kept)
        self.flush(seq, end, first)

    @property
    def context_rows(self) -> int:
        """The most context rows one DraftPrefill call takes (D)."""
        return self.plan.draft_prefill_rows[-1]

    def queue(self, seq, hidden: np.ndarray, lo: int, n: int) -> None:
        """The features of positions lo … lo+n-1 wait in the slot's context for the draft."""
        ctx, ctx_pos = self.bufs.context(seq.slot)  # [1, D, H], [1, D]
        k = seq.pending
        ctx[0, k : k + n] = hidden
        if n == 1:  # a decode step's row
            ctx_pos[0, k] = lo
        else:
            ctx_pos[0, k : k + n] = np.arange(lo, lo + n)
        seq.pending = k + n

    def flush(self, seq, end: int, first: int | None, costs=None) -> None:
        """One DraftPrefill call: the waiting context, then the block from `end` (its first id
        `first`, the anchor at position end; None: MASK, proposals not kept)."""
        plan, b, slot, k = self.plan, self.bufs, seq.slot, seq.pending
        rows = next(r for r in plan.draft_prefill_rows if r >= k)  # the smallest that holds them
        _, ctx_pos = b.context(slot)
        ctx_pos[0, k:] = contract.PAD_POSITION
        b.bidx[0, 0] = slot
        b.blk_ids[0, 0] = b.mask_id if first is None else first
        np.add(self._arange_b, end, out=b.blk_pos[0])
        # near the end of the context (a decoding row drafting again), block rows past the last
        # slot sit at the last position, as in the step's draft call
        np.minimum(b.blk_pos[0], contract.max_positions(plan.ctx_len) - 1, out=b.blk_pos[0])
        d = b.draft_prefill(slot, rows)
        if b.draft_u is not None:  # the proposals for positions end + 1 … end + B − 1
            seq.fill_draft_uniforms(b.draft_u[0], end + 1)
        kind = "draft_prefill" if seq.prefilled < len(seq.req.ids) else "draft_context"
        out = call(kind, self.draft, b.window(d.feeds, end), [seq], costs)
        seq.pending = 0
        if first is not None:
            self.state.keep(out, slice(slot, slot + 1))


class _Step:
    """What the DFlash and decode steps share: the slot state, the buffers over every slot, and
    a slot joining or leaving the steps (its row turns live or inactive in every call)."""

    def __init__(self, plan, target, draft, bufs: StepBuffers, state: SlotBook):
        self.plan, self.target, self.draft, self.bufs, self.state = plan, target, draft, bufs, state
        self._arange_b = np.arange(plan.block_size, dtype=np.int64)
        #: positions a sequence may hold: 0 … max_pos − 1 (the padding slot is the last one)
        self.max_pos = contract.max_positions(plan.ctx_len)
        bufs.bidx.fill(contract.INACTIVE_ROW)
        # structured output: the constrained rows' token masks (runtime/grammar.py)
        self.masks = StepMasks(state, [*bufs.verify.values(), bufs.decode], plan.block_size)

    def join(self, slot: int, sampled: bool = False, fresh: bool = True) -> None:
        """The slot's sequence steps from now on (its anchor and start set by its prefill;
        `sampled`: it samples, `fresh` False: it has no first block, for the step policy)."""
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

    def _decode(self, seqs: list, costs=None) -> dict:
        """The decode call: each row's anchor at its position (inactive rows: -1)."""
        st, c = self.state, self.bufs.decode  # ids, pos: [N, 1]
        c.ids[:, 0] = st.anchor
        c.pos[:, 0] = st.start
        if self.masks.on:
            self.masks.decode(seqs, c)
        return self._target("decode", 1, c, seqs, costs)


class DFlashStep(_Step):
    """One verify call over every slot (its `verifier`: fill, call, accept, commit), then one
    draft call over the rows that go on: the draft takes the features of each row's acc + 1
    committed rows as context and proposes the block [new anchor, MASK…]. Every array
    operation covers all rows at once (inactive rows compute harmless values that nothing
    reads); Python work is per sequence.

    The step policy (`policy`, runtime/policy.py) picks, per row, drafting or decoding (module
    docstring): a decoding row is a 1-row verify, and a step where every row decodes is one
    decode call. Under "always" every row drafts every step.

    At the end of the context a row verifies what is left: its positions past the last slot
    are padding (-1), so it accepts at most the proposals before them and commits up to the
    last position the context holds (docs/DESIGN.md, Runtime: the end of the context)."""

    def __init__(
        self,
        plan,
        target,
        draft,
        bufs,
        state,
        lengths,
        costs: StepCosts,
        rule=None,
        trees=(),
        *,
        policy: StepPolicy | None = None,
        context: Prefill | None = None,
    ):
        """lengths: the chain verify lengths a step picks from; trees: a tree step's row
        counts (EngineConfig.tree_sizes; rule contract.TREE); policy: the step policy (None:
        always draft); context: the prompt's calls, which also hold a decoding row's waiting
        context and send it (needed unless the policy is "always")."""
        super().__init__(plan, target, draft, bufs, state)
        self.lengths, self.costs, self.trees = list(lengths), costs, list(trees)
        self.furthest = 0  # the largest start after the last verify
        self.verifier: Verifier = VERIFIERS[contract.rule(rule or contract.CHAIN)](self)
        self.policy = policy or StepPolicy("always", plan.cache_rows, plan.block_size)
        self.context = context
        self._zeros = np.zeros(plan.cache_rows, np.int64)  # a decode call's acc
        self._ones = np.ones(plan.cache_rows, np.int64)  # and its rows
        self._queued = False  # the last step decoded every row: its context already waits

    def join(self, slot: int, sampled: bool = False, fresh: bool = True) -> None:
        """The slot steps from now on; the policy sees its first proposals' confidences (fresh
        False: it has none, `Prefill.lazy`, and decodes until its first probe)."""
        super().join(slot)
        st, one = self.state, slice(slot, slot + 1)
        self.policy.join(slot, st.confidence[slot], self.costs, sampled, fresh)
        if not fresh:
            st.decoding[slot] = True
            return
        st.decoding[slot] = not self.policy.use([slot], st.confidence[one], self.costs)[0]

    def leave(self, slot: int) -> None:
        super().leave(slot)
        self.state.decoding[slot] = False

    def run(self, rows: np.ndarray, seqs: list) -> None:
        t = time.perf_counter()
        going = self.verify(rows, seqs)
        if going:
            self.propose(going)
        self.costs.step("decode" if self._queued else "draft", time.perf_counter() - t)

    def verify(self, rows: np.ndarray, seqs: list) -> list:
        """The verify call (or, when every row decodes, the decode call) and the commits;
        returns the sequences that go on, whose committed rows are now the draft's context."""
        v, st = self.verifier, self.state
        self._queued = bool(st.decoding[rows].all())
        if self._queued:  # every row decodes: the decode call
            going = self._decode_all(rows, seqs)
        else:
            n, c = v.fill(rows, seqs)
            out = v.call(n, c, seqs)
            acc = v.accept(n, c, out)
            if self.policy.mode == "auto":
                self._observe(rows, acc, v.lens)
            going = v.commit(rows, seqs, n, out, acc)
        return going

    def _decode_all(self, rows: np.ndarray, seqs: list) -> list:
        """The decode call over every slot, one token per row; each row's feature waits in its
        context for the draft (`Prefill.queue`). Returns the sequences that go on."""
        st = self.state
        out = self._decode(seqs, self.costs)
        check_committed("decode", out, rows, 1, seqs)
        token, hidden = out[contract.NEXT_TOKENS][:, 0], out[contract.HIDDEN_STATES]  # [N]
        going, tokens = [], token.tolist()
        for seq in seqs:
            r = seq.slot
            self.context.queue(seq, hidden[r, :1], int(st.start[r]), 1)
        st.anchor[:] = token
        st.start += st.alive
        self.furthest = int(st.start.max())
        for seq in seqs:
            r = seq.slot
            seq.verified.append(1)
            commit_rows(self.bufs, seq, r, out, [tokens[r]])
            if seq.reason is None and st.start[r] >= self.max_pos:
                seq.reason = "ctx_len"  # positions ≥ ctx_len − 1 have no slot (contract.py)
            if seq.reason is None:
                going.append(seq)
            else:
                self.leave(r)
        return going

    def _observe(self, rows: np.ndarray, acc: np.ndarray, lens: np.ndarray) -> None:
        """The drafted rows' acceptance (and what the draft's confidences promised) to the
        policy's running estimates."""
        drafted = rows[lens[rows] > 1]
        if len(drafted):
            self.policy.observe(drafted, acc[drafted], self.state.confidence[drafted], self.costs)

    def propose(self, seqs: list) -> None:
        """The next proposals of every row going on that drafts (context filled by verify):
        one draft call over them. Under the policy, the rows that decode keep their context
        waiting (`Prefill.queue`), and a row drafting again after decoding sends it with its
        own DraftPrefill call, which proposes its block; then each row with fresh proposals
        verifies them or decodes (`StepPolicy.use`)."""
        pol, st = self.policy, self.state
        if pol.mode == "always":
            return self._draft(seqs)
        slots = [q.slot for q in seqs]
        if (  # every row drafts on and will verify: as under always
            not self._queued
            and not any(st.decoding[r] or q.pending for r, q in zip(slots, seqs))
            and pol.steady(slots, self.costs)
        ):
            return self._draft(seqs)
        d, ctx = self.bufs.draft, self.context
        batched, fresh = [], []
        for seq, w in zip(seqs, pol.want(slots, self.costs)):
            r = seq.slot
            if w and seq.pending == 0:
                batched.append(seq)
                continue
            if not self._queued:  # this step's committed rows wait in its context
                k = int(np.count_nonzero(d.ctx_pos[r] >= 0))
                ctx.queue(seq, d.ctx[r, :k], int(d.ctx_pos[r, 0]), k)
                d.ctx_pos[r] = contract.PAD_POSITION  # not in the draft call
            if w or seq.pending + self.plan.block_size > ctx.context_rows:
                # proposes its block; its seconds are a call's, not the host's (StepCosts.step)
                ctx.flush(seq, int(st.start[r]), int(st.anchor[r]), self.costs)
            if w:
                fresh.append(r)
        if not self._queued:  # (after a decode call every row decodes already)
            st.decoding[slots] = True
        if batched:
            self._draft(batched, part=len(batched) < len(seqs))
            fresh += [q.slot for q in batched]
        if fresh:
            st.decoding[fresh] = np.logical_not(pol.use(fresh, st.confidence[fresh], self.costs))

    def _draft(self, seqs: list, part: bool = False) -> None:
        """The draft call over every row (part: only `seqs`' rows are kept; the others sat out
        with positions -1). Each row's block: its anchor at its position start."""
        st, d = self.state, self.bufs.draft
        d.blk_ids[:, 0] = st.anchor
        np.add(st.start[:, None], st.offsets, out=d.blk_pos)  # inactive rows: all -1
        # near the end, block rows past the last slot propose what no verify will take: they
        # sit at the last position (the draft's tables and windows end there)
        np.minimum(d.blk_pos, self.max_pos - 1, out=d.blk_pos)
        rows = None
        if part:  # the others sit out
            rows = np.fromiter((q.slot for q in seqs), np.int64, len(seqs))
            out_rows = np.ones(len(d.blk_pos), bool)
            out_rows[rows] = False
            d.blk_pos[out_rows] = contract.PAD_POSITION
        feeds = self.bufs.window(d.feeds, self.furthest)  # the cached slots: below each block
        if self.bufs.draft_u is not None:  # each row's proposals: positions start + 1 …
            for seq in seqs:
                seq.fill_draft_uniforms(self.bufs.draft_u[seq.slot], int(st.start[seq.slot]) + 1)
        out = call("draft", self.draft, feeds, seqs, self.costs)
        if part:
            st.keep(out, rows, rows)
        else:
            st.keep(out, slice(None))


class DecodeStep(_Step):
    """The target alone: one decode call over every slot, one token per row."""

    def __init__(self, plan, target, draft, bufs, state, costs: StepCosts | None = None):
        super().__init__(plan, target, draft, bufs, state)
        self.costs = costs  # a decode call's seconds, for the step policy

    def run(self, rows: np.ndarray, seqs: list) -> None:
        st, t = self.state, time.perf_counter()
        out = self._decode(seqs, self.costs)
        check_committed("decode", out, rows, 1, seqs)
        token = out[contract.NEXT_TOKENS][:, 0]  # [N]
        st.anchor[:] = token
        st.start += st.alive
        tokens = token.tolist()
        full = int(st.start.max()) + 1 > contract.max_positions(self.plan.ctx_len)
        for seq in seqs:
            commit_rows(self.bufs, seq, seq.slot, out, [tokens[seq.slot]])
            if (
                seq.reason is None
                and full
                and out_of_room(st.start[seq.slot], 1, self.plan.ctx_len)
            ):
                seq.reason = "ctx_len"
        if self.costs is not None:
            self.costs.step("decode", time.perf_counter() - t)
