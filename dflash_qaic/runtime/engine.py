"""The host loop: one engine steps every sequence in flight (docs/DESIGN.md, Runtime and
Continuous batching; the algorithm is docs/DESIGN.md, Algorithm). Three parts:

    BatchEngine (here)  the scheduler: a FIFO of requests, the slots (cache rows), admission
                        into a free slot, prefill within the admission policy, one step over
                        the slots in flight, retirement
    runtime/buffers.py  the host buffers of every call, typed and allocated once
    runtime/step.py     the calls: a prompt's prefill, the speculative step (verify length,
                        acceptance, draft context) or the target alone
    runtime/policy.py   per row and step, drafting or plain decoding (the step policy)

built from one frozen `EngineConfig`, the two programs and the artifacts' `contract.ShapePlan`;
the statistics are runtime/stats.py.

    admit:    a queued request takes the lowest free slot (a cache row)
    prefill:  its prompt, chunk by chunk at batch 1 into that row; the first token
    step:     one verify call over every slot and one draft call over the rows that go on
              (DFlash), or one decode call (the target alone)
    retire:   a sequence ends on a stop token, max_new_tokens or the context end, or when one
              of its calls fails; its slot is free for the next request at the next step

Rows are slots: a step's calls have `full_batch_size` rows, row r on cache row r, and a slot
without a sequence that steps is an inactive row. Every row has its own positions, acceptance,
sampling settings and random numbers (drawn from the request's own seed and indexed by the
position they decide), so a request's tokens never depend on what else is in the batch or when
it joined. Artifacts exported without continuous batching run the same loop with one slot.

Admission policy (`prefill_chunks_per_step`): at most that many prefill chunks run between two
steps; None (the default) prefills every waiting prompt before the next step, as QEfficient's
host does. Bounding it bounds how long the sequences in flight wait for a newcomer (their time
per output token), at the cost of the newcomers' time to first token and of steps run with few
rows; `dflash-bench --concurrency` measures both, and on the default pair None won.

Faults stay with the requests they hit: a prefill call serves one request, so its failure
fails that request; a step's call serves the sequences in it, so its failure fails those; the
engine goes on with the rest and the queue. Nothing needs resetting: no cache is ever reset.
A query at position p sees only slots written at positions ≤ p (target) or < the block start
(draft), and every such slot was written by the sequence now in that cache row, so a new
request simply overwrites from position 0, a rejection needs no rollback, and a failed call's
partial writes are never read.
"""

from __future__ import annotations

import collections
import heapq
import logging
from dataclasses import dataclass

import numpy as np

from dflash_qaic import contract
from dflash_qaic.runtime import handoff, prefix
from dflash_qaic.runtime.buffers import PrefillBuffers, StepBuffers
from dflash_qaic.runtime.options import KV_OFFLOADING_SIZE, PREFIX_CACHING, SPEC_POLICY
from dflash_qaic.runtime.policy import POLICIES, StepPolicy
from dflash_qaic.runtime.sequence import Request, Sequence
from dflash_qaic.runtime.stats import GenerationResult, StepCosts, result
from dflash_qaic.runtime.step import CallFailed, DecodeStep, DFlashStep, Prefill, SlotBook

__all__ = ["MODES", "BatchEngine", "EngineConfig", "GenerationResult", "Request", "Sequence"]

log = logging.getLogger("dflash_qaic.runtime")

