"""dflash-serve over artifacts exported with --full-batch-size 4: requests run together on the
continuous-batching engine. A real server process (ephemeral port) driven by the official
`openai` client and raw HTTP; every output is checked against the same prompt run alone
in-process, and the overlap against the server's own count of sequences in its slots."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import leave_mid_stream, serving, stream_lines

import dflash_qaic
from dflash_qaic import assets
from dflash_qaic.serve.process import ServerProcess
from tests.test_serve import decode, scrape, sse

MODEL = "default-pair-cb"
SLOTS = 4
PROMPTS = assets.heldout_prompts()


@pytest.fixture(scope="module")
def pipe(cb_artifacts):
    p = dflash_qaic.load(cb_artifacts, threads=1)
    assert p.full_batch_size == SLOTS
    return p


@pytest.fixture(scope="module")
def server(cb_artifacts):
    yield from serving(cb_artifacts, "--threads", "1", "--served-model-name", MODEL)


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def test_concurrent_requests_run_together_and_equal_their_solo_runs(client, http, pipe):
    """8 greedy requests at once (streamed and not, two with stop strings) on 4 slots: each
    equals its prompt run alone, and the server had all 4 slots busy at once."""
    n = 96
    refs = [pipe.generate(p, n, temperature=0) for p in PROMPTS[:8]]
    want = [
        (decode(pipe, r.tokens), "stop" if r.stop_reason == "stop_token" else "length")
        for r in refs
    ]
    stops: list[list[str]] = [[] for _ in refs]
    for i in (2, 5):  # a stop string from the middle of the solo text cuts it there
        text = want[i][0]
        stops[i] = [text[len(text) // 2 : len(text) // 2 + 3], "\x00never"]
        want[i] = (text[: text.find(stops[i][0])], "stop")
    assert value(scrape(http), "dflash:num_requests_running_max") <= 1  # nothing ran together yet
    go = threading.Barrier(8)

    def run(i):
        kw = dict(model=MODEL, prompt=PROMPTS[i], max_tokens=n, temperature=0, stop=stops[i])
        go.wait()
        if i % 2:
            chunks = list(client.completions.create(stream=True, **kw))
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        c = client.completions.create(**kw).choices[0]
        return c.text, c.finish_reason

    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(run, range(8)))
    assert outs == want
    m = scrape(http)
    assert value(m, "dflash:num_requests_running_max") == SLOTS  # they overlapped, 4 at a time
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:num_requests_waiting") == 0


def _stream(url: str, body: dict, rec: dict, started: threading.Event) -> None:
    _, lines = stream_lines(url, body, lambda _: started.set())
    rec["events"], rec["t_done"] = sse(lines), time.monotonic()


def test_disconnected_stream_frees_its_slot_while_others_go_on(server, http, pipe):
    """4 slots: 3 long streams and one that disconnects. A fifth request gets the freed slot and
    is answered while the 3 are still generating (without the abort it would wait for one of
    them to finish), and the 3 still equal their solo runs."""
    before = scrape(http)
    n = 400
    ref = pipe.generate([65, 66], 8, temperature=0)  # a short one: a few steps once admitted
    recs, threads = [{} for _ in range(3)], []
    for i, rec in enumerate(recs):
        body = dict(prompt=PROMPTS[i], max_tokens=n, ignore_eos=True, temperature=0, stream=True)
        started = threading.Event()
        t = threading.Thread(
            target=_stream, args=(server.url, {**body, "return_token_ids": True}, rec, started)
        )
        t.start()
        threads.append(t)
        assert started.wait(120)
    leave_mid_stream(http, PROMPTS[5])
    r = http.post("/v1/completions", json=dict(prompt=[65, 66], max_tokens=8, temperature=0))
    t_answered = time.monotonic()
    assert r.json()["choices"][0]["text"] == decode(pipe, ref.tokens)
    for t in threads:
        t.join(120)
    for i, rec in enumerate(recs):
        ids = [t for e in rec["events"] for t in e["choices"][0]["token_ids"]]
        assert ids == pipe.generate(PROMPTS[i], n, [], temperature=0).tokens
        assert t_answered < rec["t_done"]  # the fifth request did not wait for a long one
    after = scrape(http)
    d = lambda name, **kw: value(after, name, **kw) - value(before, name, **kw)  # noqa: E731
    assert d("vllm:request_success_total", finished_reason="abort") == 1
    assert d("vllm:request_success_total", finished_reason="length") == 4
    assert d("vllm:generation_tokens_total") < 3 * n + 8 + 700  # the abandoned one stopped early
    assert value(after, "vllm:num_requests_running") == 0


def test_sigterm_drains_every_request_in_flight_and_exits_0(cb_artifacts, pipe):
    with ServerProcess(cb_artifacts, "--threads", "1") as server:
        n = 200
        recs, threads = [{} for _ in range(3)], []
        for i, rec in enumerate(recs):
            body = dict(prompt=PROMPTS[i], max_tokens=n, ignore_eos=True, temperature=0)
            body.update(stream=True, return_token_ids=True)
            started = threading.Event()
            t = threading.Thread(target=_stream, args=(server.url, body, rec, started))
            t.start()
            threads.append(t)
            assert started.wait(120)
        code = server.stop()  # SIGTERM while the three stream
        for t in threads:
            t.join(120)
        assert code == 0, server.log()
        for i, rec in enumerate(recs):  # drained, not cut
            ids = [t for e in rec["events"] for t in e["choices"][0]["token_ids"]]
            assert ids == pipe.generate(PROMPTS[i], n, [], temperature=0).tokens
