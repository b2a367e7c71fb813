"""Logprobs from the device (docs/DESIGN.md, Logprobs): a target exported with --logprobs K
returns, per row, log p of its choice, of a scored token and its top K; the host keeps the
committed rows' only. Against Hugging Face's log_softmax on the built-in pair (fp32 ONNX
Runtime), for generated and prompt tokens, greedy and sampled, under DFlash with accepted
blocks."""

from __future__ import annotations

import numpy as np
import pytest
from sampling_ref import TOL, check_against_hf, check_prompt_logprobs, hf_logprobs

import dflash_qaic
from dflash_qaic import contract
from dflash_qaic.runtime.pipeline import GenerationError

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance asserted (drafts accepted, every length), seeded tokens

K = 5
# longer than the 64-row prefill chunk: prompt logprobs cross a chunk boundary
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib"


def _export(d, **options):
    from dflash_qaic.exporter.cli import load_recipe

    r = load_recipe("default")
    opts = dict(compile=False, prefill_seq_len=64, ctx_len=512, **options)
    dflash_qaic.export(r["target"], r["draft"], d, **opts)
    return d


@pytest.fixture(scope="module")
def lp_artifacts(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("lp") / "art", logprobs=K)


@pytest.fixture(scope="module")
def hf_model():
    from dflash_qaic import checkpoints as ck
    from dflash_qaic.exporter.cli import load_recipe

    return ck.load_target_model(load_recipe("default")["target"])


def test_generated_and_prompt_logprobs_equal_hf_greedy(lp_artifacts, hf_model):
    pipe = dflash_qaic.load(lp_artifacts)
    pipe.configure(verify_lengths=[16])
    res = pipe.generate(PROMPT, max_new_tokens=40, logprobs=K, prompt_logprobs=2)
    assert max(res.acceptance_lengths) > 1  # blocks were accepted: verify rows were recorded
    ids = pipe.tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 64
    ref = hf_logprobs(hf_model, ids + res.tokens)
    check_against_hf(res, ids, ref, K)
    # greedy: every token is the argmax, its logprob the top one's
    assert all(gen[0][0] == t for gen, t in zip(res.logprobs.top, res.tokens, strict=True))
    check_prompt_logprobs(res.prompt_logprobs, ids, ref, 2)


def test_sampled_logprobs_equal_hf_and_batch_rows_mix(lp_artifacts, hf_model):
    """At T > 0 the raw logprobs of the sampled tokens are the target's; a batch mixes rows that
    ask for logprobs, rows that ask for fewer and rows that ask for none."""
    pipe = dflash_qaic.load(lp_artifacts)
    prompts = [PROMPT, "import numpy as np\n", "class Stack:\n"]
    out = pipe.generate(
        prompts, max_new_tokens=30, temperature=0.8, seed=[1, 2, 3], logprobs=[K, 1, None]
    )
    assert out[2].logprobs is None and out[2].prompt_logprobs is None
    assert sum(max(r.acceptance_lengths) > 1 for r in out) >= 1
    for res, p, k in zip(out[:2], prompts[:2], (K, 1), strict=True):
        ids = pipe.tokenizer(p)["input_ids"]
        check_against_hf(res, ids, hf_logprobs(hf_model, ids + res.tokens), k)
    # the same seed without logprobs gives the same tokens: recording changes nothing
    alone = pipe.generate(prompts[0], max_new_tokens=30, temperature=0.8, seed=1)
    assert alone.tokens == out[0].tokens


def test_processed_logprobs_follow_the_temperature(tmp_path_factory, hf_model):
    art = _export(
        tmp_path_factory.mktemp("lp-processed") / "art",
        logprobs=2,
        logprobs_mode=contract.PROCESSED_LOGPROBS,
    )
    pipe = dflash_qaic.load(art)
    res = pipe.generate(PROMPT, max_new_tokens=12, temperature=0.5, seed=4, logprobs=2)
    ids = pipe.tokenizer(PROMPT)["input_ids"]
    check_against_hf(res, ids, hf_logprobs(hf_model, ids + res.tokens, 0.5), 2)


