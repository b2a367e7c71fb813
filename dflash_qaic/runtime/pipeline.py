"""The host loop (REFERENCE.md §3) over the two programs.

    prefill:  for each prompt chunk: target(chunk) -> next_tokens, features
                                     draft(features of the chunk)        (⌈P / chunk⌉ calls each)
              first token = target's choice at the last prompt row; the last draft call also
              proposes the first block [first, MASK…] -> B−1 proposals
    step:     target verifies [anchor, proposals] at start … start+B−1
              acc = leading proposals equal to the target's choice; commit them + 1 target token
              draft(features of the acc+1 committed rows, block [new anchor, MASK…]) -> proposals

Per step one verify call and one draft call; only ids, positions and committed feature rows
cross the host. The KV caches stay in the programs (retained state). No cache is ever reset:
a query at position p sees only slots written at positions ≤ p (target) or < the block start
(draft), and every such slot was written earlier in the same generation, so a new prompt simply
overwrites from position 0 and a rejection needs no rollback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from dflash_qaic import contract


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

    def __init__(self, manifest: dict, target, draft, tokenizer=None, backend: str = "ort"):
        self.manifest = manifest
        self.target, self.draft = target, draft
        self.tokenizer = tokenizer
        self.backend = backend
        m = manifest
        self.B = int(m["block_size"])
        self.chunk = int(m["prefill_seq_len"])
        self.ctx_len = int(m["ctx_len"])
        self.H = int(m["hidden_size"])
        self.vocab = int(m["vocab_size"])
        self.mask_id = int(m["mask_token_id"])
        self.eos = list(m.get("eos_token_ids") or [])
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

    # ------------------------------------------------------------------ inputs

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise GenerationError(
                    "a text prompt needs a tokenizer, and these artifacts have none (the target "
                    "directory had no tokenizer files): pass token ids instead"
                )
            prompt = self.tokenizer(prompt)["input_ids"]
        ids = [int(t) for t in np.asarray(prompt, dtype=np.int64).reshape(-1)]
        if not ids:
            raise GenerationError("the prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise GenerationError(
                f"prompt token ids {bad[:5]} are outside the vocabulary 0 … {self.vocab - 1}"
            )
        return ids

    def _check_room(self, n: int, limit: int, what: str) -> None:
        if n > limit:
            raise GenerationError(
                f"the prompt has {n} tokens but {what} allows at most {limit} with ctx_len "
                f"{self.ctx_len}: shorten the prompt or re-export with a larger --ctx-len"
            )

    def _stop_set(self, stop_token_ids) -> set[int]:
        return set(self.eos if stop_token_ids is None else stop_token_ids)

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
            out = clock.call(
                "prefill",
                self.target,
                {contract.INPUT_IDS: self._pre_ids, contract.POSITION_IDS: self._pre_pos},
            )
            if lo + n == P:
                first = int(out[contract.NEXT_TOKENS][0, n - 1])
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

    def _dflash(self, prompt, max_new_tokens, stop_token_ids) -> Iterator[list[int]]:
        ids = self._prompt_ids(prompt)
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be ≥ 1 (got {max_new_tokens})")
        B, P = self.B, len(ids)
        self._check_room(P, self.ctx_len - 1 - B, "DFlash (prompt + one verify block)")
        stop = self._stop_set(stop_token_ids)
        clock = _Clock()
        d0 = self.target.device_s + self.draft.device_s
        t0 = time.perf_counter()

        first, proposals = self._target_prefill(ids, clock, with_draft=True)
        t_first = t0 + clock.total("prefill")
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
            feeds = {contract.INPUT_IDS: self._ver_ids, contract.POSITION_IDS: self._ver_pos}
            out = clock.call("verify", self.target, feeds)
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
            proposals = self._draft_call(
                "draft", clock, feats[: acc + 1], start, B, committed[-1], new_start
            )
            start = new_start

        t_end = time.perf_counter()
        decode_s = t_end - t_dec
        device = self.target.device_s + self.draft.device_s
        n = len(tokens)
        self._result = GenerationResult(
            tokens=tokens,
            acceptance_lengths=lengths,
            stop_reason=reason,
            stats={
                "tau": float(np.mean(lengths)) if lengths else 0.0,
                "steps": len(lengths),
                "ttft_s": t_first - t0,
                "prefill_s": t_dec - t0,
                "decode_s": decode_s,
                "tpot_s": decode_s / n,
                "tokens_per_s": n / decode_s if decode_s > 0 else float("inf"),
                "device_s": device - d_dec,
                "host_s": decode_s - (device - d_dec),
                "bytes_per_step": (clock.bytes.get("verify", 0) + clock.bytes.get("draft", 0))
                / max(len(lengths), 1),
                "prompt_tokens": P,
                "new_tokens": n,
                "prefill_calls": len(clock.times.get("prefill", ())),
                "draft_prefill_calls": len(clock.times.get("draft_prefill", ())),
                "device_s_total": device - d0,
            },
            call_times=clock.times,
        )

    # ------------------------------------------------------------------ target alone

    def _baseline(self, prompt, max_new_tokens, stop_token_ids) -> Iterator[list[int]]:
        ids = self._prompt_ids(prompt)
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be ≥ 1 (got {max_new_tokens})")
        P = len(ids)
        self._check_room(P, contract.max_positions(self.ctx_len) - 1, "the target")
        stop = self._stop_set(stop_token_ids)
        clock = _Clock()
        t0 = time.perf_counter()
        first, _ = self._target_prefill(ids, clock, with_draft=False)
        t_dec = time.perf_counter()
        d_dec = self.target.device_s
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
            feeds = {contract.INPUT_IDS: self._dec_ids, contract.POSITION_IDS: self._dec_pos}
            out = clock.call("decode", self.target, feeds)
            t = int(out[contract.NEXT_TOKENS][0, 0])
            tokens.append(t)
            start += 1
            yield [t]
            if t in stop:
                reason = "stop_token"
        decode_s = time.perf_counter() - t_dec
        n = len(tokens)
        device = self.target.device_s - d_dec
        steps = n - 1
        self._result = GenerationResult(
            tokens=tokens,
            acceptance_lengths=[1] * steps,
            stop_reason=reason,
            stats={
                "tau": 1.0,
                "steps": steps,
                "ttft_s": t_dec - t0,
                "prefill_s": t_dec - t0,
                "decode_s": decode_s,
                "tpot_s": decode_s / n,
                "tokens_per_s": n / decode_s if decode_s > 0 else float("inf"),
                "device_s": device,
                "host_s": decode_s - device,
                "bytes_per_step": clock.bytes.get("decode", 0) / max(steps, 1),
                "prompt_tokens": P,
                "new_tokens": n,
                "prefill_calls": len(clock.times.get("prefill", ())),
                "draft_prefill_calls": 0,
            },
            call_times=clock.times,
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
    ) -> GenerationResult:
        """DFlash greedy generation; token for token the target's own greedy output.

        prompt: token ids, or text when the artifacts carry a tokenizer.
        stop_token_ids: None = the target's EOS ids from the manifest; [] = never stop early.
        on_tokens: called with each run of newly committed tokens, as they are committed.
        """
        return self._drive(self._dflash(prompt, max_new_tokens, stop_token_ids), on_tokens)

    def stream(self, prompt, max_new_tokens: int = 64, stop_token_ids=None) -> Iterator[int]:
        """Yield generated tokens one by one as steps commit them (DFlash)."""
        for chunk in self._dflash(prompt, max_new_tokens, stop_token_ids):
            yield from chunk

    def generate_baseline(
        self,
        prompt: list[int] | str,
        max_new_tokens: int = 64,
        stop_token_ids: list[int] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """The target alone on the decode specialization of the same program; same statistics."""
        return self._drive(self._baseline(prompt, max_new_tokens, stop_token_ids), on_tokens)
