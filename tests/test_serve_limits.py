"""dflash-serve under pressure: request size (the body limit, prompts refused from their length
before tokenizing, tokenizing off the event loop), --max-queue under a burst, and the shutdown
timeout cutting requests with proper answers. Real server processes on 127.0.0.1 over the
default pair exported with --full-batch-size 4; timing bounds only where timing is the property
(/health while a huge request is handled), generous ones everywhere else."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import random
import signal
import socket
import threading
import time
import types
from pathlib import Path

import httpx
import pytest
from conftest import serving, stream_lines

import dflash_qaic
from dflash_qaic import assets
from dflash_qaic.serve import app as app_module
from dflash_qaic.serve.app import _CancelledAtShutdown, create_app
from dflash_qaic.serve.engine import AsyncEngine
from dflash_qaic.serve.limits import longest_token_chars
from dflash_qaic.serve.process import ServerProcess
from tests.test_serve import TEMPLATE, scrape, sse

SLOTS = 4
LIMIT = 12_000_000  # --max-request-bytes of the server below: an 8 MB prompt is read whole
PROMPTS = assets.heldout_prompts()
HUGE = "def f(x): return x + 1\n" * (8_000_000 // 24)  # 8 MB of text


@pytest.fixture(scope="module")
def server(cb_artifacts, tmp_path_factory):
    tpl = tmp_path_factory.mktemp("template") / "chat.jinja"
    tpl.write_text(TEMPLATE)
    args = ["--threads", "1", "--max-queue", "2", "--max-request-bytes", str(LIMIT)]
    yield from serving(cb_artifacts, *args, "--chat-template", str(tpl))


def test_huge_prompts_are_refused_without_tokenizing(server, http):
    """8 MB prompts (text, a chat message, token ids) get a 400 naming the limit; the server is
    intact afterwards. That they are refused before any tokenizing is shown in process below
    (test_huge_prompts_never_reach_the_tokenizer): a property of events, not of durations."""
    bodies = [
        ("/v1/completions", {"prompt": HUGE, "max_tokens": 4}, "prompt", "characters"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 4},
            "messages",
            "characters",
        ),
        ("/v1/completions", {"prompt": [65] * 500_000, "max_tokens": 4}, "prompt", "tokens"),
    ]
    encoded = [(path, json.dumps(b).encode(), param, word) for path, b, param, word in bodies]
    assert [len(b) > 2_000_000 for _, b, _, _ in encoded] == [True] * 3
    for path, body, param, word in encoded:
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, err
        assert word in err["message"] and "at most 1007" in err["message"], err
    assert http.get("/health").status_code == 200
    # the server is intact
    r = http.post("/v1/completions", json={"prompt": "def f", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _raw(server, head: bytes, chunks=()) -> tuple[int, dict]:
    """Send a request by hand (headers, then body parts) and read the answer."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head)
        try:
            for c in chunks:
                s.sendall(c)
        except OSError:  # the server answered and closed while we were still sending
            pass
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            part = s.recv(65536)
            if not part:
                break
            data += part
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1][: _length(data)])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def test_body_limit_413(server, http):
    """A body above --max-request-bytes is a 413 naming the flag: declared too large (refused
    before a byte of it is read), sent chunked (refused once the bytes read pass the limit),
    or plain; the server goes on serving."""
    path = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    status, body = _raw(server, path + b"Content-Length: 1000000000000\r\n\r\n")
    assert status == 413, body
    err = body["error"]
    assert "--max-request-bytes" in err["message"] and str(LIMIT) in err["message"], err
    assert (err["code"], err["type"]) == (413, "BadRequestError")
    piece = b" " * 1_000_000
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    status, body = _raw(server, path + b"Transfer-Encoding: chunked\r\n\r\n", [chunk] * 40)
    assert status == 413 and "--max-request-bytes" in body["error"]["message"], body
    r = http.post("/v1/completions", content=b" " * (LIMIT + 1))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    r = http.post("/v1/completions", content=b" " * (LIMIT - 100) + b'{"prompt": [65]}')
    assert r.status_code == 200, r.text  # just under the limit: read and served
    assert http.get("/health").status_code == 200


