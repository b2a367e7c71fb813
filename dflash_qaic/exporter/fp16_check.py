"""fp16 as the card computes it: every op of a program evaluated and rounded in fp16.

`qaic-compile -convert-to-fp16` turns every float tensor of a program into fp16: weights,
constants, float inputs and outputs, and the targets of explicit Casts to float. ONNX Runtime's
CPU provider cannot show what that does: it has no fp16 kernel for Pow, ReduceMean and others and
quietly computes them in fp32, and it fuses RMSNorm into an op that accumulates in fp32. So this
module converts the graph the way the compiler does (`convert_to_fp16`) and evaluates it with
`onnx.reference.ReferenceEvaluator`, whose numpy kernels compute fp16 in fp16. On the check's
inputs it records the largest |value| of every float intermediate and compares it with fp16's
largest finite value, 65504 (`Fp16Report`): a value within a factor `MARGIN` of it is flagged,
an inf/NaN is an error.

What it cannot see: partial sums inside one op (MatMul, ReduceSum, Softmax's sum), whose
accumulation width is the kernel's choice; the exported layers keep those bounded by
construction (docs/DESIGN.md, fp16). MatMul accumulates in fp32 and rounds its output to fp16
(numpy's own fp16 matmul is a scalar loop, far too slow); numpy's mean of fp16 values
accumulates in fp32.

A bf16 profile (`convert_to_fp16: false` with bfloat16 KV, the AI 200's `ai200_bf16`) computes
in bfloat16, whose exponent is fp32's: the check then evaluates the fp32 graph (same ranges; the
8-bit significand's rounding is not modelled) and reads bf16's largest finite value,
3.39e38, instead of fp16's (`check_dtype`, `LIMITS`).

The evaluator is pure numpy (fp16 has no BLAS), so it is for small graphs: `check_graph` runs it
below `FAITHFUL_MAX_BYTES` of weights and says so in its report when it skips it.
`FaithfulProgram` runs a program call after call behind the runtime's `Program` interface, so the
whole greedy loop can be driven through fp16-faithful programs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dflash_qaic import contract
from dflash_qaic.state import retained_inputs

FP16_MAX = 65504.0  # largest finite fp16 value
BF16_MAX = 3.3895313892515355e38  # largest finite bfloat16 value, (2 − 2⁻⁷) · 2¹²⁷
LIMITS = {"float16": FP16_MAX, "bfloat16": BF16_MAX}  # the card's compute dtype -> its range
MARGIN = 16.0  # flag any intermediate above FP16_MAX / MARGIN (4094)
# Weights (fp32 bytes) up to which check_graph runs the faithful evaluation: about a 30M-parameter
# model, which the numpy evaluator runs in seconds per specialization.
FAITHFUL_MAX_BYTES = 128 * 1024**2


def check_dtype(profile) -> str:
    """The dtype a compile profile computes in: "bfloat16" for a bf16 profile (no fp16
    conversion, bfloat16 KV), else "float16" (`-convert-to-fp16`)."""
    bf16 = not profile.convert_to_fp16 and profile.kv_dtype == "bfloat16"
    return "bfloat16" if bf16 else "float16"


# ---------------------------------------------------------------- the fp16 form of a graph


def _fp16_tensor(t: TensorProto) -> TensorProto:
    arr = numpy_helper.to_array(t).astype(np.float16)
    return numpy_helper.from_array(arr, t.name)


def _convert_nodes(nodes) -> None:
    for node in nodes:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(_fp16_tensor(attr.t))
            elif attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT:
                if attr.i == TensorProto.FLOAT:
                    attr.i = TensorProto.FLOAT16
            elif attr.type == onnx.AttributeProto.GRAPH:
                _convert_graph(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _convert_graph(g)
            elif node.op_type == "Constant" and attr.name in ("value_float", "value_floats"):
                val = attr.f if attr.name == "value_float" else list(attr.floats)
                value = numpy_helper.from_array(np.array(val, np.float16))
                attr.CopyFrom(helper.make_attribute("value", value))


def _convert_graph(graph: onnx.GraphProto) -> None:
    for i, t in enumerate(graph.initializer):
        if t.data_type == TensorProto.FLOAT:
            graph.initializer[i].CopyFrom(_fp16_tensor(t))
    for vi in list(graph.input) + list(graph.output):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    del graph.value_info[:]
    _convert_nodes(graph.node)


def convert_to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` computing in fp16, like the compiler's `-convert-to-fp16`.

    Float initializers, Constant tensors, float graph inputs/outputs and Casts to float become
    float16, in the graph and in its functions (CtxScatter); integer tensors are untouched. The
    model must be loaded with its external data.
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    _convert_graph(m.graph)
    for f in m.functions:
        del f.value_info[:]
        _convert_nodes(f.node)
    return m


def fp16_feed(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Cast the float32 arrays of a feed to float16."""
    return {
        k: (np.asarray(v).astype(np.float16) if np.asarray(v).dtype == np.float32 else v)
        for k, v in feed.items()
    }


