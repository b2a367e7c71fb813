"""DFlash-2 drafts (docs/DESIGN.md, DFlash-2 drafts): the published `DFlash2DraftModel` form
(dynamic causal convs around attention and MLP, a candidate selector over each row's top-k).

Oracles: the reference `DFlash2DraftModel` (dflash 0.1.0) for the forward and the selector's
path, and its `dflash_generate` for tokens and per-step acceptance (whole-block verification);
the target's exact distribution (chi-square) when sampling.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from dflash.model import DFlash2DraftModel, dflash_generate
from test_sampling import PROMPT as SAMPLING_PROMPT
from test_sampling import V as SAMPLING_V
from test_sampling import batched_first_two, gof, gof_pvalue

import dflash_qaic
from dflash_qaic import checkpoints as ck
from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
from dflash_qaic.modeling.draft import DFlashDraft

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens

V = 24  # a small vocabulary; `agree` makes the target and the draft lean to token 0
FORM = dict(draft_form="dflash2", block_size=8, vocab_size=V, tie_word_embeddings=False)
FORM["target_layer_ids"] = [1, 3]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return tiny_pair(agree=2.0, **FORM)


def _copy(d, tmp_path, **edit):
    bad = tmp_path / "draft"
    shutil.copytree(d, bad)
    cfg = json.loads((bad / "config.json").read_text())
    for k, v in edit.items():
        if v is None:
            cfg.pop(k, None)
            cfg["dflash_config"].pop(k, None)
        else:
            cfg["dflash_config"][k] = v
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


# ---------------------------------------------------------------- checkpoints


def test_published_form_is_read_and_validated(pair):
    t, d = pair
    c = ck.read_draft_config(d)
    assert c.dflash2 and (c.conv_kernel_size, c.conv_group_size) == (3, 16)
    assert (c.selector_rank, c.selector_top_k) == (4, 4)
    on_disk = ck.checkpoint_tensors(d, "draft")
    assert "candidate_selector.predecessor_codebook" in on_disk  # published: no `.weight`
    tensors = ck.read_pair(t, d).draft_tensors
    assert len(tensors) == 3 + 15 * c.num_layers + 3
    assert "candidate_selector.predecessor_codebook.weight" in tensors
    assert set(ck.load_draft_state(c)) == set(tensors)


def test_fields_at_top_level(pair, tmp_path):
    _, d = pair
    moved = _copy(d, tmp_path)
    cfg = json.loads((moved / "config.json").read_text())
    for k in ck.DRAFT2_FIELDS:
        cfg[k] = cfg["dflash_config"].pop(k)
    (moved / "config.json").write_text(json.dumps(cfg))
    assert ck.read_draft_config(moved).selector_top_k == 4


@pytest.mark.parametrize(
    "edit,match",
    [
        ({"conv_kernel_size": None}, "positive integer `conv_kernel_size`"),
        ({"selector_rank": 0}, "`dflash_config.selector_rank` is 0 .*a positive integer"),
        ({"conv_group_size": 5}, "does not divide `hidden_size` 64"),
        ({"selector_top_k": 25}, "`selector_top_k` \\(25\\) at most that"),
    ],
)
def test_bad_fields_are_refused(pair, tmp_path, edit, match):
    with pytest.raises(ck.CheckpointError, match=match):
        ck.read_draft_config(_copy(pair[1], tmp_path, **edit))


def _retensor(d, tmp_path, change):
    from safetensors.torch import load_file, save_file

    out = _copy(d, tmp_path)
    state = load_file(str(out / "model.safetensors"))
    change(state)
    save_file(state, str(out / "model.safetensors"))
    return ck.read_draft_config(out)


def test_tensor_layout(pair, tmp_path):
    _, d = pair
    # the `.weight` spelling of the codebooks is read too
    c = _retensor(d, tmp_path / "a", lambda s: s.update(
        {"candidate_selector.successor_codebook.weight":
         s.pop("candidate_selector.successor_codebook")}))  # fmt: skip
    assert "candidate_selector.successor_codebook.weight" in ck.check_draft_tensors(c)

    def both(s):
        s["candidate_selector.successor_codebook.weight"] = s[
            "candidate_selector.successor_codebook"
        ].clone()

    with pytest.raises(ck.CheckpointError, match="both with and without `.weight`"):
        ck.check_draft_tensors(_retensor(d, tmp_path / "b", both))
    with pytest.raises(ck.CheckpointError, match="unknown tensor keys .*selector.extra"):
        c = _retensor(
            d,
            tmp_path / "c",
            lambda s: s.update({"candidate_selector.extra": s["norm.weight"].clone()}),
        )
        ck.check_draft_tensors(c)
    with pytest.raises(ck.CheckpointError, match="missing tensor keys .*layers.1.mlp_conv.base"):
        ck.check_draft_tensors(
            _retensor(d, tmp_path / "d", lambda s: s.pop("layers.1.mlp_conv.base_kernel"))
        )

    # a b16 draft carrying DFlash-2 tensors is refused, naming the architecture
    def b16(path):
        cfg = json.loads((path / "config.json").read_text())
        cfg["architectures"] = ["DFlashDraftModel"]
        (path / "config.json").write_text(json.dumps(cfg))

    plain = _copy(d, tmp_path / "e")
    b16(plain)
    with pytest.raises(ck.CheckpointError, match="unknown tensor keys .*DFlash2DraftModel"):
        ck.check_draft_tensors(ck.read_draft_config(plain))


def test_make_tiny_pair_cli(tmp_path):
    from dflash_lab.tiny import main

    main([str(tmp_path), "--draft-form", "dflash2", "--vocab-size", "32", "--selector-top-k", "6"])
    c = ck.read_draft_config(tmp_path / "draft")
    assert c.dflash2 and c.selector_top_k == 6
    ck.read_pair(tmp_path / "target", tmp_path / "draft")
    ref = DFlash2DraftModel.from_pretrained(tmp_path / "draft", dtype=torch.float32)
    state = ck.load_draft_state(c)  # the reference's loader reads the published form as we do
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in state.items())


# ---------------------------------------------------------------- the draft forward


@torch.no_grad()
def test_forward_and_selector_equal_reference(pair):
    t, d = pair
    c = ck.read_draft_config(d)
    ours = DFlashDraft.from_checkpoint(c, ck.load_draft_state(c))
    ref = DFlash2DraftModel.from_pretrained(d, dtype=torch.float32).eval()
    head = ck.load_target_model(t).lm_head
    gen = torch.Generator().manual_seed(0)
    n, B, differ = 13, 8, 0
    for _ in range(4):
        feats = torch.randn(1, n, 64 * 2, generator=gen)
        ids = torch.randint(0, V, (1, B), generator=gen)
        emb_w = torch.randn(V, 64, generator=gen)
        pos = torch.arange(n + B)[None]
        emb = ours.embed(ids, emb_w)
        a = ours(ours.fuse(feats), pos[:, :n], emb, pos[:, n:])
        b = ref(position_ids=pos, noise_embedding=emb, target_hidden=feats)
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
        logits = ours.logits(a[:, 1:], head.weight)
        path = ours.candidate_selector(a[:, 1:], logits, ids[:, 0])
        want, _, _ = ref.propose(b[:, 1:], ids[:, 0], head, 0.0)
        assert path.tolist() == want.tolist()
        differ += int((path != logits.argmax(-1)).sum())
    assert differ > 0  # the selector matters: its path is not the argmax everywhere
    # the convs matter: the same layers without them give another block
    plain = DFlashDraft.from_checkpoint(c, ck.load_draft_state(c))
    for layer in plain.layers:
        layer.attention_conv = layer.mlp_conv = None
    assert (plain(plain.fuse(feats), pos[:, :n], emb, pos[:, n:]) - a).abs().max() > 1e-2


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def built(exported):
    """The pair exported with 3 cache rows (the fp16-faithful check included), once per session:
    the conformance ladder's qwen3-dflash2 case (tests/test_conformance.py) is this pair."""
    pair = {k: v for k, v in FORM.items() if k != "draft_form"}
    e = exported("qwen3", "dflash2", pair={**pair, "agree": 2.0}, prefill_seq_len=16,
                 ctx_len=160, full_batch_size=3)  # fmt: skip
    return e.target, e.draft, e.artifacts, e.model()


