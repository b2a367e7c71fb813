"""The trainers (`dflash_lab.train`) and the committed trained pair (`dflash_qaic.assets`)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_lab.train import corpus as C
from dflash_lab.train import draft as D
from dflash_lab.train import target as T
from dflash_qaic import assets
from dflash_qaic import checkpoints as ck
from dflash_qaic.modeling.draft import DFlashDraft

CODE_A = "def f(x):\n    return x + 1\n\n" * 20
CODE_B = "for i in range(10):\n    print(i, i * i)\n" * 20


@pytest.fixture(autouse=True)
def _one_thread():
    """Small matrices on a shared 2-core machine: one thread is much faster (see THREADS_HELP)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random target (layer ids 1 and 3 named) and a two-file corpus."""
    from dflash_lab.tiny import make_tiny_pair

    root = tmp_path_factory.mktemp("train")
    tdir, _ = make_tiny_pair(root / "pair", target_layer_ids=[1, 3], block_size=8)
    (root / "a.py").write_text(CODE_A)
    (root / "b.py").write_text(CODE_B)
    return root, tdir


def _draft_args(root, tdir, out, *extra: str):
    argv = ["--target", str(tdir), "--corpus", str(root / "a.py"), str(root / "b.py")]
    argv += ["--out", str(out), "--block-size", "8", "--target-layer-ids", "1", "3"]
    argv += ["--num-seqs", "8", "--gen-batch", "8", "--gen-len", "16", "--prompt-len", "8", "24"]
    argv += ["--batch-size", "4", "--anchors", "6", "--warmup", "4", "--lr", "3e-3"]
    argv += ["--save-every", "3", "--dtype", "float32", *extra]
    return D.parser().parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The draft trainer


@torch.no_grad()
def test_multi_block_forward_equals_dflash_draft(tiny_pair):
    """The batched training forward (many anchors, one masked pass) computes, for every block,
    exactly what `DFlashDraft.forward` computes on that block's context prefix."""
    tdir, ddir = tiny_pair(target_layer_ids=[1, 3], draft_layers=2, block_size=8)
    pair = ck.read_pair(tdir, ddir)
    target = ck.load_target_model(pair.target)
    draft = DFlashDraft.from_checkpoint(pair.draft, ck.load_draft_state(pair.draft))
    embed = target.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(0)
    S, L, A, B = 2, 30, 5, pair.draft.block_size
    tokens = torch.randint(0, 250, (S, L), generator=gen)
    ctx = draft.fuse(D.target_features(target, tokens, pair.draft.target_layer_ids))
    anchors = torch.randint(1, L - B, (S, A), generator=gen)
    block_ids = torch.full((S, A, B), pair.draft.mask_token_id)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    emb = draft.embed(block_ids.view(S, A * B), embed)
    got = D.multi_block_forward(draft, ctx, emb, anchors).view(S, A, B, -1)
    for s in range(S):
        for a in range(A):
            p = int(anchors[s, a])
            expect = draft(
                ctx[s : s + 1, :p],
                torch.arange(p)[None],
                emb[s : s + 1, a * B : (a + 1) * B],
                torch.arange(p, p + B)[None],
            )
            torch.testing.assert_close(got[s, a], expect[0], atol=2e-5, rtol=1e-5)


def test_sample_batch_anchors_and_labels():
    seqs = [{"tokens": torch.arange(100, 120), "prompt_len": 12}] * 3
    b = D.sample_batch(seqs, 50, 3, 4, torch.Generator().manual_seed(0))
    assert b["anchors"].min() >= 12 and b["anchors"].max() <= 18  # ≥ one label after the anchor
    lab = b["labels"]
    assert torch.equal(lab[..., 0], 100 + b["anchors"])
    pos = b["anchors"][..., None] + torch.arange(4)
    assert torch.equal(lab, torch.where(pos < 20, 100 + pos, -100))