# ---------------------------------------------------------------- the report


@dataclasses.dataclass
class Fp16Report:
    """Largest |value| of every float node output over the runs of one program."""

    program: str
    runs: int = 0
    max_abs: dict[str, float] = dataclasses.field(default_factory=dict)
    op_of: dict[str, str] = dataclasses.field(default_factory=dict)  # value -> producing op
    dtype: str = "float16"  # the range checked against (LIMITS)

    @property
    def limit(self) -> float:
        return LIMITS[self.dtype]

    def add(self, values: Mapping[str, np.ndarray]) -> None:
        for name, v in values.items():
            if name not in self.op_of or not np.issubdtype(np.asarray(v).dtype, np.floating):
                continue
            a = np.asarray(v)
            m = float(np.abs(a).max()) if a.size else 0.0
            if not np.isfinite(a).all():
                m = float("inf")
            self.max_abs[name] = max(self.max_abs.get(name, 0.0), m)

    def largest(self, n: int = 5) -> list[dict]:
        top = sorted(self.max_abs.items(), key=lambda kv: -kv[1])[:n]
        return [{"value": k, "op": self.op_of[k], "max_abs": v} for k, v in top]

    @property
    def flagged(self) -> list[str]:
        """Values within a factor MARGIN of the dtype's maximum (or beyond it)."""
        return sorted(k for k, v in self.max_abs.items() if v >= self.limit / MARGIN)

    @property
    def nonfinite(self) -> list[str]:
        return sorted(k for k, v in self.max_abs.items() if not np.isfinite(v))

    def to_json(self) -> dict:
        top = self.largest(1)
        return {
            "ran": True,
            "runs": self.runs,
            "n_values": len(self.max_abs),
            "dtype": self.dtype,
            "limit": self.limit,
            "margin": MARGIN,
            "max_abs": top[0]["max_abs"] if top else 0.0,
            "where": f"{top[0]['value']} ({top[0]['op']})" if top else None,
            "largest": self.largest(5),
            "flagged": [f"{k} ({self.op_of[k]}): {self.max_abs[k]:.4g}" for k in self.flagged],
        }

    def summary(self) -> str:
        j = self.to_json()
        flagged = f"; flagged: {', '.join(j['flagged'])}" if j["flagged"] else ""
        kind = "fp16" if self.dtype == "float16" else "bf16"
        return (
            f"{self.program}: largest {kind} intermediate {j['max_abs']:.4g} at {j['where']} "
            f"(limit {self.limit:g}, flag above {self.limit / MARGIN:g}){flagged}"
        )


# ---------------------------------------------------------------- evaluation


