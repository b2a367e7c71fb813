"""dflash-serve end to end: a real server process on 127.0.0.1 (an ephemeral port) over the
default pair, driven by the official `openai` client and raw HTTP (httpx). Every output is
checked against the in-process Pipeline (single-request greedy, or the same seed), and the
metrics against the requests made. One server serves the whole module; the SIGTERM test starts
its own."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import prometheus_client
import pytest
from conftest import leave_mid_stream, serving, stream_lines
from prometheus_client.parser import text_string_to_metric_families

import dflash_qaic
from dflash_qaic import assets
from dflash_qaic.serve.engine import AsyncEngine, Params
from dflash_qaic.serve.process import ServerProcess

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens

MODEL = "default-pair"
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = assets.heldout_prompts()
B = 16


@pytest.fixture(scope="module")
def pipe(default_artifacts):
    pipe = dflash_qaic.load(default_artifacts, threads=1)
    pipe.configure(verify_lengths=[B])  # as the server below: the same steps, step for step
    return pipe


@pytest.fixture(scope="module")
def server(default_artifacts, tmp_path_factory):
    tpl = tmp_path_factory.mktemp("template") / "chat.jinja"
    tpl.write_text(TEMPLATE)
    args = ["--threads", "1", "--served-model-name", MODEL, "--chat-template", str(tpl)]
    args += ["--verify-lengths", str(B)]
    yield from serving(default_artifacts, *args)


def decode(pipe, ids) -> str:
    return pipe.tokenizer.decode(ids, skip_special_tokens=True)


def reason(res) -> str:
    return "stop" if res.stop_reason == "stop_token" else "length"


def sse(lines) -> list[dict]:
    """The JSON events of a server-sent event stream; checks it ends with [DONE]."""
    data = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def scrape(http) -> dict:
    """{(sample name, frozenset of labels but model_name): value}"""
    text = http.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def delta(after, before, name, **labels) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_models_and_health(client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 1023  # ctx_len − the padding slot
    assert http.get("/health").status_code == 200


def test_completion_equals_single_request_greedy(client, pipe):
    text = PROMPTS[0]
    ref = pipe.generate(text, 48, temperature=0)
    ids = pipe.tokenizer(text)["input_ids"]
    for prompt in (text, ids):
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=48,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == ref.tokens
        assert choice.text == decode(pipe, ref.tokens)
        assert choice.finish_reason == reason(ref)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.tokens))
        assert r.usage.total_tokens == len(ids) + len(ref.tokens)


def test_streaming_equals_non_streaming(client, pipe):
    ref = pipe.generate(PROMPTS[2], 64, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=64,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.tokens)
    body = chunks[:-1]
    assert "".join(c.choices[0].text for c in body) == decode(pipe, ref.tokens)
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + [reason(ref)]
    assert len(body) > 2  # streamed step by step, not in one piece


def test_streaming_never_splits_a_character(http, pipe):
    """At temperature 10 the target emits arbitrary bytes, one token per step (τ ≈ 1): valid
    two- and three-byte characters arrive split over several steps and must come out whole."""
    kw = dict(temperature=10.0, seed=3)
    ref = pipe.generate(PROMPTS[3], 200, [], **kw)
    body = dict(prompt=PROMPTS[3], max_tokens=200, ignore_eos=True, stream=True, **kw)
    with http.stream("POST", "/v1/completions", json={**body, "return_token_ids": True}) as r:
        events = sse(r.iter_lines())
    ids = [t for e in events for t in e["choices"][0]["token_ids"]]
    deltas = [e["choices"][0]["text"] for e in events]
    assert ids == ref.tokens  # the same seed gives the same tokens
    text = "".join(deltas)
    assert text == decode(pipe, ids)
    assert any(ord(c) > 127 and c != "\ufffd" for c in text), "no multibyte character produced"
    # decoding each step on its own would garble them
    assert "".join(decode(pipe, e["choices"][0]["token_ids"]) for e in events) != text


def test_chat_completions(client, pipe):
    messages = [{"role": "system", "content": "python"}, {"role": "user", "content": "def f(x):"}]
    rendered = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"
    ids = pipe.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    ref = pipe.generate(ids, 40, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == decode(pipe, ref.tokens)
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == decode(pipe, ref.tokens)
    assert chunks[-1].choices[0].finish_reason == reason(ref)


def test_concurrent_clients_equal_single_request_greedy(client, pipe):
    prompts = PROMPTS[4:8]
    refs = [decode(pipe, pipe.generate(p, 40, temperature=0).tokens) for p in prompts]

    def run(p):
        stream = client.completions.create(
            model=MODEL, prompt=p, max_tokens=40, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream)

    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(run, prompts))
    assert outs == refs


def test_stop_strings_and_stop_token_ids(client, http, pipe):
    ref = pipe.generate(PROMPTS[1], 64, [], temperature=0)
    text = decode(pipe, ref.tokens)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = text[: text.find(stop)]
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=64, temperature=0, stop=[stop, "\x00never"]
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    body = dict(prompt=PROMPTS[1], max_tokens=64, temperature=0, stop=stop, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as s:
        events = sse(s.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    # a stop token ends the output right after it (the token is in the output)
    t = ref.tokens[10]
    cut = ref.tokens[: ref.tokens.index(t) + 1]
    body = dict(prompt=PROMPTS[1], max_tokens=64, temperature=0, stop_token_ids=[t])
    r = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    assert r["choices"][0]["token_ids"] == cut and r["choices"][0]["finish_reason"] == "stop"


def test_eos_stops_unless_ignore_eos(http, pipe):
    """The default pair never ends greedily, but sampled at T = 10 with seed 7 it draws EOS as
    its 32nd token."""
    kw = dict(temperature=10.0, seed=7)
    ref = pipe.generate(PROMPTS[3], 60, [], **kw).tokens
    eos = pipe.eos[0]
    at = ref.index(eos)
    assert at < 59
    body = dict(prompt=PROMPTS[3], max_tokens=60, return_token_ids=True, **kw)
    r = http.post("/v1/completions", json=body).json()["choices"][0]
    assert (r["token_ids"], r["finish_reason"]) == (ref[: at + 1], "stop")
    assert r["text"] == decode(pipe, ref[:at])  # the EOS itself is a special token: no text
    body.update(ignore_eos=True, skip_special_tokens=False)
    r = http.post("/v1/completions", json=body).json()["choices"][0]
    assert (r["token_ids"], r["finish_reason"]) == (ref, "length")
    assert r["text"] == pipe.tokenizer.decode(ref) and "<|endoftext|>" in r["text"]


BAD = [
    # (path, body, status, param)
    ("/v1/completions", b'{"prompt": "x"', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"{}", 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1023}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [65] * 1008, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [65, 300]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [258]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": [65, 66.5]}, 400, "prompt.1"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 1}]}, 400, None),
    ("/v1/nothing", {}, 404, None),
]


def test_bad_requests_get_openai_errors_and_the_server_lives_on(http, client, pipe):
    for path, body, status, param in BAD:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post(path, content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] == status and len(err["message"]) > 10, err
        if param is not None:
            assert err["param"] == param, (body, err)
    r = http.post("/v1/completions", content=b" " * ((1 << 20) + 1))  # the default limit
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "BadRequestError", r.text
    err = http.post("/v1/completions", json={"prompt": [65, 66.5]}).json()["error"]
    assert "should be a valid integer (got 66.5): token ids" in err["message"], err
    err = http.post("/v1/completions", json={"prompt": "x", "top_p": 2}).json()["error"]
    assert err["message"].startswith("top_p must be in (0, 1]"), err
    with pytest.raises(openai.BadRequestError, match="max_tokens must be ≥ 1"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    assert http.get("/health").status_code == 200
    ref = pipe.generate([65, 66], 8, temperature=0)
    r = http.post("/v1/completions", json={"prompt": [65, 66], "max_tokens": 8, "temperature": 0})
    assert r.json()["choices"][0]["text"] == decode(pipe, ref.tokens)


def test_client_disconnect_frees_the_worker(http, pipe):
    before = scrape(http)
    leave_mid_stream(http, PROMPTS[5])
    # a client that gives up on a non-streamed answer
    body = dict(prompt="def f", max_tokens=1000, ignore_eos=True, temperature=0)
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=0.2)
    # the pipeline serves the next request, from a clean state
    ref = pipe.generate(PROMPTS[6], 24, temperature=0)
    r = http.post("/v1/completions", json=dict(prompt=PROMPTS[6], max_tokens=24, temperature=0))
    assert r.json()["choices"][0]["text"] == decode(pipe, ref.tokens)
    after = scrape(http)
    assert delta(after, before, "vllm:request_success_total", finished_reason="abort") == 2
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 1
    generated = delta(after, before, "vllm:generation_tokens_total")
    # both abandoned requests stopped before their max_tokens (the abort count above says so
    # too); how many tokens each made first depends on how fast this machine decodes
    assert generated < 700 + 1000
    assert after[("vllm:num_requests_running", frozenset())] == 0


def test_metrics_match_the_requests(http, pipe):
    before = scrape(http)
    lengths, usages, reasons = [], [], []
    for p in PROMPTS[8:10]:
        ref = pipe.generate(p, 64, temperature=0)
        body = dict(prompt=p, max_tokens=64, temperature=0, stream=True, return_token_ids=True)
        body["stream_options"] = {"include_usage": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            events = sse(r.iter_lines())
        runs = [e["choices"][0]["token_ids"] for e in events if e["choices"]]
        runs = [run for run in runs if run]
        # the first run is prefill's token; every later one is one verify step
        assert [len(run) for run in runs[1:]] == ref.acceptance_lengths
        lengths += ref.acceptance_lengths
        usages.append(events[-1]["usage"])
        reasons.append(events[-2]["choices"][0]["finish_reason"])
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}).status_code == 400
    after = scrape(http)
    steps, accepted = len(lengths), sum(n - 1 for n in lengths)
    assert delta(after, before, "vllm:spec_decode_num_drafts_total") == steps
    assert delta(after, before, "vllm:spec_decode_num_draft_tokens_total") == steps * (B - 1)
    assert delta(after, before, "vllm:spec_decode_num_accepted_tokens_total") == accepted
    for i in range(B - 1):
        want = sum(n - 1 > i for n in lengths)
        name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        assert delta(after, before, name, position=str(i)) == want
    for why in ("stop", "length"):
        n = reasons.count(why)
        assert delta(after, before, "vllm:request_success_total", finished_reason=why) == n
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    assert delta(after, before, "vllm:prompt_tokens_total") == prompt_tokens
    generated = sum(u["completion_tokens"] for u in usages)
    assert delta(after, before, "vllm:generation_tokens_total") == generated
    assert delta(after, before, "vllm:time_to_first_token_seconds_count") == 2
    assert delta(after, before, "vllm:time_per_output_token_seconds_count") == 2
    assert delta(after, before, "dflash:request_errors_total", status="400") == 1


class _OneStepAtATime:
    """The real Pipeline whose engine takes at least 20 ms per step (so a shutdown lands
    mid-request)."""

    def __init__(self, pipe):
        self._pipe = pipe

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def engine(self, mode):
        core = self._pipe.engine(mode)
        step = core.step

        def slow():
            time.sleep(0.02)
            return step()

        core.step = slow
        return core


def test_engine_shutdown_cancels_at_the_next_step(pipe):
    async def main():
        engine = AsyncEngine(_OneStepAtATime(pipe), max_queue=1)
        engine.start()
        ids = pipe.tokenizer(PROMPTS[0])["input_ids"]
        running = engine.submit(ids, Params(max_tokens=600, stop_token_ids=()))
        first = await running.__anext__()  # the worker took it: the queue is empty again
        queued = engine.submit(ids, Params(max_tokens=8, stop_token_ids=()))
        with pytest.raises(RuntimeError, match="queue is full"):
            engine.submit(ids, Params(max_tokens=8, stop_token_ids=()))
        engine.shutdown(timeout=30)
        outs = [first] + [o async for o in running]
        rest = [o async for o in queued]
        return engine, outs, rest

    engine, outs, rest = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and outs[-1].completion_tokens < 600
    assert [(o.finish_reason, o.completion_tokens) for o in rest] == [("abort", 0)]
    assert not engine.alive


class _FailsOnce(_OneStepAtATime):
    """The real Pipeline whose first engine's third step raises (a backend failure)."""

    engines = 0

    def engine(self, mode):
        core = self._pipe.engine(mode)
        self.engines += 1
        if self.engines == 1:
            step, calls = core.step, []

            def failing():
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("device lost")
                return step()

            core.step = failing
        return core


