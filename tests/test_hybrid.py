"""Hybrid targets (Qwen3.5: Gated DeltaNet + gated full attention): checkpoints in both forms,
the program against Hugging Face's `Qwen3_5ForCausalLM`, the state committed inside the verify
call, and the whole loop lossless (tokens = HF greedy, acceptance = the reference)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from dflash.model import DFlashDraftModel, dflash_generate

import dflash_qaic
from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
from dflash_qaic.artifacts.manifest import read_manifest
from dflash_qaic.modeling import hybrid
from dflash_qaic.modeling.target import ExportTarget

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens

B, CHUNK, CTX = 4, 16, 112
HYBRID = dict(family="qwen3_5", block_size=B, tie_word_embeddings=False, target_layer_ids=[1, 3])
PUBLISHED = dict(multimodal=True, dtype="bfloat16", shards=2)


@pytest.fixture(scope="module")
def pair(tiny_pair):
    """A biased tiny hybrid pair (acceptance varies), text-only form, fp32."""
    return tiny_pair(agree=1.0, **HYBRID)


@pytest.fixture(scope="module")
def published(tiny_pair):
    """The same kind of pair in the published form: Qwen3_5ForConditionalGeneration, text
    tensors under model.language_model.*, a vision tower, bf16, 2 shards with an index."""
    return tiny_pair(agree=1.0, **PUBLISHED, **HYBRID)


def art(exported, published=False, **options):
    """The artifacts of `pair` (or `published`) exported once per session (tests/conftest.py)."""
    pair = {**HYBRID, "agree": 1.0, **(PUBLISHED if published else {})}
    del pair["family"]
    return exported("qwen3_5", pair=pair, prefill_seq_len=CHUNK, ctx_len=CTX, **options).artifacts


def prompt(n, seed):
    return torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model, ids, n):
    x = torch.tensor([ids])  # an explicit mask: token 0 in the ids is not padding
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


# ---------------------------------------------------------------- checkpoints


def test_both_forms_read_and_validate(pair, published):
    for (t, d), prefix in ((pair, "model."), (published, "model.language_model.")):
        p = ck.read_pair(t, d)
        assert p.target.family == "qwen3_5" and p.target.prefix == prefix
        assert p.target.deltanet["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    tt = ck.read_pair(*published).target_tensors
    assert any(k.startswith("model.visual.") for k in tt)  # present, and ignored
    assert json.loads((published[0] / "config.json").read_text())["architectures"] == [
        "Qwen3_5ForConditionalGeneration"
    ]


def test_incomplete_or_unknown_checkpoints_are_refused(published, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    t, d = published
    bad = tmp_path / "t"
    shutil.copytree(t, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    state = load_file(shard)
    name = next(k for k in state if "linear_attn.A_log" in k)
    del state[name]
    save_file(state, str(shard), metadata={"format": "pt"})
    index = json.loads((bad / ck.INDEX_NAME).read_text())
    del index["weight_map"][name]
    (bad / ck.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ck.CheckpointError, match="missing tensor keys.*A_log"):
        ck.read_pair(bad, d)
    cfg = json.loads((t / "config.json").read_text())
    cfg["text_config"]["layer_types"][3] = "sliding_attention"
    shutil.copytree(t, tmp_path / "u")
    (tmp_path / "u" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ck.CheckpointError, match="layer_types"):
        ck.read_pair(tmp_path / "u", d)


# ---------------------------------------------------------------- the program (eager) vs HF


def _module(model, max_rows=CHUNK, ctx=64):
    H = model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    fc = torch.randn(H, 2 * H, generator=g) * 0.1
    t = ExportTarget.from_hf(
        model,
        fc,
        torch.ones(H),
        1e-6,
        [1, 3],
        ctx_len=ctx,
        block_size=B,
        max_rows=max_rows,
        emit_logits=True,
        sampling=False,
    ).eval()
    t.comp_ctx = False
    from dflash_qaic.exporter.target import target_io

    io = target_io(t, 1, emit_logits=True, sampling=False)  # inputs bound by name, as exported
    t.input_names = [contract.INPUT_IDS, contract.POSITION_IDS] + [s.name for s in io.kv]
    t.output_names = [s.name for s in io.outputs]
    return t


def _buffers(t, ctx=64):
    from dflash_qaic.exporter.target import target_io

    io = target_io(t, 1, emit_logits=True, sampling=False)
    return [torch.zeros(s.bind(batch_size=1, ctx_len=ctx)) for s in io.kv]


@torch.no_grad()
def test_program_equals_hf_across_chunks_and_commits(pair):
    """Prefill in padded chunks, then verify calls that accept 0 … B-1 proposals: every row's
    logits equal HF's on the committed sequence; a commit one position off is caught."""
    model = ck.load_target_model(pair[0])
    t = _module(model)
    ids = prompt(21, 7)

    def run(count_shift: int = 0):
        # a variant that outputs the right count but writes back the state one position off
        orig = hybrid.GatedDeltaNet.commit
        if count_shift:

            def commit(self, pending, count, idx):
                return orig(self, pending, (count + count_shift).clamp(0, len(idx)), idx)

            hybrid.GatedDeltaNet.commit = commit
        try:
            past, seq, worst = _buffers(t), list(ids), 0.0
            for c0 in range(0, len(ids), 8):  # chunks of 8 rows, the last one padded
                chunk = ids[c0 : c0 + 8]
                pos = list(range(c0, c0 + len(chunk))) + [-1] * (8 - len(chunk))
                x = torch.tensor([chunk + [0] * (8 - len(chunk))])
                nt, _, logits, count, *past = t(x, torch.tensor([pos]), *past)
                assert count.tolist() == [len(chunk)] or count_shift
            ref = model(torch.tensor([seq])).logits[0, -1]
            worst = max(worst, (logits[0, len(chunk) - 1] - ref).abs().max().item())
            tok = int(ref.argmax())
            for accept in (0, 3, 1, 2, 0):  # proposals right for `accept` rows, then wrong
                truth = hf_greedy(model, seq + [tok], B - 1)
                props = truth[:accept] + [(v + 1) % 256 for v in truth[accept:]]
                p = len(seq)
                block = torch.tensor([[tok, *props]])
                nt, _, logits, count, *past = t(block, torch.arange(p, p + B)[None], *past)
                full = model(torch.tensor([seq + [tok] + props])).logits[0, p:]
                worst = max(worst, (logits[0, : accept + 1] - full[: accept + 1]).abs().max())
                assert count.tolist() == [accept + 1] or count_shift
                seq += [tok] + truth[:accept]
                tok = int(nt[0, accept])
            return worst
        finally:
            hybrid.GatedDeltaNet.commit = orig

    assert run() < 1e-4
    for shift in (1, -1):  # the state committed one position off: logits leave HF's
        assert run(shift) > 1e-2


