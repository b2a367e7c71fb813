"""The draft under extended sampling (docs/DESIGN.md, Extended sampling): exported with
`--extended-sampling`, it reads the target's history arrays (no copy) and proposes from its
logits adjusted as the target's verify rows will be (modeling/penalties.py: proposal_logits).
The target's verify still decides, so the tokens stay the target alone's; the proposals follow
the adjusted target, so more of them are accepted where an adjustment changes its choice."""

from __future__ import annotations

import numpy as np
import pytest
from sampling_ref import adjust, reference_greedy
from test_sampling_params import (  # noqa: F401 (ext_artifacts, model: fixtures)
    N_NEW,
    PROMPT,
    ext_artifacts,
    model,
)

import dflash_qaic
from dflash_lab.sampling_tau import UnadjustedDraft, fixed_steps, measure
from dflash_qaic import assets, contract

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance asserted (drafts accepted, every length), seeded tokens


@pytest.fixture(scope="module")
def pipe(ext_artifacts):  # noqa: F811 (the fixture imported above)
    pipe = dflash_qaic.load(ext_artifacts)
    fixed_steps(pipe)  # whole blocks every step: τ depends on the proposals alone
    return pipe


class Recorder:
    """The draft program, its proposals of live rows kept."""

    def __init__(self, program):
        self.program, self.proposals = program, []

    def __getattr__(self, name):
        return getattr(self.program, name)

    def run(self, feeds):
        out = self.program.run(feeds)
        live = feeds[contract.POSITION_IDS][:, 0] >= 0
        self.proposals.append(out[contract.DRAFT_TOKENS][live])
        return out


def proposals(pipe, draft, **settings) -> tuple[np.ndarray, list[int]]:
    """(every proposal of a generation of PROMPT, its tokens) with `draft` as the program."""
    rec, program = Recorder(draft), pipe.draft
    pipe.draft = rec
    try:
        res = pipe.generate(PROMPT, N_NEW, stop_token_ids=[], **settings)
    finally:
        pipe.draft = program
    return np.concatenate(rec.proposals), res.tokens


def test_the_draft_takes_the_targets_history_inputs(pipe):
    io = pipe.artifacts.draft.io
    assert io.extended_sampling
    names = {s.name for s in io.inputs}
    left_out = {contract.MIN_P, contract.REPETITION_PENALTY, contract.PROMPT_TOKENS}
    assert {s.name for s in contract.extended_specs(io.vocab_size)} - names == left_out
    plain = contract.DraftIO(**{**io.__dict__, "extended_sampling": False})
    assert contract.OUTPUT_COUNTS not in {s.name for s in plain.inputs}
    eng = pipe.engine()  # the step's draft call reads the very arrays its verify calls read
    draft, verify = eng.spec.bufs.draft.feeds, eng.spec.bufs.verify[pipe.B].feeds
    for s in contract.draft_extended_specs(io.vocab_size):
        assert any(draft[s.name] is f[s.name] for f in verify.values())


def test_the_proposals_obey_the_masks_and_the_bias(pipe):
    plain, _ = proposals(pipe, UnadjustedDraft(pipe.draft))
    favourite = int(np.bincount(plain.ravel()).argmax())  # the draft's most proposed token
    banned, tokens = proposals(pipe, pipe.draft, bad_words=[[favourite]])
    assert favourite not in banned  # the first block too (the DraftPrefill call's)
    unmasked, same = proposals(pipe, UnadjustedDraft(pipe.draft), bad_words=[[favourite]])
    assert favourite in unmasked and same == tokens  # the verify decides the tokens
    pushed, _ = proposals(pipe, pipe.draft, logit_bias={favourite + 1: 100.0})
    assert (pushed == favourite + 1).all()


@pytest.mark.parametrize(
    "s",
    [dict(repetition_penalty=1.2, presence_penalty=0.6, frequency_penalty=0.4),
     dict(logit_bias={"101": -100.0}, bad_words=[[32, 32], [61]])],
)  # fmt: skip
def test_greedy_tokens_are_the_target_alones(pipe, model, s):  # noqa: F811
    ids = pipe.tokenizer(PROMPT)["input_ids"]
    res = pipe.generate(PROMPT, N_NEW, stop_token_ids=[], **s)
    assert res.tokens == reference_greedy(model, ids, N_NEW, s)
    assert max(res.acceptance_lengths) > 1


