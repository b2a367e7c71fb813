"""The step policy: per sequence and per step, a DFlash step (draft, then verify the
proposals) or plain decoding (docs/DESIGN.md, Step policy). Both paths are exact, so the
choice changes speed only, never what the target would have chosen.

    always   every step drafts (the behaviour before the policy: with fixed verify lengths a
             run's acceptance counters are reproducible from run to run)
    never    every step decodes (the target alone; the draft never runs)
    auto     the default (options.SPEC_POLICY): a row drafts while its expected tokens per
             second beat decoding's, from

             - `est`, a running estimate of the proposals the row keeps per drafted step,
               updated from each drafted step's acceptance (and the draft's own confidences in
               its proposals, when the draft returns them), seeded from its first block's
               confidences (a greedy row: or the pair's memory, if that promises more); the
               pair's memory is kept apart for greedy and sampled rows;
             - the step's cost profile, `StepCosts`: the measured seconds of a verify call of
               n rows, of a draft call and of a decode call, in this process on this backend.

A drafted step of n rows costs verify(n) + draft and commits 1 + min(est, n − 1) tokens on
average; a decode step costs decode and commits 1. A row drafts when some n makes the first
rate at least the second (`pays`). Once the draft call has run (its cost spent), the row
verifies the fresh proposals only if verify(n) alone pays for what their confidences promise
(`use`). A row that decodes is probed after `wait` steps (a draft call and, if its confidences
promise enough, a verify); a probe that does not pay doubles `wait` (up to PROBE_MAX), one that
pays resets it (to PROBE_FIRST where drafts pay on the whole, else PROBE_LATE), so a sequence
that becomes predictable again gets its drafts back within a bounded number of steps while a
hopeless one costs one draft call per PROBE_MAX tokens. A row
whose kind (greedy, sampled) kept less than half the break-even on this pair so far starts
decoding without its first block (`lazy`) and probes first after PROBE_MAX steps: the prompt's
context waits for the draft with the rows it decodes, and goes to it with that probe (or when
the context buffer fills).

Decisions depend on measured times, so under `auto` which steps draft varies from run to run;
greedy tokens never do (both paths commit the target's own argmax). Sampled tokens are exactly
distributed on either path, but the tokens a seed gives depend on the proposals a step verified
(the rejection rule reads them), so `always` (or `never`) is the setting that reproduces a
seeded run's tokens.
"""

from __future__ import annotations

import numpy as np

POLICIES = ("auto", "always", "never")


def memory(costs, sampled: bool) -> tuple[float | None, float | None]:
    """The pair's memory for greedy or sampled rows (StepCosts): (proposals kept per drafted
    step, what the draft's confidences promised for them), running means, None until seen."""
    if sampled:
        return costs.kept_sampled, costs.promised_sampled
    return costs.kept, costs.promised


def _remember(costs, sampled: bool, kept: float, promised: float | None) -> None:
    """`memory`'s pair for greedy or sampled rows, replaced."""
    if sampled:
        costs.kept_sampled, costs.promised_sampled = kept, promised
    else:
        costs.kept, costs.promised = kept, promised


def expected(confidence: np.ndarray) -> np.ndarray:
    """Expected kept proposals per row from the draft's confidences ([rows, B − 1], the
    probability the target takes proposal j given it took those before): Σ_j Π_{i ≤ j} c_i."""
    c = np.asarray(confidence, np.float64)
    return np.cumprod(c, axis=1).sum(axis=1)