# ---------------------------------------------------------------- end to end


def test_published_form_lossless_and_acceptance_equal_reference(published, exported):
    """The published form end to end (the text form climbs the conformance ladder,
    tests/test_conformance.py)."""
    form = "published"
    t, d = published
    art_dir = art(exported, published=True)
    model = ck.load_target_model(t)
    ref = DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
    pipe = dflash_qaic.load(art_dir)
    pipe.configure(verify_lengths=[B])  # whole blocks, as the reference verifies
    lengths, compared = [], 0
    cases = [(1, 30), (CHUNK - 1, 33), (CHUNK + 3, 25), (2 * CHUNK + 5, 41)]
    for seed, (n, new) in enumerate(cases):
        ids = prompt(n, seed)
        res = pipe.generate(ids, max_new_tokens=new)
        with torch.no_grad():
            assert res.tokens == hf_greedy(model, ids, new), (form, n)
            out = dflash_generate(ref, model, torch.tensor([ids]), new, None, return_stats=True)
        # The reference runs HF's chunked recurrence over each block and its recurrent one at
        # decode: on a tiny random hybrid it leaves HF greedy at near-ties (REFERENCE.md: HF
        # greedy is then the oracle). Its steps are compared up to where it leaves HF's tokens.
        theirs = out.output_ids[0, n:].tolist()
        same = next((i for i, (a, b) in enumerate(zip(res.tokens, theirs)) if a != b), new)
        done, k = 1, 0  # the first token comes from prefill
        for a in out.acceptance_lengths[:-1]:  # its last step may shrink the block
            if done + a > same:
                break
            done, k = done + a, k + 1
        assert res.acceptance_lengths[:k] == out.acceptance_lengths[:k], (form, n)
        compared += k
        lengths += res.acceptance_lengths
    assert compared >= 12, compared
    assert min(lengths) == 1 and max(lengths) == B and len(set(lengths)) >= 3, lengths


def test_state_is_updated_in_place(exported):
    from dflash_qaic.runtime.backends import inplace_cache_safe

    a = art(exported)
    m = read_manifest(a)
    names = [s.name for s in m.target.io.kv]
    assert contract.past_state(0) in names and contract.past_conv(0) in names
    assert contract.past_key(3) in names and contract.past_key(0) not in names
    assert inplace_cache_safe(a / m.target.onnx, names)


