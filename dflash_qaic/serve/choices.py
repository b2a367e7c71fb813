"""`n > 1` on dflash-serve: one request's n choices from one prefill (runtime/prefix.py: the
prompt is prefilled once, from a cached prefix when there is one, and forked into n cache rows;
choice i samples with seed + i, as vLLM seeds parallel sampling's children). A whole answer
lists the n choices by index; a streamed one interleaves their chunks, each carrying its
choice's index, as vLLM streams them. The usage counts the prompt once and every choice's
tokens, and the prefix found cached once. `best_of` is taken when it equals n (ranking
more choices than are returned needs their log-probabilities)."""

from __future__ import annotations

import asyncio
import time

from starlette.responses import JSONResponse, Response, StreamingResponse

from dflash_qaic.serve import protocol as proto
from dflash_qaic.serve.engine import EngineFull, Output


class Handles(list):
    """The n choices' handles; cancel() cancels every one."""

    def cancel(self) -> None:
        for h in self:
            h.cancel()


def check(fe, req, params, plan, api_error) -> int:
    """n, after refusing what n > 1 cannot be served with (an APIError naming the field)."""
    n = req.n
    if not isinstance(n, int) or n < 1:
        raise api_error(f"n must be an integer ≥ 1 (got {n!r})", param="n")
    if n > fe.engine.slots:
        raise api_error(
            f"n = {n} choices need {n} cache rows at once; this server runs {fe.engine.slots}: "
            "ask for fewer, or export with a larger --full-batch-size",
            param="n",
        )
    if req.best_of is not None and req.best_of != n:
        raise api_error(
            "best_of other than n needs the choices' log-probabilities to rank them: not served",
            param="best_of",
        )
    if n > 1 and plan is not None and plan.calls_tools:
        raise api_error("n > 1 with tools is not served: ask for one choice", param="n")
    if n > 1 and (params.export_only or params.handoff is not None):
        raise api_error("n > 1 is not served by a prefill or decode role", param="n")
    return n


def _use(finals: list[Output]) -> dict:
    first = finals[0]
    done = sum(o.completion_tokens for o in finals)
    return proto.usage(first.prompt_tokens, done, first.cached_tokens)


async def answer(fe, request, req, ids, params, chat, n, unless_gone, error_of, api_error):
    """The answer of n > 1 choices (module docstring)."""
    try:
        handles = Handles(fe.engine.submit_choices(ids, params, n))
    except EngineFull as e:
        raise api_error(f"{e}: retry later", 503) from None
    rid = proto.request_id("chatcmpl" if chat else "cmpl", req.request_id)
    if req.stream:
        events = _events(fe, handles, rid, chat, req, error_of)
        return StreamingResponse(events, media_type="text/event-stream")
    outs = await unless_gone(_collect_all(handles), request, handles)
    if outs is None:
        return Response(status_code=499)
    finals = [o[-1] for o in outs]
    bad = next((o for o in finals if o.error is not None), None)
    if bad is not None:
        raise error_of(bad)
    choices = []
    for i, o in enumerate(outs):
        text = "".join(x.text for x in o)
        toks = [t for x in o for t in x.token_ids] if req.return_token_ids else None
        one = proto.completion_body(rid, fe.model_name, text, o[-1].finish_reason, toks, {}, chat)
        choices.append({**one["choices"][0], "index": i})
    body = {**one, "choices": choices, "usage": _use(finals)}
    return JSONResponse(body)


async def _collect_all(handles) -> list[list[Output]]:
    async def collect(h):
        return [o async for o in h]

    return await asyncio.gather(*(collect(h) for h in handles))


async def _events(fe, handles, rid, chat, req, error_of):
    """The choices' chunks as they come, each with its index; the usage last when asked."""
    from dflash_qaic.serve.app import _sse

    created, model, want_ids = int(time.time()), fe.model_name, req.return_token_ids
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, h):
        async for out in h:
            await queue.put((i, out))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    finals: list[Output] = []
    try:
        for i in range(len(handles) if chat else 0):
            yield _sse(
                _indexed(proto.chunk_body(rid, model, created, chat, "", role="assistant"), i)
            )
        while len(finals) < len(handles):
            i, out = await queue.get()
            if out.error is not None:
                yield _sse(error_of(out).body())
                break
            if out.text or out.final or (want_ids and out.token_ids):
                toks = out.token_ids if want_ids else None
                body = proto.chunk_body(
                    rid, model, created, chat, out.text, out.finish_reason, toks
                )
                yield _sse(_indexed(body, i))
            if out.final:
                finals.append(out)
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse(proto.usage_chunk(rid, model, created, chat, _use(finals)))
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        handles.cancel()


def _indexed(body: dict, i: int) -> dict:
    body["choices"][0]["index"] = i
    return body