def test_engine_backend_failure_fails_the_requests_in_flight_only(pipe):
    ids = pipe.tokenizer(PROMPTS[1])["input_ids"]
    ref = pipe.generate(ids, 24, temperature=0)

    async def main():
        engine = AsyncEngine(_FailsOnce(pipe))
        engine.start()
        failed = [o async for o in engine.submit(ids, Params(max_tokens=200, stop_token_ids=()))]
        ok = [o async for o in engine.submit(ids, Params(max_tokens=24, stop_token_ids=()))]
        engine.shutdown(timeout=30)
        return failed, ok

    failed, ok = asyncio.run(main())
    assert isinstance(failed[-1].error, RuntimeError) and "device lost" in str(failed[-1].error)
    assert [t for o in ok for t in o.token_ids] == ref.tokens and ok[-1].finish_reason == "length"


@pytest.mark.slow  # the fast tier drains a batched server (test_serve_batching)
def test_sigterm_drains_in_flight_requests_and_exits_0(default_artifacts):
    with ServerProcess(default_artifacts, "--threads", "1") as server:
        started, result = threading.Event(), {}
        body = dict(prompt=PROMPTS[7], max_tokens=500, ignore_eos=True, temperature=0, stream=True)
        body["stream_options"] = {"include_usage": True}

        def client():
            _, lines = stream_lines(server.url, body, lambda _: started.set())
            result["events"] = sse(lines)

        t = threading.Thread(target=client)
        t.start()
        assert started.wait(120)
        code = server.stop()  # SIGTERM while the request streams
        t.join(120)
        assert code == 0, server.log()
        assert result["events"][-1]["usage"]["completion_tokens"] == 500  # drained, not cut
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", trust_env=False)


