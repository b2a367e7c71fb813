"""Faults stay with the requests they hit (docs/DESIGN.md, Runtime): a program call that raises
fails the requests of that call and no others. A prompt's own prefill call fails that prompt
alone; a step's call fails the sequences in it while the queue goes on; `generate([...])`
returns a result for every prompt (a failed one marked "error" with its message); a server
answers the failed request with a JSON 500 and streams the others on. Every bystander is checked
token for token against its solo run."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

import dflash_qaic
from dflash_qaic import contract
from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
from dflash_qaic.serve.process import ServerProcess
from tests.faulty_serve import Faulty, prefill_of

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens

N, B = 3, 4  # slots, block size


@pytest.fixture(scope="module")
def art(tiny_pair, tmp_path_factory):
    t, d = tiny_pair(
        family="qwen3", block_size=B, agree=1.25, tie_word_embeddings=False, target_layer_ids=[1, 3]
    )
    out = tmp_path_factory.mktemp("fault-art")
    opts = ExportOptions(prefill_seq_len=8, ctx_len=160, compile=False, full_batch_size=N)
    build_artifacts(t, d, out, opts, progress=lambda m: None)
    return out


def prompt(n, seed):
    return torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(n, 300 + s) for s, n in enumerate([5, 13, 9, 20, 7, 11])]
NEW = [20, 31, 17, 25, 12, 22]


@pytest.fixture(scope="module")
def solo(art):
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[B])
    return [pipe.generate(p, n, stop_token_ids=[]) for p, n in zip(PROMPTS, NEW)]


def fresh(art):
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[B])  # the solo runs' steps
    return pipe


def check_bystanders(res, solo, failed: set[int]):
    assert len(res) == len(solo)
    for i, (r, s) in enumerate(zip(res, solo)):
        if i in failed:
            assert r.stop_reason == "error" and "injected fault" in r.error, (i, r.stop_reason)
            assert r.tokens == s.tokens[: len(r.tokens)]  # what it had before the fault
        else:
            assert r.stop_reason == s.stop_reason and r.error is None, (i, r.error)
            assert r.tokens == s.tokens, i
            assert r.acceptance_lengths == s.acceptance_lengths, i


def slot_call(slot: int, rows: int):
    """Picks the first batch-1 call into `slot` (rows: the feed that gives the call's rows)."""
    seen = []

    def bad(feeds) -> bool:
        hit = feeds[rows].shape[0] == 1 and int(feeds[contract.BATCH_INDEX][0, 0]) == slot
        if hit and not seen:
            seen.append(1)
            return True
        return False

    return bad


@pytest.mark.parametrize("where", ["prefill", "second-chunk", "draft-prefill"])
def test_a_failing_prefill_fails_its_request_alone(art, solo, where):
    """Prompt 1 (13 tokens: two chunks) fails in its own prefill; the 5 others, running beside
    it and queued for its slot, commit exactly their solo tokens."""
    pipe = fresh(art)
    if where == "prefill":
        pipe.target = Faulty(pipe.target, prefill_of(PROMPTS[1]))
    elif where == "second-chunk":  # the first chunk is already in the slot's cache row
        pipe.target = Faulty(pipe.target, prefill_of(PROMPTS[1][8:]))
    else:  # prompts 0, 1, 2 take slots 0, 1, 2 in order
        pipe.draft = Faulty(pipe.draft, slot_call(1, contract.TARGET_HIDDEN))
    res = pipe.generate(PROMPTS, NEW, stop_token_ids=[])
    check_bystanders(res, solo, {1})
    assert res[1].tokens == [] and res[1].error.startswith("RuntimeError: injected fault")
    assert res[1].stats["slot"] == 1


@pytest.mark.parametrize("kind", ["verify", "draft"])
def test_a_failing_step_fails_its_sequences_and_the_queue_goes_on(art, solo, kind):
    """The third step's verify (or draft) call raises: exactly the sequences in that call fail
    (keeping the tokens they had), the others and every request queued behind them complete
    with their solo tokens."""
    pipe = fresh(art)
    calls = []

    def third_step(feeds) -> bool:
        rows = feeds[contract.INPUT_IDS if kind == "verify" else contract.TARGET_HIDDEN]
        if rows.shape[0] != N or (kind == "verify" and rows.shape[1] == 1):
            return False  # a prefill call, or not this kind
        calls.append(1)
        return len(calls) == 3

    if kind == "verify":
        pipe.target = faulty = Faulty(pipe.target, third_step)
    else:
        pipe.draft = faulty = Faulty(pipe.draft, third_step)
    res = pipe.generate(PROMPTS, NEW, stop_token_ids=[])
    (feeds,) = faulty.failed
    in_call = int((feeds[contract.BATCH_INDEX] >= 0).sum())
    failed = {i for i, r in enumerate(res) if r.stop_reason == "error"}
    assert len(failed) == in_call >= 1
    check_bystanders(res, solo, failed)
    assert len(PROMPTS) - len(failed) >= len(PROMPTS) - N  # the queue ran after the fault
    assert all(res[i].tokens for i in failed)  # they had committed tokens before it


def test_one_prompt_raises_and_the_pipeline_goes_on(art, solo):
    pipe = fresh(art)
    programs = pipe.target
    pipe.target = Faulty(programs, prefill_of(PROMPTS[0]))
    with pytest.raises(RuntimeError, match="injected fault"):
        pipe.generate(PROMPTS[0], NEW[0], stop_token_ids=[])
    with pytest.raises(RuntimeError, match="injected fault"):
        list(pipe.stream(PROMPTS[0], NEW[0], stop_token_ids=[]))
    assert pipe.generate(PROMPTS[2], NEW[2], stop_token_ids=[]).tokens == solo[2].tokens
    pipe.target = programs
    assert pipe.generate(PROMPTS[0], NEW[0], stop_token_ids=[]).tokens == solo[0].tokens


def test_server_answers_the_failed_request_500_and_the_others_in_full(art, solo, monkeypatch):
    """A real dflash-serve process whose target raises on one prompt's prefill: that request
    gets a JSON 500 naming the fault; three requests in flight beside it (one streamed) get
    their solo tokens; the server goes on serving."""
    monkeypatch.setenv("FAULT_PROMPT", ",".join(map(str, PROMPTS[1])))
    server = ServerProcess(art, "--threads", "1")
    server.argv[1:3] = [str(Path(__file__).with_name("faulty_serve.py"))]
    assert server.argv[0] == sys.executable

    def body(i, stream=False):
        return dict(
            model=str(art),
            prompt=PROMPTS[i],
            max_tokens=NEW[i],
            temperature=0,
            ignore_eos=True,
            return_token_ids=True,
            stream=stream,
        )

    def post(i):
        with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as c:
            if i == 3:  # streamed
                with c.stream("POST", "/v1/completions", json=body(i, True)) as r:
                    lines = list(r.iter_lines())
                events = [ln[6:] for ln in lines if ln.startswith("data: ")]
                assert events[-1] == "[DONE]"
                toks = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
                return r.status_code, toks
            r = c.post("/v1/completions", json=body(i))
            return r.status_code, r.json()

    with server:
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(post, [0, 1, 2, 3]))
        status, err = got[1]
        assert status == 500 and "injected fault" in err["error"]["message"], got[1]
        for i in (0, 2):
            status, out = got[i]
            assert status == 200 and out["choices"][0]["token_ids"] == solo[i].tokens
        assert got[3] == (200, solo[3].tokens)
        again = post(4)  # the server goes on
        assert again[0] == 200 and again[1]["choices"][0]["token_ids"] == solo[4].tokens
        assert server.stop() == 0, server.log()