def test_logprobs_refused_without_the_outputs(default_artifacts, lp_artifacts):
    pipe = dflash_qaic.load(default_artifacts)
    with pytest.raises(GenerationError, match=r"re-export with `dflash-export --logprobs 2`"):
        pipe.generate("x", max_new_tokens=2, logprobs=2)
    with pytest.raises(GenerationError, match="prompt_logprobs"):
        pipe.generate("x", max_new_tokens=2, prompt_logprobs=0)
    lp = dflash_qaic.load(lp_artifacts)
    with pytest.raises(GenerationError, match=rf"above the {K} alternatives.*--logprobs 9"):
        lp.generate("x", max_new_tokens=2, logprobs=9)
    with pytest.raises(GenerationError, match="logprobs must be in 0 … 20"):
        lp.generate("x", max_new_tokens=2, logprobs=21)


def test_export_without_logprobs_has_no_logprob_io():
    io = contract.TargetIO(n_layers=1, n_kv_heads=1, head_dim=4, hidden_size=8, vocab_size=32)
    names = {s.name for s in io.inputs + io.outputs}
    assert not names & {contract.LOGPROB_IDS, contract.TOKEN_LOGPROBS, contract.TOP_LOGPROBS}
    with_lp = contract.TargetIO(**{**io.__dict__, "logprobs": 3})
    top = next(s for s in with_lp.outputs if s.name == contract.TOP_LOGPROB_IDS)
    assert top.shape == (contract.BATCH, contract.SEQ, 3)


# ---------------------------------------------------------------- dflash-serve

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def http(lp_artifacts):
    from fastapi.testclient import TestClient

    from dflash_qaic.serve.app import create_app
    from dflash_qaic.serve.engine import AsyncEngine

    pipe = dflash_qaic.load(lp_artifacts)
    with TestClient(create_app(AsyncEngine(pipe), "m", pipe.tokenizer, TEMPLATE)) as c:
        yield c, pipe


def test_completions_logprobs_and_echo_are_openai_shaped_and_equal_hf(http, hf_model):
    c, pipe = http
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2, "echo": True}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = pipe.tokenizer(PROMPT)["input_ids"]
    assert choice["text"].startswith(PROMPT)
    lp = choice["logprobs"]
    n = len(lp["tokens"])
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    gen = pipe.tokenizer(choice["text"][len(PROMPT) :])["input_ids"]
    ref = hf_logprobs(hf_model, ids + gen)
    want = [ref[j - 1][t] for j, t in enumerate(ids + gen) if j > 0]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=TOL)
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])  # k, and the token itself


def test_chat_logprobs_and_prompt_logprobs(http):
    c, _ = http
    body = {
        "messages": [{"role": "user", "content": "def add(a, b):"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "prompt_logprobs": 1,
    }
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(x["token"] for x in content) == choice["message"]["content"]
    for x in content:
        assert set(x) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(x["top_logprobs"]) == 3 and x["top_logprobs"][0]["logprob"] >= x["logprob"]
        assert x["bytes"] == list(x["token"].encode())
    pl = choice["prompt_logprobs"]
    assert pl[0] is None and all(1 <= len(e) <= 2 for e in pl[1:])
    assert all(v["logprob"] <= 0 for e in pl[1:] for v in e.values())


def test_streamed_logprobs_equal_the_whole_answer(http):
    c, _ = http
    body = {"prompt": "import os\n", "max_tokens": 16, "temperature": 0, "logprobs": 1}
    whole = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    tokens, values = [], []
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                lp = json.loads(line[6:])["choices"][0].get("logprobs")
                if lp:
                    tokens += lp["tokens"]
                    values += lp["token_logprobs"]
    assert tokens == whole["tokens"]
    np.testing.assert_allclose(values, whole["token_logprobs"], atol=1e-6)


def test_serve_refuses_logprobs_on_artifacts_without_them(default_artifacts):
    from fastapi.testclient import TestClient

    from dflash_qaic.serve.app import create_app
    from dflash_qaic.serve.engine import AsyncEngine

    pipe = dflash_qaic.load(default_artifacts)
    with TestClient(create_app(AsyncEngine(pipe), "m", pipe.tokenizer, TEMPLATE)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 1})
        assert r.status_code == 400
        err = r.json()["error"]
        assert "dflash-export --logprobs" in err["message"] and err["param"] == "logprobs"
        chat = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "needs logprobs: true" in r.json()["error"]["message"]
