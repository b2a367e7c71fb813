"""Prefill/decode hand-off (runtime/handoff.py): the payload's documented byte form, what a
decode engine refuses, and a refused or failing admission leaving no row taken. The ladder's
"P/D = aggregated" rung (tests/test_conformance.py) checks tokens and acceptance per family."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from dflash_qaic.runtime import handoff
from dflash_qaic.state import MAGIC, SlotState

pytestmark = pytest.mark.draft_every_step  # P/D against the aggregated run: seeded tokens

PAIR = dict(block_size=4, agree=1.25, tie_word_embeddings=False, target_layer_ids=[1, 3])


@pytest.fixture(scope="module")
def pd(exported):
    """A prefill and a decode pipeline on one export (two cache rows each), and another export
    of a different pair (its programs differ)."""
    e = exported("qwen3", "dflash", pair=PAIR, prefill_seq_len=8, ctx_len=160, full_batch_size=2)
    other = exported(
        "qwen3", "dflash", pair={**PAIR, "agree": 2.0}, prefill_seq_len=8, ctx_len=160,
        full_batch_size=2,
    )  # fmt: skip
    return e.load(verify_lengths=4), e.load(verify_lengths=4), other.load(verify_lengths=4)


IDS = list(range(3, 23))


def test_payload_bytes_are_the_documented_form(pd):
    """Magic, version, a JSON header naming both programs' sha256, the target's state specs and
    the prompt, then raw arrays: the target's rows up to P − 1 and the draft's context."""
    pre, dec, _ = pd
    data = handoff.export(pre.engine(), pre.artifacts, IDS)
    magic, version, n = struct.unpack_from("<7sBI", data)
    assert magic == MAGIC and version == 1
    header = json.loads(data[12 : 12 + n])
    head = header["meta"]["handoff"]
    assert head["version"] == handoff.VERSION and head["prompt_len"] == len(IDS)
    assert head == {**head, **handoff.fingerprint(dec.artifacts)}
    assert len(head["target_sha256"]) == 64 and head["target_state"]
    st = SlotState.from_bytes(data)
    assert st.upto == len(IDS) - 1
    feats = st.context[handoff.FEATURES]
    assert feats.shape == (len(IDS) - 1, dec.artifacts.draft.io.hidden_size)
    assert np.isfinite(feats).all() and np.abs(feats).sum() > 0
    assert st.context[handoff.POSITIONS].tolist() == list(range(len(IDS) - 1))
    assert b"pickle" not in data[: 12 + n] and data[12 + n :]  # raw array bytes follow


def test_decode_refuses_a_mismatched_payload(pd):
    pre, dec, other = pd
    data = handoff.export(pre.engine(), pre.artifacts, IDS)
    engine = dec.engine()
    req = dec.request(IDS, 8, stop_token_ids=[])
    with pytest.raises(handoff.HandoffError, match="same artifacts"):
        handoff.admit(other.engine(), other.artifacts, other.request(IDS, 8), data)
    with pytest.raises(handoff.HandoffError, match="another prompt"):
        handoff.admit(engine, dec.artifacts, dec.request(IDS[:-1] + [5], 8), data)
    with pytest.raises(handoff.HandoffError, match="not a hand-off payload"):
        handoff.admit(engine, dec.artifacts, req, b"nonsense" + data)
    plain = SlotState.from_bytes(data)
    plain.meta = {}
    with pytest.raises(handoff.HandoffError, match="format version None"):
        handoff.admit(engine, dec.artifacts, req, plain.to_bytes())
    with pytest.raises(handoff.HandoffError, match="at least 1 token"):
        handoff.export(pre.engine(), pre.artifacts, IDS[:0])
    assert not engine.busy  # nothing queued by a refusal


def test_a_one_token_prompt_hands_off_no_position(pd):
    """P = 1: the payload holds no position; the decode side computes the only prompt token
    and its tokens equal the aggregated run's, greedy and seeded."""
    pre, dec, _ = pd
    for sp in (dict(temperature=0), dict(temperature=1.0, seed=5)):
        data = handoff.export(pre.engine(), pre.artifacts, IDS[:1])
        assert SlotState.from_bytes(data).upto == 0
        engine = dec.engine()
        seq = handoff.admit(engine, dec.artifacts, dec.request(IDS[:1], 8, [], **sp), data)
        while engine.busy:
            engine.step()
        assert seq.result.tokens == dec.generate(IDS[:1], 8, stop_token_ids=[], **sp).tokens