@pytest.mark.slow
def test_serve_bench(default_artifacts):
    from dflash_lab.serve_bench import render_markdown, run_serve_bench

    res = run_serve_bench(default_artifacts, 4, max_tokens=24, threads=1, progress=lambda m: None)
    assert res["ok"], res
    assert (res["completed"], res["equal_greedy"], res["server_errors"]) == (4, 4, 0)
    assert res["tokens"] == 4 * 24 and res["server_exit_code"] == 0
    assert (res["full_batch_size"], res["max_running"]) == (1, 1)
    assert res["ttft_p50_s"] <= res["ttft_p95_s"] and res["aggregate_tokens_per_s"] > 0
    assert "| completed | 4 / 4 |" in render_markdown(res)


def test_serve_cli_errors_are_one_line(default_artifacts, tmp_path, capsys):
    import socket

    from dflash_qaic.serve.cli import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    cases = [
        ([str(tmp_path), "--port", "0"], ""),  # the runtime words the ArtifactsError
        ([str(default_artifacts), "--port", port], f"cannot listen on 127.0.0.1:{port}"),
        ([str(default_artifacts), "--port", "70000"], "--port must be in 0 … 65535"),
        ([str(default_artifacts), "--threads", "0"], "--threads must be in 1 …"),
        ([str(default_artifacts), "--max-queue", "0"], "--max-queue must be ≥ 1"),
        ([str(default_artifacts), "--max-request-bytes", "0"], "--max-request-bytes must be ≥ 1"),
        ([str(default_artifacts), "--verify-lengths", "4,x"], "--verify-lengths must be integers"),
        (
            [str(default_artifacts), "--port", "0", "--verify-lengths", "4,8"],
            "--verify-lengths: verify_lengths [4, 8]: the target has verify lengths [4, 8, 16]",
        ),
        ([str(default_artifacts), "--chat-template", str(tmp_path / "no.jinja")], "cannot read"),
    ]
    try:
        for argv, message in cases:
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err, err
            assert err.startswith("dflash-serve: error: ") and err.count("\n") == 1, err
    finally:
        busy.close()


