"""Logprobs, prompt logprobs and the extended sampling parameters through the vLLM plugin
(docs/sampling.md, under vLLM): a real `vllm serve` from `.venv-vllm` over the built-in pair
exported with `--logprobs 5 --extended-sampling`, against dflash-serve's app over the same
artifacts and `pipe.generate` in this process. Both run whole-block verifies (verify_lengths
[16]), so every step's call shapes, and so the device's values, are the same on both sides.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from openai import BadRequestError

# PROMPT: longer than the 64-row prefill chunk, so prompt logprobs cross a chunk boundary;
# TEMPLATE: the chat template of dflash-serve's app and of vllm serve
from test_logprobs import PROMPT, TEMPLATE
from test_vllm import BLOCK, B, client  # whole-block verifies, one thread

import dflash_qaic
from dflash_qaic.bench.vllm_host import VllmServer, vllm_bin

K = 5
TOL = 1e-5
PENALTIES = dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    from dflash_qaic.exporter.cli import load_recipe

    r = load_recipe("default")
    out = tmp_path_factory.mktemp("vllm-sampling") / "art"
    opts = dict(full_batch_size=2, prefill_seq_len=64, ctx_len=512, compile=False)
    dflash_qaic.export(r["target"], r["draft"], out, logprobs=K, extended_sampling=True, **opts)
    return out


@pytest.fixture(scope="module")
def pipe(art):
    p = dflash_qaic.load(art, threads=1)
    p.configure(verify_lengths=[B], spec_policy="always")  # as the server's BLOCK: seeds agree
    return p


@pytest.fixture(scope="module")
def serve(pipe):
    """dflash-serve's app over the same pipeline, in this process."""
    from fastapi.testclient import TestClient

    from dflash_qaic.serve.app import create_app
    from dflash_qaic.serve.engine import AsyncEngine

    with TestClient(create_app(AsyncEngine(pipe), "m", pipe.tokenizer, TEMPLATE)) as c:
        yield c


@pytest.fixture(scope="module")
def server(art, tmp_path_factory):
    """One `DFLASH_QAIC_VLLM=1 vllm serve` for the module (fails without .venv-vllm)."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ("--max-num-seqs", "2", "--additional-config", json.dumps(BLOCK))
    with VllmServer(art, *args, "--chat-template", str(template), timeout=420) as s:
        s.model = str(art)
        yield s


def completion(server, **kw) -> dict:
    out = client(server).completions.create(model=server.model, **kw)
    return out.model_dump()["choices"][0]


def ours(serve, path: str, body: dict) -> dict:
    r = serve.post(path, json={"model": "m", **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def same_completion_logprobs(got: dict, want: dict) -> None:
    """Completions' logprobs: the same tokens, values within TOL, the same alternatives."""
    assert got["tokens"] == want["tokens"]
    a, b = got["token_logprobs"], want["token_logprobs"]
    assert [x is None for x in a] == [x is None for x in b]
    np.testing.assert_allclose(
        [x for x in a if x is not None], [x for x in b if x is not None], atol=TOL
    )
    for i, (x, y) in enumerate(zip(got["top_logprobs"], want["top_logprobs"], strict=True)):
        if y is None:
            assert x is None, i
            continue
        assert set(x) == set(y), (i, x, y)
        np.testing.assert_allclose([x[t] for t in y], list(y.values()), atol=TOL)


def test_completions_logprobs_equal_dflash_serve_and_generate(server, serve, pipe):
    body = dict(prompt=PROMPT, max_tokens=40, temperature=0, logprobs=K)
    got = completion(server, **body, extra_body={"ignore_eos": True, "return_token_ids": True})
    want = ours(serve, "/v1/completions", {**body, "ignore_eos": True})
    assert got["text"] == want["text"]
    same_completion_logprobs(got["logprobs"], want["logprobs"])
    res = pipe.generate(PROMPT, 40, stop_token_ids=[], logprobs=K)
    assert max(res.acceptance_lengths) > 1  # accepted blocks: verify rows reached the client
    assert got["token_ids"] == res.tokens
    np.testing.assert_allclose(got["logprobs"]["token_logprobs"], res.logprobs.logprobs, atol=TOL)
    for alts, top in zip(got["logprobs"]["top_logprobs"], res.logprobs.top, strict=True):
        assert set(alts) >= {pipe.tokenizer.decode([i]) for i, _ in top}
    # streamed: the same logprobs, chunk by chunk
    stream = client(server).completions.create(
        model=server.model, **body, stream=True, extra_body={"ignore_eos": True}
    )
    tokens, values = [], []
    for chunk in stream:
        lp = chunk.choices[0].logprobs if chunk.choices else None
        if lp is not None:
            tokens += lp.tokens
            values += lp.token_logprobs
    assert tokens == got["logprobs"]["tokens"]
    np.testing.assert_allclose(values, got["logprobs"]["token_logprobs"], atol=TOL)