def test_fp16_faithful_with_massive_activations(tiny_pair, tmp_path):
    """A hybrid pair whose residual stream carries activations in the thousands: the
    fp16-faithful check of every specialization finds no inf/NaN and nothing flagged."""
    t, d = tiny_pair(agree=0.0, seed=3, **HYBRID)
    from safetensors.torch import load_file, save_file

    state = load_file(t / "model.safetensors")
    state["model.embed_tokens.weight"][:, 5] = 3000.0  # a massive channel
    out = t.parent / "massive"
    import shutil

    shutil.copytree(t, out / "target", dirs_exist_ok=True)
    shutil.copytree(d, out / "draft", dirs_exist_ok=True)
    save_file(state, str(out / "target" / "model.safetensors"), metadata={"format": "pt"})
    opts = ExportOptions(prefill_seq_len=CHUNK, ctx_len=CTX, compile=False)
    build_artifacts(out / "target", out / "draft", tmp_path / "art", opts, progress=lambda m: None)
    rep = read_manifest(tmp_path / "art").target.check["fp16_faithful"]
    assert rep["ran"] and not rep["flagged"] and np.isfinite(rep["max_abs"])


def test_host_refuses_a_count_that_disagrees(exported):
    """The runtime checks the program's num_committed against its own acceptance: a program
    whose state would no longer match the tokens fails its request instead of diverging."""
    pipe = dflash_qaic.load(art(exported))
    pipe.configure(verify_lengths=[B])
    good = pipe.generate([prompt(6, 1)], max_new_tokens=12)[0]
    assert good.stop_reason == "max_new_tokens"
    run = pipe.target.run

    def off_by_one(feeds):
        out = run(feeds)
        if feeds[contract.INPUT_IDS].shape[1] == B:  # verify calls
            out[contract.NUM_COMMITTED] += 1
        return out

    pipe.target.run = off_by_one
    bad = pipe.generate([prompt(6, 1)], max_new_tokens=12)[0]
    assert bad.stop_reason == "error" and bad.tokens == good.tokens[:1]


def test_custom_io_lists_the_state_in_fp16(exported):
    from dflash_qaic.compiler.qpc import custom_io

    io = read_manifest(art(exported)).target.io
    for kv_dtype in ("float16", "mxint8"):
        entries = {e["IOName"]: e["Precision"] for e in custom_io(io, kv_dtype)}
        for name in (contract.past_state(0), contract.retained(contract.past_conv(2))):
            assert entries[name] == "float16"
        assert entries[contract.retained(contract.past_key(3))] == kv_dtype
    assert len(entries) == 2 * len(io.kv)


@pytest.mark.slow
def test_sampled_distribution_equals_the_target_alone(tiny_pair, tmp_path_factory):
    """At T > 0 the state is committed by the sampler's own acceptance: DFlash's first five
    tokens are distributed as the target's own sampling, and the first two as the exact
    distribution from Hugging Face's logits (chi-square; test_sampling.end_to_end)."""
    import test_sampling as S

    t, d = tiny_pair(vocab_size=S.V, agree=2.5, **HYBRID)
    out = tmp_path_factory.mktemp("hy-sampling")
    opts = ExportOptions(prefill_seq_len=S.CHUNK, ctx_len=S.CTX, compile=False)
    build_artifacts(t, d, out, opts, progress=lambda m: None)
    pipe = dflash_qaic.load(out, threads=1)
    pipe.configure(verify_lengths=[S.B])
    S.end_to_end(pipe, ck.load_target_model(t), (1.0, 0, 1.0), 800)


