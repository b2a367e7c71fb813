"""Block verification (docs/DESIGN.md, Block verification): the target graph's sampler with
`sample_block` is distributed as the target's own sampling (chi-square against the exact joint of
the first tokens, on a tiny vocabulary with prefix-dependent target and draft distributions),
for a sampling draft (its q given) and a greedy draft (q one-hot); the same test rejects a
deliberately wrong rule (the draft sampled, another q verified); its mean accepted count is not below
the token-wise rule's on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dflash_qaic.modeling.sampler import sample_block, sample_chain

pytestmark = pytest.mark.draft_every_step  # acceptance and seeded tokens compared across runs

V, GAMMA, DEPTH, SAMPLES = 5, 3, 3, 40_000


def tables(seed: int):
    """Per depth d, logits [V^d, V] of a target and of a draft that disagrees with it, indexed by
    the prefix's code (its tokens as base-V digits): both depend on the whole prefix."""
    rng = np.random.default_rng(seed)
    target = [rng.normal(0, 1.5, (V**d, V)) for d in range(GAMMA + 2)]
    draft = [t + rng.normal(0, 1.0, t.shape) for t in target]
    return target, draft


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def draw(rng, p):
    """One token per row of p [n, V] (inverse CDF)."""
    return (p.cumsum(-1) < rng.random((len(p), 1))).sum(-1).clip(max=V - 1)


def run(target, draft, greedy_draft: bool, block: bool, seed: int, q_rule="draft"):
    """One verify call over SAMPLES rows; returns (each row's first DEPTH tokens, completed by
    sampling the target, [SAMPLES, DEPTH]; accepted [SAMPLES]). q_rule: the q the verify is
    told ("draft": the draft's own; "uniform": a wrong one; None: none, q one-hot)."""
    rng = np.random.default_rng(seed)
    n = GAMMA + 1
    props = np.zeros((SAMPLES, GAMMA), np.int64)
    code = np.zeros(SAMPLES, np.int64)
    q = np.zeros((SAMPLES, GAMMA, V), np.float32)
    logits = np.zeros((SAMPLES, n, V), np.float32)
    for j in range(n):  # the draft's proposals and the target's logits, prefix by prefix
        logits[:, j] = target[j][code]
        if j == GAMMA:
            break
        q[:, j] = softmax(draft[j][code])
        props[:, j] = q[:, j].argmax(-1) if greedy_draft else draw(rng, q[:, j])
        code = code * V + props[:, j]
    ids = np.concatenate([np.zeros((SAMPLES, 1), np.int64), props], 1)
    pos = np.tile(np.arange(n), (SAMPLES, 1))
    u = rng.random((SAMPLES, n, 2), dtype=np.float32)
    kw = {}
    if q_rule is not None:  # every token a candidate: q over the whole (tiny) vocabulary
        told = q if q_rule == "draft" else np.full_like(q, 1.0 / V)
        kw = dict(
            q_ids=torch.tensor(np.tile(np.arange(V), (SAMPLES, GAMMA, 1))),
            q_probs=torch.tensor(told),
        )
    one = torch.ones(SAMPLES)
    out = (sample_block if block else sample_chain)(
        torch.tensor(logits), torch.tensor(ids), torch.tensor(pos), one,
        torch.zeros(SAMPLES, dtype=torch.int64), one, torch.tensor(u), V, **kw,
    )  # fmt: skip
    if block:
        tokens, acc = out[0].numpy(), out[1].numpy()
    else:  # the chain: leading proposals equal to the choice
        tokens = out.numpy()
        same = np.concatenate([tokens[:, :GAMMA] == props, np.zeros((SAMPLES, 1), bool)], 1)
        acc = same.argmin(1)
    first = np.zeros((SAMPLES, DEPTH), np.int64)
    code = np.zeros(SAMPLES, np.int64)
    for k in range(DEPTH):  # the committed tokens, then the target alone from there
        committed = acc + 1 > k
        alone = draw(rng, softmax(target[k][code]))
        first[:, k] = np.where(committed, tokens[:, min(k, n - 1)], alone)
        code = code * V + first[:, k]
    return first, acc


def chi2_pvalue(target, first) -> float:
    """Chi-square of the first DEPTH tokens' joint against the target's exact joint."""
    exact = np.ones(1)
    for d in range(DEPTH):  # P(prefix) · p(next | prefix), codes in order
        exact = (exact[:, None] * softmax(target[d])).reshape(-1)
    counts = np.bincount(first @ (V ** np.arange(DEPTH - 1, -1, -1)), minlength=V**DEPTH)
    # cells of small expectation pooled into one (chi-square wants expected counts ≥ 5)
    expected = exact * len(first)
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    return chisquare(obs, exp).pvalue


