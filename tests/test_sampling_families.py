"""Logprobs and extended sampling on every family of the conformance ladder (docs/sampling.md):
each family's tiny pair (tests/test_conformance.py: CASES, its own DFlash draft) exported once
with `--logprobs 5 --extended-sampling`, against the target's own Hugging Face class under
DFlash with accepted blocks:

(a) generated and prompt logprobs within 2e-3 of HF's log_softmax (fp32 ONNX Runtime);
(b) greedy with repetition_penalty 1.3 equal to HF `generate(repetition_penalty=1.3)`;
(c) presence and frequency penalties, logit_bias, bad_words and min_tokens on one request equal
    to the reference loop over HF's logits (tests/sampling_ref.py).

The default tier runs one family of each kind (dense, MoE, hybrid, sliding window, latent
attention); the others are in the slow tier."""

from __future__ import annotations

from collections import Counter

import pytest
from sampling_ref import check_against_hf, check_prompt_logprobs, hf_logprobs, reference_greedy
from test_conformance import CASES, build, hf_greedy, prompt

from dflash_qaic.runtime.prefix import BLOCK

# the blocks are asserted accepted: every step drafts (not the default auto)
pytestmark = pytest.mark.draft_every_step

K = 5
N_NEW = 28
#: family -> its case on the ladder (the DFlash draft form: the family's own pair)
FAMILY_CASES = {fam: case for case, (fam, form, *_) in CASES.items() if form == "dflash"}
#: one family of each kind in the default tier: dense, MoE, hybrid, sliding window, latent
FAST = {"qwen3", "qwen3_moe", "qwen3_5", "gemma4", "deepseek_v3"}
assert FAST <= set(FAMILY_CASES)

families = pytest.mark.parametrize(
    "family",
    [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILY_CASES)],
)


@pytest.fixture(scope="module")
def pairs(exported):
    """family -> (pipeline on its export with both options, whole blocks every step; the HF
    model; the case), each exported and loaded once."""
    cache = {}

    def get(family):
        if family not in cache:
            case = FAMILY_CASES[family]
            e = build(exported, case, logprobs=K, extended_sampling=True)
            pipe = e.load(verify_lengths=CASES[case][2]["block_size"])
            io = pipe.artifacts.target.io
            assert io.extended_sampling and io.logprobs == K
            cache[family] = (pipe, e.model(), case)
        return cache[family]

    return get


def prompts(case) -> list[list[int]]:
    """Three prompts: a short one, one under a prefill chunk, one over it and over a prefix
    cache block (runtime/prefix.py)."""
    chunk = CASES[case][3]
    lengths = (3, chunk - 1, max(chunk, BLOCK) + 3)
    return [prompt(case, n, seed) for seed, n in enumerate(lengths, 1)]


def run(pipe, case, check, times: int = 1, **settings):
    """pipe.generate(**settings) on each prompt (`times` times in a row), check(ids, result) on
    each; some step of them accepted a proposal (the verify rows decided tokens)."""
    lengths = []
    for ids in prompts(case):
        for _ in range(times):
            res = pipe.generate(ids, N_NEW, **{"stop_token_ids": [], **settings})
            check(ids, res)
            lengths += res.acceptance_lengths
    assert max(lengths) > 1, lengths


@families
def test_logprobs_equal_hf(pairs, family):
    pipe, model, case = pairs(family)

    def check(ids, res):
        assert res.tokens == hf_greedy(model, ids, N_NEW)
        ref = hf_logprobs(model, ids + res.tokens)
        check_against_hf(res, ids, ref, K)
        check_prompt_logprobs(res.prompt_logprobs, ids, ref, 2)

    # twice: the second finds the prompt in the prefix cache, which prompt logprobs skip
    run(pipe, case, check, times=2, logprobs=K, prompt_logprobs=2)


@families
def test_repetition_penalty_equals_hf_generate(pairs, family):
    pipe, model, case = pairs(family)
    changed = []

    def check(ids, res):
        assert res.tokens == hf_greedy(model, ids, N_NEW, repetition_penalty=1.3)
        changed.append(res.tokens != hf_greedy(model, ids, N_NEW))

    run(pipe, case, check, repetition_penalty=1.3)
    assert any(changed)  # the penalty bit


MIN_TOKENS = 10


def combined(plain: list[int]) -> dict:
    """Presence and frequency penalties, a bias, two bad words and min_tokens, chosen from the
    plain greedy output `plain` so that each can bite. The tiny pairs' drafts propose token 0
    (dflash_lab/tiny.py, agree) and their targets often pick it: a bias that keeps 0 ahead of
    the penalties keeps proposals accepted."""
    others = [t for t, _ in Counter(plain).most_common() if t != 0] or [1]
    after0 = [b for a, b in zip(plain, plain[1:]) if a == 0 and b != 0] or [7]
    return dict(
        presence_penalty=0.3, frequency_penalty=0.1, min_tokens=MIN_TOKENS,
        logit_bias={0: 2.0, others[-1]: -1.5}, bad_words=[[others[0]], [0, after0[0]]],
    )  # fmt: skip


@families
def test_penalties_bias_bad_words_and_min_tokens_equal_the_reference(pairs, family):
    pipe, model, case = pairs(family)
    lengths, changed = [], []
    for last, ids in zip((False, False, True), prompts(case), strict=True):
        plain = hf_greedy(model, ids, N_NEW)
        s = combined(plain)
        free = reference_greedy(model, ids, N_NEW, {**s, "min_tokens": 0})
        # a stop token the output without min_tokens has early (min_tokens holds it back); 0,
        # the drafts' proposal, only on the last prompt: the others keep accepting blocks
        stop = [t for t in free[2:] if t != 0 or last][:1]
        res = pipe.generate(ids, N_NEW, stop_token_ids=stop, **s)
        want = reference_greedy(model, ids, N_NEW, s, stop)
        assert s["bad_words"][0][0] not in want  # a bad word (plain's most common but 0) bit
        changed.append(want != plain)
        end = [i + 1 for i, t in enumerate(want) if t in stop and i >= MIN_TOKENS] or [N_NEW]
        assert res.tokens == want[: end[0]], (res.tokens, want)
        assert not set(stop) & set(res.tokens[:MIN_TOKENS])
        lengths += res.acceptance_lengths
    assert stop == [free[2]] and free[2] not in want[:MIN_TOKENS]  # min_tokens bit
    assert any(changed)
    assert max(lengths) > 1, lengths


@pytest.mark.parametrize(
    "options, flags",
    [(dict(logprobs=2), "--logprobs"), (dict(extended_sampling=True), "--extended-sampling"),
     (dict(logprobs=2, extended_sampling=True), "--logprobs and --extended-sampling")],
)  # fmt: skip
def test_tree_verification_refuses_them_by_name_before_reading(tiny_pair, tmp_path, options, flags):
    import dflash_qaic
    from dflash_qaic.exporter.options import ExportError

    t, d = tiny_pair(family="qwen3")
    fix = f"export without --tree-budgets .* or without {flags}$"
    with pytest.raises(ExportError, match=rf"--tree-budgets\) with {flags} is not built: .*{fix}"):
        dflash_qaic.export(t, d, tmp_path / "art", compile=False, tree_budgets=(16,), **options)
    assert not (tmp_path / "art").exists()