def test_max_queue_counts_waiting_requests_only(server, http):
    """4 slots and --max-queue 2: of a burst of 16 long requests, 6 are accepted (4 running,
    2 waiting) and 10 get 503 (before: 4 and 12, the queue filled before the worker moved
    requests into their slots)."""
    body = dict(prompt=PROMPTS[0], max_tokens=700, ignore_eos=True, temperature=0)

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=300, trust_env=False) as c:
            tasks = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(16)]
            refused = []
            deadline = time.monotonic() + 120
            while len(refused) < 10 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                refused = [t for t in tasks if t.done()]
            accepted = [t for t in tasks if not t.done()]
            while time.monotonic() < deadline:  # the worker fills its slots step by step
                gauges = scrape(http)
                if gauges[("vllm:num_requests_running", frozenset())] == SLOTS:
                    break
                await asyncio.sleep(0.1)
            for t in accepted:
                t.cancel()  # the clients go away: their requests leave the engine
            await asyncio.gather(*accepted, return_exceptions=True)
            return [t.result() for t in refused], len(accepted), gauges

    refused, n_accepted, gauges = asyncio.run(burst())
    assert n_accepted == 6 and len(refused) == 10, [r.status_code for r in refused]
    for r in refused:
        err = r.json()["error"]
        assert r.status_code == 503 and "--max-queue" in err["message"], err
        assert err["type"] == "ServiceUnavailableError"
    assert gauges[("vllm:num_requests_running", frozenset())] == SLOTS
    assert gauges[("vllm:num_requests_waiting", frozenset())] == 2
    deadline = time.monotonic() + 120  # the cancelled ones leave at the worker's next steps
    while scrape(http)[("vllm:num_requests_running", frozenset())] and time.monotonic() < deadline:
        time.sleep(0.2)
    r = http.post("/v1/completions", json={"prompt": "def f", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200


def _two_long_requests(server, stream_options=None) -> tuple[dict, list[threading.Thread]]:
    """A long non-streamed and a long streamed request on `server`, each in a thread; returns
    once both run in the engine (its running gauge says 2). results["plain"] is the response,
    results["stream"] (status, lines), once they end."""
    long = dict(prompt=PROMPTS[3], max_tokens=700, ignore_eos=True, temperature=0)
    results, streaming = {}, threading.Event()

    def plain():
        with httpx.Client(timeout=300, trust_env=False) as c:
            results["plain"] = c.post(server.url + "/v1/completions", json=long)

    def streamed():
        body = dict(long, stream=True)
        if stream_options:
            body["stream_options"] = stream_options
        results["stream"] = stream_lines(server.url, body, lambda _: streaming.set(), 300)

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    assert streaming.wait(120)
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as c:
        deadline = time.monotonic() + 120
        while scrape(c)[("vllm:num_requests_running", frozenset())] < 2:
            assert time.monotonic() < deadline, "the two requests never ran together"
            time.sleep(0.1)
    return results, threads


def test_sigterm_past_the_shutdown_timeout_cuts_with_proper_answers(cb_artifacts, monkeypatch):
    """SIGTERM with --shutdown-timeout 1 while a long non-streamed and a long streamed request
    run: the first gets a 503 JSON error, the second a last chunk with finish_reason "abort"
    and data: [DONE] (before: uvicorn's plain-text 500 and a stream ending without either)."""
    # every target call 50 ms longer: the requests cannot finish within the timeout on any host
    monkeypatch.setenv("SLOW_CALL_S", "0.05")
    server = ServerProcess(cb_artifacts, "--threads", "1", "--shutdown-timeout", "1")
    server.argv[1:3] = [str(Path(__file__).with_name("faulty_serve.py"))]
    with server:
        results, threads = _two_long_requests(server, {"include_usage": True})
        code = server.stop()
        for t in threads:
            t.join(120)
        assert code == 0, server.log()
        assert not any(t.is_alive() for t in threads), "a client never got its answer"
    r = results["plain"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert "--shutdown-timeout" in err["message"] and err["code"] == 503, err
    status, lines = results["stream"]
    events = sse(lines)  # ends with data: [DONE]
    assert status == 200 and events[-1]["choices"] == []  # the usage chunk, as asked
    assert events[-2]["choices"][0]["finish_reason"] == "abort", events[-3:]
    assert 0 < events[-1]["usage"]["completion_tokens"] < 700


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_second_signal_cuts_at_once_and_exits_0(cb_artifacts, monkeypatch, second):
    """SIGTERM, then a second signal while the shutdown waits for two long requests: the server
    cuts them at once, each answered (503 naming the second signal / the stream's abort chunk),
    joins its engine and exits 0 (before: SIGABRT, "terminate called without an active
    exception", its worker thread left inside ONNX Runtime at the interpreter's exit; and the
    503s blamed the --shutdown-timeout, which had not run out)."""
    monkeypatch.setenv("SLOW_CALL_S", "0.05")  # requests that cannot end before the signals
    server = ServerProcess(cb_artifacts, "--threads", "1", "--shutdown-timeout", "600")
    server.argv[1:3] = [str(Path(__file__).with_name("faulty_serve.py"))]
    with server:
        results, threads = _two_long_requests(server)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60  # the shutdown has begun: no new connections
        while _accepts(server):
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        code = server.stop(second)
        for t in threads:
            t.join(120)
        log = server.log()
    assert code == 0, log
    assert "terminate called" not in log and "Traceback" not in log, log
    r = results["plain"]
    assert r.status_code == 503, r.text
    msg = r.json()["error"]["message"]
    assert "second signal" in msg and "--shutdown-timeout" not in msg, msg
    _, lines = results["stream"]
    events = sse(lines)
    assert events[-1]["choices"][0]["finish_reason"] == "abort", events[-2:]


def _accepts(server) -> bool:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        return True
    except OSError:
        return False


def test_cancelled_by_uvicorn_still_answers():
    """The backstop when uvicorn's own timeout cancels a request task: a JSON 503 before the
    response started; in a stream, the final abort chunk and [DONE] the route left."""

    async def run(inner):
        sent = []

        async def send(m):
            sent.append(m)

        async def receive():
            await asyncio.sleep(3600)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "state": {}}
        engine = types.SimpleNamespace(stop_reason="its --shutdown-timeout of 1 s ran out")
        task = asyncio.ensure_future(_CancelledAtShutdown(inner, engine)(scope, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sent

    async def waiting(scope, receive, send):
        await asyncio.sleep(3600)

    async def streaming(scope, receive, send):
        scope["state"]["sse_tail"] = b'data: {"x": "abort"}\n\ndata: [DONE]\n\n'
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.sleep(3600)

    sent = asyncio.run(run(waiting))
    assert sent[0]["status"] == 503 and (b"content-type", b"application/json") in sent[0]["headers"]
    err = json.loads(sent[1]["body"])["error"]
    assert err["code"] == 503 and "--shutdown-timeout" in err["message"]
    sent = asyncio.run(run(streaming))
    assert sent[-1] == {
        "type": "http.response.body",
        "body": b'data: {"x": "abort"}\n\ndata: [DONE]\n\n',
    }


# ---------------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def pipe(cb_artifacts):
    return dflash_qaic.load(cb_artifacts, threads=1)


def _gated_app(pipe, monkeypatch):
    """The server app over `pipe` whose tokenizing of a long text waits for the test: it sets
    `started` once inside the tokenizer (on a pool thread) and goes on only after `release`."""
    started, release = threading.Event(), threading.Event()
    engine = AsyncEngine(pipe, max_queue=4)
    app = create_app(engine, "m", copy.deepcopy(pipe.tokenizer))
    app.state.frontend.chars_per_token = None  # as a tokenizer that gives no bound
    real = app_module._encode_text

    def gated(tok, text, add_special_tokens):
        if len(text) > 100_000:
            started.set()
            assert release.wait(120), "the test never released the tokenizer"
        return real(tok, text, add_special_tokens)

    monkeypatch.setattr(app_module, "_encode_text", gated)
    return engine, app, started, release


def in_process(engine, app, requests, finally_=None):
    """`await requests(c)` with c an httpx client of `app` in this process, its engine running
    meanwhile (then shut down; `finally_()` first, when given)."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            return await requests(c)

    engine.start()
    try:
        return asyncio.run(main())
    finally:
        if finally_ is not None:
            finally_()
        engine.shutdown()


def test_tokenizing_runs_off_the_event_loop(pipe, monkeypatch):
    """While a text prompt is provably being tokenized (the tokenizer is held inside its call
    until the test lets it go), /health and another client's request are answered; the long
    one then gets its answer (a 400: too many tokens). Events, not durations."""
    engine, app, started, release = _gated_app(pipe, monkeypatch)
    text = "def f(x): return x + 1\n" * (600_000 // 24)

    async def requests(c):
        slow = asyncio.ensure_future(
            c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        )
        assert await asyncio.to_thread(started.wait, 120), "tokenizing never started"
        health = await c.get("/health")
        ids = await c.post("/v1/completions", json={"prompt": [65, 66], "max_tokens": 1})
        in_flight = started.is_set() and not release.is_set() and not slow.done()
        release.set()
        return health, ids, in_flight, await slow

    health, ids, in_flight, r = in_process(engine, app, requests, release.set)
    assert in_flight  # both answers came while the tokenizer was held
    assert health.status_code == 200
    assert ids.status_code == 200 and ids.json()["usage"]["completion_tokens"] == 1, ids.text
    assert r.status_code == 400 and "tokens but this model takes at most" in r.text, r.text


def test_huge_prompts_never_reach_the_tokenizer(pipe, monkeypatch):
    """8 MB of text (completion and chat) is refused from its length alone: the tokenizer is
    never called (the length bound of serve/limits.py)."""
    calls = []
    engine = AsyncEngine(pipe, max_queue=4)
    app = create_app(engine, "m", copy.deepcopy(pipe.tokenizer), TEMPLATE, max_request_bytes=LIMIT)
    real = app_module._encode_text
    monkeypatch.setattr(app_module, "_encode_text", lambda *a: calls.append(len(a[1])) or real(*a))

    async def requests(c):
        a = await c.post("/v1/completions", json={"prompt": HUGE, "max_tokens": 2})
        msgs = [{"role": "user", "content": HUGE}]
        b = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        ok = await c.post("/v1/completions", json={"prompt": "def f", "max_tokens": 1})
        return a, b, ok

    a, b, ok = in_process(engine, app, requests)
    assert a.status_code == 400 and "characters" in a.text, a.text
    assert b.status_code == 400 and "characters" in b.text, b.text
    assert ok.status_code == 200
    assert all(n < 100_000 for n in calls), calls  # only the short prompt was tokenized


def test_prompt_length_bound(pipe):
    """L = the longest token's length: every text of n characters has ≥ ⌈n / L⌉ tokens; a
    tokenizer part that can delete text (here a Strip normalizer) gives no bound."""
    from tokenizers import normalizers

    tok = pipe.tokenizer
    L = longest_token_chars(tok)
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    assert L == max(len(t) for t in vocab) and L > 1
    rng = random.Random(0)
    words = [t for t in vocab if t.isascii()] + PROMPTS
    for _ in range(200):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        assert len(tok(text)["input_ids"]) >= math.ceil(len(text) / L), text
    strip = copy.deepcopy(tok)
    strip.backend_tokenizer.normalizer = normalizers.Strip()
    assert longest_token_chars(strip) is None


def test_the_fields_vllm_router_adds_are_accepted(pipe):
    """vllm-router forwards every request with SGLang's fields added at their defaults (seen on
    the wire from vllm-router 0.1.17); they are accepted, and a non-default no_stop_trim or
    return_hidden_states is refused by name."""
    engine = AsyncEngine(pipe, max_queue=4)
    app = create_app(engine, "m", copy.deepcopy(pipe.tokenizer), TEMPLATE)
    added = dict(no_stop_trim=False, ignore_eos=False, skip_special_tokens=True)
    added |= dict(return_hidden_states=False, echo=False)
    chat_added = dict(added, logprobs=False, continue_final_message=False)
    chat_added |= dict(separate_reasoning=True, stream_reasoning=True, include_reasoning=True)

    async def requests(c):
        a = await c.post("/v1/completions", json=dict(prompt="def f", max_tokens=2, **added))
        msgs = [{"role": "user", "content": "hi"}]
        body = dict(messages=msgs, max_tokens=2, **chat_added)
        b = await c.post("/v1/chat/completions", json=body)
        bad = dict(prompt="def f", max_tokens=2, return_hidden_states=True)
        return a, b, await c.post("/v1/completions", json=bad)

    a, b, bad = in_process(engine, app, requests)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_hidden_states"