@pytest.fixture(scope="module")
def tab():
    return tables(0)


@pytest.mark.parametrize("greedy_draft", [False, True], ids=["sampled-draft", "greedy-draft"])
def test_block_verify_is_the_targets_distribution(tab, greedy_draft):
    target, draft = tab
    rule = None if greedy_draft else "draft"
    first, acc = run(target, draft, greedy_draft, block=True, seed=1, q_rule=rule)
    assert chi2_pvalue(target, first) > 1e-3
    # never worse than the token-wise rule (same inputs, its own uniforms): within noise
    _, acc_tw = run(target, draft, greedy_draft, block=False, seed=2, q_rule=rule)
    assert acc.mean() >= acc_tw.mean() - 3 * acc_tw.std() / np.sqrt(SAMPLES)


def test_a_wrong_rule_is_rejected_by_the_same_test(tab):
    """Proposals sampled from the draft's q but verified against another q (uniform): the
    block rule with the wrong q is measurably biased, and the test says so."""
    target, draft = tab
    first, _ = run(target, draft, greedy_draft=False, block=True, seed=3, q_rule="uniform")
    assert chi2_pvalue(target, first) < 1e-6


# ---------------------------------------------------------------- exported with --verify-rule block

B, CHUNK, CTX = 8, 16, 96


# the families whose block programs are proven here: a dense target, and the two with sliding
# and full attention kinds (ring caches); their pairs' own fields (Gemma 4's head is tied)
BLOCK_FAMILIES = {"qwen3": dict(tie_word_embeddings=False), "gemma4": {}, "gpt_oss": {}}


@pytest.fixture(scope="module", params=sorted(BLOCK_FAMILIES))
def block_art(request, tiny_pair, tmp_path_factory):
    """A tiny pair exported with verify_rule="block" and 2 cache rows (its DFlash draft then
    samples its proposals from its top-8), the draft's top-4 returned and logits emitted."""
    from dflash_qaic import checkpoints as ck
    from dflash_qaic.artifacts.build import ExportOptions, build_artifacts

    t, d = tiny_pair(
        family=request.param,
        vocab_size=32,
        block_size=B,
        agree=1.5,
        target_layer_ids=[1, 3],
        **BLOCK_FAMILIES[request.param],
    )
    out = tmp_path_factory.mktemp("block-art")
    opts = ExportOptions(
        prefill_seq_len=CHUNK,
        ctx_len=CTX,
        compile=False,
        full_batch_size=2,
        verify_rule="block",
        draft_top_k=4,
        emit_logits=True,
    )
    build_artifacts(t, d, out, opts)
    return out, ck.load_target_model(t)


