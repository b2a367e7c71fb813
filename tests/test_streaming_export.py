"""The streaming export (exporter/weights.py): programs written from the safetensors files tensor by
tensor are the in-memory export's programs, output for output, on bf16 / fp16, sharded / single,
tied / untied pairs; every parameter has a checkpoint tensor; damaged weights are refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dflash_lab.tiny import make_tiny_pair
from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
from dflash_qaic.exporter import weights
from dflash_qaic.exporter.draft import check_feeds as draft_feeds
from dflash_qaic.exporter.draft import export_draft
from dflash_qaic.exporter.target import check_feeds as target_feeds
from dflash_qaic.exporter.target import export_target
from dflash_qaic.modeling.draft import DFlashDraft, ExportDraft
from dflash_qaic.modeling.target import ExportTarget

KW = dict(ctx_len=48, prefill_seq_len=12, block_size=8, fp16_check=False)
PAIRS = {
    "qwen3-tied-bf16-sharded": dict(family="qwen3", dtype="bfloat16", shards=3),
    "llama-untied-fp16": dict(family="llama", dtype="float16", tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    t, d = make_tiny_pair(root, target_layer_ids=[1, 2], **PAIRS[request.param])
    return ck.read_pair(t, d)


def _in_memory(pair: ck.Pair, out):
    model = ck.load_target_model(pair.target)
    state = ck.load_draft_state(pair.draft)
    tf = export_target(
        model,
        state["fc.weight"],
        state["hidden_norm.weight"],
        pair.draft.rms_norm_eps,
        pair.draft.target_layer_ids,
        out / "target.onnx",
        **KW,
    )
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    df = export_draft(pair.draft, state, emb, head, out / "draft.onnx", **KW)
    return model, tf, df


def _streamed(pair: ck.Pair, out):
    fc = weights.load_fp32(pair.draft_tensors["fc.weight"])
    hn = weights.load_fp32(pair.draft_tensors["hidden_norm.weight"])
    tf = export_target(
        weights.placeholder_target(pair.target),
        fc,
        hn,
        pair.draft.rms_norm_eps,
        pair.draft.target_layer_ids,
        out / "target.onnx",
        stream_from=pair,
        **KW,
    )
    embed, head = weights.placeholder_head(pair.target)
    df = export_draft(pair.draft, None, embed, head, out / "draft.onnx", stream_from=pair, **KW)
    return tf, df


def _program_io(facts: dict, prog: str):
    """The contract object of an exported program, from its facts."""
    keys = ("n_layers", "n_kv_heads", "head_dim", "hidden_size", "vocab_size", "emit_logits")
    common = {k: facts[k] for k in keys}
    if prog == "target":  # the per-layer cache shapes of ring and latent layers too
        shapes = {
            k: tuple(facts[k]) for k in ("layer_kv", "ring_slots", "latent_dims") if k in facts
        }
        return contract.TargetIO(
            **common, **shapes, sampling=facts["sampling"], comp_ctx=facts["comp_ctx"]
        )
    return contract.DraftIO(block_size=facts["block_size"], comp_ctx=facts["comp_ctx"], **common)


def assert_same_outputs(prog, fa, fb, pair):
    """Program `prog` exported two ways (facts fa, fb) gives the same outputs, bit for bit, on
    `_feeds`; returns the session of the second."""
    a = ort.InferenceSession(fa["path"], providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(fb["path"], providers=["CPUExecutionProvider"])
    for feed in _feeds(prog, fa, pair):
        for x, y, spec in zip(a.run(None, feed), b.run(None, feed), a.get_outputs()):
            assert np.array_equal(x, y), f"{prog} output {spec.name} differs"
    return b


def assert_same_graph_size(fa, fb):
    """The two programs have as many nodes and initializers."""
    ga = onnx.load(fa["path"], load_external_data=False).graph
    gb = onnx.load(fb["path"], load_external_data=False).graph
    assert len(ga.node) == len(gb.node) and len(ga.initializer) == len(gb.initializer)


def _feeds(prog, facts, pair):
    io = _program_io(facts, prog)
    if prog == "target":
        return target_feeds(io, facts["specializations"])
    return draft_feeds(io, facts["specializations"], pair.draft.mask_token_id)


def test_streamed_programs_equal_in_memory_ones(pair, tmp_path):
    model, tf_a, df_a = _in_memory(pair, tmp_path / "a")
    tf_b, df_b = _streamed(pair, tmp_path / "b")
    for prog, fa, fb in (("target", tf_a, tf_b), ("draft", df_a, df_b)):
        assert (
            fa["fc_scale" if prog == "target" else "tied_head"]
            == (fb["fc_scale" if prog == "target" else "tied_head"])
        )
        assert_same_outputs(prog, fa, fb, pair)
    assert_same_graph_size(tf_a, tf_b)  # the target's (the draft may fold a few constants)

    # and the target program's greedy tokens are Hugging Face's
    feed = _feeds("target", tf_b, pair)[0]
    feed[contract.TEMPERATURE][:] = 0.0
    s = feed[contract.INPUT_IDS].shape[1] - 1  # the last row is padding
    ids = torch.from_numpy(feed[contract.INPUT_IDS][:, :s])
    b = ort.InferenceSession(tf_b["path"], providers=["CPUExecutionProvider"])
    tokens = b.run([contract.NEXT_TOKENS], feed)[0][:, :s]
    with torch.no_grad():
        hf = model(ids).logits.argmax(-1).numpy()
    assert (tokens == hf).mean() > 0.9  # fp32 ties aside


def test_every_parameter_has_a_checkpoint_tensor(pair):
    model = ck.load_target_model(pair.target)
    state = ck.load_draft_state(pair.draft)
    target = ExportTarget.from_hf(
        model, state["fc.weight"], state["hidden_norm.weight"], 1e-6, [1, 2], ctx_len=16
    )
    draft = DFlashDraft.from_checkpoint(pair.draft, state)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    dmod = ExportDraft(draft, emb, head, 16)
    for module, fn in ((target, weights.target_sources), (dmod, weights.draft_sources)):
        src = fn(weights.stream_ready(module), pair)
        assert set(src) == {n for n, _ in module.named_parameters()}
        # a parameter the mapping does not know (e.g. after a rename) fails loudly
        module.register_parameter("renamed_weight", torch.nn.Parameter(torch.zeros(2)))
        with pytest.raises(KeyError, match="renamed_weight"):
            fn(module, pair)


def test_placeholders_cost_no_memory_and_stay_distinct():
    arena = weights._ZeroArena(64 << 20)  # 256 MB of fp32 placeholders
    a, b = arena.take((1024, 1024)), arena.take((1024, 1024))
    assert a.data_ptr() != b.data_ptr() and not torch.equal(a, b)
    assert float(a[1:].abs().sum()) == 0.0  # reads as zeros


def test_small_placeholders_deep_in_a_large_model_stay_distinct():
    """Two small neighbours 1.5 G values into an arena (a multi-GB model's late layers: a
    Qwen3.5 layer's A_log and dt_bias, 32 values each) and placeholders of separate arenas
    (the target, its Linear weights, the draft's head) all differ, or the exporter merges them
    into one weight. Offset-derived marks (offset · 1e-12) rounded such neighbours to one
    fp32 value."""
    arena = weights._ZeroArena((3 << 29) + 64 * 32)  # 6 GB of address space, untouched
    arena.take((3 << 29,))
    small = [arena.take((32,)) for _ in range(64)]
    small += [weights._ZeroArena(32).take((32,)) for _ in range(4)]
    marks = {float(t[0]) for t in small}
    assert len(marks) == len(small)


def test_merged_weights_are_refused():
    """A weight with a source that is no graph input of its own (merged by the exporter) stops
    the export instead of writing a program that reads another weight in its place."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    w = onnx.helper.make_tensor_value_info("a.weight", onnx.TensorProto.FLOAT, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "a.weight"], ["y"])], "g", [x, w], [y]
    )
    info = ck.TensorInfo("f", "t", "F32", (2,), 0, 8)
    sources = {"a.weight": weights.Source(info), "b.weight": weights.Source(info)}
    with pytest.raises(RuntimeError, match=r"b\.weight.*merged"):
        weights._plan(graph, sources)


def _copy_pair(pair: ck.Pair, tmp_path):
    t, d = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(pair.target.path, t)
    shutil.copytree(pair.draft.path, d)
    return t, d


def _poke(info: ck.TensorInfo, value: float, dtype) -> None:
    with open(info.file, "r+b") as f:
        f.seek(info.offset)
        f.write(torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("prog", ["target", "draft"])
def test_non_finite_weight_refused_naming_file_and_tensor(pair, tmp_path, prog):
    t, d = _copy_pair(pair, tmp_path)
    p = ck.read_pair(t, d)
    info = (
        p.target_tensors["model.layers.1.mlp.down_proj.weight"]
        if prog == "target"
        else p.draft_tensors["layers.0.self_attn.k_proj.weight"]
    )
    _poke(info, float("nan"), ck.SAFETENSORS_DTYPES[info.dtype])
    opts = ExportOptions(ctx_len=48, prefill_seq_len=12, compile=False, fp16_check=False)
    with pytest.raises(ck.CheckpointError, match=rf"{info.file.name}: tensor `{info.name}`.*NaN"):
        build_artifacts(t, d, tmp_path / "out", opts)


def test_build_artifacts_streams_and_reuses(pair, tmp_path):
    opts = ExportOptions(ctx_len=48, prefill_seq_len=12, compile=False, fp16_check=True)
    res = build_artifacts(pair.target.path, pair.draft.path, tmp_path, opts)
    m = res.manifest
    assert m["target"]["check"]["fp16_runs"] == 5  # tiny programs: the fp16 run is not skipped
    again = build_artifacts(pair.target.path, pair.draft.path, tmp_path, opts)
    assert again.steps[0][:2] == ("export", "reused")
    assert again.manifest["input_hash"] == m["input_hash"]


def test_multi_gb_artifacts_of_an_exporter_that_merged_weights_are_refused(pair, tmp_path):
    """Artifacts whose multi-GB programs dflash-qaic ≤ 0.6.0 wrote (its streaming export could
    merge two small weights) are refused with "re-export"; small ones of that version, and
    multi-GB ones of a fixed version, load."""
    from dflash_qaic.artifacts.files import ArtifactsError
    from dflash_qaic.artifacts.manifest import read_manifest

    opts = ExportOptions(ctx_len=48, prefill_seq_len=12, compile=False, fp16_check=False)
    build_artifacts(pair.target.path, pair.draft.path, tmp_path, opts)
    path = tmp_path / "manifest.json"
    original = json.loads(path.read_text())

    def load(version: str, big: bool):
        m = json.loads(json.dumps(original))
        m["versions"]["dflash_qaic"] = version
        if big:  # as if the target's weights file held 2 GiB
            m["files"][0]["size"] = 2 << 30
        path.write_text(json.dumps(m))
        return read_manifest(tmp_path, check_files="none")

    with pytest.raises(ArtifactsError, match="re-export"):
        load("0.6.0", big=True)
    assert load("0.6.0", big=False) and load("0.6.1", big=True)


def test_graph_run_skipped_above_the_budget(monkeypatch):
    monkeypatch.setattr(weights, "GRAPH_RUN_MAX_BYTES", 1000)
    assert weights.graph_run_skip_reason(1000) is None
    assert "fp16 run skipped" in weights.graph_run_skip_reason(1001)


def test_fingerprint_reads_no_weights_but_sees_changes(pair, tmp_path):
    t, _ = _copy_pair(pair, tmp_path)
    fp = ck.fingerprint(t)
    assert ck.fingerprint(t) == fp
    (t / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    fp2 = ck.fingerprint(t)
    assert fp2 != fp
    shard = sorted(t.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data)  # same bytes, new mtime: counted as changed (cheap and safe)
    assert ck.fingerprint(t) != fp2


@pytest.mark.slow
def test_export_bench_on_a_small_preset(tmp_path, monkeypatch):
    from dflash_lab import tiny
    from dflash_lab.export_bench import render_markdown, run_export_bench

    small = dict(hidden_size=64, target_layers=6, intermediate_size=128, num_heads=4)
    small |= dict(num_kv_heads=2, head_dim=16, vocab_size=512, mask_token_id=511, draft_layers=2)
    monkeypatch.setitem(tiny.PRESETS, "small", small)
    res = run_export_bench(["small"], tmp_path, ctx_len=160, verify_tokens=3)
    row = res["rows"][0]
    assert row["bytes_written"] > 4 * 512 * 64 and row["peak_rss_bytes"] > 0
    assert row["greedy_equal"] and len(row["hf_tokens"]) == 3
    assert "| small | 160 |" in render_markdown(res)
    only = run_export_bench(["small"], tmp_path, ctx_len=160, verify_tokens=3, target_only=True)
    assert only["rows"][0]["ort_tokens"] == row["ort_tokens"] == row["hf_tokens"]
