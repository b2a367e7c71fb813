"""Verify lengths (docs/DESIGN.md, Verify length): the target exported with Verify
specializations of several lengths, the draft's confidences, and the engine's choice of how much
of each block to verify.

Any length is lossless: greedy tokens equal Hugging Face greedy generate at every forced length,
batched or alone; sampled tokens follow the target's exact distribution at a forced short length.
The choice: the most expected tokens per second when greedy (so a device whose calls cost the
same at any length always verifies the whole block), the confidences alone when sampling (so a
seed reproduces its tokens whatever the timings).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from test_sampling import PROMPT as SAMPLING_PROMPT
from test_sampling import exact_first_two, gof, gof_pvalue

import dflash_qaic
from dflash_qaic import contract
from dflash_qaic.artifacts.build import ExportError, ExportOptions, build_artifacts
from dflash_qaic.exporter.draft import check_feeds
from dflash_qaic.runtime.stats import StepCosts

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens

B, CHUNK, CTX = 8, 16, 96


class Fixed(StepCosts):
    """Always the same verify length."""

    def __init__(self, n):
        super().__init__(warmup_calls=0)
        self.n = n

    def best_length(self, lengths, confidences, sampled=False):
        assert self.n in lengths
        return self.n


@pytest.fixture(scope="module")
def built(exported):
    """built(…) -> (artifacts, HF model), exported once per session (tests/conftest.py)."""

    def make(full_batch_size=None, emit_logits=False, vocab=None, agree=1.25, block=B):
        pair = dict(block_size=block, agree=agree, tie_word_embeddings=False)
        if vocab:
            pair["vocab_size"] = vocab
        e = exported("qwen3", pair={**pair, "target_layer_ids": [1, 3]}, prefill_seq_len=CHUNK,
                     ctx_len=CTX, full_batch_size=full_batch_size, emit_logits=emit_logits)  # fmt: skip
        return e.artifacts, e.model()

    return make


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 200, n).tolist()


# ---------------------------------------------------------------- the export


def test_export_has_every_verify_length_and_the_confidences(built):
    art, _ = built(emit_logits=True)
    m = dflash_qaic.load(art).artifacts
    assert m.plan.verify_lengths == (2, 4, 8)
    names = {s["name"] for s in m.target.specializations}
    assert {"Verify[2]", "Verify[4]", "Verify", "VerifySampled[2]", "VerifySampled"} <= names
    for s in m.target.specializations:
        if s["kind"] == contract.VERIFY_SAMPLED:
            assert s["symbols"][contract.SAMPLE] == s["symbols"][contract.SEQ]
    assert m.to_json()["verify_lengths"] == [2, 4, 8] and "verify_lengths" not in m.target.facts
    assert m.draft.io.confidence
    # the confidence is the softmax over the 16 largest logits, at the argmax
    sess = ort.InferenceSession(str(art / m.draft.onnx), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    io = m.draft.io
    for feed in check_feeds(io, list(m.draft.specializations)[:2], m.mask_token_id, seed=3):
        out = dict(zip(names, sess.run(None, feed)))
        logits = out[contract.LOGITS].astype(np.float64)
        top = -np.sort(-logits, axis=-1)[..., : contract.CONFIDENCE_TOPK]
        want = 1.0 / np.exp(top - top[..., :1]).sum(-1)
        np.testing.assert_allclose(out[contract.DRAFT_CONFIDENCE], want, rtol=1e-5)
        assert (out[contract.DRAFT_TOKENS] == logits.argmax(-1)).all()


def test_verify_lengths_option(built, tiny_pair, tmp_path):
    t, d = tiny_pair(
        family="qwen3", block_size=B, agree=1.25, tie_word_embeddings=False, target_layer_ids=[1, 3]
    )
    opts = ExportOptions(prefill_seq_len=CHUNK, ctx_len=CTX, compile=False, verify_lengths=(8,))
    m = build_artifacts(t, d, tmp_path / "one", opts).manifest
    assert m.plan.verify_lengths == (8,)
    verify = [s for s in m.target.specializations if s["kind"] == contract.VERIFY]
    assert verify and all(s["symbols"][contract.SEQ] == 8 for s in verify)
    for bad in ((3, 5), (4, 4, 8), (1, 8), (8, 16)):
        opts = ExportOptions(prefill_seq_len=CHUNK, ctx_len=CTX, compile=False, verify_lengths=bad)
        with pytest.raises(ExportError, match="--verify-lengths: .*end at the block size 8"):
            build_artifacts(t, d, tmp_path / "bad", opts)
        assert not (tmp_path / "bad").exists()
    with pytest.raises(ExportError, match="--verify-lengths must be integers"):
        ExportOptions(verify_lengths=("4", 8))
    pipe = dflash_qaic.load(built()[0])
    with pytest.raises(ValueError, match=r"pick some of them, including the block size 8"):
        pipe.configure(verify_lengths=[2, 4])
    with pytest.raises(AttributeError):  # the config is replaced whole, never poked
        pipe.verify_lengths = [8]
    assert pipe.config.verify_lengths is None


# ---------------------------------------------------------------- lossless at every length


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_verify_length_is_lossless(built, n):
    art, model = built()
    pipe = dflash_qaic.load(art)
    pipe.step_costs = Fixed(n)
    lengths = []
    for seed, (plen, new) in enumerate([(5, 40), (CHUNK + 3, 33)]):
        ids = prompt(plen, seed)
        res = pipe.generate(ids, max_new_tokens=new, stop_token_ids=[])
        assert res.tokens == hf_greedy(model, ids, new)
        assert res.stats["verify_rows"] == n
        lengths += res.acceptance_lengths
    assert max(lengths) <= n and min(lengths) == 1
    assert max(lengths) >= min(n, 5)  # whole verify blocks accepted (the bonus row) happen


def test_a_batch_is_lossless_at_the_chosen_lengths(built):
    art, model = built(full_batch_size=3)
    pipe = dflash_qaic.load(art)
    prompts = [prompt(n, s) for s, n in enumerate([4, 9, CHUNK + 1, 2 * CHUNK, 7])]
    for costs in (Fixed(2), Fixed(4), StepCosts(warmup_calls=0)):
        pipe.step_costs = costs
        results = pipe.generate(prompts, max_new_tokens=30, stop_token_ids=[])
        for ids, res in zip(prompts, results):
            assert res.tokens == hf_greedy(model, ids, 30)


def test_sampled_tokens_follow_the_target_at_a_short_length(built):
    """Two rows verify one proposal: the second token is decided by row 0's rule with the
    proposal from the draft, and must still follow the target's exact distribution."""
    art, model = built(vocab=32, agree=1.5)
    pipe = dflash_qaic.load(art, threads=1)
    pipe.step_costs = Fixed(2)
    cfg = (1.0, 0, 1.0)
    a = np.array(
        [
            pipe.generate(SAMPLING_PROMPT, 2, stop_token_ids=[], temperature=1.0, seed=i).tokens
            for i in range(600)
        ]
    )
    p1, p2 = exact_first_two(model, cfg)
    assert gof_pvalue([gof(a[:, 0], p1)]) > 1e-3
    assert gof_pvalue([gof(a[:, 1], p2)]) > 1e-3


