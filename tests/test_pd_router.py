"""A real vllm-router in its P/D mode (`--vllm-pd-disaggregation --prefill URL --decode URL`) in
front of a real `dflash-serve --role prefill` and `--role decode` (the built-in pair, 4 cache
rows, ONNX Runtime), started by `serve.replicas.Replicas` with roles (what `dflash-serve-replicas
--prefill-device-ids … --decode-device-ids …` runs), everything on 127.0.0.1 and stopped by its
pid. The router sends the prefill server the request with max_tokens 1, stream false and
{"do_remote_decode": true, ...}, copies the answer's kv_transfer_params into the original
request and streams the decode server's answer: the tokens must equal the aggregated run's.

The faults: the prefill server killed while it holds a request (its device hung), a transfer
cut mid-body, a prefill server on other artifacts (refused at the handshake, before any
payload is pulled), a payload over the byte cap, an unreachable prefill server with and
without --fallback-local-prefill. Tests wait on events (log lines, first stream events),
never on durations."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

import dflash_qaic
from dflash_qaic.serve.process import ServerProcess
from dflash_qaic.serve.replicas import Replicas
from tests.test_serve import scrape, sse

KEY = "pd-router-key"
HANG = [7, 7, 7, 7, 9]  # the prefill server's device hangs on a prompt beginning so
TIMEOUT = 120  # seconds a client waits (never expected)
# acceptance comparable across servers: every step drafts and verifies the whole block
WHOLE_BLOCKS = ["--verify-lengths", "16", "--spec-policy", "always"]


class HangingPrefill(Replicas):
    """The prefill replica runs tests/faulty_serve.py: a prompt beginning with HANG hangs it."""

    def _replica(self, i: int, port: int = 0):
        server = super()._replica(i, port)
        if self.roles[i] == "prefill":
            server.argv[1:3] = [str(Path(__file__).with_name("faulty_serve.py"))]
            server.env["HANG_PROMPT"] = ",".join(map(str, HANG))
        return server


@pytest.fixture(scope="module")
def fleet(cb_artifacts, tmp_path_factory):
    reps = HangingPrefill(
        cb_artifacts,
        [[3], [5]],
        roles=["prefill", "decode"],
        serve_args=["--threads", "1", "--api-key", KEY, *WHOLE_BLOCKS],
        log_dir=tmp_path_factory.mktemp("pd-logs"),
        log_level="info",  # the prefill server logs each request it receives
        timeout=180,
    )
    with reps:
        yield reps
    assert reps.router.proc.poll() is not None


@pytest.fixture(scope="module")
def agg(cb_artifacts):
    pipe = dflash_qaic.load(cb_artifacts, threads=1)
    pipe.configure(verify_lengths=[16], spec_policy="always")
    return pipe


def _client(url: str) -> httpx.Client:
    return httpx.Client(
        base_url=url, timeout=TIMEOUT, trust_env=False, headers={"Authorization": f"Bearer {KEY}"}
    )


def _tokens(url: str, body: dict) -> list[int]:
    """The token ids of one completion, streamed or not."""
    with _client(url) as c:
        if not body.get("stream"):
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            events = sse(list(r.iter_lines()))
    return [t for e in events for t in e["choices"][0]["token_ids"]]


def _metric(url: str, name: str) -> float:
    with _client(url) as c:
        m = scrape(c)
    return sum(v for (n, _), v in m.items() if n == name)


def test_router_pd_mode_equals_the_aggregated_tokens(fleet, agg):
    """Greedy and seeded, streamed and not: the router's answer has the aggregated tokens; the
    prefill server exported as many bytes as the decode server pulled; /metrics says the role."""
    pre, dec = fleet.replicas
    ids = list(range(40, 90))
    sent = _metric(pre.url, "dflash:kv_transfer_bytes_total")
    for sp in (dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.7, seed=11)):
        ref = agg.generate(ids, 24, stop_token_ids=[], **sp)
        for stream in (False, True):
            body = dict(prompt=ids, max_tokens=24, ignore_eos=True, return_token_ids=True, **sp)
            before = _acceptance(dec.url)
            assert _tokens(fleet.url, {**body, "stream": stream}) == ref.tokens, (sp, stream)
            after = _acceptance(dec.url)  # the draft's context crossed: acceptance equal
            steps = len(ref.acceptance_lengths)
            want = (steps, sum(ref.acceptance_lengths) - steps)
            assert (after[0] - before[0], after[1] - before[1]) == want, sp
    one = dict(prompt=ids[:1], max_tokens=8, ignore_eos=True, return_token_ids=True, temperature=0)
    assert _tokens(fleet.url, one) == agg.generate(ids[:1], 8, stop_token_ids=[]).tokens
    sent = _metric(pre.url, "dflash:kv_transfer_bytes_total") - sent
    assert sent > 0 and sent == _metric(dec.url, "dflash:kv_transfer_received_bytes_total")
    assert _metric(dec.url, "dflash:kv_transfer_seconds_count") == 7
    with _client(dec.url) as c:
        assert 'dflash:role_info{model_name="' in c.get("/metrics").text
        assert 'role="decode"} 1.0' in c.get("/metrics").text
        plain = c.post("/v1/completions", json=dict(prompt=ids, max_tokens=4))
    assert plain.status_code == 400 and "--fallback-local-prefill" in plain.text


def _acceptance(url: str) -> tuple[float, float]:
    """A server's vllm:spec_decode_num_drafts and _num_accepted_tokens totals."""
    m = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")
    return _metric(url, m[0]), _metric(url, m[1])


