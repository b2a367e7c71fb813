"""The host loop (REFERENCE.md §3) over the two programs.

    prefill:  for each prompt chunk: target(chunk) -> next_tokens, features
                                     draft(features of the chunk)        (⌈P / chunk⌉ calls each)
              first token = target's choice at the last prompt row; the last draft call also
              proposes the first block [first, MASK…] -> B−1 proposals
    step:     target verifies [anchor, proposals] at start … start+B−1
              acc = leading proposals equal to the target's choice; commit them + 1 target token
              draft(features of the acc+1 committed rows, block [new anchor, MASK…]) -> proposals

Sampling (temperature > 0) is decided inside the target program (REFERENCE.md §3): row j of a
verify block keeps proposal j+1 with probability p(proposal), else returns a sample from p with
the proposal removed, so the same "accept while proposal == choice" loop commits exactly what
lossless speculative sampling commits; the last row (and every decode call) samples from p. The
host only supplies the sampling settings and one pair of uniforms per row, drawn from
`np.random.default_rng(seed)` into preallocated buffers.

Per step one verify call and one draft call; only ids, positions and committed feature rows
cross the host. The KV caches stay in the programs (retained state). No cache is ever reset:
a query at position p sees only slots written at positions ≤ p (target) or < the block start
(draft), and every such slot was written earlier in the same generation, so a new prompt simply
overwrites from position 0 and a rejection needs no rollback.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from dflash_qaic import contract
from dflash_qaic.manifest import Manifest


class GenerationError(ValueError):
    """Bad input to generate(): says what is wrong and how to fix it."""


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens only, prompt excluded
    acceptance_lengths: list[int]  # tokens committed per step (1 … B); the first token is prefill's
    stats: dict  # tau, ttft_s, tpot_s, tokens_per_s, host_s, device_s, bytes_per_step, …
    stop_reason: str  # "max_new_tokens" | "stop_token" | "ctx_len"
    text: str | None = None
    call_times: dict[str, list[float]] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Sampling:
    """Validated sampling settings of one generation (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @classmethod
    def checked(cls, temperature=0.0, top_k=0, top_p=1.0, seed=None) -> Sampling:
        def real(name, x):
            if isinstance(x, bool) or not isinstance(x, numbers.Real):
                raise GenerationError(f"{name} must be a number (got {x!r})")
            return float(x)

        def integer(name, x):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise GenerationError(f"{name} must be an integer (got {x!r})")
            return int(x)

        t = real("temperature", temperature)
        if not math.isfinite(t) or t < 0:
            raise GenerationError(
                f"temperature must be a finite number ≥ 0 (got {temperature!r}); 0 is greedy"
            )
        k = integer("top_k", top_k)
        if k < 0:
            raise GenerationError(f"top_k must be ≥ 0 (got {top_k!r}); 0 turns top-k off")
        p = real("top_p", top_p)
        if not 0.0 < p <= 1.0:  # NaN fails too
            raise GenerationError(f"top_p must be in (0, 1] (got {top_p!r}); 1 turns top-p off")
        if seed is not None and integer("seed", seed) < 0:
            raise GenerationError(f"seed must be an integer ≥ 0 or None (got {seed!r})")
        return cls(t, k, p, None if seed is None else int(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _token_ids(value, what: str, vocab: int | None) -> list[int]:
    """A flat sequence of token ids (Python or numpy ints; a 1-D integer array), checked against
    the vocabulary when given. Floats, bools, strings and nested lists are refused, never
    converted or flattened."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise GenerationError(
                f"{what} must be a 1-D array of integer token ids (got shape {value.shape}, "
                f"dtype {value.dtype})"
            )
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, range)):
        raise GenerationError(
            f"{what} must be a list of integer token ids (got {type(value).__name__})"
        )
    bad = [t for t in value if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise GenerationError(
            f"{what} must hold integer token ids only; got {bad[0]!r} ({type(bad[0]).__name__})"
            + (" — one prompt per call, not a nested list" if isinstance(bad[0], list) else "")
        )
    ids = [int(t) for t in value]
    hi = vocab if vocab is not None else 2**63
    out_of_range = [t for t in ids if not 0 <= t < hi]
    if out_of_range:
        where = f"the vocabulary 0 … {vocab - 1}" if vocab is not None else "0 … 2^63 - 1"
        raise GenerationError(f"{what}: token ids {out_of_range[:5]} are outside {where}")
    return ids


class _Clock:
    """Wall time per program call, by kind (prefill, verify, draft, decode, draft_prefill)."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}
        self.bytes: dict[str, int] = {}  # bytes crossing the host, in + out, by kind

    def call(self, kind: str, program, feeds: dict) -> dict:
        t = time.perf_counter()
        out = program.run(feeds)
        self.times.setdefault(kind, []).append(time.perf_counter() - t)
        moved = sum(a.nbytes for a in feeds.values()) + sum(a.nbytes for a in out.values())
        self.bytes[kind] = self.bytes.get(kind, 0) + moved
        return out

    def total(self, *kinds: str) -> float:
        return sum(sum(self.times.get(k, ())) for k in kinds)


class Pipeline:
    """DFlash generation over a target program and a draft program (see `dflash_qaic.load`)."""

    def __init__(self, manifest, target, draft, tokenizer=None, backend: str = "ort"):
        """manifest: a `dflash_qaic.manifest.Manifest`, or its JSON form (validated here)."""
        if not isinstance(manifest, Manifest):
            manifest = Manifest.from_json(manifest, "manifest", complete=False)
        self.artifacts = manifest  # the typed manifest
        self.manifest = manifest.to_json()  # its JSON form, for reports
        self.target, self.draft = target, draft
        self.tokenizer = tokenizer
        self.backend = backend
        m = manifest
        self.B = m.block_size
        self.chunk = m.prefill_seq_len
        self.ctx_len = m.ctx_len
        self.H = m.hidden_size
        self.vocab = m.vocab_size
        self.mask_id = m.mask_token_id
        self.eos = list(m.eos_token_ids)
        # Per-call host buffers, allocated once and refilled in place on the hot path.
        B, C, H = self.B, self.chunk, self.H
        self._pre_ids = np.zeros((1, C), np.int64)
        self._pre_pos = np.zeros((1, C), np.int64)
        self._ver_ids = np.zeros((1, B), np.int64)
        self._ver_pos = np.zeros((1, B), np.int64)
        self._dec_ids = np.zeros((1, 1), np.int64)
        self._dec_pos = np.zeros((1, 1), np.int64)
        self._ctx = {n: np.zeros((1, n, H), np.float32) for n in {B, C}}
        self._ctx_pos = {n: np.zeros((1, n), np.int64) for n in {B, C}}
        self._blk_ids = np.full((1, B), self.mask_id, np.int64)
        self._blk_pos = np.zeros((1, B), np.int64)
        self._arange_b = np.arange(B, dtype=np.int64)
        # Sampling inputs of the target (absent in artifacts exported before sampling existed:
        # those run greedy only). The uniforms are refilled in place, one pair per row.
        self.can_sample = m.target.io.sampling
        # the largest top_k the program takes (its top-k/top-p candidates; all of V if unknown)
        self.max_top_k = m.target.sampling_candidates or self.vocab
        self._temperature = np.zeros((1,), np.float32)
        self._top_k = np.zeros((1,), np.int64)
        self._top_p = np.ones((1,), np.float32)
        # Rows per call that run the sampler (`sample_len`): a greedy call picks the
        # specialization that samples the fewest rows, so it does not pay for the sampler.
        specs = list(m.target.specializations)
        self._sample_len = {
            (n, greedy): contract.sample_rows(specs, n, greedy)
            for n in {1, B, C}
            for greedy in (True, False)
        }
        self._u = {
            n: np.zeros((1, n, contract.N_RANDOM), np.float32)
            for n in set(self._sample_len.values())
        }
        self._rng: np.random.Generator | None = None

    # ------------------------------------------------------------------ inputs

    def _prompt_ids(self, prompt) -> list[int]:
        """Token ids of one prompt: text (with a tokenizer) or a flat sequence of ints."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise GenerationError(
                    "a text prompt needs a tokenizer, and these artifacts have none (the target "
                    "directory had no tokenizer files): pass token ids instead"
                )
            prompt = self.tokenizer(prompt)["input_ids"]
        ids = _token_ids(prompt, "the prompt", self.vocab)
        if not ids:
            raise GenerationError("the prompt is empty: give at least one token")
        return ids

    @staticmethod
    def _check_args(max_new_tokens, on_tokens=None) -> None:
        """generate / stream / generate_baseline arguments, type-checked before any work
        (stop_token_ids are checked where they are read, `_stop_set`)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise GenerationError(f"max_new_tokens must be an integer ≥ 1 (got {max_new_tokens!r})")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be ≥ 1 (got {max_new_tokens})")
        if on_tokens is not None and not callable(on_tokens):
            raise GenerationError(f"on_tokens must be callable or None (got {on_tokens!r})")

    def _check_room(self, n: int, limit: int, what: str) -> None:
        if n > limit:
            raise GenerationError(
                f"the prompt has {n} tokens but {what} allows at most {limit} with ctx_len "
                f"{self.ctx_len}: shorten the prompt or re-export with a larger --ctx-len"
            )

    def _stop_set(self, stop_token_ids) -> set[int]:
        if stop_token_ids is None:
            return set(self.eos)
        return set(_token_ids(stop_token_ids, "stop_token_ids", None))

    def _set_sampling(self, temperature, top_k, top_p, seed) -> Sampling:
        """Validate the settings, load them into the target's inputs and seed the generator.
        seed None draws fresh entropy; the seed used is returned (and reported in stats)."""
        sp = Sampling.checked(temperature, top_k, top_p, seed)
        if not sp.greedy and not self.can_sample:
            raise GenerationError(
                "these artifacts' target program has no sampling inputs (exported by an older "
                "version or without sampling): use temperature=0, or re-export with dflash-export"
            )
        if sp.top_k > self.max_top_k and not sp.greedy and self.max_top_k < self.vocab:
            raise GenerationError(
                f"top_k {sp.top_k} is above the {self.max_top_k} candidates this target program "
                f"reads its top-k / top-p thresholds from: use top_k ≤ {self.max_top_k} or 0 (off)"
            )
        self._temperature[0] = sp.temperature
        self._top_k[0] = sp.top_k
        self._top_p[0] = sp.top_p
        if sp.greedy:
            self._rng = None  # the program takes the argmax; the uniforms stay zero
            for u in self._u.values():
                u.fill(0.0)
            return sp
        if sp.seed is None:
            sp = Sampling(sp.temperature, sp.top_k, sp.top_p, np.random.SeedSequence().entropy)
        self._rng = np.random.default_rng(sp.seed)
        return sp

    def _target_call(self, kind: str, clock: _Clock, ids: np.ndarray, pos: np.ndarray) -> dict:
        """One target call on preallocated ids/positions, with fresh uniforms when sampling."""
        feeds = {contract.INPUT_IDS: ids, contract.POSITION_IDS: pos}
        if self.can_sample:
            u = self._u[self._sample_len[ids.shape[1], self._rng is None]]
            if self._rng is not None:
                self._rng.random(out=u, dtype=np.float32)
            feeds[contract.TEMPERATURE] = self._temperature
            feeds[contract.TOP_K] = self._top_k
            feeds[contract.TOP_P] = self._top_p
            feeds[contract.RANDOM_U] = u
        return clock.call(kind, self.target, feeds)

    @staticmethod
    def _sampling_stats(sp: Sampling) -> dict:
        return {
            "temperature": sp.temperature,
            "top_k": sp.top_k,
            "top_p": sp.top_p,
            "seed": sp.seed,
        }

    # ------------------------------------------------------------------ program calls

    def _target_prefill(self, ids: list[int], clock: _Clock, with_draft: bool):
        """Chunked prefill of the target (and of the draft's context).
        Returns the first token and, with the draft, its proposals for the first block."""
        C, P = self.chunk, len(ids)
        first = proposals = None
        for lo in range(0, P, C):
            n = min(C, P - lo)
            self._pre_ids[0, :n] = ids[lo : lo + n]
            self._pre_ids[0, n:] = 0
            self._pre_pos[0, :n] = np.arange(lo, lo + n)
            self._pre_pos[0, n:] = contract.PAD_POSITION
            out = self._target_call("prefill", clock, self._pre_ids, self._pre_pos)
            if lo + n == P:
                first = int(out[contract.NEXT_TOKENS][0, n - 1])
                self._t_first = time.perf_counter()  # the first token exists from here on
            if with_draft:
                last = lo + n == P
                anchor = first if last else self.mask_id
                feats = out[contract.HIDDEN_STATES][0, :n]
                proposals = self._draft_call("draft_prefill", clock, feats, lo, C, anchor, lo + n)
        return first, proposals

    def _draft_call(self, kind, clock, feats, pos0, rows, anchor, start) -> np.ndarray:
        """Inject `feats` (n rows at positions pos0…) as context; propose a block at `start`."""
        n = len(feats)
        ctx, ctx_pos = self._ctx[rows], self._ctx_pos[rows]
        ctx[0, :n] = feats
        ctx_pos[0, :n] = np.arange(pos0, pos0 + n)
        ctx_pos[0, n:] = contract.PAD_POSITION
        self._blk_ids[0, 0] = anchor
        np.add(self._arange_b, start, out=self._blk_pos[0])
        out = clock.call(
            kind,
            self.draft,
            {
                contract.TARGET_HIDDEN: ctx,
                contract.POSITION_IDS_TARGET: ctx_pos,
                contract.INPUT_IDS: self._blk_ids,
                contract.POSITION_IDS: self._blk_pos,
            },
        )
        return out[contract.DRAFT_TOKENS][0]

    # ------------------------------------------------------------------ DFlash

    def _dflash(self, prompt, max_new_tokens, stop_token_ids, sampling) -> Iterator[list[int]]:
        ids = self._prompt_ids(prompt)
        B, P = self.B, len(ids)
        self._check_room(P, self.ctx_len - 1 - B, "DFlash (prompt + one verify block)")
        stop = self._stop_set(stop_token_ids)
        sp = self._set_sampling(*sampling)
        clock = _Clock()
        t0 = time.perf_counter()

        first, proposals = self._target_prefill(ids, clock, with_draft=True)
        t_dec = time.perf_counter()
        d_dec = self.target.device_s + self.draft.device_s
        tokens = [first]
        yield [first]
        lengths: list[int] = []
        reason = "stop_token" if first in stop else None
        start = P  # position of the anchor (the last committed token)
        while reason is None:
            if len(tokens) >= max_new_tokens:
                reason = "max_new_tokens"
                break
            if start + B > contract.max_positions(self.ctx_len):
                reason = "ctx_len"
                break
            self._ver_ids[0, 0] = tokens[-1]
            self._ver_ids[0, 1:] = proposals
            np.add(self._arange_b, start, out=self._ver_pos[0])
            # the program's choice per row: argmax, or (sampling) the proposal of the next row
            # kept with probability p(proposal), else a sample from p without it
            out = self._target_call("verify", clock, self._ver_ids, self._ver_pos)
            choice = out[contract.NEXT_TOKENS][0]
            feats = out[contract.HIDDEN_STATES][0]

            acc = 0
            while acc < B - 1 and proposals[acc] == choice[acc]:
                acc += 1
            committed = [int(t) for t in proposals[:acc]] + [int(choice[acc])]
            room = max_new_tokens - len(tokens)
            produced = committed[:room]
            for i, t in enumerate(produced):
                if t in stop:
                    produced = produced[: i + 1]
                    reason = "stop_token"
                    break
            tokens += produced
            lengths.append(len(produced))
            yield produced
            if reason is not None or len(tokens) >= max_new_tokens:
                continue
            # the committed rows (anchor + accepted) become draft context
            new_start = start + acc + 1
            if new_start + B > contract.max_positions(self.ctx_len):
                # no room for another verify block, so no draft call either (its block would
                # reach past the last slot: positions ≥ ctx_len have no RoPE row)
                reason = "ctx_len"
                break
            proposals = self._draft_call(
                "draft", clock, feats[: acc + 1], start, B, committed[-1], new_start
            )
            start = new_start

        self._result = self._finish(
            tokens, lengths, reason, clock, P, t0, t_dec, d_dec, ("verify", "draft"), sp
        )

    def _finish(self, tokens, lengths, reason, clock, P, t0, t_dec, d_dec, step_kinds, sp):
        """The result and its statistics. Decode time runs from the end of prefill (the draft's
        included) to the end, as the reference measures it; device time is time inside program
        calls, host time the rest of the decode loop."""
        decode_s = time.perf_counter() - t_dec
        device_s = self.target.device_s + self.draft.device_s - d_dec
        n = len(tokens)
        stats = {
            "tau": float(np.mean(lengths)) if lengths else 0.0,
            "steps": len(lengths),
            "ttft_s": self._t_first - t0,
            "prefill_s": t_dec - t0,
            "decode_s": decode_s,
            "tpot_s": decode_s / n,
            "tokens_per_s": n / decode_s if decode_s > 0 else float("inf"),
            "device_s": device_s,
            "host_s": decode_s - device_s,
            "bytes_per_step": sum(clock.bytes.get(k, 0) for k in step_kinds) / max(len(lengths), 1),
            "prompt_tokens": P,
            "new_tokens": n,
            "prefill_calls": len(clock.times.get("prefill", ())),
            "draft_prefill_calls": len(clock.times.get("draft_prefill", ())),
            **self._sampling_stats(sp),
        }
        return GenerationResult(tokens, lengths, stats, reason, call_times=clock.times)

    # ------------------------------------------------------------------ target alone

    def _baseline(self, prompt, max_new_tokens, stop_token_ids, sampling) -> Iterator[list[int]]:
        ids = self._prompt_ids(prompt)
        P = len(ids)
        self._check_room(P, contract.max_positions(self.ctx_len) - 1, "the target")
        stop = self._stop_set(stop_token_ids)
        sp = self._set_sampling(*sampling)
        clock = _Clock()
        t0 = time.perf_counter()
        first, _ = self._target_prefill(ids, clock, with_draft=False)
        t_dec = time.perf_counter()
        d_dec = self.target.device_s + self.draft.device_s
        tokens = [first]
        yield [first]
        reason = "stop_token" if first in stop else None
        start = P
        while reason is None:
            if len(tokens) >= max_new_tokens:
                reason = "max_new_tokens"
                break
            if start + 1 > contract.max_positions(self.ctx_len):
                reason = "ctx_len"
                break
            self._dec_ids[0, 0] = tokens[-1]
            self._dec_pos[0, 0] = start
            # one row, no proposal: argmax, or a sample from p
            out = self._target_call("decode", clock, self._dec_ids, self._dec_pos)
            t = int(out[contract.NEXT_TOKENS][0, 0])
            tokens.append(t)
            start += 1
            yield [t]
            if t in stop:
                reason = "stop_token"
        self._result = self._finish(
            tokens, [1] * (len(tokens) - 1), reason, clock, P, t0, t_dec, d_dec, ("decode",), sp
        )

    # ------------------------------------------------------------------ public

    def _drive(self, gen: Iterator[list[int]], on_tokens) -> GenerationResult:
        for chunk in gen:
            if on_tokens is not None:
                on_tokens(chunk)
        res = self._result
        if self.tokenizer is not None:
            res.text = self.tokenizer.decode(res.tokens)
        return res

    def generate(
        self,
        prompt: list[int] | str,
        max_new_tokens: int = 64,
        stop_token_ids: list[int] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> GenerationResult:
        """DFlash generation. Greedy by default: token for token the target's own greedy output.

        prompt: token ids, or text when the artifacts carry a tokenizer.
        stop_token_ids: None = the target's EOS ids from the manifest; [] = never stop early.
        on_tokens: called with each run of newly committed tokens, as they are committed.
        temperature, top_k, top_p: sampling from the target's distribution after temperature,
            top-k (0 = off) and top-p (1 = off) filtering; lossless (the output is distributed
            exactly as the target's own sampling); temperature 0 = greedy.
        seed: seeds the host's random numbers; the same seed gives the same tokens. None draws
            fresh entropy (the value used is in `stats["seed"]`).
        """
        self._check_args(max_new_tokens, on_tokens)
        sampling = (temperature, top_k, top_p, seed)
        gen = self._dflash(prompt, max_new_tokens, stop_token_ids, sampling)
        return self._drive(gen, on_tokens)

    def stream(
        self,
        prompt,
        max_new_tokens: int = 64,
        stop_token_ids=None,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Iterator[int]:
        """Yield generated tokens one by one as steps commit them (DFlash; arguments as generate)."""
        self._check_args(max_new_tokens)
        sampling = (temperature, top_k, top_p, seed)
        for chunk in self._dflash(prompt, max_new_tokens, stop_token_ids, sampling):
            yield from chunk

    def generate_baseline(
        self,
        prompt: list[int] | str,
        max_new_tokens: int = 64,
        stop_token_ids: list[int] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> GenerationResult:
        """The target alone on the decode specialization of the same program; same statistics
        and the same sampling arguments as generate (each decode call samples from p)."""
        self._check_args(max_new_tokens, on_tokens)
        sampling = (temperature, top_k, top_p, seed)
        gen = self._baseline(prompt, max_new_tokens, stop_token_ids, sampling)
        return self._drive(gen, on_tokens)