def test_block_export_greedy_is_hf_greedy_and_seeds_batch_as_solo(block_art):
    import dflash_qaic
    from dflash_qaic import contract
    from dflash_qaic.runtime.step import BlockVerifier

    art, model = block_art
    pipe = dflash_qaic.load(art, threads=1)
    io = pipe.artifacts.target.io
    assert io.verify_rule == contract.BLOCK
    assert contract.NUM_ACCEPTED in [s.name for s in io.outputs]
    assert pipe.artifacts.draft.io.q_top_k == contract.DRAFT_SAMPLE_TOP_K
    assert io.draft_q == (B - 1, contract.DRAFT_SAMPLE_TOP_K)
    assert isinstance(pipe.engine().spec.verifier, BlockVerifier)
    prompts = [[7, 19, 3, 25, 11], list(range(1, CHUNK + 4))]
    for ids in prompts:  # greedy: the argmax chain, token for token Hugging Face's
        want = model.generate(
            torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
        assert pipe.generate(ids, 20, stop_token_ids=[]).tokens == want
    batched = pipe.generate(prompts, 20, stop_token_ids=[], temperature=1.0, seed=[5, 6])
    solo = [pipe.generate(p, 20, stop_token_ids=[], temperature=1.0, seed=5 + i) for i, p in
            enumerate(prompts)]  # fmt: skip
    assert [r.tokens for r in batched] == [r.tokens for r in solo]
    assert max(max(r.acceptance_lengths) for r in batched) > 1  # proposals were kept


@pytest.mark.slow
def test_block_export_samples_the_targets_first_two_tokens(block_art):
    """End to end through the exported programs: the first two sampled tokens follow the
    target's exact distribution (as tests/test_sampling.py checks the chain). 2400 runs per
    family (at 600, one family's draw of seeds 0 … 599 sat at p ≈ 3e-4 for the second token,
    where seeds 0 … 2399 and 10000 … 14799 give 0.08 and 0.77)."""
    from test_sampling import PROMPT, exact_first_two, gof, gof_pvalue

    import dflash_qaic

    art, model = block_art
    pipe = dflash_qaic.load(art, threads=1)
    pipe.configure(verify_lengths=[B])
    a = np.array(
        [pipe.generate(PROMPT, 2, stop_token_ids=[], temperature=1.0, seed=i).tokens
         for i in range(2400)]
    )  # fmt: skip
    p1, p2 = exact_first_two(model, (1.0, 0, 1.0))
    assert gof_pvalue([gof(a[:, 0], p1)]) > 1e-3
    assert gof_pvalue([gof(a[:, 1], p2)]) > 1e-3


def test_draft_top_k_reaches_the_host(block_art):
    """--draft-top-k 4: the draft returns each proposal row's 4 most likely ids and their
    log-probabilities under its full softmax (checked against its logits), and a step keeps them
    per slot."""
    import onnxruntime as ort

    import dflash_qaic
    from dflash_qaic import contract
    from dflash_qaic.exporter.draft import check_feeds

    art, _ = block_art
    pipe = dflash_qaic.load(art, threads=1)
    m = pipe.artifacts
    assert m.draft.io.top_k == 4
    sess = ort.InferenceSession(str(art / m.draft.onnx), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    for feed in check_feeds(m.draft.io, list(m.draft.specializations)[:2], m.mask_token_id, 3):
        out = dict(zip(names, sess.run(None, feed)))
        logits = out[contract.LOGITS].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        ids = out[contract.DRAFT_TOP_IDS]
        np.testing.assert_array_equal(ids, np.argsort(-logits, -1, kind="stable")[..., :4])
        want = np.take_along_axis(logp, ids, -1)
        np.testing.assert_allclose(out[contract.DRAFT_TOP_LOGPROBS], want, atol=1e-5)
    engine = pipe.engine()
    seq = engine.add(pipe.request([7, 19, 3, 25, 11], 6, stop_token_ids=[]))
    while engine.busy and not seq.tokens:
        engine.step()
    st = engine.spec.state
    assert st.top_ids is not None and st.top_ids.shape == (2, B - 1, 4)
    assert (np.diff(st.top_logprobs[seq.slot], axis=-1) <= 0).all()  # descending
    assert (st.top_ids[seq.slot, :, 0] == st.proposals[seq.slot]).all()  # greedy: the argmax


def test_a_prefill_chunk_samples_its_last_row_from_p():
    """A prefill chunk runs the same rule: its prompt rows (uniforms 0) and padding rows never
    stop the row, so the last prompt row's token is the draw from p by its own uniform."""
    gen = torch.Generator().manual_seed(4)
    b, s, n = 64, 8, 5  # rows 0 … 4 the prompt, 5 … 7 padding
    logits = torch.randn(b, s, V, generator=gen)
    ids = torch.randint(0, V, (b, s), generator=gen)
    pos = torch.tensor([[0, 1, 2, 3, 4, -1, -1, -1]]).expand(b, s)
    u = torch.zeros(b, s, 2)
    u[:, n - 1] = torch.rand(b, 2, generator=gen)
    one = torch.ones(b)
    tokens, acc = sample_block(logits, ids, pos, one, torch.zeros(b, dtype=torch.int64), one, u, V)
    assert (acc <= n - 1).all()
    p = torch.softmax(logits[:, n - 1], -1)  # the inverse CDF of p at the row's second uniform
    want = (p.cumsum(-1) <= u[:, n - 1, 1:]).sum(-1).clamp(max=V - 1)
    assert torch.equal(tokens[:, n - 1], want)


def test_row_layout_chain_and_tree():
    """contract.RowLayout: the chain (today's programs) is causal with slots = positions; a tree
    layout repeats positions (start + depth) on distinct slots and sees only its ancestors."""
    from dflash_qaic.contract import RowLayout

    chain = RowLayout.chain(4)
    assert chain.is_chain and chain.positions(10) == chain.slots(10) == [10, 11, 12, 13]
    assert all(chain.visible(r, c) == (c <= r) for r in range(4) for c in range(4))
    tree = RowLayout(parents=(-1, 0, 0, 1), depths=(0, 1, 1, 2))  # root, two children, a grandchild
    assert not tree.is_chain
    assert tree.positions(10) == [10, 11, 11, 12] and tree.slots(10) == [10, 11, 12, 13]
    assert [c for c in range(4) if tree.visible(3, c)] == [0, 1, 3]
    assert not tree.visible(2, 1) and tree.visible(2, 0)