# ---------------------------------------------------------------- the choice


def conf(*values):
    return np.array(values + (values[-1],) * (B - 1 - len(values)), np.float32)


def test_greedy_choice_follows_the_costs():
    lengths = [2, 4, 8]
    c = StepCosts()
    c.observe("verify", 5.0, 8)  # a first call sets up buffers: not timed
    c.observe("draft", 5.0)
    assert c.verify_s == {} and c.draft_s is None
    assert c.best_length(lengths, [conf(0.01)]) == 8  # nothing timed yet: the whole block
    c.observe("verify", 1.0, 8)
    c.observe("draft", 0.5)
    # costs that grow with rows (a CPU): unsure -> 2 rows (untimed: 2/8 of 8's), sure -> 8
    assert c.best_length(lengths, [conf(0.05)]) == 2
    assert c.best_length(lengths, [conf(0.99)]) == 8
    # a device whose calls cost the same at any length: the whole block, however unsure
    flat = StepCosts(warmup_calls=0)
    for n in lengths:
        flat.observe("verify", 1.0, n)
    flat.observe("draft", 0.5)
    assert flat.best_length(lengths, [conf(0.01)]) == 8
    # the expected-token arithmetic: 1 + c1 + c1c2 + … per row, summed over rows
    for _ in range(2):  # the first call of each length is not timed
        c.observe("verify", 0.4, 2)
        c.observe("verify", 0.5, 4)
    assert c.verify_s == {8: 1.0, 2: 0.4, 4: 0.5}
    # at 2 rows: (1 + 0.9) / 0.9 = 2.11; at 4: (1 + .9 + .81 + .729) / 1.0 = 3.44;
    # at 8: (1 + Σ_{j≤7} 0.9^j) / 1.5 = 3.80 -> 8; a second, unsure row (0.3) makes it
    # 3.56 / 4.86 / 4.75 -> 4
    assert c.best_length(lengths, [conf(0.9)]) == 8
    assert c.best_length(lengths, [conf(0.9), conf(0.3)]) == 4
    # … unless 4 rows turn out slow: 4.86 / 1.4 = 3.47 < 4.75 -> 8
    slow = StepCosts(warmup_calls=0)
    for n, t in ((8, 1.0), (2, 0.4), (4, 0.9)):
        slow.observe("verify", t, n)
    slow.observe("draft", 0.5)
    assert slow.best_length(lengths, [conf(0.9), conf(0.3)]) == 8
    # a running mean: one slow call moves the estimate a WEIGHT of the way
    c.observe("verify", 2.0, 8)
    assert c.verify_s[8] == pytest.approx(1.0 + StepCosts.WEIGHT * 1.0)


