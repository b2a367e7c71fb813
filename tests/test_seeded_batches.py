"""Seeded sampling in a continuous batch: a request's tokens equal its solo run with the same
seed whatever else shares the batch, with the default verify lengths (each sampled row picks its
own length from its own confidences: runtime/step.py). The red team's case: different prompts
at T = 1 on the built-in pair, with both of its drafts."""

from __future__ import annotations

import pytest

import dflash_qaic
from dflash_qaic import assets

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens


@pytest.fixture(scope="module")
def dflash2_cb_artifacts(tmp_path_factory):
    target, draft = assets.default_pair("dflash2")
    out = tmp_path_factory.mktemp("default-dflash2-cb")
    dflash_qaic.export(
        target, draft, out, full_batch_size=4, compile=False, prefill_seq_len=64, ctx_len=1024
    )
    return out


@pytest.mark.parametrize("form", ["dflash", "dflash2"])
def test_seeded_requests_equal_their_solo_runs_in_a_batch(form, cb_artifacts, request):
    art = cb_artifacts if form == "dflash" else request.getfixturevalue("dflash2_cb_artifacts")
    pipe = dflash_qaic.load(art)
    assert len(pipe.config.step_lengths(pipe.plan)) > 1  # the default: several lengths
    prompts = assets.heldout_prompts()[:6]
    seeds = [3, 1, 4, 1, 5, 9]
    kw = dict(max_new_tokens=48, stop_token_ids=[], temperature=1.0)
    batch = pipe.generate(prompts, seed=seeds, **kw)
    for p, s, res in zip(prompts, seeds, batch):
        solo = pipe.generate(p, seed=s, **kw)
        assert res.tokens == solo.tokens, (p[:20], s)
        assert res.acceptance_lengths == solo.acceptance_lengths
