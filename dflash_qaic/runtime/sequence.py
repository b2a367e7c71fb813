"""One request in the engine: what was asked (`Request`) and what happened (`Sequence`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dflash_qaic import contract
from dflash_qaic.runtime.logprobs import LogprobRecord
from dflash_qaic.runtime.stats import CallLog, GenerationResult


@dataclass(frozen=True)
class Request:
    """A validated request (see Pipeline for the checks)."""

    ids: list[int]
    max_new_tokens: int
    stop: frozenset[int]
    sampling: object  # runtime.pipeline.Sampling, seed resolved when sampling
    grammar: object = None  # runtime.grammar.Grammar: structured output (None: unconstrained)
    # prefix caching (runtime/prefix.py): only requests of the same salt share cached state
    cache_salt: str | None = None


class Sequence:
    """A request's tokens, its slot, its place in its prompt and its statistics. What the next
    step reads of it (anchor, position, proposals) lives in the step's per-slot arrays
    (runtime/step.py), written when it takes a slot."""

    def __init__(self, req: Request, block_size: int):
        self.req = req
        self.block_size = block_size
        self.slot: int | None = None
        self.tokens: list[int] = []
        self.lengths: list[int] = []  # tokens committed per step
        self.verified: list[int] = []  # rows of each step's verify call (its verify length)
        self.new: list[list[int]] = []  # runs of tokens committed since the caller took them
        self.prefilled = 0  # prompt tokens already in the target's cache
        self.pending = 0  # prompt feature rows waiting in its slot's context for the draft
        self.lazy = False  # it starts decoding, without a first block (Prefill.lazy)
        # the position of its newest token (the anchor): the state below it is committed
        self.end = len(req.ids) - 1
        self.last_run = 0  # tokens its last commit was given (before a cut)
        self.tail: list[int] = []  # its last commit's tokens cut off (their state exists)
        # prefix caching (runtime/prefix.py): prompt tokens found cached, the hit to enter at
        # admission, the last step's committed rows the draft never took
        self.cached, self.resume, self.unsent = 0, None, 0
        # a rolling state's saved block boundaries: where its prefill chunks end (`marks`) and
        # the states saved there (`saved`, prefix.Mark), kept with its entry at retirement
        self.marks: list[int] = []
        self.saved: list = []
        # n > 1: a group's leader forks its prefill into its followers' rows (`fork`), which
        # wait for it (`held`)
        self.fork: list[Sequence] = []
        self.held = False
        # sampling: the uniforms of the token at position len(ids) + i are row i, drawn once
        # from the seed (a step may look B − 1 past the budget; the rows it discards are never
        # used again); None when greedy
        self.uniforms = self.draft_uniforms = None
        sp = req.sampling
        if not sp.greedy:
            rows = req.max_new_tokens + block_size + 1
            rng = np.random.default_rng(sp.seed)
            self.uniforms = rng.random((rows, contract.N_RANDOM), dtype=np.float32)
            # a DFlash-2 draft's uniform per proposal, by position as above (after the
            # target's: those stay what they were)
            self.draft_uniforms = rng.random(rows, dtype=np.float32)
        # block verification (docs/DESIGN.md, Block verification): a step's decision reads every
        # row's uniforms and every proposal, so a step draws its own (`step_uniforms`), never
        # reused by a later step; set by the engine for such programs
        self.per_step = False
        self._step_table: np.ndarray | None = None
        self.reason: str | None = None
        self.error: BaseException | None = None  # reason "error": what failed
        # structured output: the grammar's matcher (runtime/grammar.py), advanced per commit
        self.constraint = req.grammar.constraint() if req.grammar is not None else None
        self.logprobs = LogprobRecord.of(req)  # None unless logprobs were asked for
        self.log = CallLog()
        self.t_arrival = time.perf_counter()
        self.t_first = self.t_dec = None
        self.result: GenerationResult | None = None

    @property
    def decoding(self) -> bool:
        return self.t_dec is not None and self.reason is None

    @property
    def finished(self) -> bool:
        return self.result is not None

    def take(self) -> list[list[int]]:
        """The runs of tokens committed since the last call (the first token, then one run per
        step), in order."""
        out, self.new = self.new, []
        return out

    def commit(self, committed: list[int], step: bool) -> None:
        """Commit tokens, cut at max_new_tokens and after a stop token (which ends it)."""
        req = self.req
        self.end += len(committed)
        self.last_run = len(committed)
        produced = committed[: req.max_new_tokens - len(self.tokens)]
        for i, t in enumerate(produced):
            if t in req.stop:
                produced = produced[: i + 1]
                self.reason = "stop_token"
                break
        self.tokens += produced
        self.tail = committed[len(produced) :]
        if produced:
            self.new.append(produced)
        if self.constraint is not None:
            self._advance(produced)
        if step:
            self.lengths.append(len(produced))
        if self.reason is None and len(self.tokens) >= req.max_new_tokens:
            self.reason = "max_new_tokens"

    def _advance(self, produced: list[int]) -> None:
        """The grammar takes the committed tokens; once it has accepted its stop token the
        sequence ends (as a stop token ends it), and a token it rejects fails this sequence."""
        try:
            self.constraint.advance(produced)
        except RuntimeError as e:
            self.reason, self.error = "error", e
            return
        if self.reason is None and self.constraint.terminated:
            self.reason = "stop_token"

    def step_uniforms(self, start: int) -> np.ndarray | None:
        """[B, 3] uniforms of the step whose anchor sits at `start` (target rows' 2, the draft's
        1 per proposal), from the seed: each step has its own start, so no two steps share one.
        None when greedy or past the table."""
        if self.uniforms is None:
            return None
        if self._step_table is None:
            rows, B = len(self.uniforms), self.block_size
            seed = self.req.sampling.seed  # None (no seed given): fresh entropy
            rng = np.random.default_rng(None if seed is None else [seed, 1])
            self._step_table = rng.random((rows, B, 3), dtype=np.float32)
        t = start - len(self.req.ids)
        return self._step_table[t] if 0 <= t < len(self._step_table) else None

    def fill_draft_uniforms(self, u: np.ndarray, first: int) -> None:
        """Row j of `u` ([B − 1]) <- the draft's uniform for the proposal at position first + j."""
        u.fill(0.0)
        if self.draft_uniforms is None:
            return
        if self.per_step:  # this step's own (its anchor at first − 1)
            table = self.step_uniforms(first - 1)
            if table is not None:
                u[:] = table[1:, 2]
            return
        t0 = first - len(self.req.ids)
        lo, hi = max(0, -t0), min(len(u), len(self.draft_uniforms) - t0)
        if lo < hi:
            u[lo:hi] = self.draft_uniforms[t0 + lo : t0 + hi]

    def fill_uniforms(self, u: np.ndarray, first: int, step: bool = False) -> None:
        """Call row j of `u` ([n, 2]) <- this request's uniforms of the token at position
        first + j (zeros where its table has none: prompt positions, never read); a verify
        (`step`) of a block program: its step's own (`step_uniforms`)."""
        u.fill(0.0)
        if self.uniforms is None:
            return
        if step and self.per_step:
            table = self.step_uniforms(first - 1)
            if table is not None:
                u[:] = table[: len(u), :2]
            return
        t0 = first - len(self.req.ids)  # the table row of call row 0
        lo, hi = max(0, -t0), min(len(u), len(self.uniforms) - t0)
        if lo < hi:
            u[lo:hi] = self.uniforms[t0 + lo : t0 + hi]
