"""The step policy: per sequence and per step, a DFlash step (draft, then verify the
proposals) or plain decoding (docs/DESIGN.md, Step policy). Both paths are exact, so the
choice changes speed only, never what the target would have chosen.

    always   every step drafts (the behaviour before the policy: with fixed verify lengths a
             run's acceptance counters are reproducible from run to run)
    never    every step decodes (the target alone; the draft never runs)
    auto     a row drafts while its expected tokens per second beat decoding's, from

             - `est`, a running estimate of the proposals the row keeps per drafted step,
               updated from each drafted step's acceptance (and the draft's own confidences in
               its proposals, when the draft returns them), seeded from its first block's
               confidences;
             - the step's cost profile, `StepCosts`: the measured seconds of a verify call of
               n rows, of a draft call and of a decode call, in this process on this backend.

A drafted step of n rows costs verify(n) + draft and commits 1 + min(est, n − 1) tokens on
average; a decode step costs decode and commits 1. A row drafts when some n makes the first
rate at least the second (`pays`). Once the draft call has run (its cost spent), the row
verifies the fresh proposals only if verify(n) alone pays for what their confidences promise
(`use`). A row that decodes is probed after `wait` steps (a draft call and, if its confidences
promise enough, a verify); a probe that does not pay doubles `wait` (up to PROBE_MAX), one that
pays resets it, so a sequence that becomes predictable again gets its drafts back within a
bounded number of steps while a hopeless one costs one draft call per PROBE_MAX tokens.

Decisions depend on measured times, so under `auto` which steps draft varies from run to run;
greedy tokens never do (both paths commit the target's own argmax). A sampled row's tokens are
the target's own samples on a chain program (each position's uniforms, whatever the path);
under q-aware or block verification they are exactly distributed but depend on the proposals
verified, so `always` is the setting that reproduces a seeded run's tokens there.
"""

from __future__ import annotations

import numpy as np

POLICIES = ("auto", "always", "never")


def expected(confidence: np.ndarray) -> np.ndarray:
    """Expected kept proposals per row from the draft's confidences ([rows, B − 1], the
    probability the target takes proposal j given it took those before): Σ_j Π_{i ≤ j} c_i."""
    c = np.asarray(confidence, np.float64)
    return np.cumprod(c, axis=1).sum(axis=1)


class StepPolicy:
    """Per slot: the running estimate `est`, the decode steps since it last drafted (`idle`),
    the steps it waits before its next probe (`wait`), and whether its last draft was a probe.
    All arrays over every slot; a step passes the slots it decides for."""

    WEIGHT = 0.5  # of the newest observation in the running estimate
    PROBE_FIRST = 4  # decode steps before a row's first probe
    PROBE_MAX = 128  # the longest wait between two probes

    def __init__(self, mode: str, slots: int, block_size: int, confidence: bool = True):
        """confidence: the draft returns confidences in its proposals (contract.DraftIO)."""
        if mode not in POLICIES:
            raise ValueError(f"spec_policy must be one of {', '.join(POLICIES)}, got {mode!r}")
        self.mode, self.B, self.confidence = mode, block_size, confidence
        self.est = np.full(slots, float(block_size - 1))
        self.idle = np.zeros(slots, np.int64)
        self.wait = np.full(slots, self.PROBE_FIRST, np.int64)
        self.probing = np.zeros(slots, bool)

    def join(self, slot: int, confidence: np.ndarray | None = None) -> None:
        """A sequence starts stepping in `slot`, its first proposals' confidences given."""
        prior = self.B - 1.0
        if self.confidence and confidence is not None:
            prior = float(expected(confidence[None])[0])
        self.est[slot], self.idle[slot] = prior, 0
        self.wait[slot], self.probing[slot] = self.PROBE_FIRST, False

    def observe(self, slots: np.ndarray, accepted: np.ndarray, confidence=None) -> None:
        """The drafted rows `slots` kept `accepted` proposals; `confidence` ([rows, B − 1]: what
        the draft expected of those proposals) joins the observation when the draft has one."""
        obs = np.asarray(accepted, np.float64)
        if self.confidence and confidence is not None:
            obs = 0.5 * (obs + expected(confidence))
        self.est[slots] += self.WEIGHT * (obs - self.est[slots])

    def pays(self, est: np.ndarray, costs, draft: bool = True) -> np.ndarray:
        """Whether rows of estimate `est` commit more tokens per second drafting than decoding,
        by the measured costs (draft False: the draft call already ran, its cost spent). Until
        a verify and a draft call have been timed, every row drafts (they must be measured to
        be compared); until a decode call has, the cheapest verify stands for it."""
        est = np.asarray(est, np.float64)
        if costs.draft_s is None or not costs.verify_s:
            return np.ones(est.shape, bool)
        t_dec = costs.decode_s if costs.decode_s is not None else min(costs.verify_s.values())
        extra = costs.draft_s if draft else 0.0
        best = np.zeros(est.shape)
        for n, t in costs.verify_s.items():
            best = np.maximum(best, (1.0 + np.minimum(est, n - 1)) / (t + extra))
        return best * t_dec >= 1.0

    def want(self, slots: np.ndarray, costs) -> np.ndarray:
        """Which of `slots` (the rows going on after this step) draft for their next step: the
        ones it pays for, and the ones due a probe."""
        if self.mode != "auto":
            return np.full(len(slots), self.mode == "always")
        pays = self.pays(self.est[slots], costs)
        was = self.probing[slots]  # a probe's outcome sets the next wait
        self.wait[slots[was & pays]] = self.PROBE_FIRST
        failed = slots[was & ~pays]
        self.wait[failed] = np.minimum(2 * self.wait[failed], self.PROBE_MAX)
        due = self.idle[slots] >= self.wait[slots]
        want = pays | due
        self.probing[slots] = want & ~pays
        self.idle[slots] = np.where(want, 0, self.idle[slots] + 1)
        return want

    def use(self, slots: np.ndarray, confidence: np.ndarray | None, costs) -> np.ndarray:
        """Which of `slots`, whose draft call just ran, verify its proposals (confidence
        [rows, B − 1], theirs): those whose proposals pay for the verify alone, by the running
        estimate and the confidences (a probe by its confidences alone). Without confidences,
        every one."""
        if self.mode != "auto" or not self.confidence or confidence is None:
            return np.full(len(slots), self.mode != "never")
        fresh = expected(confidence)
        mix = np.where(self.probing[slots], fresh, 0.5 * (self.est[slots] + fresh))
        return self.pays(mix, costs, draft=False)
