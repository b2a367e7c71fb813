"""Two real dflash-serve replicas (ONNX Runtime, the built-in pair with 4 cache rows) on device
ids 3 and 5, behind a real vllm-router on 127.0.0.1, started by `serve.replicas.Replicas` (what
`dflash-serve-replicas` runs). Every output is checked against the same prompt run alone
in-process; which replica answered is read from each replica's own counters and request log.
One module-scoped fleet; every process is stopped by its pid when the module ends."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import dflash_qaic
from dflash_qaic import assets
from dflash_qaic.serve.replicas import Replicas
from tests.test_serve import decode, scrape, sse

MODEL = "replicated"
GROUPS = [[3], [5]]
PROMPTS = assets.heldout_prompts()
TIMEOUT = 120  # seconds any one request may take before the client gives up (never expected)


@pytest.fixture(scope="module")
def pipe(cb_artifacts):
    return dflash_qaic.load(cb_artifacts, threads=1)


@pytest.fixture(scope="module")
def solo(pipe):
    """The first 16 prompts' greedy token ids (16 tokens), each run alone in-process."""
    return [pipe.generate(p, 16, temperature=0).tokens for p in PROMPTS[:16]]


class SlowReplicas(Replicas):
    """Replicas whose every target call takes SLOW_CALL_S longer (tests/faulty_serve.py): a long
    stream then cannot end before the test kills its replica, on however fast a host."""

    def _replica(self, i: int, port: int = 0):
        server = super()._replica(i, port)
        server.argv[1:3] = [str(Path(__file__).with_name("faulty_serve.py"))]
        server.env["SLOW_CALL_S"] = "0.05"
        return server


@pytest.fixture(scope="module")
def fleet(cb_artifacts, tmp_path_factory):
    reps = SlowReplicas(
        cb_artifacts,
        GROUPS,
        serve_args=["--threads", "1", "--served-model-name", MODEL],
        router_args=["--health-check-interval-secs", "1", "--health-success-threshold", "1"],
        log_dir=tmp_path_factory.mktemp("replicas-logs"),
        log_level="info",  # each replica logs the id of every request it receives
        timeout=180,
    )
    with reps:
        yield reps
    assert all(r.proc.poll() is not None for r in reps.replicas)
    assert reps.router.proc.poll() is not None


def succeeded(http_or_url) -> float:
    """Requests a replica finished (every finish reason)."""
    with httpx.Client(base_url=http_or_url, timeout=30, trust_env=False) as c:
        m = scrape(c)
    return sum(v for (name, _), v in m.items() if name == "vllm:request_success_total")


