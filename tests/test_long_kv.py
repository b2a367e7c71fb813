"""Long-context decode reads each cache byte once and writes only the new rows (modeling/attention.py;
docs/DESIGN.md, Attention windows): in the exported program, a cache's only reader is its
in-place update, and the updated cache is read only by one Gather of its window's slots (the
window input, or a ring's R slots), which ONNX Runtime feeds straight to the two attention
products. No other Gather, Transpose, Cast or Concat of a cache-sized tensor. A decode under a short
window equals the same decode under the full window (the window only drops slots the mask hides).
A tiny Gemma 4 target (test_gemma4.py's: ring caches on the sliding layers, ctx_len caches of
their own head shape on the full layers) and a Qwen3 dense one.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from spec_loop import program_io
from test_gemma4 import LAYER_IDS, make_gemma4
from test_target_export import CTX, VOCAB, Runner, export_program, make_hf, session

from dflash_qaic import contract

PRODUCTS = {"MatMul", "FusedMatMul", "Transpose"}  # Transpose: the keys' (q·kᵀ), in raw ONNX


def _qwen3():
    return make_hf("qwen3", 3), [0, 2]


class WindowSession:
    """An ONNX Runtime session whose calls read through `window` slots (None: as fed, the
    full window test_target_export's Runner feeds)."""

    def __init__(self, sess: ort.InferenceSession):
        self.sess, self.window = sess, None

    def __getattr__(self, name):
        return getattr(self.sess, name)

    def run(self, names, feed):
        if self.window is not None:
            feed = {**feed, contract.COMP_CTX_LENGTHS: np.arange(self.window, dtype=np.int64)}
        return self.sess.run(names, feed)


@pytest.fixture(scope="module", params=["gemma4", "qwen3"])
def program(request, tmp_path_factory):
    model, ids = (make_gemma4("text"), LAYER_IDS) if request.param == "gemma4" else _qwen3()
    path = tmp_path_factory.mktemp(f"longkv_{request.param}") / "target.onnx"
    e = export_program(model, ids, path, emit_logits=True)
    return dict(e, io=program_io(e["facts"], path))


def _consts(graph) -> dict[str, np.ndarray]:
    out = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant":
            out[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return out


def _readers(nodes) -> dict[str, list]:
    readers: dict[str, list] = {}
    for n in nodes:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    return readers


def test_caches_are_updated_in_place_and_read_by_window_slices(program):
    g = onnx.load(str(program["path"]), load_external_data=False).graph
    consts, readers = _consts(g), _readers(g.node)
    outputs = {o.name for o in g.output}
    shapes = {s.name: s.shape for s in program["io"].kv}
    for name, shape in shapes.items():
        uses = [n for n in readers.get(name, []) if n.op_type != "Shape"]
        assert [n.op_type for n in uses] == ["CtxScatter"], name  # the update, nothing else
        updated = uses[0].output[0]
        assert updated == contract.retained(name) and updated in outputs
        reads = readers.get(updated, [])
        assert reads and all(n.op_type == "Gather" for n in reads), [n.op_type for n in reads]
        for n in reads:  # Gather(data, slots) on the slot axis: the window's slots 0 … L-1
            assert [a.i for a in n.attribute if a.name == "axis"] == [2]
            if shape[2] == contract.CTX:  # a ctx_len cache: the window input itself
                assert n.input[1] == contract.COMP_CTX_LENGTHS, name
            else:  # a ring of R + 1 slots: its R slots, the padding slot never read
                assert consts[n.input[1]].tolist() == list(range(shape[2] - 1)), name
            assert {r.op_type for r in readers[n.output[0]]} <= PRODUCTS


def test_onnx_runtime_feeds_the_window_to_the_products(program, tmp_path):
    """In the graph ONNX Runtime runs (its optimizations applied), each window read is read
    only by the score and value products: no copy, transpose or cast of the window between."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(program["path"]), so, providers=["CPUExecutionProvider"])
    g = onnx.load(so.optimized_model_filepath, load_external_data=False).graph
    readers = _readers(g.node)
    windows = [n for r in program["io"].kv for n in readers[contract.retained(r.name)]]
    assert len(windows) == len(program["io"].kv)
    for n in windows:
        assert n.op_type == "Gather"
        assert [r.op_type for r in readers[n.output[0]]] in (["FusedMatMul"], ["MatMul"])


def test_decode_under_a_short_window_equals_the_full_window(program):
    """A decode at position p read through the smallest window holding p and through the full
    one: the same logits, next token and caches."""
    windows = program["facts"]["comp_ctx_lengths"]
    assert len(windows) > 1 and windows[-1] == CTX
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, VOCAB, windows[0] - 3).tolist()
    runs = []
    for window in (windows[0], CTX):
        sess = WindowSession(session(str(program["path"])))
        r = Runner(sess, program["io"])
        r.prefill(prompt)
        sess.window = window
        out = r(prompt[-1:], [len(prompt)])
        runs.append((out, r.kv))
    (a, kv_a), (b, kv_b) = runs
    np.testing.assert_allclose(a[contract.LOGITS], b[contract.LOGITS], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(a[contract.NEXT_TOKENS], b[contract.NEXT_TOKENS])
    for name in kv_a:
        np.testing.assert_array_equal(kv_a[name], kv_b[name])


def test_layer_cost_counts_the_window_and_the_rings():
    """dflash_lab.layer_cost's accounting: one row's window of a ctx_len cache, a ring whole."""
    from dflash_lab.layer_cost import cache_read_bytes

    specs = [
        contract.TensorSpec("past_key.0", "float32", (contract.BATCH, 4, contract.CTX, 8)),
        contract.TensorSpec("past_key.1", "float32", (contract.BATCH, 2, 7, 16)),
    ]
    sym = {contract.BATCH: 3, contract.CTX: 64}
    assert cache_read_bytes(specs, sym, 32) == 4 * (4 * 32 * 8 + 2 * 7 * 16)
    assert cache_read_bytes(specs, sym, 64) == 4 * (4 * 64 * 8 + 2 * 7 * 16)
