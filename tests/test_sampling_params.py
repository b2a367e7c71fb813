"""Extended sampling on the device (docs/DESIGN.md, Extended sampling): repetition, presence and
frequency penalties, logit_bias, min_tokens, bad words and min_p, applied to every row's logits
from the request's history plus the block's own proposals before that row. Greedy: the tokens of
a reference loop over Hugging Face's logits (HF generate's for repetition_penalty; OpenAI's and
vLLM's formulas for the rest) under DFlash with accepted blocks; T > 0: every row of a verify
call is distributed as the target alone with the same adjustments (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_ref import adjust, reference_greedy
from test_conformance import hf_greedy
from test_sampling import ALPHA, REJECT, gof, gof_pvalue

import dflash_qaic
from dflash_qaic import contract
from dflash_qaic.runtime.pipeline import GenerationError

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance asserted (drafts accepted, every length), seeded tokens

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return "
N_NEW = 40


@pytest.fixture(scope="module")
def ext_artifacts(tmp_path_factory):
    from dflash_qaic.exporter.cli import load_recipe

    r = load_recipe("default")
    out = tmp_path_factory.mktemp("ext") / "art"
    opts = dict(compile=False, prefill_seq_len=64, ctx_len=512, extended_sampling=True)
    dflash_qaic.export(r["target"], r["draft"], out, **opts)
    return out


@pytest.fixture(scope="module")
def pipe(ext_artifacts):
    pipe = dflash_qaic.load(ext_artifacts)
    pipe.configure(verify_lengths=[16])  # whole blocks: the later rows' histories hold proposals
    return pipe


@pytest.fixture(scope="module")
def model():
    from dflash_qaic import checkpoints as ck
    from dflash_qaic.exporter.cli import load_recipe

    return ck.load_target_model(load_recipe("default")["target"])


def test_repetition_penalty_equals_hf_generate(pipe, model):
    ids = pipe.tokenizer(PROMPT)["input_ids"]
    res = pipe.generate(PROMPT, N_NEW, stop_token_ids=[], repetition_penalty=1.3)
    assert res.tokens == hf_greedy(model, ids, N_NEW, repetition_penalty=1.3)
    assert max(res.acceptance_lengths) > 1  # proposals were accepted under the penalty
    assert res.tokens != pipe.generate(PROMPT, N_NEW, stop_token_ids=[]).tokens


SETTINGS = {
    "penalties": dict(repetition_penalty=1.2, presence_penalty=0.6, frequency_penalty=0.4),
    "negative": dict(presence_penalty=-0.5, frequency_penalty=-0.3),
    "bias": dict(logit_bias={"32": -3.0, "101": 4.0, "40": -100.0}),
    "bad_words": dict(bad_words=[[32, 32], [114]]),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_equals_the_reference_under_dflash(pipe, model, name):
    s = SETTINGS[name]
    ids = pipe.tokenizer(PROMPT)["input_ids"]
    res = pipe.generate(PROMPT, N_NEW, stop_token_ids=[], **s)
    assert res.tokens == reference_greedy(model, ids, N_NEW, s)
    assert max(res.acceptance_lengths) > 1


def test_min_tokens_holds_back_the_stop_tokens(pipe, model):
    ids = pipe.tokenizer(PROMPT)["input_ids"]
    plain = pipe.generate(PROMPT, N_NEW, stop_token_ids=[]).tokens
    stop = [plain[3], plain[10]]  # the greedy output would stop at its 4th token
    res = pipe.generate(PROMPT, N_NEW, stop_token_ids=stop, min_tokens=12)
    want = reference_greedy(model, ids, N_NEW, {"min_tokens": 12}, stop)
    end = next(i for i, t in enumerate(want) if t in stop and i >= 12) + 1
    assert res.tokens == want[:end] and res.stop_reason == "stop_token"
    assert not set(res.tokens[:12]) & set(stop)


def test_settings_per_row_in_one_batch(pipe, model):
    """A continuous batch mixes rows with and without extended settings."""
    prompts = [PROMPT, "import os\n", PROMPT]
    settings = [SETTINGS["penalties"], {}, SETTINGS["bias"]]
    out = pipe.generate(
        prompts,
        N_NEW,
        stop_token_ids=[],
        repetition_penalty=[s.get("repetition_penalty", 1.0) for s in settings],
        presence_penalty=[s.get("presence_penalty", 0.0) for s in settings],
        frequency_penalty=[s.get("frequency_penalty", 0.0) for s in settings],
        logit_bias=[s.get("logit_bias") for s in settings],
    )
    for res, p, s in zip(out, prompts, settings, strict=True):
        ids = pipe.tokenizer(p)["input_ids"]
        assert res.tokens == reference_greedy(model, ids, N_NEW, s)


# ---------------------------------------------------------------- T > 0: the graph, row by row


def call_feed(pipe, seq: list[int], P: int, b: int, s: dict, rng) -> dict:
    """One target call on `seq` (fresh caches, positions 0 …): rows from P on are generated
    inputs (a verify's anchor and proposals); an earlier history of OUTPUT_COUNTS."""
    from dflash_qaic.runtime.history import ExtendedRows

    n, io = len(seq), pipe.artifacts.target.io
    req = type("Req", (), {"ids": seq[:P], "stop": frozenset()})()
    sp = pipe.sampling(temperature=s["temperature"], **s["ext"])
    ext = ExtendedRows(b, io.vocab_size)
    for r in range(b):
        ext.set_row(r, sp, req)
    np.add.at(ext.counts, (slice(None), s["earlier"]), 1.0)
    feed = {
        contract.INPUT_IDS: np.tile(np.asarray(seq, np.int64), (b, 1)),
        contract.POSITION_IDS: np.tile(np.arange(n, dtype=np.int64), (b, 1)),
        contract.TEMPERATURE: np.full(b, s["temperature"], np.float32),
        contract.TOP_K: np.zeros(b, np.int64),
        contract.TOP_P: np.ones(b, np.float32),
        contract.RANDOM_U: rng.random((b, n, contract.N_RANDOM), dtype=np.float32),
        contract.COMP_CTX_LENGTHS: np.arange(min(pipe.plan.windows), dtype=np.int64),
        **ext.arrays(),
    }
    for kv in io.kv:
        shape = kv.bind(batch_size=b, ctx_len=pipe.ctx_len)
        feed[kv.name] = np.zeros(shape, np.float32)
    return feed


def exact(model, seq, P, s: dict, with_proposals: bool = True) -> np.ndarray:
    """p of every row [n, V]: the adjusted logits after the earlier history and (unless
    with_proposals is False: a deliberately wrong rule) the generated inputs up to the row,
    then temperature and min_p."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0]
    rows = []
    for j in range(len(seq)):
        output = list(s["earlier"]) + (seq[P : j + 1] if with_proposals else [])
        x = adjust(logits[j], seq[:P], output, s["ext"]) / s["temperature"]
        p = torch.softmax(x, -1)
        p = torch.where(p >= s["ext"].get("min_p", 0.0) * p.max(), p, 0.0)
        rows.append((p / p.sum()).numpy())
    return np.array(rows)


@pytest.mark.slow  # 2000 rows of a fresh 512-slot cache: about 20 s
def test_every_verify_row_is_the_adjusted_target(pipe, model, ext_artifacts):
    import onnxruntime as ort

    prompt = "def fib(n):\n    return "
    ids = pipe.tokenizer(prompt)["input_ids"]
    P = len(ids) - 6  # the last 6 prompt tokens stand in for an anchor and its proposals
    seq = ids + pipe.generate(prompt, 14, stop_token_ids=[]).tokens
    s = {
        "temperature": 1.2,
        "earlier": [32, 32, 110],
        "ext": dict(
            repetition_penalty=1.4,
            presence_penalty=0.8,
            frequency_penalty=0.5,
            min_p=0.02,
            logit_bias={"32": 1.5},
        ),
    }
    n = 2000
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    path = str(ext_artifacts / "target" / "target.onnx")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feed = call_feed(pipe, seq, P, n, s, np.random.default_rng(7))
    (draws,) = sess.run([contract.NEXT_TOKENS], feed)
    rows = range(P - 1, len(seq))  # the rows deciding generated tokens
    good = exact(model, seq, P, s)
    wrong = exact(model, seq, P, s, with_proposals=False)
    assert np.abs(good - wrong)[P:].sum() > 0.5  # the proposals change the distributions
    p_good = gof_pvalue([gof(draws[:, j], good[j]) for j in rows])
    p_wrong = gof_pvalue([gof(draws[:, j], wrong[j]) for j in rows])
    assert p_good > ALPHA and p_wrong < REJECT, (p_good, p_wrong)


# ---------------------------------------------------------------- refusals


def test_refused_without_the_option_and_checked(default_artifacts, pipe):
    plain = dflash_qaic.load(default_artifacts)
    for kw in (
        dict(repetition_penalty=1.1),
        dict(min_p=0.1),
        dict(logit_bias={"3": 1.0}),
        dict(bad_words=[[3]]),
        dict(min_tokens=2),
    ):
        with pytest.raises(GenerationError, match=r"re-export with `dflash-export --extended"):
            plain.generate("x", 2, **kw)
    for kw, match in (
        (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0"),
        (dict(presence_penalty=3.0), r"presence_penalty must be .* in \[-2, 2\]"),
        (dict(min_p=1.5), r"min_p must be .* in \[0, 1\]"),
        (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
        (dict(logit_bias={"999999": 1}), "outside the vocabulary"),
        (dict(bad_words=[[1, 2, 3, 4, 5]]), "bad_words: at most"),
    ):
        with pytest.raises(GenerationError, match=match):
            pipe.generate("x", 2, **kw)


# ---------------------------------------------------------------- dflash-serve


def _client(artifacts):
    from fastapi.testclient import TestClient

    from dflash_qaic.serve.app import create_app
    from dflash_qaic.serve.engine import AsyncEngine

    pipe = dflash_qaic.load(artifacts)
    return TestClient(create_app(AsyncEngine(pipe), "m", pipe.tokenizer, None)), pipe


def test_serve_answers_the_parameters_as_generate(ext_artifacts):
    c, pipe = _client(ext_artifacts)
    s = dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4)
    s |= dict(logit_bias={"101": 2.0}, min_p=0.05)
    with c:
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **s}
        r = c.post("/v1/completions", json={**body, "bad_words": ["re"]})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
    bad = [pipe.tokenizer.encode(w, add_special_tokens=False) for w in ("re", " re")]
    want = pipe.generate(PROMPT, 24, stop_token_ids=[], bad_words=bad, **s)
    assert text == pipe.tokenizer.decode(want.tokens)
    assert "re" not in text


def test_serve_refuses_them_on_artifacts_without_the_option(default_artifacts):
    c, _ = _client(default_artifacts)
    with c:
        for name, value in (("repetition_penalty", 1.1), ("min_p", 0.1), ("bad_words", ["x"])):
            body = {"prompt": "x", "max_tokens": 2, name: value}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == name and "dflash-export --extended-sampling" in err["message"]
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
