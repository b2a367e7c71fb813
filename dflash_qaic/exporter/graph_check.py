"""Validate an exported program before it goes to the compiler.

`check_graph` asserts what the AI100 toolchain and the runtime rely on:
  1. `onnx.checker` with `full_check=True` (path form, so external data and > 2 GB work);
  2. every op is a standard ONNX op or one of the custom functions `CtxScatter` /
     `CtxScatterCB` (with continuous batching) of domain `com.qualcomm.cloud`, defined in the model (function bodies are checked too);
  3. graph inputs/outputs have exactly the names, dtypes and dims of the contract specs, so
     binding a specialization's symbols leaves no dynamic dimension; onnx shape inference from
     the bound inputs must then derive every output's shape, fully static and equal to the spec;
  4. fp16 safety (docs/DESIGN.md, fp16), on the given inputs: the fp16-faithful evaluation of
     `fp16_check` (every op computes and rounds in fp16, as `-convert-to-fp16` on the card)
     must give no inf/NaN in any output or intermediate, and reports the largest intermediate
     against 65504 (flagging any within a factor 16). Above `faithful_max_bytes` of weights it
     is skipped (the report says so and why) and ONNX Runtime's fp16 run checks the outputs
     only (it widens Pow/ReduceMean to fp32, so it cannot see overflow inside the graph).
It also reports the nodes per decoder layer.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from dflash_qaic.contract import TensorSpec
from dflash_qaic.exporter.fp16_check import (
    FAITHFUL_MAX_BYTES,
    FaithfulSession,
    convert_to_fp16,
    fp16_feed,
)
from dflash_qaic.exporter.weights import initializer_bytes
from dflash_qaic.modeling.ops import QAIC_DOMAIN

CUSTOM_FUNCTIONS = frozenset({(QAIC_DOMAIN, "CtxScatter"), (QAIC_DOMAIN, "CtxScatterCB")})
STANDARD_DOMAINS = ("", "ai.onnx")
# Beyond this size an in-memory ModelProto cannot be serialized (protobuf's 2 GB cap).
_INLINE_LIMIT = int(1.5 * 1024**3)
_LAYER_SCOPE = re.compile(r"^/layers\.(\d+)/")
log = logging.getLogger(__name__)
__all__ = [
    "GraphCheckError",
    "check_graph",
    "convert_to_fp16",
    "fp16_feed",
    "fp16_session",
    "nodes_per_layer",
]


class GraphCheckError(Exception):
    """An exported graph violates the contract or the AI100 constraints."""


def check_graph(
    path: str | os.PathLike,
    io_specs,
    symbols_list: list[dict],
    fp16_inputs: list[dict] | None = None,
    *,
    faithful_max_bytes: int = FAITHFUL_MAX_BYTES,
    dtype: str = "float16",
) -> dict:
    """Check the ONNX file at `path`; raise GraphCheckError on the first violated rule.

    io_specs: an object with `.inputs` / `.outputs` lists of TensorSpec (contract.TargetIO,
        contract.DraftIO) or a pair (inputs, outputs).
    symbols_list: the specializations' symbol bindings, e.g. [{"batch_size": 1, "seq_len": 16,
        "ctx_len": 256}, ...] (a specialization dict with a "symbols" key is accepted too).
    fp16_inputs: feeds (name -> numpy array, fp32 for float inputs) to run the fp16 graph on.
    faithful_max_bytes: run the fp16-faithful evaluation up to this many bytes of weights.
    dtype: the card's compute dtype (fp16_check.check_dtype): "bfloat16" checks bf16's range.

    Returns {"ops": {op_type: count}, "n_nodes", "nodes_per_layer": {"0": n, …, "other": n},
    "unresolved_intermediates", "fp16_max_abs": largest |value| in the fp16 float outputs (None
    without fp16_inputs), "fp16_runs", "fp16_faithful": the Fp16Report as JSON ({"ran": True,
    "max_abs", "where", "largest", "flagged", …}) or {"ran": False, "skipped": why}}.
    """
    path = Path(path)
    inputs, outputs = _split_specs(io_specs)
    symbols_list = [s.get("symbols", s) for s in symbols_list]
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:  # checker raises several types
        raise GraphCheckError(f"{path.name}: onnx.checker failed: {e}") from e
    model = onnx.load(str(path), load_external_data=False)

    ops = _check_ops(model, path.name)
    _check_io(model.graph.input, inputs, "input", path.name)
    _check_io(model.graph.output, outputs, "output", path.name)
    unresolved = [_check_bound_shapes(model, inputs, outputs, s, path.name) for s in symbols_list]

    report = {
        "ops": dict(sorted(ops.items())),
        "n_nodes": len(model.graph.node),
        "nodes_per_layer": nodes_per_layer(model),
        # intermediate values whose shape onnx inference leaves unresolved (informational; the
        # compiler folds shapes itself), per specialization
        "unresolved_intermediates": unresolved,
        "fp16_max_abs": None,
        "fp16_runs": 0,
        "fp16_faithful": {"ran": False, "skipped": "no fp16 check inputs (fp16_check off)"},
    }
    if not fp16_inputs:
        return report
    size = initializer_bytes(model)
    del model
    full = onnx.load(str(path))  # with external data
    if size <= faithful_max_bytes:
        report["fp16_max_abs"], faithful = _check_fp16_faithful(full, fp16_inputs, path.name, dtype)
        report["fp16_faithful"] = faithful.to_json()
    else:
        report["fp16_faithful"]["skipped"] = (
            f"{size / 2**20:.0f} MiB of weights is above the faithful check's limit of "
            f"{faithful_max_bytes / 2**20:.0f} MiB (numpy fp16 has no BLAS); only ONNX "
            "Runtime's fp16 run checked the outputs, which cannot see overflow inside the graph"
        )
        report["fp16_max_abs"] = _check_fp16_ort(full, fp16_inputs, path.name)
    report["fp16_runs"] = len(fp16_inputs)
    return report


# ---------------------------------------------------------------- ops


def _iter_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _iter_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _iter_nodes(g)


def _is_standard(node: onnx.NodeProto, opset: int) -> bool:
    if node.domain not in STANDARD_DOMAINS:
        return False
    try:
        onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    return True


def _check_ops(model: onnx.ModelProto, name: str) -> collections.Counter:
    imports = {o.domain: o.version for o in model.opset_import}
    opset = imports.get("", imports.get("ai.onnx", 0))
    defined = {(f.domain, f.name) for f in model.functions}
    ops: collections.Counter = collections.Counter()
    bad = set()
    for node in _iter_nodes(model.graph):
        ops[node.op_type] += 1
        key = (node.domain, node.op_type)
        if key in CUSTOM_FUNCTIONS and key in defined:
            continue
        if not _is_standard(node, opset):
            bad.add(f"{node.domain or 'ai.onnx'}::{node.op_type}")
    for f in model.functions:
        if (f.domain, f.name) not in CUSTOM_FUNCTIONS:
            bad.add(f"function {f.domain}::{f.name}")
            continue
        f_opset = {o.domain: o.version for o in f.opset_import}.get("", opset)
        for node in f.node:
            if not _is_standard(node, f_opset):
                bad.add(f"{node.domain or 'ai.onnx'}::{node.op_type} (in {f.name})")
    if bad:
        allowed = ", ".join(f"{d}::{n}" for d, n in sorted(CUSTOM_FUNCTIONS))
        raise GraphCheckError(
            f"{name}: ops outside the allowed set (standard ONNX + {allowed}): "
            + ", ".join(sorted(bad))
        )
    return ops


# ---------------------------------------------------------------- I/O


def _split_specs(io_specs) -> tuple[list[TensorSpec], list[TensorSpec]]:
    if hasattr(io_specs, "inputs") and hasattr(io_specs, "outputs"):
        return list(io_specs.inputs), list(io_specs.outputs)
    inputs, outputs = io_specs
    return list(inputs), list(outputs)


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    out = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            out.append(d.dim_value)
        elif d.HasField("dim_param"):
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def _dtype_name(elem_type: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def _check_io(values, specs: list[TensorSpec], kind: str, name: str) -> None:
    got = [v.name for v in values]
    want = [s.name for s in specs]
    if got != want:
        raise GraphCheckError(f"{name}: graph {kind}s {got} != contract {want}")
    for v, s in zip(values, specs):
        dtype = _dtype_name(v.type.tensor_type.elem_type)
        if dtype != s.dtype:
            raise GraphCheckError(f"{name}: {kind} {s.name} has dtype {dtype}, contract {s.dtype}")
        dims = _dims(v)
        if dims != list(s.shape):
            raise GraphCheckError(
                f"{name}: {kind} {s.name} has dims {dims}, contract {list(s.shape)} "
                "(a dim that is neither a contract symbol nor the contract int stays dynamic)"
            )


def _check_bound_shapes(model, inputs, outputs, symbols: Mapping[str, int], name: str) -> int:
    """Shape inference from the inputs with the symbols bound: every output must come out fully
    static and equal to its bound spec. Returns how many intermediate values stay unresolved."""
    try:
        bound = {s.name: s.bind(**symbols) for s in inputs + outputs}
    except KeyError as e:
        raise GraphCheckError(f"{name}: specialization {symbols} does not bind {e}") from e
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    for vi in m.graph.input:
        for d, n in zip(vi.type.tensor_type.shape.dim, bound[vi.name]):
            d.Clear()
            d.dim_value = n
    for vi in m.graph.output:
        vi.type.tensor_type.ClearField("shape")  # to be inferred, not assumed
    try:
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    except Exception as e:
        raise GraphCheckError(f"{name}: shape inference failed for {symbols}: {e}") from e
    for vi in inferred.graph.output:
        dims, want = _dims(vi), list(bound[vi.name])
        if dims != want:
            raise GraphCheckError(
                f"{name}: with {symbols}, output {vi.name} infers to {dims}, expected {want}"
            )
    return sum(
        1
        for vi in inferred.graph.value_info
        if not all(d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)
    )


# ---------------------------------------------------------------- fp16


def nodes_per_layer(model: onnx.ModelProto) -> dict[str, int]:
    """Top-level nodes by decoder layer ("0", "1", …, from the exporter's "/layers.N/" scopes),
    and "other" for the rest (embedding, masks, RoPE rows, head, sampler, fused feature)."""
    counts: collections.Counter = collections.Counter()
    for node in model.graph.node:
        m = _LAYER_SCOPE.match(node.name)
        counts[m.group(1) if m else "other"] += 1
    layers = sorted((k for k in counts if k != "other"), key=int)
    return {**{k: counts[k] for k in layers}, "other": counts["other"]}


def fp16_session(model: onnx.ModelProto, workdir: str | os.PathLike | None = None):
    """An onnxruntime CPU session of the fp16 conversion of `model`.

    Note: ONNX Runtime's CPU provider widens several fp16 ops (Pow, ReduceMean, …) to fp32 and
    fuses RMSNorm, so this session does not show fp16 overflow; `fp16_check` does.
    Models over ~1.5 GB are written with external data to `workdir` (a temp dir if None; it
    must outlive the session creation only).
    """
    import onnxruntime as ort

    fp16 = convert_to_fp16(model)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if initializer_bytes(fp16) < _INLINE_LIMIT:
        return ort.InferenceSession(
            fp16.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        p = os.path.join(d, "fp16.onnx")
        onnx.save_model(fp16, p, save_as_external_data=True, location="fp16.onnx.data")
        return ort.InferenceSession(p, opts, providers=["CPUExecutionProvider"])


def _outputs_finite(results: Mapping[str, np.ndarray], run: int, name: str) -> float:
    """Largest |value| of the float outputs; GraphCheckError on an inf/NaN."""
    max_abs = 0.0
    for out_name, r in results.items():
        if not np.issubdtype(r.dtype, np.floating):
            continue
        if not np.isfinite(r).all():
            raise GraphCheckError(
                f"{name}: fp16 run {run} gives inf/NaN in {out_name} "
                f"({int((~np.isfinite(r)).sum())} of {r.size} values)"
            )
        if r.size:
            max_abs = max(max_abs, float(np.abs(r).max()))
    return max_abs


def _check_fp16_ort(model: onnx.ModelProto, feeds: list[dict], name: str) -> float:
    try:
        sess = fp16_session(model)
    except Exception as e:
        raise GraphCheckError(f"{name}: the fp16 conversion does not load in ORT: {e}") from e
    out_names = [o.name for o in sess.get_outputs()]
    max_abs = 0.0
    for i, feed in enumerate(feeds):
        results = dict(zip(out_names, sess.run(None, fp16_feed(feed))))
        max_abs = max(max_abs, _outputs_finite(results, i, name))
    return max_abs


def _check_fp16_faithful(model: onnx.ModelProto, feeds: list[dict], name: str, dtype: str):
    """(largest |output|, Fp16Report) of the fp16-faithful evaluation (bf16's range for
    "bfloat16"); GraphCheckError on an inf/NaN in any float output or intermediate (an
    overflow, whatever became of it later)."""
    sess = FaithfulSession(model, name, dtype)
    max_abs = 0.0
    for i, feed in enumerate(feeds):
        max_abs = max(max_abs, _outputs_finite(sess.run(feed), i, name))
    bad = sess.report.nonfinite
    if bad:
        first = ", ".join(f"{v} ({sess.report.op_of[v]})" for v in bad[:3])
        raise GraphCheckError(
            f"{name}: fp16 overflow: {len(bad)} intermediate values are inf/NaN under fp16 "
            f"arithmetic, e.g. {first} (see docs/DESIGN.md, fp16)"
        )
    if sess.report.flagged:
        log.warning("%s", sess.report.summary())
    return max_abs, sess.report