def test_a_payload_failing_at_admission_fails_alone(pd):
    """A payload whose rows do not fit the row (write_slot refuses) fails its request with the
    error; the row is free again and the other request goes on to its aggregated tokens."""
    pre, dec, _ = pd
    data = handoff.export(pre.engine(), pre.artifacts, IDS)
    engine = dec.engine()
    bad = handoff.admit(engine, dec.artifacts, dec.request(IDS, 8, stop_token_ids=[]), data)
    name = next(iter(bad.handoff.arrays))
    bad.handoff.arrays[name] = bad.handoff.arrays[name][..., :1]  # a wrong shape
    good = handoff.admit(engine, dec.artifacts, dec.request(IDS, 8, stop_token_ids=[]), data)
    while engine.busy:
        engine.step()
    assert bad.result.stop_reason == "error" and bad.error is not None
    assert good.result.tokens == dec.generate(IDS, 8, stop_token_ids=[]).tokens
    assert sorted(engine.free) == [0, 1] and engine.slots == [None, None]


# ---------------------------------------------------------------------- two real servers

KEY = "pd-test-key"


@pytest.fixture(scope="module")
def pd_servers(default_artifacts):
    """dflash-serve --role prefill and --role decode on 127.0.0.1 (ephemeral ports), one
    thread each, sharing an --api-key; stopped by their own process ids."""
    from dflash_qaic.serve.process import ServerProcess

    common = ["--threads", "1", "--api-key", KEY]
    with ServerProcess(default_artifacts, *common, "--role", "prefill") as p:
        with ServerProcess(default_artifacts, *common, "--role", "decode") as d:
            yield p, d
            assert d.stop() == 0, d.log()
        assert p.stop() == 0, p.log()


def _post(url, body, timeout=120):
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=timeout,
                      trust_env=False)  # fmt: skip


def test_two_servers_hand_off_and_equal_the_aggregated_tokens(pd_servers, default_artifacts):
    """vLLM's contract: do_remote_decode on the prefill server -> its answer's
    kv_transfer_params -> do_remote_prefill on the decode server, which pulls the payload:
    greedy and seeded tokens equal the aggregated pipeline's; a lease is pulled once."""
    import dflash_qaic

    pre, dec = pd_servers
    agg = dflash_qaic.load(default_artifacts)
    ids = list(range(40, 70))
    for sp in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        body = dict(prompt=ids, max_tokens=12, ignore_eos=True, return_token_ids=True, **sp)
        a = _post(pre.url, {**body, "kv_transfer_params": {"do_remote_decode": True}})
        assert a.status_code == 200, a.text
        kv = a.json()["kv_transfer_params"]
        assert kv["do_remote_prefill"] and kv["payload_bytes"] > 0
        b = _post(dec.url, {**body, "kv_transfer_params": kv})
        assert b.status_code == 200, b.text
        want = agg.generate(ids, 12, stop_token_ids=[], **sp).tokens
        assert b.json()["choices"][0]["token_ids"] == want, sp
        again = _post(dec.url, {**body, "kv_transfer_params": kv})  # the lease ended
        assert again.status_code == 502 and "unknown or its lease expired" in again.text
    assert "dflash:kv_transfer_bytes_total" in _get(pre.url, "/metrics")


def _get(url, path):
    import httpx

    r = httpx.get(url + path, headers={"Authorization": f"Bearer {KEY}"}, trust_env=False)
    return r.text