def test_train_tiny_writes_valid_draft_and_loss_decreases(tiny, tmp_path):
    from dflash.model import DFlashDraftModel

    root, tdir = tiny
    out = tmp_path / "draft"
    summary = D.train(_draft_args(root, tdir, out, "--steps", "36"))
    pair = ck.read_pair(tdir, out)
    assert pair.draft.target_layer_ids == (1, 3) and pair.draft.block_size == 8
    assert pair.draft.mask_token_id == 255  # no tokenizer: the last vocabulary row
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "train_state",
    ]
    ref = DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32)
    assert list(ref.target_layer_ids) == [1, 3]
    losses = [x[0] for x in summary["history"]]
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), losses
    assert (out / "train_state" / "summary.json").is_file()


def test_resume_equals_uninterrupted_run(tiny, tmp_path):
    root, tdir = tiny
    full, part = tmp_path / "full", tmp_path / "part"
    D.train(_draft_args(root, tdir, full, "--steps", "8"))
    # The interrupted run reuses the sequence cache (same data key), as a real resume does.
    (part / "train_state").mkdir(parents=True)
    seq = (full / "train_state" / "sequences.pt").read_bytes()
    (part / "train_state" / "sequences.pt").write_bytes(seq)
    stopped = D.train(_draft_args(root, tdir, part, "--steps", "8"), stop_after=5)
    assert stopped["step"] == 5 and not (part / "model.safetensors").exists()
    ckpt = torch.load(part / "train_state" / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 5 and len(ckpt["optimizer"]["state"]) > 0
    with pytest.raises(SystemExit, match="--resume"):
        D.train(_draft_args(root, tdir, part, "--steps", "8"))
    with pytest.raises(SystemExit, match="other settings"):
        D.train(_draft_args(root, tdir, part, "--steps", "8", "--lr", "1e-3", "--resume"))
    D.train(_draft_args(root, tdir, part, "--steps", "8", "--resume"))
    a, b = load_file(full / "model.safetensors"), load_file(part / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------------------
# The target trainer, the corpus and the tokenizer


def _target_args(root, out, *extra: str):
    argv = ["--corpus", str(root / "a.py"), str(root / "b.py"), "--out", str(out)]
    argv += ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1"]
    argv += ["--intermediate-size", "64", "--seq-len", "32", "--batch-size", "2", "--warmup", "1"]
    argv += ["--save-every", "2", "--dtype", "float32", "--no-eval-heldout", *extra]
    return T.parser().parse_args(argv)


def test_target_trainer_writes_hf_dir_and_resumes_exactly(tiny, tmp_path):
    from transformers import AutoTokenizer

    root, _ = tiny
    full, part = tmp_path / "full", tmp_path / "part"
    summary = T.train(_target_args(root, full, "--steps", "6"))
    assert summary["steps"] == 6
    t = ck.read_target_config(full)
    assert t.family == "qwen3" and t.vocab_size == C.BYTE_VOCAB_SIZE and t.num_layers == 2
    ck.load_target_model(t)
    tok = AutoTokenizer.from_pretrained(full, local_files_only=True)
    assert tok.eos_token_id == C.EOS_ID and tok.mask_token_id == C.MASK_ID

    assert T.train(_target_args(root, part, "--steps", "6"), stop_after=3) == {"step": 3}
    T.train(_target_args(root, part, "--steps", "6", "--resume"))
    a, b = load_file(full / "model.safetensors"), load_file(part / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_byte_tokenizer_round_trips(tmp_path):
    from transformers import AutoTokenizer

    C.build_byte_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for s in ["def f(x):\n\treturn  x ", "héllo wörld — 日本語 😀\r\n", "", " \x00\x7f"]:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert ids == C.byte_ids(s)
        assert tok.decode(ids) == s


def test_stdlib_split_is_disjoint_and_deterministic():
    train, held = C.stdlib_files("train"), C.stdlib_files("heldout")
    assert len(train) > 100 and len(held) > 10
    assert not set(train) & set(held)
    assert C.stdlib_files("heldout") == held
    root = C.stdlib_root()
    assert all(C.is_heldout(p.relative_to(root).as_posix()) for p in held)


# ---------------------------------------------------------------------------------------------
# The committed pair


def test_committed_pair_loads_and_validates():
    from transformers import AutoTokenizer

    tdir, ddir = assets.default_pair()
    pair = ck.read_pair(tdir, ddir)
    tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    s = "    def __init__(self, name='ü'):\n        self.name = name\n"
    assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s
    assert pair.draft.mask_token_id == tok.mask_token_id == C.MASK_ID
    assert pair.draft.block_size == 16
    size = sum(f.stat().st_size for d in (tdir, ddir) for f in d.iterdir())
    assert size < 6.5e6, size
    assert not (ddir / "train_state").exists() and not (tdir / "train_state").exists()
    prompts = assets.heldout_prompts()
    assert 16 <= len(prompts) <= 32 and all(100 <= len(p.encode()) <= 300 for p in prompts)
    # Held-out prompts come from held-out files only.
    rows = (assets.ROOT / "prompts" / "heldout.jsonl").read_text().splitlines()
    assert all(C.is_heldout(json.loads(r)["source"].rsplit(":", 1)[0]) for r in rows)


def test_committed_pair_reference_is_greedy_and_accepts():
    """dflash_generate on the committed pair equals HF greedy generate, and the trained draft is
    accepted (τ > 3) on held-out prompts."""
    from dflash_lab.train.tau import measure_tau

    tdir, ddir = assets.default_pair()
    res = measure_tau(tdir, ddir, assets.heldout_prompts()[:4], 64, check_greedy=True)
    assert all(res["greedy_equal"])
    assert res["mean_tau"] > 3.0, res


def test_committed_dflash2_draft_is_exact_and_accepts_more_when_sampling():
    """The committed DFlash-2 draft (`default_pair("dflash2")`): validates as published, its
    convs and selector were trained (not the identity, not the fresh init), the reference
    `dflash_generate` with it equals HF greedy, and at T = 1 (the reference verifies its sampled
    path q-aware) it commits more per step than the DFlash draft on the same prompts and seeds."""
    from safetensors.torch import load_file

    from dflash_lab.train.tau import measure_tau

    tdir, ddir = assets.default_pair("dflash2")
    pair = ck.read_pair(tdir, ddir)
    assert pair.draft.dflash2 and pair.draft.block_size == 16
    assert pair.draft.mask_token_id == ck.read_pair(*assets.default_pair()).draft.mask_token_id
    state = load_file(str(ddir / "model.safetensors"))
    assert state["layers.1.mlp_conv.kernel_projection.weight"].abs().max() > 0
    base = state["layers.0.attention_conv.base_kernel"].float()  # [2, K, H]: moved off identity
    assert (base[:, 1:].abs().max() > 0) and (base[:, 0] - 1).abs().max() > 0
    prompts = assets.heldout_prompts()[:4]
    res = measure_tau(tdir, ddir, prompts, 64, check_greedy=True)
    assert all(res["greedy_equal"]) and res["mean_tau"] > 3.0, res
    two = measure_tau(tdir, ddir, prompts, 64, temperature=1.0)
    one = measure_tau(tdir, assets.default_pair()[1], prompts, 64, temperature=1.0)
    assert two["pooled_tau"] > one["pooled_tau"], (two, one)


@pytest.mark.slow
def test_committed_pair_tau_at_block_16():
    from dflash_lab.train.tau import measure_tau

    tdir, ddir = assets.default_pair()
    res = measure_tau(tdir, ddir, assets.heldout_prompts(), 128, block_size=16)
    assert res["mean_tau"] >= 4.0, res


class _Planted:
    """A pickle that would create a file when unpickled by a full (unsafe) torch.load."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_train_state_is_never_executed(tiny, tmp_path):
    root, tdir = tiny
    out, marker = tmp_path / "draft", tmp_path / "pwned"
    state = out / "train_state"
    state.mkdir(parents=True)
    torch.save({"key": "x", "seqs": _Planted(marker)}, state / "sequences.pt")
    # without --resume the sequence cache is not even read: regenerated and overwritten
    D.train(_draft_args(root, tdir, out, "--steps", "2"))
    assert not marker.exists() and (out / "model.safetensors").is_file()
    # with --resume, a planted checkpoint or sequence cache is refused, not unpickled
    torch.save({"step": 1, "settings": _Planted(marker)}, state / "checkpoint.pt")
    with pytest.raises(SystemExit, match="not training state this trainer wrote"):
        D.train(_draft_args(root, tdir, out, "--steps", "2", "--resume"))
    torch.save({"key": "x", "seqs": _Planted(marker)}, state / "sequences.pt")
    (state / "checkpoint.pt").unlink()
    with pytest.raises(SystemExit, match="not training state this trainer wrote"):
        D.train(_draft_args(root, tdir, out, "--steps", "2", "--resume"))
    tout = tmp_path / "target"
    (tout / "train_state").mkdir(parents=True)
    torch.save({"step": 1, "model": _Planted(marker)}, tout / "train_state" / "checkpoint.pt")
    with pytest.raises(SystemExit, match="not training state this trainer wrote"):
        T.train(_target_args(root, tout, "--steps", "2", "--resume"))
    assert not marker.exists()


def test_sampled_continuations_are_the_targets_samples(tiny):
    """continue_target at T > 0 draws from the target's softmax (seeded); at T = 0 it is the
    greedy continuation."""
    _, tdir = tiny
    model = ck.load_target_model(tdir)
    prompts = torch.randint(0, 250, (3, 6), generator=torch.Generator().manual_seed(0))
    greedy = D.continue_target(model, prompts, 5)
    assert torch.equal(greedy, D.greedy_continue(model, prompts, 5))
    a = D.continue_target(model, prompts, 5, 1.0, torch.Generator().manual_seed(1))
    b = D.continue_target(model, prompts, 5, 1.0, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and torch.equal(a[:, :6], prompts)
    # the first sampled token follows softmax(logits): its log-probability is finite and the
    # draws over many seeds are not all the argmax
    with torch.no_grad():
        logits = model(prompts).logits[:, -1]
    firsts = torch.stack(
        [
            D.continue_target(model, prompts, 1, 1.0, torch.Generator().manual_seed(s))[:, 6]
            for s in range(30)
        ]
    )
    assert (firsts != logits.argmax(-1)).any()
    assert torch.isfinite(torch.log_softmax(logits, -1).gather(1, firsts.T)).all()


def test_mixed_recipe_trains_on_sampled_sequences(tiny, tmp_path):
    root, tdir = tiny
    out = tmp_path / "mixed"
    D.train(_draft_args(root, tdir, out, "--steps", "2", "--sampled-frac", "1"))
    seqs = torch.load(out / "train_state" / "sequences.pt", weights_only=True)["seqs"]
    assert all(s["sampled"] for s in seqs)
    model = ck.load_target_model(tdir)
    s = seqs[0]
    greedy = D.greedy_continue(model, s["tokens"][None, : s["prompt_len"]], 16)[0]
    assert not torch.equal(greedy, s["tokens"])  # not the greedy continuation
    with pytest.raises(SystemExit, match="sampled-frac"):
        D.main(["--target", str(tdir), "--out", str(tmp_path / "x"), "--sampled-frac", "2"])


# ---------------------------------------------------------------------------------------------
# DFlash-2: the trainer learns the convs and the candidate selector


def test_block_probs_are_the_distributions_of_the_block_rows():
    """Row j of a block at anchor p is scored against the target's distribution after position
    p + j − 1, the one that predicts the label at p + j."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (3, 40), generator=gen)
    probs = torch.zeros(3, 40, 11)
    probs[:, :-1] = torch.nn.functional.one_hot(tokens[:, 1:], 11).float()  # after t: token t+1
    seqs = [{"tokens": t, "prompt_len": 5} for t in tokens]
    batch = D.sample_batch(seqs, 4, 3, 8, gen)
    rows = D.block_probs(probs[batch["idx"]], batch["anchors"], 8)  # [S, A, 7, V]
    labels = batch["labels"][:, :, 1:]
    valid = labels >= 0
    assert valid.any()
    assert torch.equal(rows.argmax(-1)[valid], labels[valid])


def test_dflash2_from_a_dflash_draft_starts_where_it_was(tiny_pair):
    """`--init-from`: a DFlash-2 draft started from a DFlash draft computes exactly the DFlash
    draft's block hidden states (its convs start as the identity); a mismatched source is
    refused."""
    tdir, ddir = tiny_pair(target_layer_ids=[1, 3], draft_layers=2, block_size=8)
    src = ck.read_draft_config(ddir)
    dense = DFlashDraft.from_checkpoint(src, ck.load_draft_state(src))
    cfg = json.loads((ddir / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    fields = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)
    cfg["dflash_config"] = {**cfg.get("dflash_config", {}), **fields}
    c2 = ck.DraftConfig(**{**vars(src), **fields})
    draft = D.init_draft(c2, seed=1)
    D.init_from(draft, ddir)
    assert c2.dflash2 and draft.candidate_selector is not None
    gen = torch.Generator().manual_seed(0)
    H = src.hidden_size
    ctx = torch.randn(2, 9, H, generator=gen)
    emb = torch.randn(2, 8, H, generator=gen)
    cpos, bpos = torch.arange(9)[None].repeat(2, 1), (9 + torch.arange(8))[None].repeat(2, 1)
    with torch.no_grad():
        want = dense.forward(ctx, cpos, emb, bpos)
        got = draft.forward(ctx, cpos, emb, bpos)
        for layer in draft.layers:  # and the convs are real: a dynamic part changes the output
            layer.mlp_conv.kernel_projection.weight.normal_(0, 0.1, generator=gen)
        moved = draft.forward(ctx, cpos, emb, bpos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (moved - want).abs().max() > 1e-3
    small = ck.DraftConfig(**{**vars(c2), "intermediate_size": c2.intermediate_size // 2})
    with pytest.raises(SystemExit, match="do not fit"):
        D.init_from(D.init_draft(small, seed=1), ddir)


def test_dflash2_trainer_writes_the_published_form_and_learns(tiny, tmp_path):
    """`--form dflash2`: the draft is written as published (DFlash2DraftModel, its fields in
    dflash_config, codebooks without `.weight`), validates, loads in the reference, and the
    training moved the convs' dynamic parts and the selector; its loss falls and its T = 1
    estimate is reported."""
    from dflash.model import DFlash2DraftModel
    from safetensors import safe_open

    root, tdir = tiny
    out = tmp_path / "d2"
    extra = ["--form", "dflash2", "--conv-kernel-size", "3", "--conv-group-size", "16"]
    extra += ["--selector-rank", "8", "--selector-top-k", "4", "--draft-layers", "2"]
    summary = D.train(_draft_args(root, tdir, out, "--steps", "36", *extra))
    pair = ck.read_pair(tdir, out)
    assert (
        pair.draft.dflash2 and pair.draft.selector_top_k == 4 and pair.draft.conv_kernel_size == 3
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"]["selector_rank"] == 8
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "candidate_selector.predecessor_codebook" in keys
    assert "candidate_selector.predecessor_codebook.weight" not in keys
    ref = DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32)
    state = load_file(str(out / "model.safetensors"))
    assert torch.equal(
        ref.candidate_selector.successor_codebook.weight.half(),
        state["candidate_selector.successor_codebook"].half(),
    )
    assert state["layers.0.attention_conv.kernel_projection.weight"].abs().max() > 0  # learnt
    losses = [x[0] for x in summary["history"]]
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4]), losses
    assert all(len(x) == 3 and 1.0 <= x[2] <= 8.0 for x in summary["history"])
    assert "final_tau_t1_train" in summary
