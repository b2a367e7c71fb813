"""Sliding-window and causal drafts (docs/DESIGN.md, Sliding drafts): layers follow
`layer_types` / `sliding_window` / `is_causal` as the reference `DFlashDraftModel` (dflash 0.1.0,
which implements them) does; a sliding layer's cache is a ring of `sliding_window` slots.

Oracles: the reference draft's forward and `dflash_generate` (tokens and per-step acceptance,
whole-block verification); the draft forward over the whole context for the ring program, call
by call (wrap-around inside one call and across calls, continuous batching, inactive rows, a
cache row reused by a shorter sequence); the target's exact distribution (chi-square) when
sampling.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from dflash.model import DFlashDraftModel, dflash_generate
from test_sampling import V as SAMPLING_V
from test_sampling import batched_first_two

import dflash_qaic
from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
from dflash_qaic.exporter.draft import export_draft
from dflash_qaic.modeling.draft import DFlashDraft

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens

SLIDE, FULL = "sliding_attention", "full_attention"
# name -> draft fields (dflash_lab.tiny.TinySpec); every window is shorter than most prompts
DRAFTS = {
    "mixed": dict(layer_types=[SLIDE, FULL], sliding_window=6),
    "all-sliding-bidirectional-optional-fields": dict(
        layer_types=[SLIDE, SLIDE],
        sliding_window=5,
        is_causal=False,
        input_embedding_scale=1.7,
        output_multiplier=0.6,
        final_logit_softcapping=3.0,
    ),
    "causal-full": dict(is_causal=True, seed=1),
    # a ring wider than the smallest attention window (40 of ctx 160): it reads min(window, ring)
    "wide-window": dict(layer_types=[FULL, SLIDE], sliding_window=50),
}


V = 24  # a small vocabulary: a random draft then agrees with the target often enough that
# per-step acceptance tests the draft's proposals (the `agree` bias would zero the draft's norm)


def prompt(n, seed):
    return torch.randint(1, V - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pair(tiny_pair):
    def make(name):
        return tiny_pair(
            block_size=8, vocab_size=V, tie_word_embeddings=False, target_layer_ids=[1, 3],
            **DRAFTS[name],
        )  # fmt: skip

    return make


# ---------------------------------------------------------------- config


def _edit(d, **kw):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in kw.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "edit,match",
    [
        ({"block_size": 4}, "`block_size` is 4 but `dflash_config.block_size` is 8"),
        ({"layer_types": [SLIDE]}, "one of .* per draft layer \\(2\\)"),
        ({"layer_types": ["linear_attention", FULL]}, "`layer_types` must list"),
        ({"sliding_window": None}, "need an integer `sliding_window`"),
        ({"sliding_window": 1}, "of at least 2"),
        ({"is_causal": "yes"}, '`is_causal` is "yes" \\(a string\\); it must be true or false'),
    ],
)
def test_bad_draft_attention_configs_are_refused(pair, tmp_path, edit, match):
    import shutil

    _, d = pair("mixed")
    bad = tmp_path / "draft"
    shutil.copytree(d, bad)
    _edit(bad, **edit)
    with pytest.raises(ck.CheckpointError, match=match):
        ck.read_draft_config(bad)


def test_make_tiny_pair_writes_the_newer_draft_fields(tmp_path):
    from dflash_lab.tiny import main

    argv = [str(tmp_path), "--layer-types", "sliding,full", "--sliding-window", "4"]
    main([*argv, "--is-causal", "false", "--output-multiplier", "0.5", "--vocab-size", "32"])
    c = ck.read_draft_config(tmp_path / "draft")
    assert c.layer_types == (SLIDE, FULL) and c.sliding_window == 4 and c.is_causal is False
    assert c.output_multiplier == 0.5 and c.input_embedding_scale == 1.0
    assert [c.layer_attention(i) for i in range(2)] == [(False, 4), (False, None)]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--layer-types", "sliding,full"])  # no window


def test_block_size_inside_dflash_config(pair, tmp_path):
    import shutil

    _, d = pair("mixed")
    moved = tmp_path / "draft"
    shutil.copytree(d, moved)
    _edit(moved, block_size=None)  # only dflash_config.block_size (Qwen3.5-era drafts)
    c = ck.read_draft_config(moved)
    assert c.block_size == 8
    assert [c.layer_attention(i) for i in range(2)] == [(True, 6), (False, None)]


# ---------------------------------------------------------------- the draft forward


@pytest.mark.parametrize("name", DRAFTS)
@torch.no_grad()
def test_draft_forward_equals_reference(pair, name):
    t, d = pair(name)
    c = ck.read_draft_config(d)
    ours = DFlashDraft.from_checkpoint(c, ck.load_draft_state(c))
    ref = DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
    head = ck.load_target_model(t).lm_head
    gen = torch.Generator().manual_seed(0)
    n, B = 13, 8  # context longer than any window
    feats = torch.randn(1, n, 64 * len(c.target_layer_ids), generator=gen)
    ids = torch.randint(0, V, (1, B), generator=gen)
    emb_w = torch.randn(V, 64, generator=gen)
    pos = torch.arange(n + B)[None]
    emb = ours.embed(ids, emb_w)
    scale = c.input_embedding_scale  # the reference scales the noise embedding itself
    torch.testing.assert_close(emb, torch.nn.functional.embedding(ids, emb_w) * scale)
    a = ours(ours.fuse(feats), pos[:, :n], emb, pos[:, n:])
    b = ref(position_ids=pos, noise_embedding=emb, target_hidden=feats)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        ours.logits(a, head.weight), ref.compute_logits(b, head), atol=2e-5, rtol=1e-5
    )
    # the masks matter: the same layers without them give another block
    plain = DFlashDraft.from_checkpoint(c, ck.load_draft_state(c))
    for layer in plain.layers:
        layer.causal, layer.window = False, None
    assert (plain(plain.fuse(feats), pos[:, :n], emb, pos[:, n:]) - a).abs().max() > 1e-2


# ---------------------------------------------------------------- the ring program


class DraftRunner:
    """The exported draft program on ONNX Runtime, its caches carried from call to call."""

    def __init__(self, path, facts, io):
        self.sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.io, self.windows = io, facts["comp_ctx_lengths"]
        sym = facts["specializations"][0]["symbols"]
        self.caches = {kv.name: np.zeros(kv.bind(**sym), np.float32) for kv in io.kv}

    def __call__(self, ctx, ctx_pos, ids, pos, bidx):
        start = int(pos[:, 0].max())
        n = contract.window_for(self.windows, max(start, 1))
        feeds = {
            contract.TARGET_HIDDEN: ctx.astype(np.float32),
            contract.POSITION_IDS_TARGET: ctx_pos,
            contract.INPUT_IDS: ids,
            contract.POSITION_IDS: pos,
            contract.BATCH_INDEX: bidx,
            contract.COMP_CTX_LENGTHS: np.arange(n, dtype=np.int64),
            **self.caches,
        }
        names = [o.name for o in self.io.outputs]
        out = dict(zip(names, self.sess.run(names, feeds)))
        for name in self.caches:
            self.caches[name] = out[contract.retained(name)]
        return out[contract.LOGITS]


@torch.no_grad()
def test_ring_program_equals_the_whole_context_forward(pair, tmp_path):
    """Two cache rows; calls that wrap the ring inside one call (13 and 41 rows of context
    against a 5-slot ring), steps that wrap it across calls, inactive rows, and a cache row
    taken over by a shorter sequence: every active row's logits equal the draft's forward over
    that sequence's whole context, and the ring layer's cache keeps W = 6 slots."""
    t, d = pair("mixed")
    c = ck.read_draft_config(d)
    state = ck.load_draft_state(c)
    draft = DFlashDraft.from_checkpoint(c, state)
    model = ck.load_target_model(t)
    emb_w, head_w = model.get_input_embeddings().weight, model.lm_head.weight
    B, ctx_len, N, H = 4, 64, 2, c.hidden_size
    facts = export_draft(
        c, state, emb_w, head_w, tmp_path / "draft.onnx", ctx_len=ctx_len, prefill_seq_len=16,
        block_size=B, full_batch_size=N, emit_logits=True, fp16_check=False,
    )  # fmt: skip
    io = contract.DraftIO(
        n_layers=2, n_kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_size=H,
        vocab_size=V, block_size=B, emit_logits=True, continuous_batching=True, comp_ctx=True,
        confidence=True, ring_slots=(6, 0),
    )  # fmt: skip
    assert [s["shape"] for s in facts["inputs"] if s["name"].startswith("past_key")] == [
        [contract.FULL_BATCH, c.num_kv_heads, 6, c.head_dim],
        [contract.FULL_BATCH, c.num_kv_heads, contract.CTX, c.head_dim],
    ]
    run = DraftRunner(tmp_path / "draft.onnx", facts, io)
    gen = torch.Generator().manual_seed(3)
    ctx = {s: torch.randn(1, 60, H, generator=gen) for s in "abc"}  # each sequence's context
    ids = {s: torch.randint(0, V, (60,), generator=gen) for s in "abc"}

    def expect(s, start):
        blk = torch.cat([ids[s][start : start + 1], torch.full((B - 1,), c.mask_token_id)])
        h = draft(
            ctx[s][:, :start],
            torch.arange(start)[None],
            draft.embed(blk[None], emb_w),
            torch.arange(start, start + B)[None],
        )
        return draft.logits(h[:, 1:], head_w)[0].numpy(), blk.numpy()

    def call(rows, seq_len):
        """rows: per call row, None (inactive) or (seq, first ctx position, ctx rows, start)."""
        b = len(rows)
        x = np.zeros((b, seq_len, H), np.float32)
        cp = np.full((b, seq_len), -1, np.int64)
        blk = np.zeros((b, B), np.int64)
        bp = np.full((b, B), -1, np.int64)
        bidx = np.full((b, 1), -1, np.int64)
        want = {}
        for r, row in enumerate(rows):
            if row is None:
                continue
            s, lo, n, start, slot = row
            x[r, :n] = ctx[s][0, lo : lo + n].numpy()
            cp[r, :n] = np.arange(lo, lo + n)
            want[r], blk[r] = expect(s, start)
            bp[r] = np.arange(start, start + B)
            bidx[r] = slot
        got = run(x, cp, blk, bp, bidx)
        for r, w in want.items():
            np.testing.assert_allclose(got[r], w, atol=1e-4, rtol=1e-4)

    call([("a", 0, 13, 13, 1)], 16)  # a prefill call wrapping the 5-slot ring twice
    call([None, ("a", 13, 3, 16, 1)], B)  # a step beside an inactive row
    call([None, ("a", 16, 1, 17, 1)], B)
    call([("b", 0, 41, 41, 0)], 48)  # another sequence in row 0, 41 rows at once
    call([("b", 41, 3, 44, 0), ("a", 17, 4, 21, 1)], B)  # both rows, both wrap
    before = [v.copy() for v in run.caches.values()]
    call([None, None], B)  # all inactive: only row 0's padding slot may change
    for a, b, kv in zip(before, run.caches.values(), io.kv):
        pad = kv.bind(full_batch_size=N, ctx_len=ctx_len)[2] - 1
        changed = {(int(r), int(s)) for r, _, s in np.argwhere((a != b).any(-1))}
        assert changed <= {(0, pad)}
    call([("c", 0, 3, 3, 1)], 16)  # row 1 taken over by a 3-token sequence
    call([("b", 44, 2, 46, 0), ("c", 3, 2, 5, 1)], B)


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def built(exported):
    """built(name, full_batch_size=None) -> (target, draft, artifacts, HF model), exported once
    per session (tests/conftest.py)."""

    def make(name, full_batch_size=None):
        pair = dict(block_size=8, vocab_size=V, tie_word_embeddings=False, **DRAFTS[name])
        e = exported("qwen3", pair={**pair, "target_layer_ids": [1, 3]}, prefill_seq_len=16,
                     ctx_len=160, full_batch_size=full_batch_size)  # fmt: skip
        return e.target, e.draft, e.artifacts, e.model()

    return make


@pytest.mark.parametrize("name", [n for n in DRAFTS if n != "mixed"])
@torch.no_grad()
def test_tokens_and_acceptance_equal_reference(built, name):
    """Prompts from shorter to far longer than the window (70 tokens: one 64-row DraftPrefill
    call wraps the ring many times, then the steps wrap it again). The "mixed" draft is the
    conformance ladder's sliding form (tests/test_conformance.py: tokens, acceptance, batched =
    solo and the stand-in at 70 tokens)."""
    t, d, art, model = built(name)
    ref = DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[pipe.B])  # whole blocks, as the reference verifies
    lengths = []
    for seed, n in enumerate([3, 17, 39, 70]):
        ids = prompt(n, 200 + seed)
        out = dflash_generate(ref, model, torch.tensor([ids]), 40, None, return_stats=True)
        res = pipe.generate(ids, max_new_tokens=40)
        assert res.tokens == out.output_ids[0, n:].tolist(), n
        start, k = n, 0  # the reference shrinks its last blocks: compare the whole-block steps
        for a in out.acceptance_lengths:
            if n + 40 - start < pipe.B:
                break
            start, k = start + a, k + 1
        assert res.acceptance_lengths[:k] == out.acceptance_lengths[:k]
        lengths += out.acceptance_lengths[:k]
    assert len(lengths) >= 12 and sum(a > 1 for a in lengths) >= 3, lengths


def test_sampling_with_a_sliding_draft_follows_the_target(tiny_pair, tmp_path):
    """A 3-key window over a 5-token prompt, sampled in batches of 4: the first two tokens follow
    the target's exact distribution (chi-square, as tests/test_sampling.py)."""
    t, d = tiny_pair(
        block_size=4, agree=1.5, tie_word_embeddings=False, target_layer_ids=[1, 3],
        vocab_size=SAMPLING_V, layer_types=[SLIDE, FULL], sliding_window=3,
    )  # fmt: skip
    opts = ExportOptions(prefill_seq_len=8, ctx_len=32, compile=False, full_batch_size=4)
    build_artifacts(t, d, tmp_path, opts, progress=lambda m: None)
    pipe, model = dflash_qaic.load(tmp_path, threads=1), ck.load_target_model(t)
    batched_first_two(pipe, model)