def test_streamed_program_equals_in_memory_one(published, tmp_path):
    """The published bf16 sharded pair: the program written tensor by tensor from the
    safetensors files (model.language_model.* names) equals the in-memory export from Hugging
    Face's loaded model, output for output on every specialization's check feed."""
    import onnxruntime as ort

    from dflash_qaic.exporter import weights
    from dflash_qaic.exporter.target import check_feeds, export_target

    p = ck.read_pair(*published)
    kw = dict(ctx_len=48, prefill_seq_len=12, block_size=B, fp16_check=False)
    args = (p.draft.rms_norm_eps, p.draft.target_layer_ids)
    state = ck.load_draft_state(p.draft)
    fa = export_target(
        ck.load_target_model(p.target),
        state["fc.weight"],
        state["hidden_norm.weight"],
        *args,
        tmp_path / "a" / "target.onnx",
        **kw,
    )
    fb = export_target(
        weights.placeholder_target(p.target),
        weights.load_fp32(p.draft_tensors["fc.weight"]),
        weights.load_fp32(p.draft_tensors["hidden_norm.weight"]),
        *args,
        tmp_path / "b" / "target.onnx",
        stream_from=p,
        **kw,
    )
    io = read_manifest_io(fa)
    a = ort.InferenceSession(fa["path"], providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(fb["path"], providers=["CPUExecutionProvider"])
    full = [sp for sp in fa["specializations"] if "@" not in sp["name"]]  # the full window
    for feed in check_feeds(io, full):
        for x, y, spec in zip(a.run(None, feed), b.run(None, feed), a.get_outputs()):
            assert np.array_equal(x, y), spec.name


def read_manifest_io(facts: dict) -> contract.TargetIO:
    keys = ("n_layers", "n_kv_heads", "head_dim", "hidden_size", "vocab_size", "emit_logits")
    return contract.TargetIO(
        **{k: facts[k] for k in keys},
        sampling=facts["sampling"],
        comp_ctx=facts["comp_ctx"],
        linear_layers=tuple(facts["linear_layers"]),
        state_dims=tuple(facts["state_dims"]),
    )


def test_inactive_and_padding_rows_leave_the_state(exported):
    """A full-batch verify call whose rows are all inactive (batch_index and positions -1)
    writes back every state and conv window byte for byte; a prefill chunk's padding rows do
    not enter its row's state (its count is its real rows)."""
    import onnxruntime as ort

    from dflash_qaic.exporter.target import check_feeds

    a = art(exported, full_batch_size=3)
    m = read_manifest(a)
    io = m.target.io
    sess = ort.InferenceSession(str(a / m.target.onnx), providers=["CPUExecutionProvider"])
    spec = next(s for s in m.target.specializations if s["name"] == contract.VERIFY)
    feed = check_feeds(io, [spec])[0]
    rng = np.random.default_rng(0)
    for s in io.kv:
        feed[s.name] = rng.standard_normal(feed[s.name].shape).astype(np.float32)
    feed[contract.BATCH_INDEX][:] = contract.INACTIVE_ROW
    feed[contract.POSITION_IDS][:] = contract.PAD_POSITION
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
    assert out[contract.NUM_COMMITTED].tolist() == [0, 0, 0]
    for s in io.kv:
        if s.name.startswith(("past_state", "past_conv")):
            assert np.array_equal(out[contract.retained(s.name)], feed[s.name]), s.name


def test_requests_fill_the_context_to_its_last_position(pair, exported):
    """prompt + max_new_tokens up to ctx_len: every token asked for, as the target alone and HF
    greedy give them (before: the step retired a sequence once a whole block would pass the
    end, up to B − 1 tokens early). The last steps verify what is left of the block; the state
    commits only the real rows (committed count = the host's)."""
    pipe = dflash_qaic.load(art(exported))
    model = ck.load_target_model(pair[0])
    ids = prompt(CTX - 2 * CHUNK, 11)
    room = CTX - len(ids)  # the last token takes no slot: positions 0 … CTX − 1 are tokens
    whole = hf_greedy(model, ids, room)
    for new in (room - B - 1, room - 2, room - 1, room):
        got = pipe.generate(ids, max_new_tokens=new, stop_token_ids=[])
        assert got.tokens == whole[:new], new
        assert got.stop_reason == "max_new_tokens" or len(ids) + new == CTX, new
    over = pipe.generate(ids, max_new_tokens=room + 5, stop_token_ids=[])
    assert over.stop_reason == "ctx_len" and over.tokens == whole


def _constrained(pipe, ids, n, mode, grammar):
    req = pipe.request(ids, n, [], mode=mode, grammar=grammar)
    tokens = [t for _, run in pipe._run([req], mode, raises=True) for t in run]
    return tokens, pipe._results[0].acceptance_lengths


def test_structured_output_on_a_hybrid_target(exported):
    """--structured-output on a hybrid target: the bitmask masks every verify row before the
    in-graph acceptance count. A binding token set: DFlash = the target alone under it; a set
    holding the free run's tokens: the free run, with drafts accepted."""
    pipe = dflash_qaic.load(art(exported, structured_output=True), threads=1)
    assert pipe.can_constrain
    pipe.configure(verify_lengths=[B])
    rng = np.random.default_rng(5)
    ids = prompt(CHUNK + 3, 77)
    free = pipe.generate(ids, 24, stop_token_ids=[]).tokens
    extra = rng.choice(pipe.vocab, 8, replace=False).tolist()
    loose = pipe.allowed_tokens(sorted(set(free) | set(extra)))
    got, lengths = _constrained(pipe, ids, 24, "dflash", loose)
    assert got == free and max(lengths) > 1, lengths
    tight = pipe.allowed_tokens(sorted(rng.choice(pipe.vocab, 6, replace=False).tolist()))
    got, _ = _constrained(pipe, ids, 24, "dflash", tight)
    base, _ = _constrained(pipe, ids, 24, "baseline", tight)
    assert got == base
    allowed = set(np.flatnonzero(np.unpackbits(tight.row.view(np.uint8), bitorder="little")))
    assert set(got) <= allowed and got != free[: len(got)]
