"""The graph check's range on a bf16 profile (exporter/fp16_check.py): a profile that computes
in bfloat16 (`ai200_bf16`: no fp16 conversion, bfloat16 KV) is checked against bf16's largest
value, 3.39e38, not fp16's 65504; every other profile keeps the fp16-faithful check."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dflash_qaic.compiler.profiles import load_profile
from dflash_qaic.exporter import fp16_check as F


def test_the_profile_names_the_checked_dtype():
    assert F.check_dtype(load_profile("ai200_bf16")) == "bfloat16"
    for name in ("ai100_fp16", "ai100_mxfp6_mxint8", "ai100_multidevice"):
        assert F.check_dtype(load_profile(name)) == "float16", name
    import ml_dtypes

    assert F.BF16_MAX == float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def _scaled_graph() -> onnx.ModelProto:
    """y = (x · 1000) · 1000 / 1000 / 1000: an intermediate of 10⁶ · |x| on the way back to x
    (every constant within fp16's range)."""
    k = numpy_helper.from_array(np.array(1000.0, np.float32), "k")
    nodes = [
        helper.make_node("Mul", ["x", "k"], ["a"]),
        helper.make_node("Mul", ["a", "k"], ["b"]),
        helper.make_node("Div", ["b", "k"], ["c"]),
        helper.make_node("Div", ["c", "k"], ["y"]),
    ]
    g = helper.make_graph(
        nodes,
        "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [k],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_value_beyond_fp16_is_an_overflow_in_fp16_and_in_range_in_bf16():
    feed = {"x": np.array([3.0, -2.0], np.float32)}
    fp16 = F.faithful_check(_scaled_graph(), [feed], "g")
    assert fp16.nonfinite == ["b", "c", "y"] and fp16.limit == 65504.0  # 3·10⁶ overflows
    bf16 = F.faithful_check(_scaled_graph(), [feed], "g", dtype="bfloat16")
    assert not bf16.nonfinite and not bf16.flagged and bf16.max_abs["b"] == pytest.approx(3e6)
    j = bf16.to_json()
    assert j["dtype"] == "bfloat16" and j["limit"] == F.BF16_MAX
    assert "largest bf16 intermediate 3e+06" in bf16.summary()
    with pytest.raises(ValueError, match="float16, bfloat16"):
        F.FaithfulSession(_scaled_graph(), "g", dtype="float8")


def test_an_export_for_a_bf16_profile_checks_bf16_s_range(tiny_pair, tmp_path):
    from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
    from dflash_qaic.artifacts.manifest import read_manifest

    t, d = tiny_pair(block_size=4)
    for name, dtype in (("ai200_bf16", "bfloat16"), ("ai100_mxfp6_mxint8", "float16")):
        opts = ExportOptions(prefill_seq_len=8, ctx_len=32, compile=False, qpc_config=name)
        build_artifacts(t, d, tmp_path / name, opts, progress=lambda m: None)
        m = read_manifest(tmp_path / name, check_files="none")
        for p in m.programs.values():
            faithful = p.check["fp16_faithful"]
            assert faithful["ran"] and faithful["dtype"] == dtype, (name, p.kind)
            assert faithful["limit"] == F.LIMITS[dtype]