def prompt(n, seed):
    return torch.randint(1, V - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# tokens and acceptance = the reference's, batched = solo: the conformance ladder's
# qwen3-dflash2 case (tests/test_conformance.py), on this pair


def test_q_aware_sampling_follows_the_target(tiny_pair, tmp_path):
    """Exported for sampling, the draft samples its path and returns q, the target verifies
    q-aware: the first two tokens follow the target's exact distribution (chi-square, as
    tests/test_sampling.py), steps accept proposals, and a batch equals its solo runs."""
    t, d = tiny_pair(**{**FORM, "block_size": 4, "vocab_size": SAMPLING_V, "agree": 1.5})
    opts = ExportOptions(prefill_seq_len=8, ctx_len=32, compile=False, full_batch_size=4)
    build_artifacts(t, d, tmp_path, opts, progress=lambda m: None)
    pipe, model = dflash_qaic.load(tmp_path, threads=1), ck.load_target_model(t)
    batched_first_two(pipe, model)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["target"]["draft_q"] == [3, 4] and m["draft"]["q_top_k"] == 4
    prompts = [SAMPLING_PROMPT, SAMPLING_PROMPT[:3], SAMPLING_PROMPT * 3]
    batched = pipe.generate(prompts, 24, temperature=1.0, seed=[1, 2, 3])
    assert sum(a > 1 for r in batched for a in r.acceptance_lengths) >= 3
    for i, (ids, r) in enumerate(zip(prompts, batched)):
        solo = pipe.generate(ids, 24, temperature=1.0, seed=i + 1)
        assert r.tokens == solo.tokens and r.acceptance_lengths == solo.acceptance_lengths


@torch.no_grad()
def test_sampled_selector_path_and_q_equal_reference(pair, monkeypatch):
    """At T > 0 the selector draws each step by the inverse CDF of q = softmax(scores / T)
    over its candidates: along our path the reference (made to follow it) computes the same q;
    the draws follow q (chi-square over many uniforms); a T = 0 row keeps the greedy path."""
    import dflash.model as ref_model

    t, d = pair
    c = ck.read_draft_config(d)
    ours = DFlashDraft.from_checkpoint(c, ck.load_draft_state(c))
    ref = DFlash2DraftModel.from_pretrained(d, dtype=torch.float32).eval()
    head = ck.load_target_model(t).lm_head
    gen = torch.Generator().manual_seed(4)
    n, B, N = 13, 8, 3000
    feats = torch.randn(1, n, 128, generator=gen)
    ids = torch.randint(0, V, (1, B), generator=gen)
    pos = torch.arange(n + B)[None]
    h = ours(
        ours.fuse(feats), pos[:, :n], ours.embed(ids, torch.randn(V, 64, generator=gen)), pos[:, n:]
    )
    h, anchor = h[:, 1:].expand(N, -1, -1), ids[:, 0].expand(N)
    logits = ours.logits(h, head.weight)
    temp = torch.full((N,), 0.7)
    temp[0] = 0.0
    u = torch.rand(N, B - 1, generator=gen)
    path, cand, q = ours.candidate_selector(h, logits, anchor, temp, u)
    assert path[0].tolist() == ours.candidate_selector(h[:1], logits[:1], anchor[:1])[0].tolist()
    assert torch.allclose(q.sum(-1), torch.ones(())) and (path[:, :, None] == cand).any(-1).all()
    k = cand.shape[-1]
    for row in (1, 2, 3):  # the reference along our path: the same q rows
        rc = torch.topk(logits[row : row + 1], k, dim=-1, sorted=False).indices[0]  # its order
        picks = [rc[j].tolist().index(x) for j, x in enumerate(path[row].tolist())]
        draws = iter(picks)
        monkeypatch.setattr(
            ref_model, "_sample_probs", lambda p, it=draws: torch.tensor([next(it)])
        )
        rpath, rcand, rq = ref.candidate_selector.select(
            h[row : row + 1], logits[row : row + 1], anchor[:1], 0.7
        )
        assert rpath[0].tolist() == path[row].tolist() and torch.equal(rcand[0], rc)
        for j in range(B - 1):  # q per candidate id, in either order
            want = dict(zip(rc[j].tolist(), rq[0, j].tolist()))
            got = dict(zip(cand[row, j].tolist(), q[row, j].tolist()))
            assert want.keys() == got.keys()
            assert all(abs(want[x] - got[x]) < 1e-5 for x in want), (j, want, got)
    # the first step's draws follow its q (the same for every row but the greedy one)
    first = (path[1:, 0, None] == cand[1:, 0]).int().argmax(-1).numpy()
    assert gof_pvalue([gof(first, q[1, 0].numpy())]) > 1e-3


@torch.no_grad()
def test_sampled_draft_program_returns_the_selector_q(pair, tmp_path):
    """The draft program exported for sampling (fp16-faithful check included) takes temperature
    and a uniform per proposal and returns the path, candidates and q the selector computes
    from the draft's forward; T = 0 rows return the greedy path."""
    import onnxruntime as ort

    from dflash_qaic import contract
    from dflash_qaic.exporter.draft import export_draft

    t, d = pair
    c = ck.read_draft_config(d)
    state = ck.load_draft_state(c)
    draft = DFlashDraft.from_checkpoint(c, state)
    model = ck.load_target_model(t)
    emb_w, head_w = model.get_input_embeddings().weight, model.lm_head.weight
    B, ctx_len, b, s = 8, 64, 4, 16
    facts = export_draft(
        c, state, emb_w, head_w, tmp_path / "draft.onnx", ctx_len=ctx_len, prefill_seq_len=s,
        block_size=B, sampling=True,
    )  # fmt: skip
    names = [o["name"] for o in facts["outputs"]]
    assert names[:4] == [contract.DRAFT_TOKENS, contract.DRAFT_CONFIDENCE, contract.DRAFT_Q_IDS,
                         contract.DRAFT_Q_PROBS]  # fmt: skip
    sess = ort.InferenceSession(str(tmp_path / "draft.onnx"), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(8)
    n = 11  # context rows 0 … n−1, the block at n
    ctx = torch.randn(b, n, 64, generator=gen)
    blk = torch.full((b, B), c.mask_token_id)
    blk[:, 0] = torch.randint(0, V, (b,), generator=gen)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3])
    u = torch.rand(b, B - 1, generator=gen)
    feeds = {
        contract.TARGET_HIDDEN: torch.cat([ctx, torch.zeros(b, s - n, 64)], 1).numpy(),
        contract.POSITION_IDS_TARGET: np.where(np.arange(s) < n, np.arange(s), -1)[None]
        .repeat(b, 0)
        .astype(np.int64),
        contract.INPUT_IDS: blk.numpy(),
        contract.POSITION_IDS: np.arange(n, n + B)[None].repeat(b, 0).astype(np.int64),
        contract.COMP_CTX_LENGTHS: np.arange(ctx_len, dtype=np.int64),
        contract.TEMPERATURE: temp.numpy(),
        contract.DRAFT_RANDOM_U: u.numpy(),
    }
    for i in sess.get_inputs():
        if i.name.startswith("past_"):
            feeds[i.name] = np.zeros(
                [b if x == "batch_size" else ctx_len if isinstance(x, str) else x for x in i.shape],
                np.float32,
            )
    out = dict(zip(names, sess.run(names, feeds)))
    h = draft(
        ctx,
        torch.arange(n)[None].expand(b, n),
        draft.embed(blk, emb_w),
        torch.arange(n, n + B)[None].expand(b, B),
    )
    logits = draft.logits(h[:, 1:], head_w)
    path, cand, q = draft.candidate_selector(h[:, 1:], logits, blk[:, 0], temp, u)
    np.testing.assert_array_equal(out[contract.DRAFT_TOKENS], path.numpy())
    np.testing.assert_array_equal(out[contract.DRAFT_Q_IDS], cand.numpy())
    np.testing.assert_allclose(out[contract.DRAFT_Q_PROBS], q.numpy(), atol=1e-5)
    greedy = draft.candidate_selector(h[:1, 1:], logits[:1], blk[:1, 0])
    assert out[contract.DRAFT_TOKENS][0].tolist() == greedy[0].tolist()
    assert (out[contract.DRAFT_TOKENS][1:] != logits[1:].argmax(-1).numpy()).any()
    # fp16 as the card computes it, at temperatures where softmax(scores / T) overflows unless
    # the max goes first (before: every q NaN at T = 1e-4): q finite, a distribution, and the
    # path the greedy one (the score gaps here are far above T)
    import onnx

    from dflash_qaic.exporter.fp16_check import FaithfulSession

    fs = FaithfulSession(onnx.load(str(tmp_path / "draft.onnx")), "draft")
    every = draft.candidate_selector(h[:, 1:], logits, blk[:, 0])
    for tiny in (1e-4, 1e-7):
        got = fs.run({**feeds, contract.TEMPERATURE: np.full(b, tiny, np.float32)})
        q = got[contract.DRAFT_Q_PROBS].astype(np.float32)
        assert np.isfinite(q).all(), tiny
        np.testing.assert_allclose(q.sum(-1), 1.0, atol=2e-3)
        assert got[contract.DRAFT_TOKENS].tolist() == every.tolist(), tiny