class StepPolicy:
    """Per slot: the running estimate `est`, the decode steps since it last drafted (`idle`),
    the steps it waits before its next probe (`wait`), and whether its last draft was a probe.
    A step passes the slots it decides for; the work is per sequence, a few scalar operations
    (a decoding step of one row costs well under a millisecond, so this stays off numpy's
    per-call overhead). What every sequence taught (the proposals kept per drafted step and
    what the confidences promised for them) is kept in the pipeline's `StepCosts` (`kept`,
    `promised`), so a new sequence starts from it, and the draft's confidences are read
    through that calibration."""

    # of a row's newest drafted step in its running estimate: a greedy row's acceptance comes
    # in long runs with short dips (a slow mean rides them out); a sampled row's is close to
    # independent from step to step (a fast one follows it), and its first observation
    # replaces its prior
    WEIGHT = 0.1
    WEIGHT_SAMPLED = 0.5
    MEMORY = 0.1  # of a drafted step in the pair's memory (kept, promised)
    PROBE_FIRST = 8  # decode steps before a row's first probe, when drafting paid so far
    PROBE_LATE = 64  # the same when the pair's acceptance so far says drafting does not pay
    PROBE_MAX = 128  # the longest wait between two probes
    LAZY = 0.5  # a kind that kept under this share of the break-even starts decoding

    def __init__(self, mode: str, slots: int, block_size: int, confidence: bool = True):
        """confidence: the draft returns confidences in its proposals (contract.DraftIO)."""
        if mode not in POLICIES:
            raise ValueError(f"spec_policy must be one of {', '.join(POLICIES)}, got {mode!r}")
        self.mode, self.B, self.confidence = mode, block_size, confidence
        self.est = [block_size - 1.0] * slots
        self.idle = [0] * slots
        self.wait = [self.PROBE_FIRST] * slots
        self.probing = [False] * slots
        self.fast = [False] * slots  # the row samples (WEIGHT_SAMPLED)
        self.seen = [0] * slots  # drafted steps observed since the sequence joined

    def promise(self, confidence, costs, sampled) -> list[float] | None:
        """The proposals the draft's confidences ([rows, B − 1]) promise, calibrated by what
        such promises kept so far for rows of their kind (`sampled`, one per row: `memory`);
        None without confidences."""
        if not self.confidence or confidence is None:
            return None
        out = expected(confidence).tolist()
        for i, s in enumerate(sampled):
            kept, promised = memory(costs, s)
            if kept is not None and promised:
                out[i] *= kept / promised
        return out

    def lazy(self, costs, sampled: bool = False) -> bool:
        """Whether a sequence of this kind (`sampled`: T > 0) starts decoding without its first
        block: under auto, when rows of its kind kept less than half the break-even so far (a
        pair whose draft does not fit its target: the prompt's last draft call would be wasted;
        its first probe comes after PROBE_MAX decode steps, as `join` has it). Where drafts
        only fall short of paying (a sampled row on a CPU) the first block is kept: it comes
        with the prompt's context, which the draft needs before any probe anyway, and its
        proposals often pay where a completion starts."""
        if self.mode != "auto":
            return False
        kept, _ = memory(costs, sampled)
        return kept is not None and kept < self.LAZY * self.threshold(costs)

    def join(
        self,
        slot: int,
        confidence: np.ndarray | None,
        costs,
        sampled: bool = False,
        fresh: bool = True,
    ) -> None:
        """A sequence starts stepping in `slot`; `confidence` [B − 1]: its first proposals';
        `sampled`: it samples (T > 0); fresh False: it has no first proposals (`lazy`) and
        decodes until its first probe, PROBE_MAX steps on."""
        kept, _ = memory(costs, sampled)
        e = None if not fresh or confidence is None else confidence[None]
        e = self.promise(e, costs, [sampled])
        if e is not None:
            prior = e[0]
        else:
            prior = self.B - 1.0 if kept is None else kept
        if not sampled and fresh and kept is not None:
            # a greedy row starts from the pair's memory when that promises more: one block's
            # confidences are a noisy sample of a run whose acceptance comes in long stretches,
            # and a row that starts decoding learns nothing until a probe, while one that
            # drafts learns at each step (its slow mean takes it out of a real desert)
            prior = max(prior, kept)
        self.est[slot], self.idle[slot], self.probing[slot] = prior, 0, False
        self.seen[slot], self.fast[slot] = 0, sampled
        # a lazy row's kind is hopeless here: it waits as long as a row that probed in vain;
        # another waits as after a probe that paid, by its kind's record
        self.wait[slot] = self._waits(kept, self.threshold(costs))[1] if fresh else self.PROBE_MAX

    def observe(self, slots, accepted, confidence, costs) -> None:
        """The drafted rows `slots` kept `accepted` proposals of a block the draft gave
        `confidence` ([rows, B − 1]) in: their estimates, and the pipeline's."""
        obs = [float(a) for a in accepted]
        rows = slots.tolist() if hasattr(slots, "tolist") else list(slots)
        for r, a in zip(rows, obs):
            # a probe's step weighs as a sampled row's: the row's estimate is stale by then
            w = self.WEIGHT_SAMPLED if self.fast[r] or self.probing[r] else self.WEIGHT
            first = self.seen[r] == 0 and self.fast[r]  # replaces the prior
            self.est[r] = a if first else self.est[r] + w * (a - self.est[r])
            self.seen[r] += 1
        e = None
        if self.confidence and confidence is not None:
            e = expected(confidence).tolist()
        for sampled in (False, True):  # the pair's memory, greedy and sampled rows apart
            idx = [i for i, r in enumerate(rows) if self.fast[r] == sampled]
            if not idx:
                continue
            kept, promised = memory(costs, sampled)
            kept = _mean(kept, sum(obs[i] for i in idx) / len(idx), self.MEMORY)
            if e is not None:
                promised = _mean(promised, sum(e[i] for i in idx) / len(idx), self.MEMORY)
            _remember(costs, sampled, kept, promised)

    @staticmethod
    def threshold(costs, draft: bool = True) -> float:
        """The least estimate at which drafting pays (draft False: the draft call already ran,
        its cost spent): some verify length n with (1 + min(est, n − 1)) / (verify(n) +
        draft + host) ≥ 1 / (decode + host), each path's host seconds per step its own
        (`StepCosts.host_s`; the other path's until measured). Until a verify and a draft call have been timed, −inf (every row
        drafts: they must be measured to be compared); until a decode call has, the cheapest
        verify stands for it."""
        if costs.draft_s is None or not costs.verify_s:
            return -np.inf
        t_dec = costs.decode_s if costs.decode_s is not None else min(costs.verify_s.values())
        host = costs.host_s
        h_draft = host.get("draft", host.get("decode", 0.0))
        t_dec += host.get("decode", h_draft)
        extra = costs.draft_s + h_draft if draft else 0.0
        return break_even(costs.verify_s, extra, t_dec)[0]

    def want(self, slots, costs) -> list[bool]:
        """Which of `slots` (the rows going on after this step) draft for their next step: the
        ones it pays for, and the ones due a probe. A probe that did not pay doubles the row's
        wait (to at most PROBE_MAX, or twice PROBE_FIRST while drafting pays on the pair's
        memory for rows of its kind), one that did resets it (to PROBE_FIRST, or PROBE_LATE
        where drafting does not pay on that memory)."""
        if self.mode != "auto":
            return [self.mode == "always"] * len(slots)
        thr, out = self.threshold(costs), []
        # (a probe that did not pay) a pair whose drafts pay on the whole for rows of this kind
        # has dips, not deserts: its probes back off less; (one that paid) the next run of
        # drafts ends in a short wait only where drafts pay on the whole: elsewhere (a sampled
        # row on a CPU, a pair that does not fit) a lucky step is most often followed by a
        # plain one, and short waits would probe again and again (as `join` has it)
        waits = None  # per kind: (after a probe in vain: the longest, after one that paid)
        for r in slots:
            pays = self.est[r] >= thr
            if self.probing[r]:  # the last draft was a probe: its outcome sets the wait
                if waits is None:
                    waits = [self._waits(kept, thr) for kept in (costs.kept, costs.kept_sampled)]
                most, first = waits[self.fast[r]]
                self.wait[r] = first if pays else min(2 * self.wait[r], most)
            want = pays or self.idle[r] >= self.wait[r]
            self.probing[r] = want and not pays
            self.idle[r] = 0 if want else self.idle[r] + 1
            out.append(want)
        return out

    def _waits(self, kept: float | None, thr: float) -> tuple[int, int]:
        """(the longest wait, the wait after a probe that paid) for rows of a kind that kept
        `kept` per drafted step so far (None: no record)."""
        if kept is None:
            return self.PROBE_MAX, self.PROBE_FIRST
        if kept < thr:
            return self.PROBE_MAX, self.PROBE_LATE
        return 2 * self.PROBE_FIRST, self.PROBE_FIRST

    def steady(self, slots, costs) -> bool:
        """Whether `want` would have every one of `slots` draft because drafting pays for it
        (none is probing) and `use` would have it verify its fresh proposals without reading
        their confidences (half its estimate pays for the verify alone): the usual greedy step,
        decided here in one pass, with `want`'s bookkeeping."""
        if self.mode != "auto":
            return self.mode == "always"
        thr, thr_v = self.threshold(costs), self.threshold(costs, draft=False)
        for r in slots:
            if self.probing[r] or self.est[r] < thr or 0.5 * self.est[r] < thr_v:
                return False
        for r in slots:
            self.idle[r] = 0
        return True

    def use(self, slots, confidence: np.ndarray | None, costs) -> list[bool]:
        """Which of `slots`, whose draft call just ran, verify its proposals (confidence
        [rows, B − 1], theirs): those whose proposals pay for the verify alone (the draft's
        cost is spent), by the running estimate and what the confidences promise (a probe by
        the promise alone). Without confidences, every one."""
        if self.mode != "auto" or not self.confidence or confidence is None:
            return [self.mode != "never"] * len(slots)
        thr = self.threshold(costs, draft=False)
        if not any(self.probing[r] or 0.5 * self.est[r] < thr for r in slots):
            # the usual greedy step: half the estimate pays alone, so its mean with any promise
            # (≥ 0) does, and the confidences need not be read (the step's host work)
            return [True] * len(slots)
        e = self.promise(confidence, costs, [self.fast[r] for r in slots])
        mix = [p if self.probing[r] else 0.5 * (self.est[r] + p) for r, p in zip(slots, e)]
        return [m >= thr for m in mix]


def break_even(verify_s: dict[int, float], draft_s: float, decode_s: float):
    """(the fewest proposals a drafted step must keep on average to commit tokens as fast as
    decoding does, the verify length that needs fewest): a step of n verify rows costs
    verify_s[n] + draft_s and commits 1 + kept tokens, a decode step decode_s and 1, so
    kept ≥ (verify_s[n] + draft_s) / decode_s − 1, which a step of n rows can keep only if
    ≤ n − 1. (inf, None) when no length can. The break-even τ per step is 1 + kept: the
    policy's rule, and the projection's (bench/project.py) on the card's roofline."""
    best, at = np.inf, None
    for n, t in sorted(verify_s.items()):
        need = (t + draft_s) / decode_s - 1.0
        if need <= n - 1 and need < best:
            best, at = need, n
    return best, at


def _mean(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)
