"""Routed experts on ONNX Runtime's MoE kernel (runtime/ort_rewrite.py): the session-time rewrite
finds every union-gather expert block, leaves no expert Gather behind, and the rewritten program's
outputs equal the exported one's (every specialization's feeds: prefill, verify, decode) for the
softmax (qwen3_moe) and the grouped sigmoid (deepseek_v3) routers; programs without that block
(dense, gpt-oss's biased experts, Gemma 4's gelu-tanh experts) are left to open as files.

Tiny pairs from dflash_lab.tiny, exported in memory as tests/test_streaming_export.py does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_streaming_export import _feeds, _streamed

from dflash_lab.tiny import make_tiny_pair
from dflash_qaic import checkpoints as ck
from dflash_qaic.runtime.ort_rewrite import ort_session, rewrite_moe


def _export(root, family: str):
    t, d = make_tiny_pair(root, family=family)
    pair = ck.read_pair(t, d)
    tf, _ = _streamed(pair, root / "art")
    tf["top_k"] = json.loads((Path(t) / "config.json").read_text()).get("num_experts_per_tok")
    return pair, tf, root / "art" / "target.onnx"


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def moe_program(request, tmp_path_factory):
    return _export(tmp_path_factory.mktemp(request.param), request.param)


def test_every_routed_block_is_rewritten(moe_program):
    _, _, path = moe_program
    rw = rewrite_moe(path)
    assert rw is not None
    g = onnx.load_from_string(rw.model).graph
    moe = [n for n in g.node if n.op_type == "MoE" and n.domain == "com.microsoft"]
    src = onnx.load(str(path), load_external_data=False).graph
    stacks = {t.name for t in src.initializer if t.name.endswith(".gate_up")}
    assert stacks and len(moe) == len(stacks) == rw.blocks
    # no expert stack is gathered (copied) any more: the kernel reads them in place
    read = {i for n in g.node if n.op_type == "Gather" for i in n.input[:1]}
    assert not read & (stacks | {s.replace("gate_up", "down") for s in stacks})
    for name, arr in rw.initializers.items():  # gate and up rows interleaved, nothing else
        gu = onnx.numpy_helper.to_array(next(t for t in src.initializer if f"{t.name}." in name))
        assert np.array_equal(arr[:, 0::2], gu[:, : gu.shape[1] // 2])
        assert np.array_equal(arr[:, 1::2], gu[:, gu.shape[1] // 2 :])


def test_rewritten_outputs_equal_the_exported_program(moe_program):
    pair, facts, path = moe_program
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fast, _keep = ort_session(path, ort.SessionOptions())
    names = [o.name for o in plain.get_outputs()]
    feeds = _feeds("target", facts, pair)
    assert len(feeds) > 2  # prefill, verify and decode shapes
    for feed in feeds:
        for name, a, b in zip(names, plain.run(names, feed), fast.run(names, feed)):
            if a.dtype.kind in "iu":
                assert np.array_equal(a, b), name  # tokens
            else:
                np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5, err_msg=name)


def test_layer_cost_counts_the_routed_union(moe_program):
    """dflash_lab.layer_cost's bytes: a decode row reads k of each stack's E experts."""
    from dflash_lab.layer_cost import layer_bytes

    _, facts, path = moe_program
    src = onnx.load(str(path), load_external_data=False).graph
    stacks = [t for t in src.initializer if t.name.endswith((".gate_up", ".down"))]
    E, k = stacks[0].dims[0], facts["top_k"]
    full = sum(4 * int(np.prod(t.dims)) for t in stacks)
    assert 0 < k < E and layer_bytes(path, 1, k)["routed"] == full * k // E
    assert layer_bytes(path, E, k)["routed"] == full  # the union capped at every expert


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "gemma4_moe"])
def test_programs_without_the_block_open_unchanged(tmp_path, family):
    _, _, path = _export(tmp_path, family)
    assert rewrite_moe(path) is None
    sess, kept = ort_session(path, ort.SessionOptions())
    assert kept == {} and sess.get_outputs()


def test_routed_shapes_projection_arithmetic():
    """The published parameter counts come out of the dimensions (DeepSeek-V3 671 B, Kimi K2.5
    about 1.03 T, MiniMax-M2.5 about 229 B), the latent cache is kv_lora_rank + qk_rope_head_dim
    values per token per layer, and a call reads the union of its rows' experts."""
    from dflash_qaic.bench.moe_shapes import ROUTED_SHAPES, project_routed

    ds, kimi, mm = (ROUTED_SHAPES[n] for n in ("deepseek-v3", "kimi-k2.5", "minimax-m2.5"))
    assert round(ds.resident() / 1e9) == 671
    assert 1.02e12 < kimi.resident() < 1.04e12 and 2.2e11 < mm.resident() < 2.4e11
    assert ds.cache_per_token() == 512 + 64 and mm.cache_per_token() == 2 * 8 * 128
    assert kimi.routed(16) == 60 * 128 * kimi.expert()  # 16 rows · top-8 of 384
    assert ds.routed(64) == 58 * 256 * ds.expert()  # the union is capped at every expert
    one, four = project_routed(kimi, 1, 8192, "mxfp4"), project_routed(kimi, 4, 8192, "mxfp4")
    assert one.cards == four.cards > 1  # over a terabyte does not fit one Ultra (128 GB)
    assert four.routed_gb == pytest.approx(4 * one.routed_gb) and four.ms > one.ms
    with pytest.raises(ValueError, match="experts format"):
        project_routed(kimi, 1, 8192, "fp8")


def test_an_older_onnx_runtime_runs_the_program_as_exported(moe_program, monkeypatch, caplog):
    pair, facts, path = moe_program
    monkeypatch.setattr(ort, "__version__", "1.20.1")
    sess, kept = ort_session(path, ort.SessionOptions())
    assert kept == {} and "install onnxruntime>=" in caplog.text
    assert sess.run(None, _feeds("target", facts, pair)[0])


def test_without_onnx_installed_the_program_runs_as_exported(moe_program, monkeypatch, caplog):
    """Running exported programs needs no `onnx` package (a runtime-only install: the vLLM
    environment): a MoE program then opens as the file, with a warning naming the install; a
    program without routed experts never reaches the rewrite at all."""
    import sys

    from dflash_qaic.runtime import ort_rewrite

    pair, facts, path = moe_program
    assert ort_rewrite._multiplies_gathered(path)
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ImportError
    sess, kept = ort_session(path, ort.SessionOptions())
    assert kept == {} and "pip install onnx" in caplog.text
    assert sess.run(None, _feeds("target", facts, pair)[0])


def test_a_dense_program_is_not_parsed_for_experts(tmp_path):
    _, _, path = _export(tmp_path, "qwen3")
    from dflash_qaic.runtime import ort_rewrite

    assert not ort_rewrite._multiplies_gathered(path)