# ---------------------------------------------------------------- long context


def test_long_context_windows_follow_the_prompt():
    """Up to 16K of context the default windows are ctx/8 … ctx as before; past it they halve
    down to 2K, each at most twice the one below."""
    w = contract.default_comp_ctx_lengths
    for ctx, chunk in [(160, 16), (1024, 256), (4096, 128), (16384, 1024)]:
        floor = contract.prefill_lengths(chunk, 16)[0] + 16
        assert w(ctx, chunk, 16) == sorted({ctx >> k for k in range(4) if ctx >> k >= floor})
    assert w(40960, 1024, 16) == [2560, 5120, 10240, 20480, 40960]
    assert w(131072, 1024, 16) == [2048 << k for k in range(7)]


def test_long_context_bench_mode(built, tmp_path):
    from dflash_qaic.bench.cli import main

    _, _, art, _ = built("mixed")
    out = tmp_path / "long.json"
    argv = ["--long-context", str(art), "--prompt-len", "60", "--positions", "10,120"]
    assert main([*argv, "--max-new-tokens", "4", "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["ring_slots"] == [6, 0] and r["prompt_len"] == 60 and r["peak_rss_gb"] > 0
    assert set(r["cost_s"]) == {"10", "120"}
    assert all(set(c) == {"draft", "verify", "decode"} for c in r["cost_s"].values())
