"""The engine behind dflash-serve: one worker thread drives one continuous-batching engine
(`runtime/engine.py`); requests wait in a bounded FIFO until a slot is free.

The runtime engine is not thread-safe, so exactly one thread calls it. The HTTP side (asyncio)
talks to it only through this interface:

    handle = engine.submit(prompt_ids, params)   # from the event loop; EngineFull when the queue is
    async for out in handle: ...                 # Output deltas: text, ids, then a finish_reason
    handle.cancel()                              # the request leaves the batch at the next step
    engine.shutdown()                            # cancel everything, stop the worker

The worker loop: take submissions while a slot is free (blocking only when nothing is in
flight), validate each with `pipe.request` and `add` it; one `step()` (prefill chunks of the
newcomers, then one verify + draft call over every sequence in flight); for each sequence the
step touched, turn its new runs of tokens into text (`runtime/streamer.py`: whole characters
only), hold back what could still become a stop string, and hand one delta per run to the
request's asyncio queue with `call_soon_threadsafe`. A sequence leaves its slot when it finishes
(stop token, max_tokens, context end), when its text reaches a stop string, or when its handle is
cancelled (client gone, server stopping): `abort(seq)` frees the slot for the next request at the
next step. A program call that fails ends only the requests in that call (an error Output: HTTP
500); the others go on. With artifacts exported without `--full-batch-size` there is one slot, so requests
run one at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

from dflash_qaic.runtime import handoff
from dflash_qaic.runtime.pipeline import GenerationError
from dflash_qaic.runtime.streamer import IncrementalDetokenizer
from dflash_qaic.serve.metrics import Metrics

log = logging.getLogger("dflash_qaic.serve")


class EngineFull(RuntimeError):
    """The request queue is full."""


@dataclass(frozen=True)
class Params:
    """What to generate for one request (validated by the HTTP layer)."""

    max_tokens: int
    stop_token_ids: tuple[int, ...]  # the whole stop set (EOS included unless ignore_eos)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    skip_special_tokens: bool = True
    grammar: object = None  # runtime.grammar.Grammar: structured output (None: unconstrained)
    # prefill/decode roles (serve/pd.py): prefill only and hand the payload back, or admit
    # with a payload prefilled elsewhere
    export_only: bool = False
    handoff: object = None  # the payload checked off the engine thread (a state.SlotState)
    # further settings as Pipeline.request takes them (logprobs, prompt_logprobs)
    extra: dict | None = None
    cache_salt: str | None = None  # prefix caching: only requests of one salt share state


@dataclass
class Output:
    """One delta of a request. The last one has finish_reason ("stop" | "length" | "abort") or
    error set, and the totals."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: Exception | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    payload: bytes | None = None  # a prefill role's hand-off payload (serve/pd.py)
    logprobs: object = None  # these tokens' logprobs (runtime/logprobs.py), when asked for
    result: object = None  # the last one's: the GenerationResult (prompt logprobs)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (the final Output's)

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Handle:
    """A submitted request: iterate it (async) for its Outputs; cancel() to stop it."""

    _ids = itertools.count()

    def __init__(
        self, prompt_ids: list[int], params: Params, loop: asyncio.AbstractEventLoop, on_final=None
    ):
        self.id = next(self._ids)
        self.prompt_ids, self.params = prompt_ids, params
        self.t_arrival = time.perf_counter()
        self._cancelled = threading.Event()
        self._loop = loop
        self._queue: asyncio.Queue[Output] = asyncio.Queue()
        self._done = False
        self._on_final = on_final  # called once, with the final Output (the engine's count)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _put(self, out: Output) -> None:  # worker thread
        if out.final and self._on_final is not None:
            self._on_final, on_final = None, self._on_final
            on_final()
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> Output:
        if self._done:
            raise StopAsyncIteration
        out = await self._queue.get()
        self._done = out.final
        return out