def test_unreachable_prefill_fails_that_request_alone(pd_servers):
    """A decode request whose prefill server cannot be reached gets a clear error; the decode
    server goes on serving (no row held)."""
    pre, dec = pd_servers
    ids = list(range(40, 60))
    gone = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9,
            "remote_handoff_id": "h0"}  # fmt: skip
    r = _post(dec.url, dict(prompt=ids, max_tokens=4, kv_transfer_params=gone))
    assert r.status_code == 502 and "unreachable" in r.text
    streamed = dict(prompt=ids, max_tokens=4, stream=True)
    r = _post(pre.url, {**streamed, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "stream false" in r.text
    wrong = _post(pre.url, dict(prompt=ids, max_tokens=4, kv_transfer_params=gone))
    assert wrong.status_code == 400 and "--role decode" in wrong.text
    a = _post(pre.url, dict(prompt=ids, max_tokens=4, kv_transfer_params={"do_remote_decode": 1}))
    b = _post(
        dec.url, dict(prompt=ids, max_tokens=4, kv_transfer_params=a.json()["kv_transfer_params"])
    )
    assert b.status_code == 200 and b.json()["usage"]["completion_tokens"] == 4
    running = [
        line for line in _get(dec.url, "/metrics").splitlines()
        if line.startswith("vllm:num_requests_running{")
    ]  # fmt: skip
    assert running and running[0].endswith(" 0.0")  # nothing left in a row


def test_a_lease_ends_when_pulled_or_expired():
    from dflash_qaic.serve.pd import Leases

    now = [0.0]
    leases = Leases(lease_s=60.0, clock=lambda: now[0])
    a, b = leases.put(b"a"), leases.put(b"b")
    assert leases.take(a) == b"a" and leases.take(a) is None  # pulled once
    now[0] = 60.0
    assert len(leases) == 0 and leases.take(b) is None  # expired: its memory gone too


def test_the_prefill_side_caps_a_payload():
    """A payload over --kv-max-bytes is refused (413) before a lease holds it."""
    from types import SimpleNamespace

    from dflash_qaic.serve import pd
    from dflash_qaic.serve.protocol import APIError

    state = SimpleNamespace(pd=pd.Config("prefill", max_bytes=10), leases=pd.Leases())
    request = SimpleNamespace(app=SimpleNamespace(state=state), scope={})
    with pytest.raises(APIError, match="exceeds --kv-max-bytes 10") as e:
        pd.transfer_params(request, b"x" * 11)
    assert e.value.status == 413 and len(state.leases) == 0
    state.engine_id = "e"
    assert pd.transfer_params(request, b"x" * 10)["payload_bytes"] == 10
    with pytest.raises(ValueError, match="kv-max-bytes"):
        pd.Config("decode", max_bytes=0)


def test_payload_bytes_per_prompt_token_equal_the_formula(pd):
    """The raw bytes after the header are (P − 1) · (every state buffer's bytes per position +
    the feature row + its int64 position): nothing else crosses."""
    pre, _, _ = pd
    m = pre.artifacts
    per_position = 0
    for spec in m.target.io.state:
        for buf in spec.to_json()["buffers"]:
            dims = [d for i, d in enumerate(buf["shape"]) if i not in (0, buf["slot_axis"])]
            per_position += int(np.prod(dims)) * np.dtype(buf["dtype"]).itemsize
    per_position += m.draft.io.hidden_size * 4 + 8  # fp32 feature row, int64 position
    for P in (2, 9, len(IDS)):
        data = handoff.export(pre.engine(), m, IDS[:P])
        (n,) = struct.unpack_from("<I", data, 8)
        assert len(data) - 12 - n == (P - 1) * per_position


def test_shared_memory_leases_live_in_files(tmp_path):
    """--kv-transport shm: a payload is a 0600 file of the shm directory, removed when read,
    expired or the server stops."""
    from dflash_qaic.serve.pd import SHM_PREFIX, Leases

    now = [0.0]
    leases = Leases(lease_s=60.0, clock=lambda: now[0], shm_dir=tmp_path)
    a, b = leases.put(b"a"), leases.put(b"b")
    leases.put(b"c")
    path = tmp_path / (SHM_PREFIX + a)
    assert path.read_bytes() == b"a" and path.stat().st_mode & 0o777 == 0o600
    assert leases.take(a) == b"a" and not path.exists() and leases.take(a) is None
    (tmp_path / (SHM_PREFIX + b)).unlink()  # read by a decode server on this host
    assert leases.take(b) is None
    now[0] = 60.0
    assert len(leases) == 0 and not list(tmp_path.iterdir())  # c expired: its file removed
    leases.put(b"d")
    leases.close()
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def shm_prefill(default_artifacts):
    from dflash_qaic.serve.process import ServerProcess

    args = ["--threads", "1", "--api-key", KEY, "--role", "prefill", "--kv-transport", "shm"]
    with ServerProcess(default_artifacts, *args) as p:
        yield p


def test_shared_memory_transport_on_one_host(pd_servers, shm_prefill, default_artifacts):
    """A decode server on the prefill server's host reads the payload from shared memory (the
    file gone after, the lease with it); params whose shm name is not this payload's are
    pulled over HTTP; both to the aggregated tokens."""
    from pathlib import Path

    import dflash_qaic

    _, dec = pd_servers
    ids = list(range(60, 90))
    body = dict(prompt=ids, max_tokens=10, ignore_eos=True, return_token_ids=True, temperature=0)
    want = dflash_qaic.load(default_artifacts).generate(ids, 10, stop_token_ids=[]).tokens
    for via_shm in (True, False):
        before = _transfers(dec.url)
        a = _post(shm_prefill.url, {**body, "kv_transfer_params": {"do_remote_decode": True}})
        kv = a.json()["kv_transfer_params"]
        path = Path("/dev/shm") / kv["remote_shm"]
        assert path.stat().st_size == kv["payload_bytes"]
        sent = kv if via_shm else {**kv, "remote_shm": "dflash-kv-h0-000000000000"}
        b = _post(dec.url, {**body, "kv_transfer_params": sent})
        assert b.status_code == 200 and b.json()["choices"][0]["token_ids"] == want, b.text
        assert not path.exists()
        after = _transfers(dec.url)
        assert after["shm" if via_shm else "http"] == before["shm" if via_shm else "http"] + 1
        assert sum(after.values()) == sum(before.values()) + 1
        again = _post(dec.url, {**body, "kv_transfer_params": kv})
        assert again.status_code == 502 and "unknown or its lease expired" in again.text


def _transfers(url) -> dict[str, float]:
    """The decode server's pulls by transport (dflash:kv_transfer_seconds_count)."""
    out = {}
    for line in _get(url, "/metrics").splitlines():
        if line.startswith("dflash:kv_transfer_seconds_count{"):
            out[line.split('transport="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out