def complete(url: str, prompt, n: int) -> str:
    body = dict(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as c:
        r = c.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_each_replica_reports_its_devices_and_the_gateway_metrics(fleet):
    for group, rep in zip(GROUPS, fleet.replicas):
        with httpx.Client(base_url=rep.url, timeout=30, trust_env=False) as c:
            m = scrape(c)
        ids = ",".join(map(str, group))
        info = {"backend": "ort", "target_device_ids": ids, "draft_device_ids": ids}
        assert m[("dflash:device_info", frozenset(info.items()))] == 1
        for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
            assert ("vllm:" + name, frozenset()) in m  # what llm-d's gateway scrapes
    assert set(fleet.router.workers()) == {r.url for r in fleet.replicas}


def test_16_concurrent_requests_through_the_router_equal_their_solo_runs(fleet, pipe, solo):
    n = 16
    want = [decode(pipe, ids) for ids in solo]
    before = [succeeded(r.url) for r in fleet.replicas]
    go = threading.Barrier(16)

    def run(i):
        go.wait()
        return complete(fleet.url, PROMPTS[i], n)

    with ThreadPoolExecutor(16) as ex:
        assert list(ex.map(run, range(16))) == want
    moved = [succeeded(r.url) - b for r, b in zip(fleet.replicas, before)]
    assert sum(moved) == 16 and all(m > 0 for m in moved), moved


def _stream(url: str, prompt, n: int, rec: dict, started: threading.Event) -> None:
    """One streamed request; rec gets its id and token ids, or the error that ended it."""
    body = dict(model=MODEL, prompt=prompt, max_tokens=n, ignore_eos=True, temperature=0)
    body.update(stream=True, return_token_ids=True)
    lines = []
    try:
        with httpx.Client(timeout=TIMEOUT, trust_env=False) as c:
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: {") and "id" not in rec:
                        rec["id"] = sse([line, "data: [DONE]"])[0]["id"]
                        started.set()
        events = sse(lines)
        rec["ids"] = [t for e in events for t in e["choices"][0]["token_ids"]]
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:  # the connection cut, not a hang
        rec["error"] = e
    finally:
        started.set()


def _received(reps) -> int:
    """Requests the replicas have logged receiving (all runs of each replica's log)."""
    return sum(r.log().count("Received request cmpl-") for r in reps.replicas)


def test_a_killed_replica_costs_only_its_streams_and_rejoins_when_restarted(fleet, pipe, solo):
    """4 long streams, then 2 long non-streamed requests, each sent once the one before has
    reached its replica (round robin: 3 on each); replica 0 killed then. Its streams end with
    the connection cut; its non-streamed request is retried by the router on replica 1; all the
    rest finish equal to their solo runs; new requests are all answered, by replica 1; replica 0
    started again is routed to again."""
    n = 200
    victim, other = fleet.replicas
    before, victim_before = succeeded(other.url), victim.log().count("Received request cmpl-")
    recs = [{} for _ in range(4)]
    threads = []
    for i, rec in enumerate(recs):
        started = threading.Event()
        threads.append(
            threading.Thread(target=_stream, args=(fleet.url, PROMPTS[i], n, rec, started))
        )
        threads[-1].start()
        assert started.wait(TIMEOUT) and "id" in rec, rec
    answers: dict[int, tuple] = {}

    def long(j: int) -> None:
        body = dict(model=MODEL, prompt=PROMPTS[j], max_tokens=n, ignore_eos=True, temperature=0)
        with httpx.Client(timeout=TIMEOUT, trust_env=False) as c:
            r = c.post(fleet.url + "/v1/completions", json={**body, "return_token_ids": True})
        answers[j] = (
            r.status_code,
            r.json()["choices"][0]["token_ids"] if r.is_success else r.text,
        )

    for j in (0, 1):  # prompts of streams: their solo runs serve both
        count = _received(fleet)
        threads.append(threading.Thread(target=long, args=(j,)))
        threads[-1].start()
        for _ in range(10 * TIMEOUT):  # bounded: until this request has reached its replica
            if _received(fleet) > count:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"request {j} reached no replica")
    assert victim.log().count("Received request cmpl-") - victim_before == 3  # 2 streams + 1
    victim.proc.send_signal(signal.SIGKILL)  # by its pid
    victim.proc.wait(30)
    on_victim = [i for i, r in enumerate(recs) if f"Received request {r['id']}:" in victim.log()]
    on_other = [i for i, r in enumerate(recs) if f"Received request {r['id']}:" in other.log()]
    assert len(on_victim) == len(on_other) == 2, recs

    short = [decode(pipe, ids[:8]) for ids in solo[:4]]  # greedy: 8 tokens are the 16's head
    with ThreadPoolExecutor(4) as ex:  # new requests while replica 0 is down: all answered
        assert list(ex.map(lambda i: complete(fleet.url, PROMPTS[i], 8), range(4))) == short
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    ref = {i: pipe.generate(PROMPTS[i], n, [], temperature=0).tokens for i in {0, 1, *on_other}}
    for i in on_victim:
        assert "error" in recs[i] and "ids" not in recs[i], recs[i]
    for i in on_other:
        assert recs[i]["ids"] == ref[i]
    assert answers == {j: (200, ref[j]) for j in (0, 1)}  # the one on replica 0 was retried
    # replica 1: the new requests, its own 2 streams, both non-streamed ones (one retried)
    assert succeeded(other.url) - before == 4 + 2 + 2

    fleet.restart(0)  # same port and devices; returns once the router counts it healthy
    with ThreadPoolExecutor(4) as ex:
        assert list(ex.map(lambda i: complete(fleet.url, PROMPTS[i], 8), range(4))) == short
    assert succeeded(fleet.replicas[0].url) > 0  # the restarted replica takes requests again


def test_router_bench_pairs_each_routed_request_with_its_neighbour():
    from dflash_qaic.bench.router import summary

    # two clients; client 0 starts direct, client 1 through the router (as measure() sends)
    seqs = [
        [("direct", 0.010, 0.001), ("router", 0.013, 0.002), ("direct", 0.050, 0.001)],
        [("router", 0.021, 0.003), ("direct", 0.020, 0.001), ("router", 0.090, 0.002)],
    ]
    s = summary(seqs)
    assert s["ttft"]["n"] == 3
    assert s["ttft"]["direct_ms"] == pytest.approx(20.0)  # median of 10, 50, 20
    assert s["ttft"]["router_ms"] == pytest.approx(21.0)  # median of 13, 21, 90
    assert s["ttft"]["cost_ms"] == pytest.approx(2.0)  # median of the pairs' 3 and 1
    assert s["models"]["cost_ms"] == pytest.approx(1.5)  # median of 1 and 2


def test_launcher_device_groups(cb_artifacts, capsys):
    from dflash_qaic.serve.replicas import ReplicasError, device_groups, main

    # the profile of these artifacts uses one device: replica i on device i
    assert device_groups(cb_artifacts, 3, None) == [[0], [1], [2]]
    assert device_groups(cb_artifacts, None, [[4], [6]]) == [[4], [6]]
    with pytest.raises(ReplicasError, match="device 1 is in the groups of replicas 0 and 1"):
        device_groups(cb_artifacts, None, [[0, 1], [1, 2]])
    with pytest.raises(ReplicasError, match="--replicas 3 but 2 --device-ids"):
        device_groups(cb_artifacts, 3, [[0], [1]])
    with pytest.raises(ReplicasError, match="give --replicas N"):
        device_groups(cb_artifacts, None, None)
    argv = [str(cb_artifacts), "--replicas", "2", "--serve-args=--port 9"]
    assert main(argv) == 2  # refused before anything starts
    assert "--serve-args may not set --port" in capsys.readouterr().err