MODES = ("dflash", "baseline")


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs; the shapes come from the artifacts' plan.

    mode: "dflash" (speculative steps) or "baseline" (the target alone, decode calls).
    max_running: at most this many sequences in slots at once (None: every slot); the benchmark
        holds concurrency c with it on a program of more slots.
    prefill_chunks_per_step: the admission policy (module docstring; None: no limit).
    verify_lengths: the verify lengths a step may pick from (None: every one the target was
        exported with); (block size,) verifies the whole block every step.
    first_token_alone: a sequence whose prefill ends in a step gives that step its first token
        only and steps from the next step() on (False: it joins that step's verify at once).
        vLLM's scheduler expects this (a step either prefills a request or decodes it; the
        plugin's worker, dflash_qaic/vllm/, sets it).
    fill_forced_tokens: structured output fills the tokens its grammar forces (runtime/grammar.py).
    tree_budget: a tree program's steps (docs/DESIGN.md, Tree verification): None picks the
        tree's size each step from its expected tokens and the measured call costs, over the
        verify lengths and the exported tree budgets; N verifies a tree of N rows every step
        (an exported budget); 0 verifies chains only.
    spec_policy: per sequence and step, drafting or plain decoding (runtime/policy.py):
        "auto" (the default, options.SPEC_POLICY) drafts while the measured costs and the
        sequence's acceptance say it pays, "always" drafts every step (acceptance counters
        reproducible), "never" decodes every step (the draft never runs).
    enable_prefix_caching: a prompt extending what a cache row or the host tier holds resumes
        there (runtime/prefix.py); kv_offloading_size: the host tier's GiB (None: none).
    """

    mode: str = "dflash"
    max_running: int | None = None
    prefill_chunks_per_step: int | None = None
    verify_lengths: tuple[int, ...] | None = None
    first_token_alone: bool = False
    # structured output: where the grammar allows one token, it replaces the draft's proposal
    # (False: the proposals as drafted, to measure what filling gains)
    fill_forced_tokens: bool = True
    tree_budget: int | None = None
    spec_policy: str = SPEC_POLICY.default
    enable_prefix_caching: bool = PREFIX_CACHING.default
    kv_offloading_size: float | None = KV_OFFLOADING_SIZE.default

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.spec_policy not in POLICIES:
            raise ValueError(
                f"spec_policy must be one of {', '.join(POLICIES)}, got {self.spec_policy!r}"
            )
        size = self.kv_offloading_size
        if size is not None and (isinstance(size, bool) or not size >= 0):
            raise ValueError(f"kv_offloading_size must be a number of GiB ≥ 0, got {size!r}")
        for name in ("max_running", "prefill_chunks_per_step"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer ≥ 1 or None (no limit), got {v!r}")
        if self.verify_lengths is not None:
            object.__setattr__(self, "verify_lengths", tuple(int(n) for n in self.verify_lengths))

    def step_lengths(self, plan: contract.ShapePlan, confidence: bool = True) -> list[int]:
        """The verify lengths a step picks from, checked against the plan; the whole block only
        for a draft without confidences."""
        lengths, B = list(plan.verify_lengths), plan.block_size
        chosen = self.verify_lengths
        if chosen is not None:
            if not set(chosen) <= set(lengths) or B not in chosen:
                raise ValueError(
                    f"verify_lengths {list(chosen)}: the target has verify lengths "
                    f"{lengths}; pick some of them, including the block size {B}"
                )
            lengths = sorted(set(chosen))
        return lengths if confidence else [B]

    def tree_sizes(self, plan: contract.ShapePlan, lengths: list[int]) -> list[int]:
        """The row counts a tree step picks from ([] : chains only), checked against the plan."""
        n = self.tree_budget
        if not plan.tree_budgets or n == 0:
            if n:
                raise ValueError(
                    f"tree_budget {n}: these artifacts have no tree budgets (export with "
                    "--tree-budgets, e.g. 16,32,64); 0 or None verifies chains"
                )
            return []
        if n is None:
            return sorted({*lengths, *plan.tree_budgets})
        if isinstance(n, bool) or n not in plan.tree_budgets:
            raise ValueError(
                f"tree_budget {n!r}: the target has tree budgets {list(plan.tree_budgets)}; pick "
                "one of them, 0 (chains) or None (chosen per step)"
            )
        return [n]


class BatchEngine:
    """Continuous batching over two programs (module docstring).

    engine.add(request) -> Sequence      queue a request (any number; they wait for a slot)
    engine.step() -> list[Sequence]      admit/prefill, then one step of every sequence in flight;
                                         returns the sequences it touched (seq.take(): new runs;
                                         seq.finished: its result is in seq.result)
    engine.abort(seq)                    end a sequence at once ("abort"), freeing its slot
    engine.busy                          sequences queued or in flight
    engine.running                       sequences in slots
    """

    def __init__(
        self,
        config: EngineConfig,
        plan: contract.ShapePlan,
        target,
        draft,
        *,
        target_io,
        draft_io,
        mask_token_id: int,
        costs: StepCosts | None = None,
        prefix_cache: prefix.PrefixCache | None = None,
    ):
        """target_io, draft_io: the programs' contract I/O (contract.TargetIO / DraftIO), the
        names their inputs are bound by; costs: the timings that pick verify lengths (a
        Pipeline passes its own, kept across engines); prefix_cache: the programs' cached
        prefixes (runtime/prefix.py; None: every prompt from position 0)."""
        self.config, self.plan = config, plan
        self.prefix = prefix_cache
        N, B = plan.cache_rows, plan.block_size
        # the draft runs unless the target alone steps ("never": every step decodes)
        dflash = config.mode == "dflash" and config.spec_policy != "never"
        lengths = config.step_lengths(plan, draft_io.confidence)
        trees = config.tree_sizes(plan, lengths) if dflash else []
        self.per_step = False  # block verification: each step its own uniforms (sequence.py)
        self.max_running = min(config.max_running or N, N)
        self.block_size = B
        state = SlotBook(N, B)
        bufs = StepBuffers(plan, sorted({*lengths, *trees}), target_io, draft_io, mask_token_id)
        self.sampling = bufs.sampling  # the step calls' per-slot settings
        prefill_bufs = PrefillBuffers(plan, target_io, draft_io, mask_token_id, bufs.sampling.ext)
        self.prefill = Prefill(plan, target, draft, prefill_bufs, state, dflash)
        costs = costs if costs is not None else StepCosts()
        if dflash:
            rule = target_io.rule.effective(target_io.sampling)  # the program's, as exported
            if rule is contract.TREE_RULE and not trees:  # budget 0: chains on a tree program
                rule = contract.CHAIN_RULE
            self.per_step = rule is contract.BLOCK_RULE
            policy = StepPolicy(config.spec_policy, N, B, draft_io.confidence)
            if policy.mode == "auto":
                self.prefill.lazy = lambda seq: policy.lazy(costs, seq.uniforms is not None)
            self.spec = DFlashStep(
                plan, target, draft, bufs, state, lengths, costs, rule, trees,
                policy=policy, context=self.prefill,
            )  # fmt: skip
        else:
            self.spec = DecodeStep(plan, target, draft, bufs, state, costs)
        self.spec.masks.fill = config.fill_forced_tokens
        self.slots: list[Sequence | None] = [None] * N  # slot -> its sequence
        self.free = list(range(N))  # a heap: the lowest free slot first
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: list[Sequence] = []  # in slots, prompt not done, in admission order
        # prompt done, stepping from the next step (first_token_alone), with its held state
        self.joining: list[tuple[Sequence, tuple]] = []
        # the slots that step and their sequences, in slot order (remade when one joins/leaves)
        self.rows, self.stepping = np.zeros(0, np.int64), []
        self._changed = False

    # ------------------------------------------------------------------ public

    def add(self, req: Request) -> Sequence:
        seq = Sequence(req, self.block_size)
        seq.per_step = self.per_step
        self.waiting.append(seq)
        return seq

    def add_choices(self, req: Request, n: int) -> list[Sequence]:
        """n choices of one request from one prefill (runtime/prefix.py, fork): they take n
        rows together; choice i samples with the request's seed + i. Returns their Sequences."""
        if not 1 <= n <= self.max_running:
            raise ValueError(f"n must be in 1 … {self.max_running} (the rows that run at once)")
        leader, *rest = prefix.choices(req, n)
        seq = self.add(leader)
        seq.fork = [Sequence(r, self.block_size) for r in rest]
        for f in seq.fork:
            f.per_step, f.held = self.per_step, True
        return [seq, *seq.fork]

    @property
    def running(self) -> int:
        return len(self.slots) - len(self.free)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.running > 0

    def abort(self, seq: Sequence) -> None:
        if seq.finished:
            return
        if seq.slot is None and seq in self.waiting:
            self.waiting.remove(seq)
            for f in seq.fork:  # its group never took rows
                self.abort(f)
        seq.reason = seq.reason or "abort"
        self._retire(seq)

    def step(self) -> list[Sequence]:
        """Admit and prefill (within the policy's budget), then one step over every sequence
        past its prompt. Returns the sequences with new tokens or a new end."""
        self._join()
        self._admit()
        touched = self._prefill()  # prompts that ended at their first token, or failed
        if self._changed:
            self.rows = np.flatnonzero(self.spec.state.alive)
            self.stepping, self._changed = [self.slots[r] for r in self.rows], False
        seqs = self.stepping
        if seqs:
            try:
                self.spec.run(self.rows, seqs)
            except CallFailed as e:  # that call's sequences fail, the others go on
                self._fail(e.seqs, e.cause)
            except Exception as e:
                self._fail(seqs, e)
            if self.prefix is not None:
                prefix.ended(self, seqs)
        touched += seqs
        for seq in touched:
            if seq.reason is not None and not seq.finished:
                self._retire(seq)
        return touched

    # ------------------------------------------------------------------ scheduling

    def _admit(self) -> None:
        while self.waiting and self.free and self.running < self.max_running:
            need = 1 + len(self.waiting[0].fork)  # a group takes its rows together
            if need > len(self.free) or self.running + need > self.max_running:
                break
            seq = self.waiting.popleft()
            if seq.fork:
                slots = prefix.take_rows(self, seq)
            else:
                slots = [prefix.take_row(self, seq)]
            for s, slot in zip([seq, *seq.fork], slots):
                s.slot = slot
                self.slots[slot] = s
                self.sampling.set_row(slot, s.req.sampling, s.req)
                self.prefilling.append(s)

    def _prefill(self) -> list[Sequence]:
        """Prompt chunks of the sequences in prefill, oldest first, within the budget. Returns
        those whose prompt ended without joining the step (done at the first token, failed)."""
        budget, ended, still = self.config.prefill_chunks_per_step, [], []
        for seq in self.prefilling:
            if seq.finished:  # aborted in the meantime
                continue
            if seq.held:  # a choice waiting for its group's prefill
                still.append(seq)
                continue
            while not seq.finished and seq.t_dec is None and (budget is None or budget > 0):
                try:
                    if getattr(seq, "handoff", None) is not None:  # prefilled elsewhere
                        handoff.enter(self, seq)
                    if seq.resume is not None:  # a prefix-cache hit
                        prefix.enter(self, seq)
                    if seq.fork:  # n > 1: the prompt once, into every choice's row
                        prefix.fork(self, seq)
                    self.prefill.chunk(seq)
                    if seq.marks:  # a rolling state saved at a block boundary
                        prefix.save_mark(self, seq)
                except Exception as e:  # its own calls: it fails alone
                    self._fail([seq], e.cause if isinstance(e, CallFailed) else e)
                budget = None if budget is None else budget - 1
            if seq.finished or seq.t_dec is not None:
                if seq.decoding and self.config.first_token_alone:
                    self.joining.append((seq, self._hold(seq.slot)))
                    ended.append(seq)  # its first token is this step's
                elif seq.decoding:
                    self.spec.join(seq.slot, seq.uniforms is not None, not seq.lazy)
                    self._changed = True
                else:
                    ended.append(seq)
            else:
                still.append(seq)
        self.prefilling = still
        return ended

    def _hold(self, slot: int) -> tuple:
        """What the prefill left in the slot's step state (anchor, start, the first block's
        proposals and confidences, the draft's q), kept aside while the slot waits to join:
        a step writes every row's anchor and proposals, and the waiting slot must stay an
        inactive row (start -1) in the step's calls until it joins."""
        st = self.spec.state
        q = None if st.q_ids is None else (st.q_ids[slot].copy(), st.q_probs[slot].copy())
        held = (
            int(st.anchor[slot]),
            int(st.start[slot]),
            st.proposals[slot].copy(),
            st.confidence[slot].copy(),
            q,
        )
        st.start[slot] = contract.PAD_POSITION
        return held

    def _join(self) -> None:
        """The sequences that got their first token alone in the last step join the steps,
        with the state their prefill left (`_hold`)."""
        st = self.spec.state
        for seq, (anchor, start, proposals, confidence, q) in self.joining:
            if seq.decoding:  # not aborted in the meantime
                slot = seq.slot
                st.anchor[slot], st.start[slot] = anchor, start
                st.proposals[slot], st.confidence[slot] = proposals, confidence
                if q is not None:
                    st.q_ids[slot], st.q_probs[slot] = q
                self.spec.join(slot, seq.uniforms is not None, not seq.lazy)
                self._changed = True
        self.joining.clear()

    def proposals(self, seq: Sequence) -> np.ndarray:
        """The draft's proposals for the positions after `seq`'s last token (the block its next
        step verifies), also while it waits to join (first_token_alone); none when its next
        step decodes (the step policy's choice)."""
        for waiting, held in self.joining:
            if waiting is seq:
                return held[2][: 0 if seq.lazy else None]
        st = self.spec.state
        return st.proposals[seq.slot, : 0 if st.decoding[seq.slot] else None]

    def _fail(self, seqs: list[Sequence], e: BaseException) -> None:
        log.warning("%d request(s) failed: %s: %s", len(seqs), type(e).__name__, e, exc_info=e)
        for seq in seqs:
            if not seq.finished:
                seq.reason, seq.error = "error", e
                self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        slot = seq.slot
        if slot is not None and self.slots[slot] is seq:
            prefix.keep(self, seq)
            self.slots[slot] = None
            self.spec.leave(slot)
            self._changed = True
            self.sampling.set_row(slot, None)
            heapq.heappush(self.free, slot)
        seq.result = result(seq, self.config.mode)
        seq.result.stats["cached_tokens"] = seq.cached

    def take_free(self) -> int:
        """A free cache row taken outside admission (the hand-off's prefill): see
        runtime/prefix.py, free_row."""
        return prefix.free_row(self)