def test_beam_search_runs_on_the_logprobs(server, pipe):
    """vLLM's beam search (its own loop over one-token requests with logprobs): width 1 is the
    greedy answer."""
    r = client(server).completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, n=1,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )  # fmt: skip
    want = pipe.generate(PROMPT, 6, stop_token_ids=[])
    assert r.choices[0].text == pipe.tokenizer.decode(want.tokens)


def test_echo_with_logprobs_equals_dflash_serve(server, serve):
    """echo: the prompt's tokens and logprobs first (the first one's null), from the prefill."""
    body = dict(prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, echo=True)
    got = completion(server, **body, extra_body={"ignore_eos": True})
    want = ours(serve, "/v1/completions", {**body, "ignore_eos": True})
    assert got["text"] == want["text"] and got["text"].startswith(PROMPT)
    assert got["logprobs"]["token_logprobs"][0] is None
    same_completion_logprobs(got["logprobs"], want["logprobs"])


def test_chat_logprobs_equal_dflash_serve(server, serve):
    body = {
        "messages": [{"role": "user", "content": "def add(a, b):"}],
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    got = client(server).chat.completions.create(model=server.model, **body)
    got = got.model_dump()["choices"][0]
    want = ours(serve, "/v1/chat/completions", body)
    assert got["message"]["content"] == want["message"]["content"]
    a, b = got["logprobs"]["content"], want["logprobs"]["content"]
    assert [x["token"] for x in a] == [x["token"] for x in b] and len(a) > 1
    for x, y in zip(a, b, strict=True):
        assert x["bytes"] == y["bytes"]
        assert abs(x["logprob"] - y["logprob"]) < TOL
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
        np.testing.assert_allclose(
            [t["logprob"] for t in x["top_logprobs"]],
            [t["logprob"] for t in y["top_logprobs"]],
            atol=TOL,
        )


def test_prompt_logprobs_equal_generate(server, pipe):
    """vLLM's prompt_logprobs: per prompt token its log p and the top 2 (with ranks), the
    first token's None; equal to pipe.generate's."""
    ids = pipe.tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 64
    got = completion(
        server, prompt=ids, max_tokens=4, temperature=0, extra_body={"prompt_logprobs": 2}
    )["prompt_logprobs"]
    want = pipe.generate(ids, 4, prompt_logprobs=2).prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        entry = {int(t): v for t, v in got[j].items()}
        assert abs(entry[ids[j]]["logprob"] - want.logprobs[j]) < TOL, j
        top = want.top[j]
        assert set(entry) == {ids[j], *(i for i, _ in top)}, j
        for r, (i, v) in enumerate(top, 1):
            assert entry[i]["rank"] == r and abs(entry[i]["logprob"] - v) < TOL, (j, r)
        assert entry[ids[j]]["rank"] >= 1


def test_prompt_logprobs_after_a_prefix_cache_hit(pipe):
    """A prompt the prefix cache holds is still scored whole when its prompt logprobs are asked
    for (the cache is not read for it, as vLLM): dflash-serve's echo after the same prompt."""
    ids = pipe.tokenizer(PROMPT)["input_ids"]
    first = pipe.generate(ids, 4, prompt_logprobs=1)
    pipe.generate(ids, 4)  # its prefix is cached now
    again = pipe.generate(ids, 4, prompt_logprobs=1).prompt_logprobs
    assert again.token_ids == ids
    assert (
        again.logprobs == first.prompt_logprobs.logprobs and again.top == first.prompt_logprobs.top
    )


def test_sampled_tokens_and_logprobs_equal_generate(server, pipe):
    """T > 0 with a seed: the same tokens as pipe.generate, and their raw logprobs."""
    kw = dict(temperature=0.8, seed=3)
    got = completion(
        server, prompt=PROMPT, max_tokens=30, logprobs=1, **kw,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    res = pipe.generate(PROMPT, 30, stop_token_ids=[], logprobs=1, **kw)
    assert got["token_ids"] == res.tokens
    np.testing.assert_allclose(got["logprobs"]["token_logprobs"], res.logprobs.logprobs, atol=TOL)


def test_penalties_logit_bias_and_bad_words_equal_dflash_serve(server, serve, pipe):
    """Greedy under the penalties, logit_bias (which vLLM itself refuses with speculative
    decoding) and bad words: token for token dflash-serve's answer and pipe.generate's, and
    each setting changed the answer."""
    s = {**PENALTIES, "logit_bias": {"101": 2.0}}
    body = dict(prompt=PROMPT, max_tokens=32, temperature=0)
    extra = {**s, "ignore_eos": True, "bad_words": ["not"], "return_token_ids": True}
    got = completion(server, **body, extra_body=extra)
    want = ours(serve, "/v1/completions", {**body, **s, "ignore_eos": True, "bad_words": ["not"]})
    assert got["text"] == want["text"] and "not" not in got["text"]
    bad = [pipe.tokenizer.encode(w, add_special_tokens=False) for w in ("not", " not")]
    s["logit_bias"] = {101: 2.0}
    res = pipe.generate(PROMPT, 32, stop_token_ids=[], bad_words=bad, **s)
    assert got["token_ids"] == res.tokens
    without_bad = pipe.generate(PROMPT, 32, stop_token_ids=[], **s)
    assert "not" in pipe.tokenizer.decode(without_bad.tokens)
    s.pop("logit_bias")
    assert pipe.generate(PROMPT, 32, stop_token_ids=[], bad_words=bad, **s).tokens != res.tokens
    assert pipe.generate(PROMPT, 32, stop_token_ids=[]).tokens != res.tokens


def test_min_p_and_min_tokens_equal_generate(server, pipe):
    """Seeded sampling under min_p (refused by vLLM itself with speculative decoding) and
    min_tokens holding back a stop token id: pipe.generate's tokens, which each changes."""
    kw = dict(temperature=1.0, seed=5, min_p=0.3)
    early = pipe.generate(PROMPT, 32, stop_token_ids=[10], **kw)
    assert early.stop_reason == "stop_token" and len(early.tokens) < 28
    n = len(early.tokens) + 4  # the stop token is out of reach until then
    extra = {"stop_token_ids": [10], "min_tokens": n, "min_p": kw["min_p"]}
    got = completion(
        server, prompt=PROMPT, max_tokens=32, temperature=1.0, seed=5,
        extra_body={**extra, "ignore_eos": True, "return_token_ids": True},
    )["token_ids"]  # fmt: skip
    res = pipe.generate(PROMPT, 32, stop_token_ids=[10], min_tokens=n, **kw)
    assert got == res.tokens and len(got) > len(early.tokens)
    kw.pop("min_p")
    assert pipe.generate(PROMPT, 32, stop_token_ids=[10], min_tokens=n, **kw).tokens != got


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"logprobs": K + 1}, rf"above the {K} alternatives.*--logprobs {K + 1}"),
        ({"extra_body": {"prompt_logprobs": 9}}, r"prompt_logprobs 9 .*--logprobs 9"),
    ],
    ids=["logprobs", "prompt_logprobs"],
)
def test_more_alternatives_than_exported_are_400(server, kw, match):
    extra = kw.pop("extra_body", {})
    with pytest.raises(BadRequestError, match=match):
        client(server).completions.create(
            model=server.model, prompt="x = 1", max_tokens=2, extra_body=extra, **kw
        )


