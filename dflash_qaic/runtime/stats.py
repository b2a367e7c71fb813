"""Statistics of the host loop: what each program call cost, the verify length those costs make
best (`StepCosts`), and a finished request's `GenerationResult` (docs/DESIGN.md, Runtime)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens only, prompt excluded
    acceptance_lengths: list[int]  # tokens committed per step (1 … B); the first token is prefill's
    stats: dict  # tau, ttft_s, tpot_s, tokens_per_s, host_s, device_s, bytes_per_step, …
    stop_reason: str  # "max_new_tokens" | "stop_token" | "ctx_len" | "abort" | "error"
    text: str | None = None
    call_times: dict[str, list[float]] = field(default_factory=dict, repr=False)
    #: rows each step verified (its verify length, ≤ B; empty for the target alone): step i
    #: proposed verify_lengths[i] − 1 draft tokens and accepted acceptance_lengths[i] − 1
    verify_lengths: list[int] = field(default_factory=list, repr=False)
    #: stop_reason "error": what failed (the tokens before it are kept)
    error: str | None = None
    #: logprobs=k: each generated token's log p and top k (runtime/logprobs.py TokenLogprobs)
    logprobs: object = field(default=None, repr=False)
    #: prompt_logprobs=k: each prompt token's (the first one's is None)
    prompt_logprobs: object = field(default=None, repr=False)


class CallLog:
    """One request's share of the program calls it took part in, by call kind: seconds of each
    call, bytes moved (a shared call's split evenly over its requests), seconds inside programs
    (shared calls counted whole)."""

    __slots__ = ("times", "bytes", "device")

    def __init__(self):
        self.times: dict[str, list[float]] = {}
        self.bytes: dict[str, float] = {}
        self.device: dict[str, float] = {}

    def add(self, kind: str, seconds: float, moved: float, device: float) -> None:
        self.times.setdefault(kind, []).append(seconds)
        self.bytes[kind] = self.bytes.get(kind, 0.0) + moved
        self.device[kind] = self.device.get(kind, 0.0) + device


def timed_call(kind: str, program, feeds: dict, seqs, costs=None, rows: int = 0) -> dict:
    """Run `program` on `feeds`; its time and bytes go to every sequence in the call (and, for
    a step's verify call of `rows` rows and its draft call, to the StepCosts `costs`)."""
    d0, t = program.device_s, time.perf_counter()
    out = program.run(feeds)
    dt, dev = time.perf_counter() - t, program.device_s - d0
    if costs is not None:
        costs.observe(kind, dt, rows)
    moved = sum(a.nbytes for a in feeds.values()) + sum(a.nbytes for a in out.values())
    share = moved / len(seqs)
    for s in seqs:
        s.log.add(kind, dt, share, dev)
    return out


class StepCosts:
    """Running means of a verify call's seconds by length, of a draft call's and of a decode
    call's, and the verify length they make best (docs/DESIGN.md, Verify length); the step
    policy reads them too (runtime/policy.py). A Pipeline keeps one for all its engines."""

    WEIGHT = 0.1  # of the newest call in the running mean
    # a call counts as at most CAP running means: on a shared machine a call's wall time has a
    # heavy tail (a short call the OS preempts takes tens of times its cost, and a short call
    # is preempted as often per second as a long one), so a tight cap (2) measured a decode
    # call at a fifth of its mean under load and a 16-row verify at nine tenths, which made
    # drafting look 3× dearer than it was; at 8 the means are within a few % of the true ones
    # while one outlier still moves a mean by at most WEIGHT × (CAP − 1)
    CAP = 8.0
    LOSS = 0.1  # sampled steps: expected tokens per row a shorter verify may give up

    def __init__(self, warmup_calls: int = 1):
        """warmup_calls: the first calls of each kind and length are not timed (a program's
        first call of a shape sets up its buffers; timed, it would make that length look slow,
        and a length that looks slow is never picked again to correct it)."""
        self.verify_s: dict[int, float] = {}
        self.draft_s: float | None = None
        self.decode_s: float | None = None
        self.draft_context_s: float | None = None  # a decoding row's context sent to the draft
        # the step policy's memory across sequences (runtime/policy.py): proposals kept per
        # drafted step, and what the draft's confidences promised for them (running means)
        self.kept: float | None = None
        self.promised: float | None = None
        # the same for sampled rows (T > 0), apart: a sampled row keeps fewer proposals for
        # the same confidences, and a pair that pays greedy may not pay sampled (or the reverse)
        self.kept_sampled: float | None = None
        self.promised_sampled: float | None = None
        # the host's seconds per step outside its timed calls, by path ("draft", "decode"):
        # Python, copies and, on a shared machine, waiting for a core
        self.host_s: dict[str, float] = {}
        self._in_calls = 0.0  # seconds of the timed calls of the step under way
        self.warmup_calls = warmup_calls
        self._seen: collections.Counter = collections.Counter()

    def observe(self, kind: str, seconds: float, n: int = 0) -> None:
        self._in_calls += seconds
        self._seen[kind, n] += 1
        if self._seen[kind, n] <= self.warmup_calls:
            return
        if kind == "verify":
            self.verify_s[n] = self._mean(self.verify_s.get(n), seconds)
            return
        name = f"{kind}_s"  # draft_s, decode_s, draft_context_s
        setattr(self, name, self._mean(getattr(self, name), seconds))

    def _mean(self, old: float | None, seconds: float) -> float:
        """The running mean after a call of `seconds`, counted as at most CAP means: a call the
        OS preempted (on a shared machine, tens of times its cost) moves the mean by at most
        WEIGHT × (CAP − 1) of it, not by its own length, while a real change of cost still gets
        through in a few calls."""
        if old is None:
            return seconds
        return old + self.WEIGHT * (min(seconds, self.CAP * old) - old)

    def step(self, path: str, seconds: float) -> None:
        """A step of `path` ("draft": it verified proposals; "decode") took `seconds` of wall
        time: what its timed calls did not take goes to `host_s[path]` (a running mean)."""
        host, self._in_calls = max(seconds - self._in_calls, 0.0), 0.0
        self.host_s[path] = self._mean(self.host_s.get(path), host)

    def row_lengths(self, lengths: list[int], confidences: np.ndarray) -> np.ndarray:
        """Each sampled row's own verify length ([rows] int64) from its own confidences
        ([rows, B−1]) alone: the shortest that loses less than LOSS expected tokens. A sampled
        row's tokens depend on its verify length (a row past it draws the bonus), so the length
        is a function of the row alone and a seeded request gives the same tokens batched as
        solo, whatever its neighbours (docs/DESIGN.md, Verify length)."""
        c = np.asarray(confidences, np.float64)  # [rows, B−1]
        # G[:, j]: expected proposals accepted among the first j + 1, Σ_{i≤j} Π_{l≤i} c_l
        G = np.cumsum(np.cumprod(c, axis=1), axis=1)
        out = np.full(len(c), lengths[-1], np.int64)
        for n in reversed(lengths[:-1]):  # loss at n rows: G[-1] − G[n − 2] (all of G at n 1)
            lost = G[:, -1] - (G[:, n - 2] if n > 1 else 0.0)
            np.copyto(out, n, where=lost < self.LOSS)
        return out

    def best_rows(self, sizes: list[int], gains: np.ndarray) -> int:
        """The row count of most expected tokens per second: gains[i], the expected tokens a
        call of sizes[i] rows commits. Until every size and a draft call have been timed, the
        largest untimed size (each is tried before it can be compared)."""
        untimed = [n for n in sizes if n not in self.verify_s]
        if untimed or self.draft_s is None:
            return max(untimed or sizes)
        rates = [g / (self.verify_s[n] + self.draft_s) for n, g in zip(sizes, gains, strict=True)]
        return sizes[int(np.argmax(rates))]

    def best_length(self, lengths: list[int], confidences: list[np.ndarray] | np.ndarray) -> int:
        """The verify length of a greedy call for rows with these confidences ([rows, B−1]):
        the most expected committed tokens per second (the longest until a call of it and a
        draft call have been timed)."""
        B = lengths[-1]
        if len(lengths) == 1:
            return B
        c = np.asarray(confidences)  # [rows, B−1]
        rows = len(c)
        # gain[n−1]: expected committed tokens at n rows, 1 + Σ_{j<n} Π_{i≤j} c_i per row
        gain = np.full(B, float(rows))
        gain[1:] += np.cumsum(np.cumprod(c, axis=1), axis=1).sum(axis=0, dtype=np.float64)
        if B not in self.verify_s or self.draft_s is None:
            return B
        best, best_rate, ref = B, -1.0, B  # ref: the shortest timed length so far
        for n in reversed(lengths):
            if n in self.verify_s:
                ref = n
            cost = self.verify_s.get(n, self.verify_s[ref] * n / ref)  # untimed: n/ref of ref's
            rate = gain[n - 1] / (cost + self.draft_s)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = n, rate
        return best


def result(seq, mode: str) -> GenerationResult:
    """A sequence's result, with statistics as the reference measures them: decode time runs
    from the end of prefill (the draft's included) to the end; device time is time inside this
    sequence's step calls (shared calls counted whole), host time the rest of its decode time."""
    now = time.perf_counter()
    t_dec = seq.t_dec if seq.t_dec is not None else now
    decode_s = now - t_dec
    n, log = len(seq.tokens), seq.log
    # a DFlash run's steps may decode (the step policy) and send a decoding row's context
    kinds = ("verify", "draft", "decode", "draft_context") if mode == "dflash" else ("decode",)
    step_device = sum(log.device.get(k, 0.0) for k in kinds)
    sp = seq.req.sampling
    steps = len(seq.lengths)
    # a step that verified one row (its anchor alone) decoded; the others drafted
    drafted = [n for n, v in zip(seq.lengths, seq.verified) if v > 1]
    stats = {
        "tau": float(np.mean(seq.lengths)) if steps else 0.0,
        "steps": steps,
        "drafted_steps": len(drafted),
        "decode_steps": steps - len(drafted),
        "tau_drafted": float(np.mean(drafted)) if drafted else None,
        "verify_rows": float(np.mean(seq.verified)) if seq.verified else None,
        "ttft_s": (seq.t_first or now) - seq.t_arrival,
        "prefill_s": t_dec - seq.t_arrival,
        "decode_s": decode_s,
        "tpot_s": decode_s / n if n else 0.0,
        "tokens_per_s": n / decode_s if decode_s > 0 else float("inf"),
        "device_s": step_device,
        "host_s": decode_s - step_device,
        "bytes_per_step": sum(log.bytes.get(k, 0.0) for k in kinds) / max(steps, 1),
        "prompt_tokens": len(seq.req.ids),
        "new_tokens": n,
        "prefill_calls": len(log.times.get("prefill", ())),
        "draft_prefill_calls": len(log.times.get("draft_prefill", ())),
        "slot": seq.slot,
        "temperature": sp.temperature,
        "top_k": sp.top_k,
        "top_p": sp.top_p,
        "seed": sp.seed,
    }
    if seq.constraint is not None:  # structured output: forced / cut proposals, host time
        stats.update(seq.constraint.stats(steps))
    error = None if seq.error is None else f"{type(seq.error).__name__}: {seq.error}"
    lp = seq.logprobs.result(n) if seq.logprobs is not None else (None, None)
    return GenerationResult(
        seq.tokens,
        seq.lengths,
        stats,
        seq.reason or "abort",
        call_times=log.times,
        verify_lengths=seq.verified,
        error=error,
        logprobs=lp[0],
        prompt_logprobs=lp[1],
    )
