"""The HTTP routes of dflash-serve (FastAPI): vLLM's OpenAI-compatible endpoints.

    GET  /health                 200 while the engine's worker lives, else 503 (never needs a key)
    GET  /metrics                Prometheus text (serve/metrics.py)
    GET  /v1/models              the one served model
    POST /v1/completions         prompt (text or ids) -> text; stream=true for server-sent events
    POST /v1/chat/completions    messages -> the chat template -> text; streaming as above

Every request is validated here, before it is queued: a bad one is a 400 (404 for an unknown
model, as vLLM and OpenAI answer) with an OpenAI-style body, and never reaches the engine. A
streamed answer starts once the engine has produced its first token (so a late error is still a
proper status code), then sends one chunk per verify step and `data: [DONE]`. A client that goes
away, while queued or while generating, cancels its request: the worker moves on at the next step.
With an API key (`--api-key`, or `VLLM_API_KEY`, as vLLM) every endpoint but /health answers 401
unless the request carries `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dflash_qaic import contract
from dflash_qaic.runtime.pipeline import GenerationError, Sampling
from dflash_qaic.serve import protocol as proto
from dflash_qaic.serve.engine import Engine, EngineFull, Handle, Output, Params
from dflash_qaic.serve.metrics import CONTENT_TYPE
from dflash_qaic.serve.protocol import APIError

log = logging.getLogger("dflash_qaic.serve")

NO_TEMPLATE = (
    "this model's tokenizer has no chat template: use /v1/completions, or start dflash-serve "
    "with --chat-template FILE (a Jinja chat template, as vLLM's --chat-template)"
)


class Frontend:
    """Request validation against the served program's limits (event-loop side; it has its own
    tokenizer instance, so it never shares one with the engine's worker thread)."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        tokenizer,
        chat_template: str | None,
        max_model_len: int | None = None,
        seed: int | None = None,
    ):
        pipe = engine.pipe
        self.engine, self.model_name, self.tokenizer = engine, model_name, tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.vocab, self.eos = pipe.vocab, tuple(pipe.eos)
        #: prompt + output, at most (vLLM's max_model_len: the artifacts' positions, or less)
        self.max_model_len = contract.max_positions(pipe.ctx_len)
        if max_model_len is not None:
            self.max_model_len = min(self.max_model_len, max_model_len)
        self.max_prompt = pipe.ctx_len - 1 - pipe.B  # room for one verify block (Pipeline)
        self.max_prompt = min(self.max_prompt, self.max_model_len - 1)  # and one output token
        self.can_sample, self.max_top_k = pipe.can_sample, pipe.max_top_k
        #: --seed: seeds of sampling requests that bring none (vLLM's global seed)
        self._seeds = random.Random(seed) if seed is not None else None
        self.log_requests = True  # one info line per request (--disable-log-requests: off)

    # ------------------------------------------------------------------ prompts

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist: this server serves `{self.model_name}`",
                404,
                "model",
            )

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(
                "these artifacts have no tokenizer: send the prompt as token ids", param=param
            )
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    f"dflash-serve takes one prompt per request (got {len(prompt)}): send them "
                    "as separate requests, which are queued",
                    param="prompt",
                )
            prompt = prompt[0]
        ids = self._encode(prompt, True, "prompt") if isinstance(prompt, str) else prompt
        return self._checked(ids, "prompt")

    def chat_ids(self, req: proto.ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or not self.chat_template:
            raise APIError(NO_TEMPLATE, param="messages")
        if not req.messages:
            raise APIError("messages is empty: give at least one message", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                [m.for_template() for m in req.messages],
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
            )
        except Exception as e:  # a Jinja error raised by the template on these messages
            raise APIError(
                f"the chat template failed on these messages: {e}", param="messages"
            ) from None
        return self._checked(self._encode(text, False, "messages"), "messages")

    def _checked(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError("the prompt is empty: give at least one token", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise APIError(
                f"prompt token ids {bad[:5]} are outside the vocabulary 0 … {self.vocab - 1}",
                param=param,
            )
        if len(ids) > self.max_prompt:
            raise APIError(
                f"the prompt has {len(ids)} tokens but this model takes at most {self.max_prompt} "
                f"(max_model_len {self.max_model_len}, less room for the output): shorten the "
                "prompt",
                param=param,
            )
        return ids

    # ------------------------------------------------------------------ sampling

    def params(self, req: proto._Sampling, n_prompt: int, max_tokens: int | None) -> Params:
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
        try:
            sp = Sampling.checked(temperature, top_k, req.top_p, seed)
        except GenerationError as e:
            raise APIError(str(e)) from None
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
        )


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


async def _events(fe: Frontend, first: Output, handle: Handle, rid, chat, req, metrics):
    """The server-sent events of one streamed answer, from its first Output on."""
    created, model, ids = int(time.time()), fe.model_name, req.return_token_ids
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
            if out.text or out.final or (ids and out.token_ids):
                reason = out.finish_reason
                toks = out.token_ids if ids else None
                yield _sse(proto.chunk_body(rid, model, created, chat, out.text, reason, toks))
            if out.final:
                if req.stream_options is not None and req.stream_options.include_usage:
                    use = proto.usage(out.prompt_tokens, out.completion_tokens)
                    yield _sse(proto.usage_chunk(rid, model, created, chat, use))
                break
            out = await handle.__anext__()
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()  # a no-op once finished; stops the generation if the client went away


async def answer(fe: Frontend, request: Request, req, ids: list[int], params: Params, chat: bool):
    try:
        handle = fe.engine.submit(ids, params)
    except EngineFull as e:
        raise APIError(
            f"{e}: retry later, or start dflash-serve with a larger --max-queue", 503
        ) from None
    rid = proto.request_id("chatcmpl" if chat else "cmpl")
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
        events = _events(fe, first, handle, rid, chat, req, fe.engine.metrics)
        return StreamingResponse(events, media_type="text/event-stream")
    outs = await _unless_gone(_collect(handle), request, handle)
    if outs is None:
        return Response(status_code=499)
    last = outs[-1]
    if last.error is not None:
        raise _error_of(last)
    text = "".join(o.text for o in outs)
    toks = [t for o in outs for t in o.token_ids] if req.return_token_ids else None
    use = proto.usage(last.prompt_tokens, last.completion_tokens)
    body = proto.completion_body(rid, fe.model_name, text, last.finish_reason, toks, use, chat)
    return JSONResponse(body)


# ---------------------------------------------------------------------- the app


def _error_response(e: APIError, metrics) -> JSONResponse:
    metrics.error(e.status)
    return JSONResponse(e.body(), status_code=e.status)


class _CancelledAtShutdown:
    """ASGI wrapper: a request task that uvicorn cancels when the graceful-shutdown timeout runs
    out ends with one log line instead of a traceback (its generation stops at the next step)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if scope["type"] != "http":
                raise
            log.warning("%s %s cancelled by the shutdown", scope["method"], scope["path"])


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
    engine: Engine,
    model_name: str,
    tokenizer=None,
    chat_template: str | None = None,
    *,
    api_key: str | None = None,
    max_model_len: int | None = None,
    seed: int | None = None,
    log_requests: bool = True,
) -> FastAPI:
    """The FastAPI app over a (not yet started) engine; the app's lifespan starts and stops it.
    api_key: required on every endpoint but /health (None: no authentication); max_model_len:
    caps prompt + output below the artifacts' positions; seed: seeds the sampling requests that
    bring no seed; log_requests: one info line per request."""
    fe = Frontend(engine, model_name, tokenizer, chat_template, max_model_len, seed)
    fe.log_requests = log_requests
    metrics = engine.metrics

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="dflash-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(_CancelledAtShutdown)
    if api_key:
        app.add_middleware(_ApiKey, key=api_key, metrics=metrics)
    app.state.frontend = fe

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e, metrics)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return _error_response(
            APIError(f"{e.detail}: {request.method} {request.url.path}", e.status_code), metrics
        )

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        return _error_response(APIError(f"internal error: {type(e).__name__}: {e}", 500), metrics)

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

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = proto.parse(proto.CompletionRequest, await request.body())
        fe.check_model(req.model)
        ids = fe.prompt_ids(req.prompt)
        params = fe.params(req, len(ids), 16 if req.max_tokens is None else req.max_tokens)
        return await answer(fe, request, req, ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = proto.parse(proto.ChatCompletionRequest, await request.body())
        fe.check_model(req.model)
        ids = fe.chat_ids(req)
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        params = fe.params(req, len(ids), max_tokens)
        return await answer(fe, request, req, ids, params, chat=True)

    return app
