"""The HTTP routes of dflash-serve (FastAPI): vLLM's OpenAI-compatible endpoints.

    GET  /health                 200 while the engine's worker lives, else 503 (never needs a key)
    GET  /metrics                Prometheus text (serve/metrics.py)
    GET  /v1/models              the one served model
    POST /v1/completions         prompt (text or ids) -> text; stream=true for server-sent events
    POST /v1/chat/completions    messages -> the chat template -> text; streaming as above

Every request is validated here, before it is queued: a bad one is a 400 (404 for an unknown
model, as vLLM and OpenAI answer; 413 for a body above --max-request-bytes, refused while it is
read) with an OpenAI-style body, and never reaches the engine. A text prompt that cannot fit is
refused from its length alone (serve/limits.py); tokenizing and chat templates run on a small
thread pool, so no request's size holds up the event loop (other clients, /health). A
streamed answer starts once the engine has produced its first token (so a late error is still a
proper status code), then sends one chunk per verify step and `data: [DONE]`. A client that goes
away, while queued or while generating, cancels its request: the worker moves on at the next step.
With an API key (`--api-key`, or `VLLM_API_KEY`, as vLLM) every endpoint but /health answers 401
unless the request carries `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import os
import random
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dflash_qaic import contract
from dflash_qaic.runtime.grammar import MAX_ALTERNATIVES
from dflash_qaic.runtime.pipeline import GenerationError, Sampling
from dflash_qaic.serve import choices, pd
from dflash_qaic.serve import logprobs as lp
from dflash_qaic.serve import protocol as proto
from dflash_qaic.serve.engine import AsyncEngine, EngineFull, Handle, Output, Params
from dflash_qaic.serve.limits import (
    default_max_request_bytes,
    longest_token_chars,
    read_body,
    too_long,
)
from dflash_qaic.serve.metrics import CONTENT_TYPE
from dflash_qaic.serve.protocol import APIError
from dflash_qaic.serve.tools import ToolPlan, ToolStream

log = logging.getLogger("dflash_qaic.serve")

NO_TEMPLATE = (
    "this model's tokenizer has no chat template: use /v1/completions, or start dflash-serve "
    "with --chat-template FILE (a Jinja chat template, as vLLM's --chat-template)"
)


@dataclass
class GrammarLimits:
    """How structured-output constraints are compiled (docs/DESIGN.md, Structured output):
    compile_s, the longest a request waits for its grammar (--max-grammar-compile-s);
    alternatives, the most enum values, choices and branches one may hold (checked before
    compiling, --max-grammar-alternatives); lenient, accept JSON-Schema keywords xgrammar does
    not enforce, with a warning header (--structured-output-lenient)."""

    compile_s: float = 10.0
    alternatives: int = MAX_ALTERNATIVES
    lenient: bool = False


WARNING_HEADER = "X-Structured-Output-Warning"


class ClientGone(Exception):
    """The client went away before its request was queued: nobody to answer (499)."""


class Frontend:
    """Request validation against the served program's limits. Tokenizing runs on a small
    thread pool whose threads each have their own copy of the tokenizer (never one shared across
    threads, nor with the engine's worker thread)."""

    THREADS = 2

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        tokenizer,
        chat_template: str | None,
        max_model_len: int | None = None,
        seed: int | None = None,
        max_request_bytes: int | None = None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
    ):
        pipe = engine.pipe
        self.engine, self.model_name, self.tokenizer = engine, model_name, tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.vocab, self.eos = pipe.vocab, tuple(pipe.eos)
        #: prompt + output, at most (vLLM's max_model_len: the artifacts' positions, or less)
        self.max_model_len = contract.max_positions(pipe.ctx_len)
        if max_model_len is not None:
            self.max_model_len = min(self.max_model_len, max_model_len)
        self.max_prompt = contract.max_prompt(pipe.ctx_len, pipe.B)  # room for one verify block
        self.max_prompt = min(self.max_prompt, self.max_model_len - 1)  # and one output token
        self.can_sample, self.max_top_k = pipe.can_sample, pipe.max_top_k
        #: --seed: seeds of sampling requests that bring none (vLLM's global seed)
        self._seeds = random.Random(seed) if seed is not None else None
        self.log_requests = True  # one info line per request (--disable-log-requests: off)
        self.max_request_bytes = max_request_bytes or default_max_request_bytes(self.max_model_len)
        #: no token is longer than this many characters (None: no bound; serve/limits.py)
        self.chars_per_token = None if tokenizer is None else longest_token_chars(tokenizer)
        self._local = threading.local()
        self.pool = ThreadPoolExecutor(self.THREADS, "dflash-tokenize", self._own_tokenizer)
        #: grammars compile on their own thread, never on the tokenizing pool: a costly one
        #: delays other constrained requests only, never a plain one
        self.compiles = ThreadPoolExecutor(1, "dflash-grammar")
        self.grammar_limits = GrammarLimits()
        #: tool_choice "auto" (vLLM's --enable-auto-tool-choice, --tool-call-parser)
        self.enable_auto_tool_choice, self.tool_call_parser = (
            enable_auto_tool_choice,
            tool_call_parser,
        )
        self.pipe = pipe  # structured output: pipe.grammar (xgrammar is loaded at first use)

    def _own_tokenizer(self) -> None:  # each pool thread, once
        self._local.tokenizer = copy.deepcopy(self.tokenizer)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ------------------------------------------------------------------ prompts

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist: this server serves `{self.model_name}`",
                404,
                "model",
            )

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of a text that could fit (pool thread)."""
        least = too_long(len(text), self.chars_per_token, self.max_prompt)
        if least is not None:
            raise APIError(
                f"the prompt has {len(text)} characters, so at least {least} tokens (no token "
                f"of this model's tokenizer is longer than {self.chars_per_token} characters), "
                f"but this model takes at most {self.max_prompt} (max_model_len "
                f"{self.max_model_len}, less room for the output): shorten the prompt",
                param=param,
            )
        return _encode_text(self._local.tokenizer, text, add_special_tokens)

    def prompt_text(self, prompt, ids: list[int]) -> str:
        """A completion prompt as echo returns it: the text given, else its ids decoded."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(
                "these artifacts have no tokenizer: send the prompt as token ids", param=param
            )

    async def grammar(self, constraint: dict | None, param: str, request: Request | None = None):
        """The compiled grammar of a request's constraint, or None; a 400 naming the field when
        it cannot be honoured, or was not compiled within the limit. Compiles run one at a time
        on their own thread (cached per spec); a compile still queued when its client leaves
        or its time runs out never starts (one under way cannot be interrupted: it finishes
        into the cache, and the alternatives bound keeps it short)."""
        if constraint is None:
            return None
        self._need_tokenizer(param)
        lim = self.grammar_limits
        compile_ = functools.partial(
            self.pipe.grammar, constraint, lenient=lim.lenient, max_alternatives=lim.alternatives
        )
        job = asyncio.get_running_loop().run_in_executor(self.compiles, compile_)
        gone = asyncio.ensure_future(_until_disconnect(request)) if request is not None else None
        try:
            done, _ = await asyncio.wait(
                {job} | ({gone} if gone else set()),
                timeout=lim.compile_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            if gone is not None:
                gone.cancel()
        if job not in done:
            job.cancel()
            if gone is not None and gone in done:
                raise ClientGone
            raise APIError(
                f"the {param} grammar was not compiled within {lim.compile_s:g} s (dflash-serve "
                "--max-grammar-compile-s): simplify it (fewer enum values or branches, a smaller "
                "schema), or raise --max-grammar-compile-s",
                param=param,
            )
        try:
            return job.result()
        except GenerationError as e:
            raise APIError(str(e), param=param) from None

    def allowed(self, req, grammar):
        """vLLM's allowed_token_ids as the request's constraint (beside no other one)."""
        if req.allowed_token_ids is None:
            return grammar
        if grammar is not None:
            raise APIError(
                "allowed_token_ids and a structured-output constraint cannot be combined: give "
                "one of them",
                param="allowed_token_ids",
            )
        try:
            return self.pipe.allowed_tokens(req.allowed_token_ids)
        except GenerationError as e:
            raise APIError(str(e), param="allowed_token_ids") from None

    async def prompt_ids(self, prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    f"dflash-serve takes one prompt per request (got {len(prompt)}): send them "
                    "as separate requests, which are queued",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._need_tokenizer("prompt")
            ids = await self._off_loop(self._encode, prompt, add_special_tokens, "prompt")
        else:
            ids = prompt
        return self._checked(ids, "prompt")

    async def chat_ids(self, req: proto.ChatCompletionRequest, tools=None) -> list[int]:
        if self.tokenizer is None or not (req.chat_template or self.chat_template):
            raise APIError(NO_TEMPLATE, param="messages")
        if not req.messages:
            raise APIError("messages is empty: give at least one message", param="messages")
        ids = await self._off_loop(self._chat_encode, req, tools)
        return self._checked(ids, "messages")

    def _chat_encode(self, req: proto.ChatCompletionRequest, tools) -> list[int]:  # pool thread
        try:
            text = self._local.tokenizer.apply_chat_template(
                [m.for_template() for m in req.messages],
                tools=tools,
                documents=req.documents,
                chat_template=req.chat_template or self.chat_template,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                **(req.chat_template_kwargs or {}),
            )
        except Exception as e:  # a Jinja error raised by the template on these messages
            raise APIError(
                f"the chat template failed on these messages: {e}", param="messages"
            ) from None
        special = bool(req.add_special_tokens)  # the chat endpoint's default: none added
        return self._encode(text, special, "messages")

    def _checked(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError("the prompt is empty: give at least one token", param=param)
        if len(ids) > self.max_prompt:  # first: cheap, and bounds the scan below
            raise APIError(
                f"the prompt has {len(ids)} tokens but this model takes at most {self.max_prompt} "
                f"(max_model_len {self.max_model_len}, less room for the output): shorten the "
                "prompt",
                param=param,
            )
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise APIError(
                f"prompt token ids {bad[:5]} are outside the vocabulary 0 … {self.vocab - 1}",
                param=param,
            )
        return ids

    # ------------------------------------------------------------------ sampling

    def params(
        self, req: proto._Sampling, n_prompt: int, max_tokens: int | None, grammar=None
    ) -> Params:
        room = self.max_model_len - n_prompt
        max_tokens = room if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise APIError(f"max_tokens must be ≥ 1 (got {max_tokens})", param="max_tokens")
        if max_tokens > room:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                f"{max_tokens} in the completion): reduce the prompt or max_tokens",
                param="max_tokens",
            )
        temperature = req.temperature
        if temperature is None:  # OpenAI's default, or greedy when the program cannot sample
            temperature = 1.0 if self.can_sample else 0.0
        top_k = 0 if req.top_k == -1 else req.top_k  # vLLM's -1 = off
        seed = req.seed
        if seed is None and self._seeds is not None and temperature != 0:
            seed = self._seeds.getrandbits(63)  # the server's --seed: reproducible in order
        extra = lp.settings(req, chat=isinstance(req, proto.ChatCompletionRequest))
        extra |= lp.extended(req, self.tokenizer)  # penalties, min_p, logit_bias, …
        sp = _sampling(temperature=temperature, top_k=top_k, top_p=req.top_p, seed=seed, **extra)
        try:  # artifacts exported without --logprobs / --extended-sampling: a 400 naming it
            self.engine.pipe.check_logprobs(sp)
            self.engine.pipe.check_extended(sp)
        except GenerationError as e:
            raise APIError(str(e), param=str(e).split(maxsplit=1)[0].rstrip(":")) from None
        if not sp.greedy and not self.can_sample:
            raise APIError(
                "this model's program cannot sample: use temperature 0", param="temperature"
            )
        if not sp.greedy and sp.top_k > self.max_top_k:
            raise APIError(f"top_k must be ≤ {self.max_top_k} (or 0: off)", param="top_k")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if stop and self.tokenizer is None:
            raise APIError("stop strings need a tokenizer: use stop_token_ids", param="stop")
        ids = tuple(req.stop_token_ids or ())
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise APIError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary 0 … {self.vocab - 1}: give "
                "token ids of this model's tokenizer",
                param="stop_token_ids",
            )
        stop_ids = ids if req.ignore_eos else tuple(dict.fromkeys(ids + self.eos))
        return Params(
            max_tokens,
            stop_ids,
            tuple(s for s in stop if s),
            sp.temperature,
            sp.top_k,
            sp.top_p,
            sp.seed,
            req.skip_special_tokens,
            grammar,
            extra=extra,
            cache_salt=req.cache_salt,
        )


def _encode_text(tok, text: str, add_special_tokens: bool) -> list[int]:
    """tok(text)["input_ids"], through the `tokenizers` backend's encode_batch where there is
    one: unlike encode, it lets go of the GIL while it works, so the event loop runs meanwhile."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _sampling(**fields) -> Sampling:
    """Sampling.checked, its error naming the field at fault as the `param`."""
    try:
        return Sampling.checked(**fields)
    except GenerationError as e:
        param = None
        for name, value in fields.items():  # the one field that fails on its own
            try:
                Sampling.checked(**{name: value})
            except GenerationError:
                param = name
                break
        raise APIError(str(e), param=param) from None


# ---------------------------------------------------------------------- answering


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(coro, request: Request, handle: Handle):
    """Await `coro`, or cancel the request when the client disconnects first (returns None)."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            handle.cancel()
    return work.result() if work in done else None


async def _collect(handle: Handle) -> list[Output]:
    return [out async for out in handle]


def _error_of(out: Output) -> APIError:
    if isinstance(out.error, GenerationError):
        return APIError(str(out.error))
    return APIError(f"generation failed: {type(out.error).__name__}: {out.error}", 500)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _cut(fe: Frontend, out: Output) -> bool:
    """This final Output ended a request the shutdown cut (not its client)."""
    return out.finish_reason == "abort" and fe.engine.stopping


def _cut_error(engine: AsyncEngine | None = None) -> APIError:
    why = (engine.stop_reason if engine is not None else None) or "the server was stopped"
    return APIError(
        f"the server is shutting down and cut this request before it finished ({why}): send "
        "it again once the server is back, or to another one",
        503,
    )


async def _events(fe: Frontend, first: Output, handle: Handle, rid, chat, req, metrics, plan=None):
    """The server-sent events of one streamed answer, from its first Output on. Tool calls
    stream as vLLM streams them (serve/tools.py, ToolStream): each call's first delta carries
    its id and name, its arguments follow as they are generated."""
    created, model, ids = int(time.time()), fe.model_name, req.return_token_ids
    tools = plan is not None and plan.calls_tools
    stream = ToolStream(plan, req.parallel_tool_calls) if tools else None
    offset = 0  # completions' logprobs: the text offset of the next token
    try:
        if chat:
            yield _sse(proto.chunk_body(rid, model, created, chat, text="", role="assistant"))
        out = first
        while True:
            if out.error is not None:
                err = _error_of(out)
                metrics.error(err.status)
                yield _sse(err.body())
                break
            if tools:
                content, deltas = stream.feed(out.text, out.final)
                if content or deltas:
                    yield _sse(
                        proto.chunk_body(
                            rid, model, created, chat, content, tool_calls=deltas or None
                        )
                    )
                if out.final:
                    reason = out.finish_reason
                    if stream.called and reason == "stop":
                        reason = "tool_calls"
                    yield _sse(proto.chunk_body(rid, model, created, chat, None, reason))
            elif out.text or out.final or (ids and out.token_ids):
                reason = out.finish_reason
                toks = out.token_ids if ids else None
                chunk = proto.chunk_body(rid, model, created, chat, out.text, reason, toks)
                offset = lp.add_to_chunk(chunk, fe.tokenizer, req, chat, out, offset)
                yield _sse(chunk)
            if out.final:
                if req.stream_options is not None and req.stream_options.include_usage:
                    use = proto.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
                    yield _sse(proto.usage_chunk(rid, model, created, chat, use))
                break
            out = await handle.__anext__()
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()  # a no-op once finished; stops the generation if the client went away


async def answer(
    fe: Frontend, request: Request, req, ids: list[int], params: Params, chat: bool, plan=None
):
    n = choices.check(fe, req, params, plan, APIError)
    if n > 1:  # one prefill, n choices (serve/choices.py)
        args = (n, _unless_gone, _error_of, APIError)
        return await choices.answer(fe, request, req, ids, params, chat, *args)
    try:
        handle = fe.engine.submit(ids, params)
    except EngineFull as e:
        raise APIError(
            f"{e}: retry later, or start dflash-serve with a larger --max-queue", 503
        ) from None
    rid = proto.request_id("chatcmpl" if chat else "cmpl", req.request_id)
    if fe.log_requests:
        log.info(
            "Received request %s: %d prompt tokens, max_tokens %d, temperature %g, top_p %g, "
            "top_k %d, seed %s, stream %s",
            rid,
            len(ids),
            params.max_tokens,
            params.temperature,
            params.top_p,
            params.top_k,
            params.seed,
            req.stream,
        )
    if req.stream:
        first = await _unless_gone(handle.__anext__(), request, handle)
        if first is None:
            return Response(status_code=499)  # nobody is listening
        if first.error is not None:
            raise _error_of(first)
        if first.final and _cut(fe, first):  # cut while queued: nothing was sent yet
            raise _cut_error(fe.engine)
        created = int(time.time())
        last = proto.chunk_body(rid, fe.model_name, created, chat, "", "abort")
        request.state.sse_tail = (_sse(last) + "data: [DONE]\n\n").encode()  # for the backstop
        events = _events(fe, first, handle, rid, chat, req, fe.engine.metrics, plan)
        return StreamingResponse(events, media_type="text/event-stream", headers=_warned(params))
    outs = await _unless_gone(_collect(handle), request, handle)
    if outs is None:
        return Response(status_code=499)
    last = outs[-1]
    if last.error is not None:
        raise _error_of(last)
    if _cut(fe, last):
        raise _cut_error(fe.engine)
    text = "".join(o.text for o in outs)
    toks = [t for o in outs for t in o.token_ids] if req.return_token_ids else None
    use = proto.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
    reason, calls = last.finish_reason, None
    if plan is not None and plan.calls_tools:
        text, calls = plan.parse(text, req.parallel_tool_calls)
        if calls and reason == "stop":
            reason = "tool_calls"
    body = proto.completion_body(rid, fe.model_name, text, reason, toks, use, chat, calls or None)
    echoed = None if chat or not req.echo else fe.prompt_text(req.prompt, ids)
    lp.add_to_choice(body["choices"][0], fe.tokenizer, req, chat, last.result, echoed)
    if last.payload is not None:  # a prefill role's answer: where the decode side pulls it
        body["kv_transfer_params"] = pd.transfer_params(request, last.payload)
    return JSONResponse(body, headers=_warned(params))


def _warned(params: Params) -> dict | None:
    """The warning header of a leniently compiled schema: what of it is not enforced."""
    warnings = getattr(params.grammar, "warnings", None)
    if not warnings:
        return None
    text = "; ".join(warnings).encode("ascii", "backslashreplace").decode()
    return {WARNING_HEADER: text}


# ---------------------------------------------------------------------- the app


def _error_response(e: APIError, metrics) -> JSONResponse:
    metrics.error(e.status)
    return JSONResponse(e.body(), status_code=e.status)


class _CancelledAtShutdown:
    """ASGI wrapper, the backstop of `Server`'s cut: a request task that uvicorn cancels when its
    own graceful-shutdown timeout runs out still ends with a proper answer, and one log line
    instead of a traceback (its generation stops at the next step). Before the response started:
    a 503 JSON error; in a stream: the final chunk (finish_reason "abort") and `data: [DONE]`,
    as the route left them in the request's state."""

    def __init__(self, app, engine: AsyncEngine | None = None):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        sent = {"start": False, "end": False}

        async def tracked(message):
            if message["type"] == "http.response.start":
                sent["start"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                sent["end"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            log.warning("%s %s cancelled by the shutdown", scope["method"], scope["path"])
            try:
                await _answer_cut(send, sent, state.get("sse_tail"), self.engine)
            except Exception:  # the connection is gone: nobody to tell
                pass


async def _answer_cut(send, sent: dict, sse_tail: bytes | None, engine=None) -> None:
    if not sent["start"]:
        err = _cut_error(engine)
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif not sent["end"] and sse_tail is not None:
        await send({"type": "http.response.body", "body": sse_tail})


class Server(uvicorn.Server):
    """uvicorn's server whose graceful shutdown cuts what still runs after `cut_after` seconds
    (--shutdown-timeout): the engine ends every request (queued ones at once, running ones at
    its next step) and each route answers it properly (a 503 JSON error, or a stream's final
    chunk with finish_reason "abort" and `data: [DONE]`). uvicorn's own timeout, GRACE seconds
    later, is only the backstop (`_CancelledAtShutdown`) for a step that would not end.

    A second signal during the shutdown cuts at once, and the cut requests are told so; a third
    is uvicorn's force exit. `run` always ends with the
    engine's worker joined, however the shutdown went: a worker thread left inside a program
    call when the interpreter exits aborts the process (ONNX Runtime's threads)."""

    GRACE = 10.0
    JOIN_S = 120.0  # the worker ends at its next step; a step that takes longer is a hang

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, cut_after: float):
        config.timeout_graceful_shutdown = cut_after + self.GRACE
        super().__init__(config)
        self.engine, self.cut_after = engine, cut_after
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, sockets=None) -> None:
        try:
            super().run(sockets)
        finally:
            self.engine.shutdown(self.JOIN_S)  # no-op when the lifespan already did it
            if self.engine.worker_alive:
                log.error("the engine did not stop within %g s: exiting now", self.JOIN_S)
                logging.shutdown()
                os._exit(1)  # not through the interpreter's exit, which would abort

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def shutdown(self, sockets=None) -> None:
        reason = f"its --shutdown-timeout of {self.cut_after:g} s ran out"
        timer = asyncio.get_running_loop().call_later(self.cut_after, self._cut, reason)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def handle_exit(self, sig: int, frame) -> None:
        """The first signal starts the graceful shutdown; a second one cuts every request now
        (each ends at the engine's next step with its answer, so the shutdown then completes
        as usual, lifespan included); only a third is uvicorn's force exit."""
        if self.should_exit and self._loop is not None and not self.engine.stopping:
            name = signal.Signals(sig).name
            reason = f"a second signal, {name}, stopped the server at once"
            self.engine.stop_reason = self.engine.stop_reason or reason  # for the backstop too
            self._loop.call_soon_threadsafe(self._cut, reason)  # safe from a signal handler
            return
        super().handle_exit(sig, frame)

    def _cut(self, reason: str) -> None:
        if self.engine.stopping:
            return
        log.warning("cutting the requests left: %s", reason)
        self.engine.stop(reason)


class _ApiKey:
    """ASGI wrapper: with a key, every HTTP request but GET /health needs
    `Authorization: Bearer KEY` (vLLM's --api-key); others get a 401 with an OpenAI-style body."""

    def __init__(self, app, key: str, metrics):
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        self.metrics.error(401)
        body = {
            "error": {
                "message": "Unauthorized: this server needs an API key (Authorization: Bearer KEY)",
                "type": "AuthenticationError",
                "param": None,
                "code": 401,
            }
        }
        response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def create_app(
    engine: AsyncEngine,
    model_name: str,
    tokenizer=None,
    chat_template: str | None = None,
    *,
    api_key: str | None = None,
    max_model_len: int | None = None,
    seed: int | None = None,
    log_requests: bool = True,
    max_request_bytes: int | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    grammar_limits: GrammarLimits | None = None,
    role: str = "both",
    pd_config: pd.Config | None = None,
) -> FastAPI:
    """The FastAPI app over a (not yet started) engine; the app's lifespan starts and stops it.
    api_key: required on every endpoint but /health (None: no authentication); max_model_len:
    caps prompt + output below the artifacts' positions; seed: seeds the sampling requests that
    bring no seed; log_requests: one info line per request; max_request_bytes: the body limit
    (None: serve/limits.py's default); enable_auto_tool_choice, tool_call_parser: tool_choice
    "auto" and how replies are parsed for calls (serve/tools.py); grammar_limits: how
    structured-output constraints are compiled (GrammarLimits); role, pd_config: prefill/decode
    disaggregation (serve/pd.py: pd.Config, which role alone stands for)."""
    fe = Frontend(
        engine,
        model_name,
        tokenizer,
        chat_template,
        max_model_len,
        seed,
        max_request_bytes,
        enable_auto_tool_choice,
        tool_call_parser,
    )
    fe.log_requests = log_requests
    fe.grammar_limits = grammar_limits or GrammarLimits()
    app = FastAPI(
        title="dflash-serve", lifespan=_lifespan(engine, fe), docs_url=None, redoc_url=None
    )
    app.add_middleware(_CancelledAtShutdown, engine=engine)
    if api_key:
        app.add_middleware(_ApiKey, key=api_key, metrics=engine.metrics)
    app.state.frontend = fe
    pd.setup(app, engine, api_key, pd_config or pd.Config(role))
    _add_error_handlers(app, engine.metrics)
    _add_info_routes(app, fe, model_name)
    app.add_api_route("/v1/completions", _completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", _chat_completions, methods=["POST"])
    return app


def _lifespan(engine: AsyncEngine, fe: Frontend):
    """The app's lifespan: the engine runs while the app does."""

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()
        fe.pool.shutdown(wait=False, cancel_futures=True)
        fe.compiles.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _add_error_handlers(app: FastAPI, metrics) -> None:
    """Every error answers in OpenAI's JSON form (and is counted)."""

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e, metrics)

    @app.exception_handler(ClientGone)
    async def _gone(request, e: ClientGone):
        return Response(status_code=499)  # nobody is listening

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return _error_response(
            APIError(f"{e.detail}: {request.method} {request.url.path}", e.status_code), metrics
        )

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        return _error_response(APIError(f"internal error: {type(e).__name__}: {e}", 500), metrics)


def _add_info_routes(app: FastAPI, fe: Frontend, model_name: str) -> None:
    """/health, /metrics (Prometheus) and /v1/models."""
    engine, metrics = fe.engine, fe.engine.metrics

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "dflash-qaic",
            "root": model_name,
            "max_model_len": fe.max_model_len,
        }
        return {"object": "list", "data": [card]}