def test_tau_is_higher_than_with_the_unadjusted_draft(pipe):
    """A count on fixed prompts (every step verifies the whole block), not a timing."""
    prompts = assets.heldout_prompts()[:4]
    s = {"logit_bias": {101: -100.0}}  # no 'e': the target's text leaves the draft's habits
    adjusted, tokens = measure(pipe, prompts, 64, s, 0.0)
    program = pipe.draft
    pipe.draft = UnadjustedDraft(program)
    try:
        unadjusted, same = measure(pipe, prompts, 64, s, 0.0)
    finally:
        pipe.draft = program
    assert same == tokens
    assert adjusted > unadjusted, (adjusted, unadjusted)


def test_a_sampling_dflash2_draft_proposes_from_the_adjusted_q(tmp_path):
    """DFlash-2 at T > 0: its selector's candidates and q come from the adjusted logits, so
    a banned token is never drawn (the verify reads that q: lossless, docs/DESIGN.md,
    DFlash-2 drafts)."""
    from dflash_qaic.exporter.cli import load_recipe

    r = load_recipe("default-dflash2")
    opts = dict(compile=False, prefill_seq_len=64, ctx_len=512, extended_sampling=True)
    dflash_qaic.export(r["target"], r["draft"], tmp_path / "art", **opts)
    pipe = dflash_qaic.load(tmp_path / "art")
    fixed_steps(pipe)
    assert pipe.artifacts.draft.io.q_top_k and pipe.artifacts.draft.io.extended_sampling
    s = dict(temperature=1.0, seed=3, repetition_penalty=1.1, presence_penalty=0.3)
    plain, _ = proposals(pipe, UnadjustedDraft(pipe.draft), **s)
    favourite = int(np.bincount(plain.ravel()).argmax())
    banned, _ = proposals(pipe, pipe.draft, bad_words=[[favourite]], **s)
    assert favourite in plain and favourite not in banned


def test_proposal_logits_are_the_reference_rule(pipe):
    """Every draft row adjusted as the reference adjusts the target after the history and the
    anchor, but for the repetition penalty (left out), min_tokens by the row's position (the
    rows after the anchor are not tokens yet: a word of several tokens can only end at row 0,
    after the tail and the anchor); banned tokens at the row's floor."""
    import torch

    from dflash_qaic.modeling.penalties import proposal_logits
    from dflash_qaic.runtime.history import ExtendedRows

    V, B, rng = pipe.vocab, pipe.B, np.random.default_rng(0)
    prompt, earlier, anchor = [5, 9, 40, 41], [40, 77, 77, 12], 101
    one = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4}
    one |= {"logit_bias": {9: 3.0, 77: -1.5, 200: 2.0}, "bad_words": [[32]], "min_tokens": 8}
    s = {**one, "bad_words": [[32], [12, anchor, 61]]}  # [12, anchor] are the last generated
    req = type("Req", (), {"ids": prompt, "stop": frozenset({7})})()
    ext = ExtendedRows(1, V)
    ext.set_row(0, pipe.sampling(**s), req)
    ext.advance(0, [*earlier, anchor], 0)  # the anchor is the last committed token
    x = {n: torch.from_numpy(a) for n, a in ext.arrays().items()}
    start = len(prompt) + len(earlier)
    ids = torch.tensor([[anchor] + [pipe.artifacts.mask_token_id] * (B - 1)])
    pos = start + torch.arange(B)[None]
    logits = torch.from_numpy(rng.normal(0, 4, (1, B - 1, V)).astype(np.float32))
    out = proposal_logits(logits, x, ids, pos, V)[0].double()
    for j in range(B - 1):
        rule = {**(s if j == 0 else one), "repetition_penalty": 1.0}  # additive ones only
        want = adjust(logits[0, j], prompt, [*earlier, anchor], rule)
        if len(earlier) + 1 + j < 8:  # min_tokens: row j decides the (5 + j + 1)-th token
            want[7] = -torch.inf
        banned = torch.isinf(want)
        assert (out[j][banned] == out[j].min()).all() and out[j].min() < want[~banned].min()
        torch.testing.assert_close(out[j][~banned], want[~banned], rtol=1e-5, atol=1e-5)
    assert torch.isinf(adjust(logits[0, 0], prompt, [*earlier, anchor], s))[61]  # it bit