class _Text:
    """Detokenised text of one request with stop strings: release only what cannot be the start
    of a stop string (hold back len(longest) − 1 characters) and cut at the first stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...], skip_special_tokens: bool):
        self.streamer = None
        if tokenizer is not None:
            self.streamer = IncrementalDetokenizer(
                tokenizer, skip_special_tokens=skip_special_tokens
            )
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters released

    def _release(self, final: bool) -> tuple[str, bool]:
        # no stop string starts before `sent` (they would have been seen whole): search from there
        hits = [i for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            cut = min(hits)
            delta, self.text, self.sent = self.text[self.sent : cut], self.text[:cut], cut
            return delta, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta, False

    def push(self, ids) -> tuple[str, bool]:
        if self.streamer is None:
            return "", False
        self.text += self.streamer.push(ids)
        return self._release(final=False)

    def flush(self) -> str:
        if self.streamer is None:
            return ""
        self.text += self.streamer.flush()
        return self._release(final=True)[0]


class _Run:
    """Bookkeeping of one request in the runtime engine."""

    def __init__(self, handle: Handle, seq, tokenizer):
        p = handle.params
        self.handle, self.seq = handle, seq
        self.text = _Text(tokenizer, p.stop, p.skip_special_tokens)
        self.t_added = time.perf_counter()
        self.t_output: float | None = None  # when the last output went out (inter-token latency)
        self.tokens = 0  # tokens sent to the client
        self.cut = False  # ended by a stop string: the text is cut, nothing held back counts


_REASONS = {"stop_token": "stop", "max_new_tokens": "length", "ctx_len": "length"}


class AsyncEngine:
    """Requests served by a worker thread that owns one continuous-batching engine of `pipe`:
    up to `pipe.full_batch_size` at once (`pipe.max_running`, vLLM's --max-num-seqs, lowers
    that), up to `max_queue` more waiting in a FIFO.

    Admission counts the requests in the engine (queued or in a slot, until their final Output),
    not the FIFO's length: a burst is accepted up to slots + max_queue even before the worker
    has moved the first ones into their slots."""

    def __init__(self, pipe, *, max_queue: int = 256, metrics: Metrics | None = None):
        self.pipe = pipe
        self.slots = min(pipe.max_running or pipe.full_batch_size, pipe.full_batch_size)
        self._context = pipe.full_batch_size * pipe.ctx_len  # KV positions of all the slots
        self.max_queue = max_queue
        self.metrics = metrics or Metrics("dflash", pipe.B)
        self._queue: queue.Queue[Handle | None] = queue.Queue()  # bounded by the count below
        self._count_lock = threading.Lock()
        self._in_engine = 0  # requests accepted and not yet given their final Output
        self._stopping = threading.Event()
        self.stop_reason: str | None = None  # why stop() was called (the cut requests' answers)
        self._thread = threading.Thread(target=self._work, name="dflash-engine", daemon=True)
        self._live: list[_Run] = []  # requests in the runtime engine (worker thread only)

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def worker_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """stop() was called: what is still in the engine is being cut."""
        return self._stopping.is_set()

    def submit(self, prompt_ids: list[int], params: Params) -> Handle:
        """Queue a request (call from the event loop). Raises EngineFull when slots + max_queue
        requests are already in the engine."""
        if self._stopping.is_set():
            raise EngineFull("the server is shutting down")
        with self._count_lock:
            if self._in_engine >= self.slots + self.max_queue:
                raise EngineFull(f"the request queue is full ({self.max_queue} waiting)")
            self._in_engine += 1
        handle = Handle(prompt_ids, params, asyncio.get_running_loop(), self._left)
        self.metrics.waiting.inc()  # before the worker can take it (and decrement)
        self._queue.put_nowait(handle)
        return handle

    def submit_choices(self, prompt_ids: list[int], params: Params, n: int) -> list[Handle]:
        """Queue one request's n choices (serve/choices.py): n handles admitted together, the
        prompt prefilled once. Raises EngineFull as submit does."""
        if self._stopping.is_set():
            raise EngineFull("the server is shutting down")
        with self._count_lock:
            if self._in_engine + n > self.slots + self.max_queue:
                raise EngineFull(f"the request queue is full ({self.max_queue} waiting)")
            self._in_engine += n
        loop = asyncio.get_running_loop()
        handles = tuple(Handle(prompt_ids, params, loop, self._left) for _ in range(n))
        self.metrics.waiting.inc()
        self._queue.put_nowait(handles)
        return list(handles)

    def _left(self) -> None:  # a request got its final Output (any thread)
        with self._count_lock:
            self._in_engine -= 1

    def stop(self, reason: str | None = None) -> None:
        """Cut everything without waiting: queued requests end now, running ones at the worker's
        next step (each with finish_reason "abort"); new submissions are refused. `reason`:
        why, for the answers of the requests cut (the first one given stays)."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self._stopping.set()
        while True:
            try:
                h = self._queue.get_nowait()
            except queue.Empty:
                break
            if h is not None:
                self.metrics.waiting.dec()
                for one in h if isinstance(h, tuple) else (h,):
                    self._finish_unstarted(one)
        self._queue.put_nowait(None)  # wake the worker if it waits

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel the running and queued requests and stop the worker (waits up to `timeout`)."""
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ worker side

    def _work(self) -> None:
        core = self.pipe.engine("dflash")
        while not self._stopping.is_set():
            if not self._admit(core):
                break
            if not core.busy:
                continue
            try:
                touched = core.step()
            except Exception as e:  # the engine itself failed (a failed program call fails only
                log.exception("generation failed")  # its requests, in step()): all in flight do
                for run in list(self._live):
                    self._fail(run, e)
                if getattr(self.pipe, "prefix_cache", None) is not None:  # rows unknown now
                    self.pipe.prefix_cache.clear()
                self._kv_usage()
                core = self.pipe.engine("dflash")
                continue
            runs = {id(r.seq): r for r in self._live}
            now, tokens = time.perf_counter(), 0
            for seq in touched:
                tokens += self._emit(core, runs[id(seq)], now)
            if touched:
                self.metrics.iteration(tokens)
            for run in [r for r in self._live if r.handle.cancelled]:
                core.abort(run.seq)  # client gone: its slot is free for the next step
                self._finish(run)
            self._kv_usage()
        for run in list(self._live):  # the server stops: what is left ends now
            core.abort(run.seq)
            self._finish(run)
        self._kv_usage()

    def _admit(self, core) -> bool:
        """Move submissions into free slots: wait for one while nothing is in flight, else take
        only what is already queued. Returns False when the worker must stop."""
        while len(self._live) < self.slots:
            try:
                h = self._queue.get(block=not self._live)
            except queue.Empty:
                return True
            if h is None:
                return False
            self.metrics.waiting.dec()
            if isinstance(h, tuple):  # n > 1: the choices of one request
                self._admit_choices(core, h)
                continue
            if h.cancelled or self._stopping.is_set():
                self._finish_unstarted(h)
                continue
            req = self._request(h)
            if req is None:
                continue
            p = h.params
            if p.export_only or p.handoff is not None:
                seq = self._handoff(core, h, req)
                if seq is None:
                    continue
            else:
                seq = core.add(req)
            self._live.append(_Run(h, seq, self.pipe.tokenizer))
            self.metrics.running_now(len(self._live))
        return True

    def _admit_choices(self, core, handles: tuple) -> None:
        """n choices into the engine at once (runtime/engine.py, add_choices)."""
        h = handles[0]
        if any(x.cancelled for x in handles) or self._stopping.is_set():
            for x in handles:
                self._finish_unstarted(x)
            return
        req = self._request(h)  # None: refused, h has its error
        if req is not None:
            try:
                seqs = core.add_choices(req, len(handles))
            except ValueError as e:
                h._put(Output("", [], error=GenerationError(str(e))))
                req = None
        if req is None:  # every other choice ends too
            for x in handles[1:]:
                x._put(Output("", [], error=GenerationError("the request was refused")))
            return
        for x, seq in zip(handles, seqs, strict=True):
            self._live.append(_Run(x, seq, self.pipe.tokenizer))
        self.metrics.running_now(len(self._live))

    def _request(self, h: Handle):
        """The runtime request of a handle (None: refused, its error Output sent)."""
        p = h.params
        try:
            req = self.pipe.request(
                h.prompt_ids,
                p.max_tokens,
                list(p.stop_token_ids),
                "dflash",
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                seed=p.seed,
                grammar=p.grammar,
                **(p.extra or {}),
            )
        except GenerationError as e:  # bad input the HTTP layer did not catch: a 400
            h._put(Output("", [], error=e))
            return None
        if p.cache_salt is not None:
            req = dataclasses.replace(req, cache_salt=p.cache_salt)
        return req

    def _handoff(self, core, h: Handle, req):
        """A prefill role's request: its payload exported now, between two steps, and its final
        Output (None returned); a decode role's: queued with its payload (its Sequence)."""
        m, P = self.pipe.artifacts, len(h.prompt_ids)
        try:
            if h.params.handoff is not None:
                return handoff.admit(core, m, req, h.params.handoff)
            payload = handoff.export(core, m, h.prompt_ids)
        except Exception as e:  # refused or failed: this request alone ends
            h._put(Output("", [], error=GenerationError(str(e))))
            return None
        self.metrics.kv_transfer(len(payload))
        h._put(Output("", [], "length", prompt_tokens=P, payload=payload))
        return None

    def _emit(self, core, run: _Run, now: float) -> int:
        """Send the new runs of a sequence the step touched; end it at a stop string or when it
        finished. Returns the tokens the step processed for it (its prompt's too when this step
        finished its prefill)."""
        h = run.handle
        runs = run.seq.take()
        tokens = sum(len(ids) for ids in runs)
        if runs:
            if run.t_output is None:
                tokens += len(h.prompt_ids)  # its first output: the prefill finished here
            else:
                self.metrics.output_interval(now - run.t_output)
            run.t_output = now
        for ids in runs:
            if run.cut:
                break
            run.tokens += len(ids)
            delta, run.cut = run.text.push(ids)
            lp = run.seq.logprobs and run.seq.logprobs.span(run.tokens - len(ids), run.tokens)
            h._put(Output(delta, list(ids), completion_tokens=run.tokens, logprobs=lp))
        if run.cut:
            core.abort(run.seq)
        if run.seq.error is not None:  # a call of its own failed: it alone ends (HTTP 500)
            self._fail(run, run.seq.error)
        elif run.seq.finished:
            self._finish(run)
        return tokens

    def _kv_usage(self) -> None:
        held = sum(len(r.handle.prompt_ids) + r.tokens for r in self._live)
        self.metrics.kv_cache_usage.set(held / self._context)
        cache = getattr(self.pipe, "prefix_cache", None)
        self.metrics.prefix_host_bytes.set(0 if cache is None else cache.host_bytes)

    def _finish(self, run: _Run) -> None:
        """The final Output of a finished sequence, after its metrics."""
        res, h = run.seq.result, run.handle
        reason = "stop" if run.cut else _REASONS.get(res.stop_reason, "abort")
        tail = "" if run.cut else run.text.flush()
        self._live.remove(run)
        self.metrics.running_now(len(self._live))
        verified = res.verify_lengths or [None] * len(res.acceptance_lengths)
        for n, v in zip(res.acceptance_lengths, verified):
            self.metrics.step(n, v)
        st, P, n = res.stats, len(h.prompt_ids), run.tokens
        queued = run.t_added - h.t_arrival
        ttft = queued + st["ttft_s"] if n else None
        e2e = time.perf_counter() - h.t_arrival
        self.metrics.finished(reason, P, n, queued, ttft, st["decode_s"], e2e)
        cached = run.seq.cached
        self.metrics.prefix_cache(P, cached)
        h._put(
            Output(
                tail,
                [],
                reason,
                prompt_tokens=P,
                completion_tokens=n,
                cached_tokens=cached,
                result=res,
            )
        )

    def _fail(self, run: _Run, e: Exception) -> None:
        self._live.remove(run)
        self.metrics.running_now(len(self._live))
        run.handle._put(Output("", [], error=e))

    def _finish_unstarted(self, h: Handle) -> None:
        now = time.perf_counter()
        self.metrics.finished("abort", len(h.prompt_ids), 0, now - h.t_arrival, None, 0.0, 0.0)
        h._put(Output("", [], "abort", prompt_tokens=len(h.prompt_ids)))
