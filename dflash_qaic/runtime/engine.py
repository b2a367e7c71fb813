"""The host loop: one engine steps every sequence in flight (docs/DESIGN.md, Runtime and
Continuous batching; the algorithm is docs/DESIGN.md, Algorithm).

    admit:    a queued request takes a free slot (a cache row)
    prefill:  per prompt chunk (of a prefill length, contract.plan_prefill), at batch 1 into
              the slot's cache row:
                  target(chunk) -> next_tokens, features;  draft(features of the chunk)
              first token = the target's choice at the last prompt row; the last draft call
              also proposes the first block [first, MASK…] -> B−1 proposals
    step:     one verify call over every slot: row r verifies [anchor_r, proposals_r[:n−1]] at
              start_r … start_r+n−1 (n: the verify length, below); acc_r = leading proposals
              equal to the target's choice;
              commit them + 1 target token; then one draft call over the rows that go on
              (features of their acc_r+1 committed rows, block [new anchor, MASK…])
    retire:   a sequence ends on a stop token, max_new_tokens or the context end; its slot is
              free for the next request at the next step

Rows are slots: verify, decode and draft calls have `full_batch_size` rows, row r on cache row r;
a slot without a sequence (or one still in prefill) is an *inactive row*: batch_index -1 and
every position -1, which changes nothing that can be read (contract.py, modeling/ops.py). Every
row has its own positions, acceptance, sampling settings and random numbers, so a request's
tokens never depend on what else is in the batch or when it joined. Artifacts exported without
continuous batching run the same loop with one slot and no `batch_index`.

Verify length: the target has Verify specializations of several lengths (contract.py, default
B/4, B/2, B rows), and each step verifies the first n rows of the block. Row r is expected to
commit E_r(n) = 1 + Σ_{j<n} Π_{i≤j} c_{r,i} tokens, from the draft's confidences c
(contract.DRAFT_CONFIDENCE). A greedy step takes the n with the most expected tokens per second:
Σ_r E_r(n) over the measured cost of a verify call of n rows plus a draft call (running means
kept by the Pipeline; a length not yet timed is assumed to cost its share of the next longer
timed one, so it gets tried). Where a call costs the same at any length (a memory-bound device)
that is B; where rows cost compute (a CPU) unsure steps verify fewer rows. Timings never change
greedy tokens, but at temperature > 0 the proposals a position sees depend on where steps
begin, so a step with a sampled row takes n from the confidences alone (the shortest giving up
less than StepCosts.LOSS expected tokens per row) and a seed still reproduces its tokens. Any n
is lossless: a step commits the accepted proposals and one target token whatever n is.

Admission policy (`prefill_chunks_per_step`): at most that many prefill chunks run between two
steps; None (the default) prefills every waiting prompt before the next step, as QEfficient's
host does. Bounding it bounds how long the sequences in flight wait for a newcomer (their time
per output token), at the cost of the newcomers' time to first token and of steps run with few
rows; `dflash-bench --concurrency` measures both, and on the default pair None won (a prefill
chunk costs less than a step).

Sampling (temperature > 0) is decided inside the target program: row j of a verify block keeps
proposal j+1 with probability p(proposal), else returns a sample from p with the proposal
removed; so "accept while proposal == choice" commits exactly what lossless speculative sampling
commits. The host supplies each row's settings and one pair of uniforms per sampled position,
taken from that request's own table, drawn once from `np.random.default_rng(seed)` and indexed by
the position of the token it decides: a request's tokens depend on its seed only, not on what
shares its calls, when it joined, or the verify lengths chosen (a position's uniforms decide it
once: rows past a rejection are discarded unread, and the lengths depend on the draft only).
A greedy call (no sampling row) takes the specialization that runs the sampler on one row only
(`sample_len`).

No cache is ever reset: a query at position p sees only slots written at positions ≤ p (target)
or < the block start (draft), and every such slot was written by the sequence now in that cache
row, so a new request simply overwrites from position 0 and a rejection needs no rollback.
Per step only ids, positions, settings and committed feature rows cross the host, all in buffers
allocated once here and refilled in place.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import numpy as np

from dflash_qaic import contract

MODES = ("dflash", "baseline")


@dataclass(frozen=True)
class Request:
    """A validated request (see Pipeline for the checks)."""

    ids: list[int]
    max_new_tokens: int
    stop: frozenset[int]
    sampling: object  # runtime.pipeline.Sampling, seed resolved when sampling


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens only, prompt excluded
    acceptance_lengths: list[int]  # tokens committed per step (1 … B); the first token is prefill's
    stats: dict  # tau, ttft_s, tpot_s, tokens_per_s, host_s, device_s, bytes_per_step, …
    stop_reason: str  # "max_new_tokens" | "stop_token" | "ctx_len" | "abort"
    text: str | None = None
    call_times: dict[str, list[float]] = field(default_factory=dict, repr=False)
    #: rows each step verified (its verify length, ≤ B; empty for the target alone): step i
    #: proposed verify_lengths[i] − 1 draft tokens and accepted acceptance_lengths[i] − 1
    verify_lengths: list[int] = field(default_factory=list, repr=False)


class Sequence:
    """One request in the engine: its slot, committed tokens, proposals and statistics."""

    def __init__(self, req: Request, block_size: int):
        self.req = req
        self.slot: int | None = None
        self.tokens: list[int] = []
        self.lengths: list[int] = []  # tokens committed per step
        self.verified: list[int] = []  # rows of each step's verify call (its verify length)
        self.new: list[list[int]] = []  # runs of tokens committed since the caller took them
        self.prefilled = 0  # prompt tokens already in the target's cache
        self.inject: dict | None = None  # prompt features waiting for a DraftPrefill call
        self.pending = 0  # rows of them
        self.start = 0  # position of the anchor (the last committed token)
        self.proposals = np.zeros(block_size - 1, np.int64)
        self.confidence = np.ones(block_size - 1, np.float32)  # the draft's, per proposal
        sp = req.sampling
        # sampling: the uniforms of the token at position len(ids) + i are row i, drawn once
        # from the seed (a step may look B − 1 past the budget; the rows it discards are never
        # used again); None when greedy
        self.uniforms = None
        if not sp.greedy:
            rows = req.max_new_tokens + block_size + 1
            rng = np.random.default_rng(sp.seed)
            self.uniforms = rng.random((rows, contract.N_RANDOM), dtype=np.float32)
        self.reason: str | None = None
        self.times: dict[str, list[float]] = {}
        self.bytes: dict[str, float] = {}
        self.device: dict[str, float] = {}  # seconds inside program runs, by call kind
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


class StepCosts:
    """Running means of a verify call's seconds by length and of a draft call's, and the verify
    length they make best (module docstring). A Pipeline keeps one for all its engines."""

    WEIGHT = 0.2  # of the newest call in the running mean
    LOSS = 0.1  # sampled steps: expected tokens per row a shorter verify may give up

    def __init__(self, warmup_calls: int = 1):
        """warmup_calls: the first calls of each kind and length are not timed (a program's
        first call of a shape sets up its buffers; timed, it would make that length look slow,
        and a length that looks slow is never picked again to correct it)."""
        self.verify_s: dict[int, float] = {}
        self.draft_s: float | None = None
        self.warmup_calls = warmup_calls
        self._seen: collections.Counter = collections.Counter()

    def observe(self, kind: str, seconds: float, n: int = 0) -> None:
        self._seen[kind, n] += 1
        if self._seen[kind, n] <= self.warmup_calls:
            return
        old = self.verify_s.get(n) if kind == "verify" else self.draft_s
        new = seconds if old is None else old + self.WEIGHT * (seconds - old)
        if kind == "verify":
            self.verify_s[n] = new
        else:
            self.draft_s = new

    def best_length(
        self, lengths: list[int], confidences: list[np.ndarray], sampled: bool = False
    ) -> int:
        """The verify length for rows with these confidences. Greedy: the most expected
        committed tokens per second (the longest until a call of it and a draft call have been
        timed). With a sampled row: the shortest that loses less than LOSS expected tokens per
        row, from the confidences alone, so that a seed reproduces its tokens."""
        B = lengths[-1]
        if len(lengths) == 1:
            return B
        # gain[n−1]: expected committed tokens at n rows, 1 + Σ_{j<n} Π_{i≤j} c_i per row
        gain = np.full(B, float(len(confidences)))
        for c in confidences:
            gain[1:] += np.cumsum(np.cumprod(c))
        if sampled:
            return next(n for n in lengths if gain[-1] - gain[n - 1] < self.LOSS * len(confidences))
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


class Engine:
    """Continuous batching over a Pipeline's two programs (module docstring).

    engine.add(request) -> Sequence      queue a request (any number; they wait for a slot)
    engine.step() -> list[Sequence]      admit/prefill, then one step of every sequence in flight;
                                         returns the sequences it touched (seq.take(): new runs)
    engine.abort(seq)                    end a sequence at once ("abort"), freeing its slot
    engine.busy                          sequences queued or in flight
    """

    def __init__(
        self,
        pipe,
        mode: str = "dflash",
        prefill_chunks_per_step: int | None = None,
        max_running: int | None = None,
        costs: StepCosts | None = None,
    ):
        """max_running: at most this many sequences in slots at once (None: every slot); the
        benchmark holds concurrency c with it on a program of more slots. costs: the timings
        that pick verify lengths (a Pipeline passes its own, kept across engines)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if prefill_chunks_per_step is not None and prefill_chunks_per_step < 1:
            raise ValueError("prefill_chunks_per_step must be ≥ 1 or None (no limit)")
        self.pipe, self.mode = pipe, mode
        self.prefill_chunks_per_step = prefill_chunks_per_step
        self.target, self.draft = pipe.target, pipe.draft
        m = pipe.artifacts
        self.cb = m.full_batch_size is not None
        self.N = m.full_batch_size or 1
        self.max_running = min(max_running or self.N, self.N)
        self.B, self.C, self.H = m.block_size, m.prefill_seq_len, m.hidden_size
        plan = m.plan
        self.chunks = list(plan.prefill_lengths)  # ascending, ends at C
        self.draft_rows = list(plan.draft_prefill_rows)  # ascending
        self.ctx_len, self.mask_id = m.ctx_len, m.mask_token_id
        self.can_sample = m.target.io.sampling
        # attention windows (contract.COMP_CTX_LENGTHS): a call reads the smallest one holding
        # every slot it needs, so its cost follows the context, not ctx_len
        self.windows = list(m.comp_ctx_lengths) if m.comp_ctx_lengths else None
        self._window_ids = {n: np.arange(n, dtype=np.int64) for n in self.windows or ()}
        self.rows: list[Sequence | None] = [None] * self.N  # slot -> sequence
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.lengths = list(plan.verify_lengths)  # ends at B
        chosen = pipe.verify_lengths
        if chosen is not None:
            if not set(chosen) <= set(self.lengths) or self.B not in chosen:
                raise ValueError(
                    f"verify_lengths {list(chosen)}: the target has verify lengths "
                    f"{self.lengths}; pick some of them, including the block size {self.B}"
                )
            self.lengths = sorted(set(chosen))
        if not m.draft.io.confidence:  # no confidences: always the whole block
            self.lengths = [self.B]
        self.costs = costs if costs is not None else StepCosts()
        self._sample_len = {
            (n, greedy): plan.sample_len(n, greedy)
            for n in {1, *self.chunks, *self.lengths}
            for greedy in (True, False)
        }
        self._alloc()

    def _alloc(self) -> None:
        """Every per-call host buffer, once: `full` ones have a row per slot, `one` ones are the
        batch-1 prefill calls'."""
        N, B, C, H, z = self.N, self.B, self.C, self.H, np.zeros
        self.full = {
            **{f"ver_ids{n}": z((N, n), np.int64) for n in self.lengths},
            **{f"ver_pos{n}": z((N, n), np.int64) for n in self.lengths},
            "dec_ids": z((N, 1), np.int64),
            "dec_pos": z((N, 1), np.int64),
            "ctx": z((N, B, H), np.float32),
            "ctx_pos": z((N, B), np.int64),
            "blk_ids": np.full((N, B), self.mask_id, np.int64),
            "blk_pos": z((N, B), np.int64),
            "bidx": z((N, 1), np.int64),
            "temperature": z((N,), np.float32),
            "top_k": z((N,), np.int64),
            "top_p": np.ones((N,), np.float32),
        }
        self.one = {
            "ids": z((1, C), np.int64),
            "pos": z((1, C), np.int64),
            "blk_ids": np.full((1, B), self.mask_id, np.int64),
            "blk_pos": z((1, B), np.int64),
            "bidx": z((1, 1), np.int64),
            "temperature": z((1,), np.float32),
            "top_k": z((1,), np.int64),
            "top_p": np.ones((1,), np.float32),
        }
        lens = set(self._sample_len.values())
        self.u_full = {n: z((N, n, contract.N_RANDOM), np.float32) for n in lens}
        self.u_one = {n: z((1, n, contract.N_RANDOM), np.float32) for n in lens}
        self._arange_b = np.arange(B, dtype=np.int64)

    # ------------------------------------------------------------------ public

    def add(self, req: Request) -> Sequence:
        seq = Sequence(req, self.B)
        self.waiting.append(seq)
        return seq

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.rows)

    def abort(self, seq: Sequence) -> None:
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.reason = seq.reason or "abort"
        self._retire(seq)

    def step(self) -> list[Sequence]:
        """Admit and prefill (within the policy's budget), then one verify + draft step (or one
        decode step) over every sequence in flight. Returns the sequences with new tokens."""
        touched: list[Sequence] = []
        self._admit()
        budget = self.prefill_chunks_per_step
        for seq in [s for s in self.rows if s is not None and s.t_dec is None]:
            while seq.t_dec is None and (budget is None or budget > 0):
                self._prefill_chunk(seq)
                budget = None if budget is None else budget - 1
            if seq.t_dec is not None:
                touched.append(seq)  # its first token; it joins this step's verify call
        active = [s for s in self.rows if s is not None and s.decoding]
        if active:
            (self._dflash_step if self.mode == "dflash" else self._decode_step)(active)
            touched += [s for s in active if s not in touched]
        for seq in touched:
            if seq.reason is not None and not seq.finished:
                self._retire(seq)
        return touched

    # ------------------------------------------------------------------ slots

    def _admit(self) -> None:
        running = sum(s is not None for s in self.rows)
        for slot in range(self.N):
            if not self.waiting or running >= self.max_running:
                return
            if self.rows[slot] is None:
                running += 1
                seq = self.waiting.popleft()
                seq.slot = slot
                self.rows[slot] = seq

    def _retire(self, seq: Sequence) -> None:
        if seq.slot is not None and self.rows[seq.slot] is seq:
            self.rows[seq.slot] = None
        seq.result = self._result(seq)

    # ------------------------------------------------------------------ calls

    def _call(self, kind: str, program, feeds: dict, seqs: list[Sequence]) -> dict:
        """One program call, its time and bytes attributed to every sequence in it; a step's
        verify and draft calls also time the verify lengths (StepCosts)."""
        d0, t = program.device_s, time.perf_counter()
        out = program.run(feeds)
        dt, dev = time.perf_counter() - t, program.device_s - d0
        if kind in ("verify", "draft"):
            self.costs.observe(
                kind, dt, feeds[contract.INPUT_IDS].shape[1] if kind == "verify" else 0
            )
        moved = sum(a.nbytes for a in feeds.values()) + sum(a.nbytes for a in out.values())
        for s in seqs:
            s.times.setdefault(kind, []).append(dt)
            s.bytes[kind] = s.bytes.get(kind, 0.0) + moved / len(seqs)
            s.device[kind] = s.device.get(kind, 0.0) + dev
        return out

    def _sampling_feeds(self, buf: dict, u: np.ndarray) -> dict:
        if not self.can_sample:
            return {}
        return {
            contract.TEMPERATURE: buf["temperature"],
            contract.TOP_K: buf["top_k"],
            contract.TOP_P: buf["top_p"],
            contract.RANDOM_U: u,
        }

    def _set_row_sampling(
        self, buf: dict, u: np.ndarray, row: int, seq: Sequence | None, first: int = 0
    ):
        """Row `row`'s settings and uniforms: the sequence's own (call row j decides the token
        at position first + j), or greedy zeros."""
        if not self.can_sample:
            return
        sp = seq.req.sampling if seq is not None else None
        buf["temperature"][row] = sp.temperature if sp else 0.0
        buf["top_k"][row] = sp.top_k if sp else 0
        buf["top_p"][row] = sp.top_p if sp else 1.0
        u[row].fill(0.0)  # rows without a table row (prompt positions) are never read
        if seq is None or seq.uniforms is None:
            return
        t0 = first - len(seq.req.ids)  # the table row of call row 0
        lo, hi = max(0, -t0), min(u.shape[1], len(seq.uniforms) - t0)
        if lo < hi:
            u[row, lo:hi] = seq.uniforms[t0 + lo : t0 + hi]

    def _with_index(self, feeds: dict, bidx: np.ndarray, needed: int) -> dict:
        """Add batch_index (continuous batching) and the attention window holding slots
        0 … needed-1 (every position the call reads)."""
        if self.cb:
            feeds[contract.BATCH_INDEX] = bidx
        if self.windows is not None:
            n = contract.window_for(self.windows, needed)
            feeds[contract.COMP_CTX_LENGTHS] = self._window_ids[n]
        return feeds

    # ------------------------------------------------------------------ prefill

    def _prefill_chunk(self, seq: Sequence) -> None:
        """One prompt chunk of `seq` at batch 1 into its cache row (target, then the draft), of
        the prefill length `contract.plan_prefill` picks for the rest of the prompt."""
        one, ids = self.one, seq.req.ids
        lo, P = seq.prefilled, len(ids)
        L = contract.plan_prefill(P - lo, self.chunks)
        n = min(L, P - lo)
        last = lo + n == P
        chunk_ids, chunk_pos = one["ids"][:, :L], one["pos"][:, :L]  # views: (1, L)
        chunk_ids[0, :n] = ids[lo : lo + n]
        chunk_ids[0, n:] = 0
        chunk_pos[0, :n] = np.arange(lo, lo + n)
        chunk_pos[0, n:] = contract.PAD_POSITION
        one["bidx"][0, 0] = seq.slot
        # only the last chunk's last row is sampled: the chunks before it take the greedy Prefill
        u = self.u_one[self._sample_len[L, seq.uniforms is None or not last]]
        self._set_row_sampling(one, u, 0, seq, lo + 1)
        feeds = {contract.INPUT_IDS: chunk_ids, contract.POSITION_IDS: chunk_pos}
        feeds.update(self._sampling_feeds(one, u))
        feeds = self._with_index(feeds, one["bidx"], lo + n)
        out = self._call("prefill", self.target, feeds, [seq])
        first = int(out[contract.NEXT_TOKENS][0, n - 1]) if last else None
        if last:
            seq.t_first = time.perf_counter()  # the first token exists from here on
        if self.mode == "dflash":
            self._draft_prefill(seq, out[contract.HIDDEN_STATES][0, :n], lo, n, first)
        seq.prefilled = lo + n
        if last:
            seq.t_dec = time.perf_counter()
            seq.start = P
            self._commit(seq, [first])

    def _draft_prefill(self, seq: Sequence, hidden: np.ndarray, lo: int, n: int, first) -> None:
        """Queue a prompt chunk's features (positions lo … lo+n-1) for the draft; one DraftPrefill
        call takes up to D = draft_rows[-1] rows (several target chunks), so the block it also
        runs, wasted on every call but the last, runs ⌈P / D⌉ times, not once per chunk; a call
        takes the smallest DraftPrefill that holds its rows. The last call's block starts at the
        prompt's end: its proposals are the first step's."""
        D = self.draft_rows[-1]
        if seq.inject is None:  # per sequence: prefills of several sequences may interleave
            seq.inject = {
                "ctx": np.zeros((1, D, self.H), np.float32),
                "ctx_pos": np.full((1, D), contract.PAD_POSITION, np.int64),
            }
        ctx, ctx_pos, k = seq.inject["ctx"], seq.inject["ctx_pos"], seq.pending
        ctx[0, k : k + n] = hidden
        ctx_pos[0, k : k + n] = np.arange(lo, lo + n)
        seq.pending = k = k + n
        end, P = lo + n, len(seq.req.ids)
        if first is None and k + min(self.C, P - end) <= D:
            return  # the next chunk still fits
        rows = next(r for r in self.draft_rows if r >= k)  # the smallest that holds them
        ctx_pos[0, k:] = contract.PAD_POSITION
        one = self.one  # its bidx is this sequence's slot (set by _prefill_chunk)
        one["blk_ids"][0, 0] = self.mask_id if first is None else first
        np.add(self._arange_b, end, out=one["blk_pos"][0])
        call = {**one, "ctx": ctx[:, :rows], "ctx_pos": ctx_pos[:, :rows]}
        props, conf = self._draft_call("draft_prefill", call, "ctx", [seq], end)
        seq.pending = 0
        if first is not None:
            seq.inject = None
            seq.proposals[:] = props[0]
            if conf is not None:
                seq.confidence[:] = conf[0]

    def _draft_call(self, kind, buf: dict, ctx: str, seqs: list[Sequence], start: int):
        """The draft over `buf`; its blocks start at `start` at most (the cached slots read).
        Returns the proposals and their confidences (None from drafts without them)."""
        feeds = {
            contract.TARGET_HIDDEN: buf[ctx],
            contract.POSITION_IDS_TARGET: buf["ctx_pos"],
            contract.INPUT_IDS: buf["blk_ids"],
            contract.POSITION_IDS: buf["blk_pos"],
        }
        out = self._call(kind, self.draft, self._with_index(feeds, buf["bidx"], start), seqs)
        return out[contract.DRAFT_TOKENS], out.get(contract.DRAFT_CONFIDENCE)

    # ------------------------------------------------------------------ steps

    def _commit(self, seq: Sequence, committed: list[int], step: bool = False) -> None:
        """Commit tokens (cut at max_new_tokens and at a stop token) and decide whether the
        sequence goes on: stop token, then max_new_tokens, then the context end."""
        req = seq.req
        produced = committed[: req.max_new_tokens - len(seq.tokens)]
        for i, t in enumerate(produced):
            if t in req.stop:
                produced = produced[: i + 1]
                seq.reason = "stop_token"
                break
        seq.tokens += produced
        if produced:
            seq.new.append(produced)
        if step:
            seq.lengths.append(len(produced))
        if seq.reason is None and len(seq.tokens) >= req.max_new_tokens:
            seq.reason = "max_new_tokens"
        rows = self.B if self.mode == "dflash" else 1  # the next call's rows from `start`
        if seq.reason is None and seq.start + rows > contract.max_positions(self.ctx_len):
            seq.reason = "ctx_len"  # positions ≥ ctx_len - 1 have no slot (contract.py)

    def _fill_rows(self, ids: str, pos: str, u: np.ndarray, seqs: list[Sequence], fill) -> None:
        """Per slot: fill(row, seq) for a sequence in `seqs`, else an inactive row."""
        f = self.full
        for r, seq in enumerate(self.rows):
            if seq is not None and seq in seqs:
                fill(r, seq)
                f["bidx"][r, 0] = r
                self._set_row_sampling(f, u, r, seq, seq.start + 1)
            else:
                f[ids][r] = 0
                f[pos][r] = contract.PAD_POSITION
                f["bidx"][r, 0] = contract.INACTIVE_ROW
                self._set_row_sampling(f, u, r, None)

    def _target_step(self, kind: str, ids: str, pos: str, seqs: list[Sequence], fill) -> dict:
        f, rows = self.full, self.full[ids].shape[1]
        greedy = all(s.uniforms is None for s in seqs)
        u = self.u_full[self._sample_len[rows, greedy]]
        self._fill_rows(ids, pos, u, seqs, fill)
        feeds = {contract.INPUT_IDS: f[ids], contract.POSITION_IDS: f[pos]}
        feeds.update(self._sampling_feeds(f, u))
        needed = max(s.start for s in seqs) + rows
        return self._call(kind, self.target, self._with_index(feeds, f["bidx"], needed), seqs)

    def _dflash_step(self, seqs: list[Sequence]) -> None:
        f = self.full
        greedy = all(s.uniforms is None for s in seqs)
        n = self.costs.best_length(self.lengths, [s.confidence for s in seqs], not greedy)
        ids, pos = f"ver_ids{n}", f"ver_pos{n}"

        def fill(r, seq):
            f[ids][r, 0] = seq.tokens[-1]
            f[ids][r, 1:] = seq.proposals[: n - 1]
            np.add(self._arange_b[:n], seq.start, out=f[pos][r])

        for seq in seqs:
            seq.verified.append(n)
        out = self._target_step("verify", ids, pos, seqs, fill)
        choice, feats = out[contract.NEXT_TOKENS], out[contract.HIDDEN_STATES]
        going = []
        for seq in seqs:
            r, props = seq.slot, seq.proposals
            acc = 0
            while acc < n - 1 and props[acc] == choice[r, acc]:
                acc += 1
            committed = [int(t) for t in props[:acc]] + [int(choice[r, acc])]
            start = seq.start
            seq.start = start + acc + 1
            self._commit(seq, committed, step=True)
            if seq.reason is None:  # its committed rows become draft context
                k = acc + 1
                f["ctx"][r, :k] = feats[r, :k]
                np.add(self._arange_b[:k], start, out=f["ctx_pos"][r, :k])
                f["ctx_pos"][r, k:] = contract.PAD_POSITION
                f["blk_ids"][r, 0] = committed[-1]
                np.add(self._arange_b, seq.start, out=f["blk_pos"][r])
                going.append(seq)
        if not going:
            return
        for r, seq in enumerate(self.rows):
            if seq not in going:  # inactive row: writes only a padding slot (contract.py)
                f["ctx_pos"][r] = contract.PAD_POSITION
                f["blk_pos"][r] = contract.PAD_POSITION
                f["bidx"][r, 0] = contract.INACTIVE_ROW
        props, conf = self._draft_call("draft", f, "ctx", going, max(s.start for s in going))
        for seq in going:
            seq.proposals[:] = props[seq.slot]
            if conf is not None:
                seq.confidence[:] = conf[seq.slot]

    def _decode_step(self, seqs: list[Sequence]) -> None:
        f = self.full

        def fill(r, seq):
            f["dec_ids"][r, 0] = seq.tokens[-1]
            f["dec_pos"][r, 0] = seq.start

        out = self._target_step("decode", "dec_ids", "dec_pos", seqs, fill)
        for seq in seqs:
            seq.start += 1
            self._commit(seq, [int(out[contract.NEXT_TOKENS][seq.slot, 0])], step=True)

    # ------------------------------------------------------------------ results

    def _result(self, seq: Sequence) -> GenerationResult:
        """Statistics as the reference measures them: decode time runs from the end of prefill
        (the draft's included) to the end; device time is time inside this sequence's program
        calls (shared calls counted whole), host time the rest of its decode time."""
        now = time.perf_counter()
        t_dec = seq.t_dec if seq.t_dec is not None else now
        decode_s = now - t_dec
        n = len(seq.tokens)
        kinds = ("verify", "draft") if self.mode == "dflash" else ("decode",)
        step_device = sum(seq.device.get(k, 0.0) for k in kinds)
        sp = seq.req.sampling
        steps = len(seq.lengths)
        stats = {
            "tau": float(np.mean(seq.lengths)) if steps else 0.0,
            "steps": steps,
            "verify_rows": float(np.mean(seq.verified)) if seq.verified else None,
            "ttft_s": (seq.t_first or now) - seq.t_arrival,
            "prefill_s": t_dec - seq.t_arrival,
            "decode_s": decode_s,
            "tpot_s": decode_s / n if n else 0.0,
            "tokens_per_s": n / decode_s if decode_s > 0 else float("inf"),
            "device_s": step_device,
            "host_s": decode_s - step_device,
            "bytes_per_step": sum(seq.bytes.get(k, 0.0) for k in kinds) / max(steps, 1),
            "prompt_tokens": len(seq.req.ids),
            "new_tokens": n,
            "prefill_calls": len(seq.times.get("prefill", ())),
            "draft_prefill_calls": len(seq.times.get("draft_prefill", ())),
            "slot": seq.slot,
            "temperature": sp.temperature,
            "top_k": sp.top_k,
            "top_p": sp.top_p,
            "seed": sp.seed,
        }
        return GenerationResult(
            seq.tokens,
            seq.lengths,
            stats,
            seq.reason or "abort",
            call_times=seq.times,
            verify_lengths=seq.verified,
        )
