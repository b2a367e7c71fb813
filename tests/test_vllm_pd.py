"""Prefill/decode between two `vllm serve` (dflash_qaic/vllm/connector.py): a producer and a
consumer from `.venv-vllm` (make setup-vllm) with `--kv-transfer-config` naming
DFlashQaicConnector, each bound to 127.0.0.1 and stopped by its pid, over the continuous-batching
artifacts of the built-in pair, both guarded by VLLM_API_KEY (the side channel too).

A request crosses as vllm-router's P/D mode sends it, by hand: to the producer with max_tokens 1
and {"do_remote_decode": true}, then to the consumer with the producer answer's
kv_transfer_params. The aggregated run it must equal is the same request sent to the consumer
without params (a consumer prefills those itself, as vLLM's connectors do) and pipe.generate
(dflash-serve's engine) in this process. Every server verifies whole blocks with the "always"
step policy, so acceptance is determined and vLLM's spec-decode counters compare per request.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import dflash_qaic
from dflash_qaic import assets
from dflash_qaic.bench.vllm_host import VllmServer, free_port

B = 16
BLOCK = {"dflash_qaic": {"verify_lengths": [B], "spec_policy": "always", "threads": 1}}
KEY = "vllm-pd-key"
PROMPTS = assets.heldout_prompts()
#: this checkout (the servers import its dflash_qaic even if .venv-vllm's editable install
#: points at another checkout)
ROOT = Path(dflash_qaic.__file__).resolve().parent.parent
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")


def _kv_config(role: str, **kw) -> str:
    return json.dumps({"kv_connector": "DFlashQaicConnector", "kv_role": role, **kw})


@pytest.fixture(scope="module")
def pipe(cb_artifacts):
    p = dflash_qaic.load(cb_artifacts, threads=1)
    p.configure(verify_lengths=[B], spec_policy="always")
    return p


@pytest.fixture(scope="module")
def pd(cb_artifacts):
    env = {"PYTHONPATH": str(ROOT), "VLLM_API_KEY": KEY}
    common = ("--max-num-seqs", "4", "--additional-config", json.dumps(BLOCK))
    port = free_port()
    prod = _kv_config("kv_producer", kv_port=port)
    cons = _kv_config("kv_consumer")
    with (
        VllmServer(cb_artifacts, *common, "--kv-transfer-config", prod, timeout=420, env=env) as p,
        VllmServer(cb_artifacts, *common, "--kv-transfer-config", cons, timeout=420, env=env) as c,
    ):
        yield SimpleNamespace(prod=p, cons=c, model=str(cb_artifacts), kv_port=port)


def _client() -> httpx.Client:
    auth = {"Authorization": f"Bearer {KEY}"}
    return httpx.Client(trust_env=False, timeout=300, headers=auth)


def _counters(url: str) -> tuple[float, ...]:
    from prometheus_client.parser import text_string_to_metric_families

    with _client() as c:
        text = c.get(url + "/metrics").text
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return tuple(got.get(name, 0.0) for name in COUNTERS)


def _complete(url: str, body: dict) -> httpx.Response:
    with _client() as c:
        return c.post(url + "/v1/completions", json=body)


def _measured(url: str, body: dict) -> tuple[list[int], tuple[float, ...]]:
    """A completion's token ids and the server's spec-decode counters it moved."""
    before = _counters(url)
    r = _complete(url, body)
    assert r.status_code == 200, r.text
    after = _counters(url)
    return r.json()["choices"][0]["token_ids"], tuple(a - b for a, b in zip(after, before))


def _prefilled(pd, body: dict) -> dict:
    """The producer's answer's kv_transfer_params for `body` (its one token dropped)."""
    pre = {**body, "max_tokens": 1, "stream": False}
    pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    r = _complete(pd.prod.url, pre)
    assert r.status_code == 200, r.text
    kv = r.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_port"] == pd.kv_port
    return kv


def _side_channel(pd, path: str, key: str | None = KEY) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(trust_env=False, timeout=30, headers=auth) as c:
        return c.get(f"http://127.0.0.1:{pd.kv_port}/v1/dflash/kv{path}")


def _body(pd, prompt, n: int, **kw) -> dict:
    body = dict(model=pd.model, prompt=prompt, max_tokens=n, temperature=0)
    return {**body, "ignore_eos": True, "return_token_ids": True, **kw}


@pytest.mark.parametrize("i", [3, 14])
def test_pd_equals_aggregated_tokens_and_acceptance(pd, pipe, i):
    """Greedy through producer -> consumer: the tokens of the consumer's aggregated run and of
    pipe.generate, and per request the same vllm:spec_decode_* counts as the aggregated run
    and as our acceptance lengths (the draft's context crossed); the lease was taken."""
    body = _body(pd, PROMPTS[i], 64)
    agg, agg_acc = _measured(pd.cons.url, body)
    kv = _prefilled(pd, body)
    got, pd_acc = _measured(pd.cons.url, {**body, "kv_transfer_params": kv})
    ref = pipe.generate(PROMPTS[i], 64, stop_token_ids=[])
    assert got == agg == ref.tokens
    lengths = ref.acceptance_lengths
    assert pd_acc == agg_acc == (len(lengths), sum(lengths) - len(lengths))
    assert sum(lengths) / len(lengths) > 2  # real multi-token steps were compared
    gone = _side_channel(pd, "/" + kv["remote_handoff_id"])
    assert gone.status_code == 404 and "unknown or its lease expired" in gone.text


def test_pd_seeded_sampling_equals_aggregated(pd, pipe):
    """T > 0 with a seed: the consumer computes the last prompt token itself, so no sampler
    state crosses and the draws equal the aggregated run's."""
    body = _body(pd, PROMPTS[5], 40, temperature=1.0, top_p=0.9, seed=7)
    agg, _ = _measured(pd.cons.url, body)
    got, _ = _measured(pd.cons.url, {**body, "kv_transfer_params": _prefilled(pd, body)})
    ref = pipe.generate(PROMPTS[5], 40, stop_token_ids=[], temperature=1.0, top_p=0.9, seed=7)
    assert got == agg == ref.tokens


def test_through_vllm_router_pd_mode(pd, pipe, tmp_path):
    """vllm-router --vllm-pd-disaggregation in front of the producer and the consumer (it asks
    the producer for min_tokens 1 and sends its own $OPENAI_API_KEY upstream): the tokens and
    the consumer's spec-decode counts of the aggregated run."""
    from dflash_qaic.serve.replicas import Router

    body = _body(pd, PROMPTS[9], 48)
    agg, agg_acc = _measured(pd.cons.url, body)
    router = Router(
        [pd.prod.url], "127.0.0.1", free_port(), "round_robin", free_port(), [],
        tmp_path / "router.log", decode=[pd.cons.url], api_key=KEY,
    )  # fmt: skip
    router.start(60)
    try:
        before = _counters(pd.cons.url)
        r = _complete(router.url, body)
        assert r.status_code == 200, r.text
        moved = tuple(a - b for a, b in zip(_counters(pd.cons.url), before))
    finally:
        router.stop()
    assert r.json()["choices"][0]["token_ids"] == agg
    assert agg == pipe.generate(PROMPTS[9], 48, stop_token_ids=[]).tokens
    assert moved == agg_acc


@pytest.mark.parametrize("ids", [[72], [72, 101]])
def test_one_and_two_token_prompts(pd, pipe, ids):
    """A one-token prompt hands off no position and a two-token prompt one: the consumer still
    computes the last prompt token itself, to the aggregated tokens and counts."""
    body = _body(pd, ids, 24)
    agg, agg_acc = _measured(pd.cons.url, body)
    got, pd_acc = _measured(pd.cons.url, {**body, "kv_transfer_params": _prefilled(pd, body)})
    assert got == agg == pipe.generate(ids, 24, stop_token_ids=[]).tokens
    assert pd_acc == agg_acc


def test_side_channel_handshake_and_key(pd, cb_artifacts):
    """The producer's side channel answers the handshake with its payload version and the
    artifacts' fingerprint, behind VLLM_API_KEY."""
    from dflash_qaic.runtime import handoff

    hello = _side_channel(pd, "").json()
    assert hello["version"] == handoff.VERSION
    assert hello["fingerprint"] == handoff.fingerprint(dflash_qaic.load(cb_artifacts).artifacts)
    assert _side_channel(pd, "", key=None).status_code == 401
    assert _side_channel(pd, "", key="wrong").status_code == 401


def test_a_hand_off_that_cannot_be_had_fails_its_request_alone(pd, pipe):
    """Params naming a lease the producer does not hold, or a producer that is not there: that
    request ends with vLLM's error naming the cause; the consumer goes on, and the lease of a
    real hand-off is not consumed by the failed ones."""
    body = _body(pd, PROMPTS[7], 24)
    kv = _prefilled(pd, body)
    for bad in (
        {**kv, "remote_handoff_id": "no-such-request"},
        {**kv, "remote_port": free_port(), "remote_engine_id": "elsewhere"},
    ):
        r = _complete(pd.cons.url, {**body, "kv_transfer_params": bad})
        assert r.status_code >= 400 or r.json()["choices"][0]["finish_reason"] == "error", r.text
    log = pd.cons.log()
    assert "unknown or its lease expired" in log and "is unreachable" in log
    got, _ = _measured(pd.cons.url, {**body, "kv_transfer_params": kv})
    assert got == pipe.generate(PROMPTS[7], 24, stop_token_ids=[]).tokens


def test_fallback_local_prefill(pd, pipe, cb_artifacts):
    """A consumer with fallback_local_prefill prefills a request whose hand-off cannot be had
    itself, to the aggregated tokens, and says so in its log."""
    extra = {"fallback_local_prefill": True}
    cons = _kv_config("kv_consumer", kv_connector_extra_config=extra)
    args = ("--max-num-seqs", "4", "--additional-config", json.dumps(BLOCK))
    env = {"PYTHONPATH": str(ROOT), "VLLM_API_KEY": KEY}
    with VllmServer(cb_artifacts, *args, "--kv-transfer-config", cons, timeout=420, env=env) as c:
        body = _body(pd, PROMPTS[8], 24)
        kv = {**_prefilled(pd, body), "remote_handoff_id": "no-such-request"}
        got, _ = _measured(c.url, {**body, "kv_transfer_params": kv})
        assert got == pipe.generate(PROMPTS[8], 24, stop_token_ids=[]).tokens
        assert "prefilling locally" in c.log() and "unknown or its lease expired" in c.log()


CONFIG_CHECKS = """
import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from vllm.config import KVTransferConfig
from dflash_qaic.vllm import connector, platform

def cfg(name="DFlashQaicConnector", role="kv_consumer", **extra):
    kv = KVTransferConfig(kv_connector=name, kv_role=role, kv_connector_extra_config=extra)
    return SimpleNamespace(kv_transfer_config=kv)

out = {}
for key, c in (("unknown", cfg(lease=5)), ("zero", cfg(max_bytes=0))):
    try:
        connector.Options.of(c)
        out[key] = "accepted"
    except ValueError as e:
        out[key] = str(e)
try:
    connector.for_worker(cfg("NixlConnector", "kv_both"), None)
    out["other"] = "accepted"
except ValueError as e:
    out["other"] = str(e)
out["none"] = connector.for_worker(SimpleNamespace(kv_transfer_config=None), None)
c = cfg(role="kv_producer")
platform._connector_module(c)
out["module"] = c.kv_transfer_config.kv_connector_module_path
out["producer"] = connector.Options.of(c).producer
print(json.dumps(out))
"""


def test_connector_config_errors_name_the_fix():
    """Unknown extra keys and a cap of 0 are refused naming what it reads; another connector
    under the plugin is refused (its worker hooks would never run); our connector by name is
    imported from our module (no registration)."""
    from dflash_qaic.bench.vllm_host import vllm_bin

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    py = vllm_bin().parent / "python"
    run = subprocess.run([str(py), "-c", CONFIG_CHECKS], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "unknown kv_connector_extra_config keys ['lease']" in out["unknown"]
    assert "max_bytes" in out["unknown"] and "lease_s" in out["unknown"]
    assert "must be > 0" in out["zero"]
    assert "'NixlConnector'" in out["other"] and "DFlashQaicConnector" in out["other"]
    assert out["none"] is None
    assert out["module"] == "dflash_qaic.vllm.connector" and out["producer"] is True


class HeldProducer:
    """A producer's side channel on 127.0.0.1 that answers the handshake with `hello` and holds
    every payload GET until `release` is set, then sends `payload`."""

    def __init__(self, hello: dict, payload: bytes):
        self.asked, self.release = threading.Event(), threading.Event()
        held = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                body = json.dumps(hello).encode()
                if self.path != "/v1/dflash/kv":
                    held.asked.set()
                    held.release.wait(120)
                    body = payload
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_pull_in_flight_does_not_hold_the_other_requests(pd, pipe):
    """While one request's payload is still on its way (a side channel that holds it), a
    request already decoding on the consumer runs to its end; the held request then gets its
    payload and the aggregated tokens (a pull inside the step would have stalled the other
    request until the pull timed out, failing the held one)."""
    body = _body(pd, PROMPTS[10], 24)
    kv = _prefilled(pd, body)
    payload = _side_channel(pd, "/" + kv["remote_handoff_id"]).content
    held = HeldProducer(_side_channel(pd, "").json(), payload)
    out: dict = {}

    def go(key, b):
        out[key] = _complete(pd.cons.url, b)

    other = threading.Thread(target=go, args=("other", _body(pd, PROMPTS[11], 160)))
    waiting = threading.Thread(
        target=go, args=("held", {**body, "kv_transfer_params": {**kv, "remote_port": held.port}})
    )
    try:
        other.start()
        waiting.start()
        assert held.asked.wait(120), "the consumer never asked for the payload"
        other.join(240)
        assert not other.is_alive() and out["other"].status_code == 200
        assert "held" not in out  # its payload is still held
    finally:
        held.close()
    waiting.join(240)
    assert out["held"].status_code == 200, out["held"].text
    assert (
        out["held"].json()["choices"][0]["token_ids"]
        == pipe.generate(PROMPTS[10], 24, stop_token_ids=[]).tokens
    )
    ref = pipe.generate(PROMPTS[11], 160, stop_token_ids=[]).tokens
    assert out["other"].json()["choices"][0]["token_ids"] == ref
