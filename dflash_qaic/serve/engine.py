"""The engine behind dflash-serve: one worker thread owns the Pipeline; requests wait in a FIFO.

The Pipeline serves one sequence at a time and is not thread-safe, so exactly one thread calls it.
The HTTP side (asyncio) talks to the engine only through this interface, which a
continuous-batching engine can implement in its place:

    handle = engine.submit(prompt_ids, params)   # from the event loop; EngineFull when the queue is
    async for out in handle: ...                 # Output deltas: text, ids, then a finish_reason
    handle.cancel()                              # the generation stops at its next step
    engine.shutdown()                            # cancel everything, stop the worker

Per step the worker turns the committed ids into text (`runtime/streamer.py`: whole characters
only), holds back what could still become a stop string, and hands the delta to the request's
asyncio queue with `call_soon_threadsafe`. A cancellation (client gone, stop string found, server
stopping) is raised from the Pipeline's `on_tokens` callback, which ends `generate` at the next
step; the next request's prefill overwrites the caches from position 0, so nothing needs reset.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from dflash_qaic.runtime.pipeline import GenerationError
from dflash_qaic.runtime.streamer import TextStreamer
from dflash_qaic.serve.metrics import Metrics

log = logging.getLogger("dflash_qaic.serve")


class EngineFull(RuntimeError):
    """The request queue is full."""


class _Abort(Exception):
    """Raised from on_tokens: the request was cancelled."""


class _StopString(Exception):
    """Raised from on_tokens: the text reached a stop string."""


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

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Handle:
    """A submitted request: iterate it (async) for its Outputs; cancel() to stop it."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: Params, loop: asyncio.AbstractEventLoop):
        self.id = next(self._ids)
        self.prompt_ids, self.params = prompt_ids, params
        self.t_arrival = time.perf_counter()
        self._cancelled = threading.Event()
        self._loop = loop
        self._queue: asyncio.Queue[Output] = asyncio.Queue()
        self._done = False

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _put(self, out: Output) -> None:  # worker thread
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
            self.streamer = TextStreamer(tokenizer, skip_special_tokens=skip_special_tokens)
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


@dataclass
class _Run:
    """Bookkeeping of the request being generated."""

    handle: Handle
    text: _Text
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    tokens: int = 0


class Engine:
    """A FIFO of requests served one at a time by a worker thread that owns `pipe`."""

    def __init__(self, pipe, *, max_queue: int = 256, metrics: Metrics | None = None):
        self.pipe = pipe
        self.metrics = metrics or Metrics("dflash", pipe.B)
        self._queue: queue.Queue[Handle | None] = queue.Queue(maxsize=max_queue)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._work, name="dflash-engine", daemon=True)

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def submit(self, prompt_ids: list[int], params: Params) -> Handle:
        """Queue a request (call from the event loop). Raises EngineFull when the queue is full."""
        handle = Handle(prompt_ids, params, asyncio.get_running_loop())
        if self._stopping.is_set():
            raise EngineFull("the server is shutting down")
        self.metrics.waiting.inc()  # before the worker can take it (and decrement)
        try:
            self._queue.put_nowait(handle)
        except queue.Full:
            self.metrics.waiting.dec()
            raise EngineFull(f"the request queue is full ({self._queue.maxsize} waiting)") from None
        return handle

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel the running and queued requests and stop the worker."""
        self._stopping.set()
        while True:
            try:
                h = self._queue.get_nowait()
            except queue.Empty:
                break
            if h is not None:
                self.metrics.waiting.dec()
                self._finish_unstarted(h)
        try:
            self._queue.put_nowait(None)  # wake the worker if it waits
        except queue.Full:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ worker side

    def _work(self) -> None:
        while not self._stopping.is_set():
            h = self._queue.get()
            if h is None:
                break
            self.metrics.waiting.dec()
            if h.cancelled or self._stopping.is_set():
                self._finish_unstarted(h)
                continue
            self.metrics.running.inc()
            try:
                out = self._serve(h)
            finally:
                self.metrics.running.dec()
            h._put(out)  # last, so that a client that sees its answer sees the metrics too

    def _finish_unstarted(self, h: Handle) -> None:
        now = time.perf_counter()
        self.metrics.finished("abort", len(h.prompt_ids), 0, now - h.t_arrival, None, 0.0, 0.0)
        h._put(Output("", [], "abort", prompt_tokens=len(h.prompt_ids)))

    def _on_tokens(self, run: _Run, chunk: list[int]) -> None:
        h = run.handle
        if h.cancelled or self._stopping.is_set():
            raise _Abort
        if run.t_first is None:
            run.t_first = time.perf_counter()  # prefill's token: no verify step
        else:
            self.metrics.step(len(chunk))
        run.tokens += len(chunk)
        delta, hit = run.text.push(chunk)
        h._put(Output(delta, list(chunk), completion_tokens=run.tokens))
        if hit:
            raise _StopString

    def _serve(self, h: Handle) -> Output:
        """Generate one request, streaming its deltas; returns its final Output."""
        p = h.params
        run = _Run(h, _Text(self.pipe.tokenizer, p.stop, p.skip_special_tokens))
        cut = False  # ended by a stop string: the text is already cut, nothing held back counts
        try:
            res = self.pipe.generate(
                h.prompt_ids,
                p.max_tokens,
                list(p.stop_token_ids),
                lambda chunk: self._on_tokens(run, chunk),
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                seed=p.seed,
            )
            reason = "stop" if res.stop_reason == "stop_token" else "length"
        except _StopString:
            reason, cut = "stop", True
        except _Abort:
            reason = "abort"
        except GenerationError as e:  # bad input the HTTP layer did not catch: a 400
            return Output("", [], error=e)
        except Exception as e:  # a backend failure: this request fails, the server lives on
            log.exception("generation failed")
            return Output("", [], error=e)
        tail = "" if cut else run.text.flush()
        t_end = time.perf_counter()
        P, n = len(h.prompt_ids), run.tokens
        ttft = None if run.t_first is None else run.t_first - h.t_arrival
        decode = 0.0 if run.t_first is None else t_end - run.t_first
        queued, e2e = run.t_start - h.t_arrival, t_end - h.t_arrival
        self.metrics.finished(reason, P, n, queued, ttft, decode, e2e)
        return Output(tail, [], reason, prompt_tokens=P, completion_tokens=n)