def test_sampled_choice_uses_each_rows_confidences_only():
    lengths = [2, 4, 8]
    timed, untimed = StepCosts(warmup_calls=0), StepCosts()
    timed.observe("verify", 1.0, 8)
    timed.observe("draft", 0.5)
    for c in (timed, untimed):
        rows = np.stack([conf(0.01), conf(0.99), conf(0.5), conf(0.4)])
        # 0.5: expected tokens beyond 4 rows 0.5^4 + … + 0.5^7 = 0.117 ≥ 0.1 -> 8; beyond 8: 0
        # 0.4: 0.04 < 0.1 -> 4
        assert c.row_lengths(lengths, rows).tolist() == [2, 8, 8, 4]
        # a row's length is its own, whatever shares the call
        for i in range(4):
            assert c.row_lengths(lengths, rows[i : i + 1]).tolist() == [[2, 8, 8, 4][i]]
    assert timed.row_lengths([8], rows).tolist() == [8] * 4


def test_a_seed_reproduces_its_tokens_whatever_the_timings(built):
    art, _ = built()
    pipe = dflash_qaic.load(art)
    kw = dict(max_new_tokens=40, stop_token_ids=[], temperature=1.0, seed=11)
    ids = prompt(6, 1)
    first = pipe.generate(ids, **kw)
    skewed = StepCosts(warmup_calls=0)  # timings that make every greedy step pick 2 rows
    skewed.observe("verify", 10.0, 8)
    skewed.observe("verify", 0.01, 2)
    skewed.observe("draft", 0.01)
    pipe.step_costs = skewed
    again = pipe.generate(ids, **kw)
    assert again.tokens == first.tokens
    assert again.acceptance_lengths == first.acceptance_lengths