def test_metrics_count_the_drafts_each_step_verified():
    """A step of v rows proposed v − 1 draft tokens (steps of shorter verify lengths)."""
    from dflash_qaic.serve.metrics import Metrics

    m = Metrics("m", B)
    for committed, verified in ((3, 4), (16, 16), (1, 8), (2, None)):
        m.step(committed, verified)
    text = prometheus_client.generate_latest(m.registry).decode()
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0' in text  # 3+15+7+15
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 18.0' in text


# ---------------------------------------------------------------------- a vLLM user's flags


def _app(pipe, **kw):
    from fastapi.testclient import TestClient

    from dflash_qaic.serve.app import create_app

    app = create_app(AsyncEngine(pipe), MODEL, pipe.tokenizer, TEMPLATE, **kw)
    return TestClient(app, raise_server_exceptions=False)


def test_api_key_guards_every_endpoint_but_health(pipe):
    key = "sk-test-123"
    body = dict(prompt=[65, 66], max_tokens=4, temperature=0)
    with _app(pipe, api_key=key) as c:
        assert c.get("/health").status_code == 200  # no key needed
        for method, path in [("get", "/v1/models"), ("get", "/metrics"), ("post", "/v1/nothing")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                r = getattr(c, method)(path, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                err = r.json()["error"]
                assert err["code"] == 401 and "API key" in err["message"], err
                assert set(err) == {"message", "type", "param", "code"}
        for headers in ({}, {"Authorization": f"Bearer {key}x"}):
            assert c.post("/v1/completions", json=body, headers=headers).status_code == 401
        ok = {"Authorization": f"Bearer {key}"}
        assert c.get("/v1/models", headers=ok).json()["data"][0]["id"] == MODEL
        r = c.post("/v1/completions", json=body, headers=ok)
        assert r.status_code == 200, r.text
        errors = [
            ln
            for ln in c.get("/metrics", headers=ok).text.splitlines()
            if ln.startswith("dflash:request_errors_total{") and 'status="401"' in ln
        ]
        assert errors and errors[0].endswith(" 11.0"), errors  # 3 paths × 3 + 2 posts
    with _app(pipe) as c:  # no key: open, as before
        assert c.get("/v1/models").status_code == 200


def test_max_model_len_caps_prompt_and_output(pipe):
    with _app(pipe, max_model_len=64) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 64
        ok = c.post("/v1/completions", json=dict(prompt=[65] * 40, max_tokens=24, temperature=0))
        assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == 64
        r = c.post("/v1/completions", json=dict(prompt=[65] * 40, max_tokens=25))
        assert (
            r.status_code == 400 and "maximum context length is 64" in r.json()["error"]["message"]
        )
        r = c.post("/v1/completions", json=dict(prompt=[65] * 64, max_tokens=1))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        # no max_tokens on chat: the rest of the 64
        msgs = [{"role": "user", "content": "def f(x):"}]
        r = c.post("/v1/chat/completions", json=dict(messages=msgs, temperature=0, ignore_eos=True))
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 64


def test_seed_makes_unseeded_sampling_reproducible(pipe):
    bodies = [dict(prompt=p, max_tokens=24, temperature=1.0) for p in PROMPTS[:3]]

    def texts(**kw):
        with _app(pipe, **kw) as c:
            return [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]

    first = texts(seed=7)
    assert texts(seed=7) == first  # the same requests in the same order: the same outputs
    assert texts(seed=8) != first
    assert len(set(first)) == 3  # each request drew its own seed


def test_request_log_lines(pipe, caplog):
    body = dict(prompt=[65, 66], max_tokens=3, temperature=0)
    with caplog.at_level("INFO", logger="dflash_qaic.serve"):
        with _app(pipe) as c:
            c.post("/v1/completions", json=body)
        assert any("Received request cmpl-" in r.message for r in caplog.records)
        caplog.clear()
        with _app(pipe, log_requests=False) as c:
            c.post("/v1/completions", json=body)
        assert not any("Received request" in r.message for r in caplog.records)


def test_vllm_current_metric_names(pipe):
    prompts = [PROMPTS[8], PROMPTS[9]]
    with _app(pipe) as c:
        usages, steps = [], []
        for p in prompts:
            body = dict(prompt=p, max_tokens=48, temperature=0, ignore_eos=True)
            usages.append(c.post("/v1/completions", json=body).json()["usage"])
            steps.append(len(pipe.generate(p, 48, [], temperature=0).acceptance_lengths))
        m = {}
        for fam in text_string_to_metric_families(c.get("/metrics").text):
            for s in fam.samples:
                m[s.name] = s.value
    # tokens per engine step: every prompt token once (the step that finished its prefill) and
    # every committed token once
    total = sum(u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert m["vllm:iteration_tokens_total_sum"] == total
    assert m["vllm:iteration_tokens_total_count"] >= sum(steps)
    # one inter-token latency per output after a request's first: a step each (the prefill's
    # token and the first step may land in one engine step)
    itl = m["vllm:inter_token_latency_seconds_count"]
    assert sum(steps) - len(prompts) <= itl <= sum(steps)
    assert 0 < m["vllm:inter_token_latency_seconds_sum"]
    assert m["vllm:time_per_output_token_seconds_count"] == 2  # the old name stays, per request
    assert m["vllm:kv_cache_usage_perc"] == 0.0  # idle: no sequence holds the cache


def test_kv_cache_usage_while_a_request_runs(pipe):
    ids = pipe.tokenizer(PROMPTS[0])["input_ids"]

    async def main():
        engine = AsyncEngine(_OneStepAtATime(pipe))
        engine.start()
        handle = engine.submit(ids, Params(max_tokens=200, stop_token_ids=()))
        n = 0
        async for out in handle:
            n = out.completion_tokens
            if n >= 20:
                break
        during = engine.metrics.kv_cache_usage._value.get()
        handle.cancel()
        async for _ in handle:
            pass
        engine.shutdown(timeout=30)
        return n, during, engine.metrics.kv_cache_usage._value.get()

    n, during, after = asyncio.run(main())
    # positions held: the prompt and the tokens made so far (the gauge is set after each step:
    # it may be a step behind the outputs read, or the worker a step ahead)
    assert len(ids) + n - B <= during * pipe.ctx_len <= len(ids) + n + 2 * B
    assert after == 0.0


def test_max_num_seqs_caps_the_engine_slots():
    import argparse
    import types

    from dflash_qaic.serve.cli import UsageError, _limits

    pipe = types.SimpleNamespace(full_batch_size=4, max_running=None, ctx_len=1024, B=16)
    pipe.configure = lambda max_running: setattr(pipe, "max_running", max_running)
    _limits(argparse.Namespace(max_model_len=1023, max_num_seqs=2), pipe)
    assert pipe.max_running == 2 and AsyncEngine(pipe).slots == 2
    with pytest.raises(
        UsageError, match=r"--max-num-seqs 5 is more than .*\(--full-batch-size 4 at export\)"
    ):
        _limits(argparse.Namespace(max_model_len=None, max_num_seqs=5), pipe)
    with pytest.raises(UsageError, match="--max-model-len 1024 is more than .* ctx_len 1024"):
        _limits(argparse.Namespace(max_model_len=1024, max_num_seqs=None), pipe)


def test_vllm_flag_errors_are_one_line(default_artifacts, capsys, monkeypatch):
    from dflash_qaic.serve.cli import main

    art = str(default_artifacts)
    cases = [
        ([art, "--port", "0", "--max-model-len", "5000"], "re-export with a larger --ctx-len"),
        ([art, "--port", "0", "--max-num-seqs", "4"], "exported without --full-batch-size"),
        ([art, "--max-model-len", "1"], "--max-model-len must be ≥ 2"),
        ([art, "--max-num-seqs", "0"], "--max-num-seqs must be ≥ 1"),
        ([art, "--seed", "-1"], "--seed must be ≥ 0"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
        assert err.startswith("dflash-serve: error: ") and err.count("\n") == 1, err


def test_server_with_vllm_flags(default_artifacts, monkeypatch):
    """A real process: the key from VLLM_API_KEY, the flags accepted; beyond loopback without a
    key, a warning."""
    monkeypatch.setenv("VLLM_API_KEY", "sk-env")
    args = ["--host", "0.0.0.0", "--threads", "1", "--max-model-len", "200", "--max-num-seqs", "1"]
    args += ["--seed", "3", "--uvicorn-log-level", "warning", "--disable-log-requests"]
    with ServerProcess(default_artifacts, *args, log_level="info") as s:
        url = s.url.replace("0.0.0.0", "127.0.0.1")
        bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sk-env", max_retries=0)
        assert good.models.list().data[0].model_extra["max_model_len"] == 200
        r = good.completions.create(model=str(default_artifacts), prompt="x", max_tokens=4)
        assert r.usage.completion_tokens == 4
        assert s.stop() == 0
        log = s.log()
        assert "without an API key" not in log and "Received request" not in log, log
    monkeypatch.delenv("VLLM_API_KEY")
    with ServerProcess(default_artifacts, "--host", "0.0.0.0", "--threads", "1") as s:
        assert s.stop() == 0
        assert "serving on 0.0.0.0 without an API key" in s.log(), s.log()