@pytest.mark.slow
@torch.no_grad()
def test_sampled_acceptance_distributed_as_reference(built):
    """At T = 1 the first step's acceptance length (the same context for every run) is
    distributed as the reference `dflash_generate`'s with the DFlash-2 draft (chi-square
    contingency of the two histograms)."""
    from scipy import stats

    t, d, art, model = built
    ref = DFlash2DraftModel.from_pretrained(d, dtype=torch.float32).eval()
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[pipe.B])
    ids, n = prompt(9, 501), 600
    res = pipe.generate([ids] * n, 9, temperature=1.0, seed=list(range(n)), stop_token_ids=[])
    ours = [r.acceptance_lengths[0] for r in res]
    theirs = []
    for i in range(n):
        torch.manual_seed(10**6 + i)
        out = dflash_generate(ref, model, torch.tensor([ids]), 9, None, 1.0, return_stats=True)
        theirs.append(out.acceptance_lengths[0])
    a, b = np.bincount(ours, minlength=9)[1:], np.bincount(theirs, minlength=9)[1:]
    keep = (a + b) > 0
    assert keep.sum() >= 3, (a, b)  # multi-token first steps happen
    assert stats.chi2_contingency(np.stack([a[keep], b[keep]])).pvalue > 1e-3, (a, b)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 15, 16])
def test_walk_composes_the_choices_in_order(n):
    """`walk` (prefix compositions by doubling) equals the sequential walk: index_0 =
    choice[0][0], index_j = choice[j][index_{j−1}]."""
    from dflash_qaic.modeling.draft import walk

    gen = torch.Generator().manual_seed(n)
    choice = torch.randint(0, 5, (3, n, 5), generator=gen)
    want = torch.zeros(3, n, dtype=torch.long)
    for b in range(3):
        at = 0
        for j in range(n):
            at = int(choice[b, j, at])
            want[b, j] = at
    assert torch.equal(walk(choice), want)