REFUSALS = """
import json
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from dflash_qaic.vllm.platform import DFlashQaicPlatform, Limits

DFlashQaicPlatform.limits = Limits(can_sample=True, max_top_k=64, vocab=256, max_prompt=100)
out = {}
for name, kw in (("logprobs", {"logprobs": 2}), ("prompt_logprobs", {"prompt_logprobs": 0}),
                 ("repetition_penalty", {"repetition_penalty": 1.1}), ("min_p", {"min_p": 0.1}),
                 ("logit_bias", {"logit_bias": {5: 1.0}}), ("bad_words", {"bad_words": ["x"]})):
    try:
        DFlashQaicPlatform.validate_request({"prompt_token_ids": [1, 2]}, SamplingParams(**kw))
        out[name] = None
    except VLLMValidationError as e:
        out[name] = [str(e), e.parameter]

import sys
from types import SimpleNamespace as NS
from dflash_qaic.vllm.platform import PluginConfigError, _logprobs_mode

io = NS(logprobs=5, logprobs_mode="raw_logprobs")
config = NS(model_config=NS(logprobs_mode="processed_logprobs"))
_logprobs_mode(config, NS(target=NS(io=io)))  # not typed: the artifacts' mode
out["mode"] = config.model_config.logprobs_mode
sys.argv += ["--logprobs-mode", "processed_logprobs"]
try:
    _logprobs_mode(NS(model_config=NS(logprobs_mode="processed_logprobs")), NS(target=NS(io=io)))
except PluginConfigError as e:
    out["typed"] = str(e)
print("OUT", json.dumps(out))
"""


def test_artifacts_without_the_options_refuse_with_the_re_export():
    """The platform's check (vLLM answers it with a 400) on artifacts exported without
    --logprobs and --extended-sampling: each names its parameter and the re-export. And vLLM's
    --logprobs-mode: the artifacts' unless typed, a typed other one refused."""
    python = vllm_bin().parent / "python"
    out = subprocess.run([str(python), "-c", REFUSALS], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("OUT "))
    got = json.loads(line[4:])
    assert got.pop("mode") == "raw_logprobs"
    assert "re-export with `dflash-export --logprobs-mode processed_logprobs`" in got.pop("typed")
    for name, (msg, param) in got.items():
        assert param == name, (name, msg)
        option = "--logprobs" if "logprobs" in name else "--extended-sampling"
        assert f"re-export them with `dflash-export {option}" in msg, (name, msg)