def _gather_elements_op():
    """GatherElements as ONNX defines it (and ONNX Runtime runs it): indices may be smaller
    than the data on the other axes. onnx's reference kernel insists on equal sizes."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        def _run(self, data, indices, axis=0):
            axis = axis % data.ndim
            window = tuple(
                slice(None) if d == axis else slice(0, n) for d, n in enumerate(indices.shape)
            )
            idx = np.where(indices < 0, indices + data.shape[axis], indices)
            return (np.take_along_axis(data[window], idx, axis=axis),)

    return GatherElements


def _matmul_op():
    """MatMul with fp32 accumulation and the output rounded to fp16. numpy has no fp16 BLAS (its
    fp16 matmul is a scalar loop, ~1000x slower); matrix units accumulate fp16 products in wider
    registers anyway. An output beyond fp16's range still comes out inf."""
    from onnx.reference.op_run import OpRun

    class MatMul(OpRun):
        def _run(self, a, b):
            if a.dtype == np.float16 and b.dtype == np.float16:
                out = np.matmul(a.astype(np.float32), b.astype(np.float32))
                return (out.astype(np.float16),)
            return (np.matmul(a, b),)

    return MatMul


class FaithfulSession:
    """ReferenceEvaluator over the fp16 form of `model` (loaded with its external data); with
    dtype "bfloat16", over the fp32 graph, its values read against bf16's range."""

    def __init__(self, model: onnx.ModelProto, name: str = "program", dtype: str = "float16"):
        from onnx.reference import ReferenceEvaluator

        if dtype not in LIMITS:
            raise ValueError(f"dtype must be one of {', '.join(LIMITS)}, got {dtype!r}")
        fp16 = convert_to_fp16(model) if dtype == "float16" else model
        self.evaluator = ReferenceEvaluator(fp16, new_ops=[_gather_elements_op(), _matmul_op()])
        self.output_names = [o.name for o in fp16.graph.output]
        self.report = Fp16Report(name, dtype=dtype)
        self.dtype, self.model = dtype, fp16
        self.keep: set[str] = set()  # intermediates to keep from each run, in `kept`
        self.kept: dict[str, np.ndarray] = {}
        for node in fp16.graph.node:
            for out in node.output:
                self.report.op_of[out] = f"{node.op_type} {node.name}".strip()

    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name for one feed (float32 arrays are cast to fp16); records every float
        intermediate in `self.report`."""
        # numpy warns when a kernel evaluates both branches of a select (Sigmoid's exp(x) for
        # large x); what counts is the node outputs, which the report checks for inf/NaN.
        feed = fp16_feed(feed) if self.dtype == "float16" else feed
        with np.errstate(over="ignore", invalid="ignore"):
            values = self.evaluator.run(None, feed, intermediate=True)
        self.report.add(values)
        self.report.runs += 1
        self.kept = {n: values[n] for n in self.keep}
        return {n: values[n] for n in self.output_names}


def faithful_check(
    model: onnx.ModelProto, feeds: list[Mapping], name: str, dtype: str = "float16"
) -> Fp16Report:
    """Run every feed through the faithful evaluation in `dtype`; the report of all
    intermediates."""
    sess = FaithfulSession(model, name, dtype)
    for feed in feeds:
        sess.run(feed)
    return sess.report


class FaithfulProgram:
    """The runtime's Program interface (`run(feeds) -> outputs`) over a FaithfulSession: the
    retained buffers (the state specs', state.py) are kept inside in fp16 and fed back call
    after call, float outputs come back as float32. Arguments as `runtime.backends.OrtProgram`
    (a manifest program's specs; `state`: its state specs, None for the I/O's pairing)."""

    def __init__(
        self, onnx_path: str | os.PathLike, inputs: list[dict], outputs, symbols: dict, state=None
    ):
        self.session = FaithfulSession(onnx.load(str(onnx_path)), os.path.basename(onnx_path))
        names = retained_inputs([i["name"] for i in inputs], [o["name"] for o in outputs], state)
        shapes = {i["name"]: i["shape"] for i in inputs}
        self.kv = {n: np.zeros([symbols.get(d, d) for d in shapes[n]], np.float16) for n in names}
        kept = {*names, *map(contract.retained, names)}
        self.out_names = [o["name"] for o in outputs if o["name"] not in kept]
        self.device_s, self.calls = 0.0, 0

    @property
    def report(self) -> Fp16Report:
        return self.session.report

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.session.run({**feeds, **self.kv})
        for name in self.kv:
            self.kv[name] = out[contract.retained(name)]
        self.calls += 1
        return {
            n: (out[n].astype(np.float32) if out[n].dtype == np.float16 else out[n])
            for n in self.out_names
        }