# ------------------------------------------------------------ a fake prefill server


class FakePrefill:
    """A prefill server on 127.0.0.1 that answers the handshake with `hello` and a payload GET
    with `payload`, sending only its first `cut` bytes (then closing) when cut is set; it
    records the paths asked."""

    def __init__(self, hello: dict, payload: bytes = b"", cut: int | None = None,
                 length: int | None = None):  # fmt: skip
        fake = self
        self.paths: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                fake.paths.append(self.path)
                body = json.dumps(hello).encode() if self.path == "/v1/dflash/kv" else payload
                self.send_response(200)
                self.send_header("Content-Length", str(length or len(body)))
                self.end_headers()
                self.wfile.write(body if cut is None or body is not payload else body[:cut])
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _handed_off(fleet, ids) -> tuple[dict, dict]:
    """A real prefill answer's kv_transfer_params for `ids`, and the prefill's handshake."""
    pre = fleet.replicas[0]
    with _client(pre.url) as c:
        body = dict(prompt=ids, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["kv_transfer_params"], c.get("/v1/dflash/kv").json()


def _decode(url: str, ids, kv: dict) -> httpx.Response:
    with _client(url) as c:
        body = dict(prompt=ids, max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True)
        return c.post("/v1/completions", json={**body, "kv_transfer_params": kv})


def _idle(url: str) -> None:
    """The server is healthy and holds no request in a row (its slot gauges)."""
    with _client(url) as c:
        assert c.get("/health").status_code == 200
    assert _metric(url, "vllm:num_requests_running") == 0
    assert _metric(url, "vllm:kv_cache_usage_perc") == 0


def test_faults_of_the_transfer_fail_their_request_alone(fleet, agg):
    """A transfer cut mid-body, a prefill server on other artifacts (refused at the handshake:
    no payload pulled), a payload over --kv-max-bytes (refused from its Content-Length), a
    payload of another prompt, an ended lease: each a 502 naming the cause; the decode server then serves the hand-off it
    can have, to the aggregated tokens, and holds no row."""
    dec = fleet.replicas[1]
    ids = list(range(100, 140))
    kv, hello = _handed_off(fleet, ids)
    data = httpx.get(
        f"http://127.0.0.1:{kv['remote_port']}/v1/dflash/kv/{kv['remote_handoff_id']}",
        headers={"Authorization": f"Bearer {KEY}"}, trust_env=False,
    ).content  # fmt: skip
    assert len(data) == kv["payload_bytes"]
    other = {**hello, "fingerprint": {**hello["fingerprint"], "target_sha256": "0" * 64}}
    cases = [
        (dict(hello=hello, payload=data, cut=len(data) // 2), "ended the transfer early"),
        (dict(hello=other, payload=data), "loads other artifacts (target_sha256 differ)"),
        (dict(hello=hello, payload=b"x", length=(1 << 30) + 1), "exceeds --kv-max-bytes"),
    ]
    for kw, message in cases:
        with FakePrefill(**kw) as fake:
            r = _decode(dec.url, ids, {**kv, "remote_port": fake.port})
        assert r.status_code == 502 and message in r.json()["error"]["message"], r.text
        if kw["hello"] is other:
            assert fake.paths == ["/v1/dflash/kv"]  # refused at the handshake: nothing pulled
    with FakePrefill(hello, data) as fake:  # refused off the engine thread: another prompt
        r = _decode(dec.url, ids[:-1] + [5], {**kv, "remote_port": fake.port})
    assert r.status_code == 502 and "prefilled for another prompt" in r.text, r.text
    with FakePrefill(hello, data) as fake:  # the whole payload: served
        r = _decode(dec.url, ids, {**kv, "remote_port": fake.port})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == agg.generate(ids, 8, stop_token_ids=[]).tokens
    r = _decode(dec.url, ids, kv)  # the real lease ended when it was pulled above
    assert r.status_code == 502 and "unknown or its lease expired" in r.text
    _idle(dec.url)


@pytest.fixture(scope="module")
def fallback(cb_artifacts):
    """A decode server with --fallback-local-prefill."""
    args = ["--threads", "1", "--api-key", KEY, "--role", "decode", "--fallback-local-prefill"]
    with ServerProcess(cb_artifacts, *args) as d:
        yield d


def test_fallback_local_prefill(fleet, fallback, agg):
    """With --fallback-local-prefill an unreachable prefill server, an ended lease and a
    request bringing no hand-off are prefilled locally: the aggregated tokens; counted."""
    ids = list(range(200, 230))
    want = agg.generate(ids, 8, stop_token_ids=[]).tokens
    kv, _ = _handed_off(fleet, ids)
    body = dict(prompt=ids, max_tokens=8, ignore_eos=True, return_token_ids=True, temperature=0)
    for params in ({**kv, "remote_port": 9}, {**kv, "remote_handoff_id": "gone"}, None):
        assert _tokens(fallback.url, {**body, "kv_transfer_params": params}) == want
    assert _metric(fallback.url, "dflash:kv_transfer_fallbacks_total") == 2
    assert _tokens(fallback.url, {**body, "kv_transfer_params": kv}) == want  # pulled
    assert _metric(fallback.url, "dflash:kv_transfer_received_bytes_total") == kv["payload_bytes"]
    _idle(fallback.url)


def _stream(url: str, body: dict, rec: dict, started: threading.Event) -> None:
    """A streamed request through the router: rec gets its token ids, or its error."""
    try:
        with _client(url) as c:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
        rec["ids"] = [t for e in sse(lines) for t in e["choices"][0]["token_ids"]]
    except Exception as e:  # noqa: BLE001 (the test reads it)
        rec["error"] = e
    finally:
        started.set()


def test_prefill_killed_mid_request(fleet, agg):
    """A stream is decoding; the prefill server's device hangs on another request and the
    server is killed while it holds it: that request ends with an error naming the prefill
    step, the stream goes on to its aggregated tokens, the decode server stays healthy with
    no row held; the prefill server restarted, requests go through again."""
    pre, dec = fleet.replicas
    ids = list(range(20, 60))
    rec, started = {}, threading.Event()
    body = dict(prompt=ids, max_tokens=200, ignore_eos=True, return_token_ids=True, temperature=0)
    streaming = threading.Thread(target=_stream, args=(fleet.url, body, rec, started))
    streaming.start()
    assert started.wait(TIMEOUT) and "error" not in rec
    seen = pre.log().count("Received request cmpl-")
    hung = {}

    def send():
        with _client(fleet.url) as c:
            body = dict(prompt=HANG + ids, max_tokens=8, temperature=0)
            hung["r"] = c.post("/v1/completions", json=body)

    sender = threading.Thread(target=send)
    sender.start()
    while pre.log().count("Received request cmpl-") == seen:  # the prefill server holds it
        assert sender.is_alive(), hung["r"].text
        threading.Event().wait(0.05)
    pre.proc.kill()
    sender.join(TIMEOUT)
    streaming.join(TIMEOUT)
    r = hung["r"]
    assert r.status_code >= 500 and "refill" in r.text, r.text
    assert rec.get("ids") == agg.generate(ids, 200, stop_token_ids=[]).tokens, rec.get("error")
    _idle(dec.url)
    fleet.restart(0)
    want = agg.generate(ids, 8, stop_token_ids=[]).tokens
    body = dict(prompt=ids, max_tokens=8, ignore_eos=True, return_token_ids=True, temperature=0)
    assert _tokens(fleet.url, body) == want


def test_launcher_xpyd_groups(cb_artifacts, capsys):
    """dflash-serve-replicas --prefill-device-ids … --decode-device-ids …: the prefill groups
    then the decode groups, each device in one group; mixed with --replicas refused."""
    from argparse import Namespace

    from dflash_qaic.serve.replicas import ReplicasError, _groups_and_roles, main, parser

    args = parser().parse_args(
        [str(cb_artifacts), "--prefill-device-ids", "0", "--prefill-device-ids", "1",
         "--decode-device-ids", "2,3"]
    )  # fmt: skip
    assert _groups_and_roles(args) == ([[0], [1], [2, 3]], ["prefill", "prefill", "decode"])
    both = Namespace(artifacts=cb_artifacts, replicas=2, device_ids=None,
                     prefill_device_ids=None, decode_device_ids=None)  # fmt: skip
    assert _groups_and_roles(both) == ([[0], [1]], ["both", "both"])
    with pytest.raises(ReplicasError, match="device 1 is in the groups of replicas 1 and 2"):
        _groups_and_roles(Namespace(**{**vars(args), "decode_device_ids": [[1]]}))
    with pytest.raises(ReplicasError, match="leave out --replicas"):
        _groups_and_roles(Namespace(**{**vars(args), "replicas": 2}))
    assert main([str(cb_artifacts), "--prefill-device-ids", "0"]) == 2  # no decode group
    assert "at least one prefill and one decode" in capsys.readouterr().err