async def _completions(request: Request):
    """POST /v1/completions."""
    fe: Frontend = request.app.state.frontend
    req = proto.parse(proto.CompletionRequest, await read_body(request, fe.max_request_bytes))
    fe.check_model(req.model)
    constraint = req.constraint()
    special = True if req.add_special_tokens is None else req.add_special_tokens
    ids = await fe.prompt_ids(req.prompt, special)
    grammar = fe.allowed(req, await fe.grammar(constraint, "response_format", request))
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    params = await pd.prepare(fe, request, req, fe.params(req, len(ids), max_tokens, grammar), ids)
    return await answer(fe, request, req, ids, params, chat=False)


async def _chat_completions(request: Request):
    """POST /v1/chat/completions (tool calls: serve/tools.py)."""
    fe: Frontend = request.app.state.frontend
    req = proto.parse(proto.ChatCompletionRequest, await read_body(request, fe.max_request_bytes))
    fe.check_model(req.model)
    plan = ToolPlan(req, fe.enable_auto_tool_choice, fe.tool_call_parser)
    constraint = req.constraint()
    if plan.constraint is not None:
        if constraint is not None:
            raise APIError(
                f"tool_choice {req.tool_choice!r} constrains the output itself: leave "
                "response_format (and structured_outputs) out",
                param="tool_choice",
            )
        constraint = plan.constraint
    ids = await fe.chat_ids(req, plan.tools)
    param = "tool_choice" if plan.constraint is not None else "response_format"
    grammar = fe.allowed(req, await fe.grammar(constraint, param, request))
    params = await pd.prepare(fe, request, req, fe.params(req, len(ids), req.max_new, grammar), ids)
    return await answer(fe, request, req, ids, params, chat=True, plan=plan)
