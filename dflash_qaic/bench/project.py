"""`dflash-bench --project ai100`: what decode, chain verify and tree verify would cost on Cloud AI 100.

    dflash-bench --project ai100                      # Qwen3-4B, Qwen3-8B, Qwen3.5-9B (exports)
    dflash-bench --project ai100 --shapes qwen3-4b --tau chain=8.88,32=10.83,64=11.5
    dflash-bench --project ai100 --artifacts artifacts/default     # an export as it is
    dflash-bench --project ai100 --card ultra --qpc-config ai100_multidevice
    dflash-bench --project ai200 --bandwidth-gbs 500  # AI 200 (bf16): its bandwidth unpublished

A projection, not a measurement: every number comes from a program's ONNX graph (its weights,
its KV and state inputs, its MatMuls with the shapes ONNX shape inference gives for a call) and
the compile profile (weight and KV formats, cores), put on the card's roofline (bytes / bandwidth
against FLOPs / peak; docs/AI100_PROJECTION.md has the formulas and assumptions). A published
shape is projected from the graph of a reduced export of it (its real dimensions, 1 or 2 target
layers, 1 draft layer, a small vocabulary; `dflash-make-tiny-pair --preset` with random
weights), scaled to the real layer count, vocabulary and draft taps by the graph's own
per-layer counts.

Writes OUT/{summary.txt, table.md, projection.png, results.json} (OUT: --out, default
bench/projection) and prints the summary. Exits 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_qaic.commands import doc_parser
from dflash_qaic.state import BATCH, GatedDeltaNetSpec

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# the card (REFERENCE: Qualcomm Cloud AI SDK architecture page)


@dataclass(frozen=True)
class Card:
    name: str
    socs: int
    bandwidth: float  # bytes/s, all SoCs together
    flops: float  # fp16 FLOP/s, all SoCs together
    cores_per_soc: int = 16

    def seconds(self, nbytes: float, flops: float, cores: int, socs: int = 1) -> float:
        """Roofline time of one call: the larger of its bytes over the DDR bandwidth of the
        SoCs it runs on and its FLOPs over the peak of the cores it was compiled for."""
        socs = min(socs, self.socs)
        bw = self.bandwidth * socs / self.socs
        peak = self.flops * socs / self.socs * cores / self.cores_per_soc
        return max(nbytes / bw, flops / peak)


CARDS = {
    "standard": Card("AI 100 Standard (1 SoC)", 1, 137e9, 110e12),
    "pro": Card("AI 100 Pro (1 SoC)", 1, 137e9, 125e12),
    "ultra": Card("AI 100 Ultra (4 SoCs)", 4, 548e9, 290e12),
}
FAMILIES = {"ai100": "ai100_mxfp6_mxint8", "ai200": "ai200_bf16"}  # family -> default profile


def card_of(family: str, card: str, bandwidth_gbs: float | None) -> Card:
    """The card to project on: an AI 100 of CARDS (--bandwidth-gbs replaces its published
    bandwidth); an AI 200 only with --bandwidth-gbs, since its bandwidth is unpublished (its
    fp16 peak is then taken as the AI 100 Standard's, and said so in its name)."""
    if bandwidth_gbs is not None and not (math.isfinite(bandwidth_gbs) and bandwidth_gbs > 0):
        raise ProjectionError(f"--bandwidth-gbs must be a positive number, got {bandwidth_gbs}")
    if family == "ai200":
        if bandwidth_gbs is None:
            raise ProjectionError(
                "AI 200 has no published memory bandwidth (768 GB of LPDDR5X per card; the "
                "bandwidth per chip is not published): give the one you assume, e.g. "
                "--bandwidth-gbs 500, and the projection scales with it"
            )
        std = CARDS["standard"]
        name = f"AI 200 ({bandwidth_gbs:g} GB/s given; fp16 peak assumed the AI 100's)"
        return Card(name, 1, bandwidth_gbs * 1e9, std.flops)
    c = CARDS[card]
    if bandwidth_gbs is None:
        return c
    name = f"{c.name}, {bandwidth_gbs:g} GB/s given"
    return Card(name, c.socs, bandwidth_gbs * 1e9, c.flops, c.cores_per_soc)


# bits per element: MX formats share one 8-bit exponent per block of 32 elements
MX_BLOCK = 32
BITS = {"float16": 16.0, "bfloat16": 16.0, "mxfp6": 6 + 8 / MX_BLOCK, "mxint8": 8 + 8 / MX_BLOCK}


class ProjectionError(ValueError):
    """Bad input to the projection: the message names it and the fix."""


# ----------------------------------------------------------------------------------------------
# counting a graph


@dataclass
class PartCounts:
    """What one call touches in one part of a program (a decoder layer, or the rest): element
    counts (formats are applied later) and FLOPs."""

    matmul_weights: float = 0.0  # initializers a MatMul/Gemm reads: streamed whole every call
    gathered: float = 0.0  # elements read from Gather-only initializers (embedding rows)
    other_weights: float = 0.0  # every other initializer (norm weights, …), read every call
    kv_read: float = 0.0  # positional cache elements the call's window reads (state.py)
    kv_write: float = 0.0  # positional cache elements the call's rows write
    state: float = 0.0  # whole-row state elements (a ring, a recurrent state): read, rewritten
    flops: float = 0.0  # 2·M·K·N of every MatMul/Gemm
    nodes: int = 0  # graph nodes (the compile work model)
    kind: str = "other"

    def add(self, other: PartCounts, times: float = 1.0) -> None:
        for k in ("matmul_weights", "gathered", "other_weights", "kv_read", "kv_write", "state"):
            setattr(self, k, getattr(self, k) + times * getattr(other, k))
        self.flops += times * other.flops
        self.nodes += round(times * other.nodes)


@dataclass
class GraphCounts:
    """A program's counts for one call, by part: `layers[i]` for decoder layer i, `rest` for
    everything outside the layers."""

    layers: dict[int, PartCounts]
    rest: PartCounts
    uncounted_matmuls: int = 0  # MatMuls whose shapes inference left unknown

    def total(self) -> PartCounts:
        out = PartCounts()
        out.add(self.rest)
        for p in self.layers.values():
            out.add(p)
        return out

    def scaled(self, kinds: dict[str, int]) -> PartCounts:
        """The counts of a model with `kinds[k]` layers of each kind k, from the mean of this
        graph's layers of that kind (the rest as it is)."""
        out = PartCounts()
        out.add(self.rest)
        by_kind: dict[str, list[PartCounts]] = defaultdict(list)
        for p in self.layers.values():
            by_kind[p.kind].append(p)
        missing = sorted(set(by_kind) - set(kinds))
        if missing:
            raise ProjectionError(
                f"the graph has {', '.join(missing)} layers the published shape does not "
                f"list ({kinds}): give their count"
            )
        for kind, n in kinds.items():
            if n and kind not in by_kind:
                have = sorted(by_kind) or ["none"]
                raise ProjectionError(
                    f"the graph has no {kind} layer to scale to {n} of them (it has: "
                    f"{', '.join(have)}): export a reduced model with at least one"
                )
            for p in by_kind.get(kind, []):
                out.add(p, n / len(by_kind[kind]))
        return out


_LAYER_INIT = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.")
_LAYER_NODE = re.compile(r"^/(?:model/)?(?:language_model/)?layers\.(\d+)/")


def _bind(model, symbols: dict[str, int]) -> None:
    for i in model.graph.input:
        for d in i.type.tensor_type.shape.dim:
            if d.dim_param:
                if d.dim_param not in symbols:
                    raise ProjectionError(
                        f"input {i.name} has the symbol {d.dim_param!r}, which the call's "
                        f"symbols {sorted(symbols)} do not bind"
                    )
                v = int(symbols[d.dim_param])
                d.Clear()
                d.dim_value = v


def _numel(shape) -> float:
    return float(math.prod(shape)) if shape is not None else 0.0


def load_graph(onnx_path: str | Path):
    """The graph without its weights' data (their shapes are in the protobuf)."""
    import onnx

    path = Path(onnx_path)
    if not path.is_file():
        raise ProjectionError(f"{path}: no such ONNX file (export the program first)")
    return onnx.load(str(path), load_external_data=False)


def count_graph(
    model,
    symbols: dict[str, int],
    *,
    window: int | None = None,
    weight_scale=None,
    state=(),
) -> GraphCounts:
    """Counts of one call of `model` (an onnx ModelProto, not modified) with its symbols bound.

    state: the program's state specs (state.py; the manifest's `io.state`), what its caches
    cost; window: the KV slots the call reads (default: the `comp_ctx_lengths` symbol, else
    ctx_len);
    weight_scale(name, dims) -> factor: scales an initializer's elements and the FLOPs of the
    MatMuls reading it (a reduced export's vocabulary or draft taps to the real ones)."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    _bind(m, symbols)
    c = _Counts(_infer(m).graph, weight_scale)
    c.weights()
    if window is None:
        window = symbols.get("comp_ctx_lengths", symbols.get("ctx_len"))
    c.caches(state, symbols, window)
    uncounted = c.nodes(symbols.get("seq_len", 1) * symbols.get("batch_size", 1))
    for p in c.layers.values():  # a layer's own kind from what it holds (its cache or state)
        if p.kind == "other":
            p.kind = "full_attention"
    return GraphCounts(dict(sorted(c.layers.items())), c.rest, uncounted)


class _Counts:
    """`count_graph`'s tally of one bound, shape-inferred graph, per layer and the rest."""

    def __init__(self, g, weight_scale):
        self.g = g
        self.shapes: dict[str, list[int] | None] = {}
        for vi in [*g.value_info, *g.input, *g.output]:
            dims = vi.type.tensor_type.shape.dim
            known = all(d.HasField("dim_value") for d in dims)
            self.shapes[vi.name] = (
                [d.dim_value for d in dims]
                if known and vi.type.tensor_type.HasField("shape")
                else None
            )
        self.inits = {i.name: list(i.dims) for i in g.initializer}
        self.shapes.update(self.inits)
        self.scale = {
            n: (weight_scale(n, d) if weight_scale else 1.0) for n, d in self.inits.items()
        }
        self.consumers: dict[str, set[str]] = defaultdict(set)
        for n in g.node:
            for x in n.input:
                if x in self.inits:
                    self.consumers[x].add(n.op_type)
        self.layers: dict[int, PartCounts] = defaultdict(PartCounts)
        self.rest = PartCounts()

    def part_of_init(self, name: str) -> PartCounts:
        mt = _LAYER_INIT.match(name)
        return self.layers[int(mt.group(1))] if mt else self.rest

    def part_of_node(self, node) -> PartCounts:
        mt = _LAYER_NODE.match(node.name)
        if mt:
            return self.layers[int(mt.group(1))]
        for x in node.input:  # e.g. a draft layer's context k_proj, named outside the layer
            if x in self.inits and _LAYER_INIT.match(x):
                return self.part_of_init(x)
        return self.rest

    def weights(self) -> None:
        """Each initializer's elements: MatMul weights, gathered tables (per Gather node, in
        `nodes`) and the rest; a layer's kind from its weights' names."""
        for name, dims in self.inits.items():
            p = self.part_of_init(name)
            ops = self.consumers.get(name, set())
            if ops & {"MatMul", "Gemm"}:
                p.matmul_weights += _numel(dims) * self.scale[name]
            elif ops != {"Gather"}:  # a table read by Gather alone: the rows a call reads
                p.other_weights += _numel(dims) * self.scale[name]
            if "linear_attn" in name:
                p.kind = "linear_attention"
            elif "self_attn" in name and p.kind == "other":
                p.kind = "full_attention"

    def caches(self, specs, symbols: dict[str, int], window: int) -> None:
        """Per state spec (state.py): a positional buffer read over `window` slots and written
        for the call's rows; a ring read and written whole (at the KV format); a recurrent
        state read and rewritten whole (`state`, at its own format). A Gated DeltaNet layer is
        a linear-attention layer."""
        seq = symbols.get("seq_len", 1)
        for spec in specs:
            p = self.layers[spec.layer]
            if isinstance(spec, GatedDeltaNetSpec):
                p.kind = "linear_attention"
            elif p.kind == "other":
                p.kind = "full_attention"
            for b in spec.buffers:
                dims = list(b.bind(symbols))
                if b.slot_axis is None:
                    p.state += _numel(dims)
                    continue
                if b.window is not None:  # a ring: every slot read and written
                    p.kv_read += _numel(dims)
                    p.kv_write += _numel(dims)
                    continue
                # a call writes its rows of every cache row it runs (batch_size rows of seq_len)
                p.kv_read += _numel(dims[: b.slot_axis] + [window] + dims[b.slot_axis + 1 :])
                p.kv_write += _numel(dims[: b.slot_axis] + [seq] + dims[b.slot_axis + 1 :])

    def nodes(self, rows: int) -> int:
        """MatMul FLOPs (2·M·K·N, scaled with their weights) and gathered rows; returns how
        many MatMuls had shapes inference left unknown."""
        uncounted = 0
        for n in self.g.node:
            p = self.part_of_node(n)
            p.nodes += 1
            if n.op_type in ("MatMul", "Gemm"):
                a, out = self.shapes.get(n.input[0]), self.shapes.get(n.output[0])
                if not a or out is None:
                    uncounted += 1
                    continue
                k = a[-2] if n.op_type == "Gemm" and _attr(n, "transA") else a[-1]
                f = 2.0 * _numel(out) * k
                for x in n.input[:2]:
                    if x in self.scale:
                        f *= self.scale[x]
                p.flops += f
            elif (
                n.op_type == "Gather"
                and n.input[0] in self.inits
                and self.consumers[n.input[0]] == {"Gather"}
            ):
                table = self.inits[n.input[0]]
                idx = self.shapes.get(n.input[1])
                nrows = _numel(idx) if idx is not None else self.gathered_rows(n, rows, table)
                self.part_of_init(n.input[0]).gathered += nrows * _numel(table[1:])
        return uncounted

    def gathered_rows(self, node, rows: int, table: list[int]) -> int:
        """Rows a Gather reads when shape inference left its index count unknown: a MoE layer's
        union of experts, U = min(rows · k, E) (modeling/moe.py: a TopK whose k the call's shape
        sets), k the layer's routing TopK (the one with a constant k), E the table's first axis;
        else one per call row (docs/DESIGN.md, A verify's experts)."""
        mt = _LAYER_NODE.match(node.name)
        k = self.route_k().get(int(mt.group(1))) if mt else None
        producer = self.producers.get(node.input[1])
        if k is None or producer is None or producer.op_type != "TopK":
            return rows
        return min(rows * k, table[0])

    def route_k(self) -> dict[int, int]:
        """Per layer, the k of its routing TopK (a constant k), for MoE layers."""
        if not hasattr(self, "_route_k"):
            from onnx import numpy_helper

            self.producers = {o: n for n in self.g.node for o in n.output}
            const = {i.name: i for i in self.g.initializer}
            self._route_k = {}
            for n in self.g.node:
                mt = _LAYER_NODE.match(n.name)
                if n.op_type != "TopK" or not mt:
                    continue
                src = self.producers.get(n.input[1])
                value = const.get(n.input[1])
                if value is None and src is not None and src.op_type == "Constant":
                    value = next((a.t for a in src.attribute if a.name == "value"), None)
                if value is not None:
                    self._route_k[int(mt.group(1))] = int(numpy_helper.to_array(value).item())
        return self._route_k


def _infer(model):
    """Shapes of every value: onnx's inference (fast), else, when it leaves a MatMul's shapes
    unknown, onnxruntime's symbolic inference (it follows the draft attention's slices)."""
    from onnx import shape_inference

    out = shape_inference.infer_shapes(model, data_prop=True)
    known = {
        vi.name
        for vi in [*out.graph.value_info, *out.graph.input]
        if vi.type.tensor_type.HasField("shape")
        and all(d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)
    } | {i.name for i in out.graph.initializer}
    if all(n.input[0] in known for n in out.graph.node if n.op_type in ("MatMul", "Gemm")):
        return out
    try:
        import onnx
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        # weights kept outside the graph (external data, not loaded): inputs of their shape
        m = onnx.ModelProto()
        m.CopyFrom(model)
        external = [i for i in m.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
        for i in external:
            m.graph.input.append(onnx.helper.make_tensor_value_info(i.name, i.data_type, i.dims))
            m.graph.initializer.remove(i)
        inferred = SymbolicShapeInference.infer_shapes(m, auto_merge=True, guess_output_rank=True)
        del inferred.graph.input[len(model.graph.input) :]
        inferred.graph.initializer.extend(external)
        return inferred
    except Exception as e:  # an op it does not know: keep onnx's shapes
        log.info("symbolic shape inference failed (%s); some MatMuls stay uncounted", e)
        return out


def _attr(node, name: str) -> int:
    for a in node.attribute:
        if a.name == name:
            return a.i
    return 0


# ----------------------------------------------------------------------------------------------
# formats and call times


@dataclass(frozen=True)
class Formats:
    """Bytes per element of each kind of data, from a compile profile."""

    matmul_weights: float
    other_weights: float
    kv: float
    state: float

    @classmethod
    def of(cls, profile) -> Formats:
        weights = "mxfp6" if profile.mxfp6_matmul else "float16"
        fp16 = BITS["float16"] / 8
        return cls(
            matmul_weights=BITS[weights] / 8,
            other_weights=fp16,
            kv=BITS[profile.kv_dtype] / 8,
            state=BITS[GatedDeltaNetSpec(0, BATCH).card_dtype(profile.kv_dtype)] / 8,
        )

    def bytes(self, c: PartCounts) -> dict[str, float]:
        """Bytes one call moves between DDR and the cores, by kind."""
        return {
            "weights": c.matmul_weights * self.matmul_weights
            + (c.gathered + c.other_weights) * self.other_weights,
            "kv": (c.kv_read + c.kv_write) * self.kv,
            "state": 2 * c.state * self.state,  # read, then rewritten
        }


@dataclass
class Call:
    """One projected call."""

    name: str
    rows: int
    bytes: dict[str, float]
    flops: float
    seconds: float
    bound: str  # "bandwidth" | "compute"

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())


def project_call(
    name: str, rows: int, counts: PartCounts, fmt: Formats, card: Card, cores: int, socs: int
) -> Call:
    b = fmt.bytes(counts)
    total = sum(b.values())
    s = card.seconds(total, counts.flops, cores, socs)
    mem = card.seconds(total, 0.0, cores, socs)
    return Call(name, rows, b, counts.flops, s, "bandwidth" if mem >= s else "compute")


def tokens_per_second(tau: float, step_seconds: float) -> float:
    """Committed tokens per second of a speculative step: τ (tokens a step commits, the bonus
    included) over its time (draft call + verify call)."""
    return tau / step_seconds


# ----------------------------------------------------------------------------------------------
# published shapes


@dataclass(frozen=True)
class Shape:
    """A published target + DFlash draft shape, and the reduced export its graph comes from."""

    name: str
    title: str
    preset: str  # dflash-make-tiny-pair preset the reduced pair starts from
    overrides: dict  # published dimensions the preset does not have
    layers: int  # the target's decoder layers
    full_attention_interval: int | None  # hybrid: every n-th layer full attention
    vocab: int
    recipe: str  # the recipe whose ctx_len, chunk and block the projection takes
    draft_layers: int = 5
    taps: int = 5  # target layers the draft reads (fc's input is taps·hidden)
    reduced_layers: int = 1
    reduced_vocab: int = 5003  # unlike any hidden dimension, so its initializers are found

    @property
    def hybrid(self) -> bool:
        return self.full_attention_interval is not None

    def kinds(self, layers: int | None = None) -> dict[str, int]:
        n = self.layers if layers is None else layers
        if not self.hybrid:
            return {"full_attention": n}
        full = n // self.full_attention_interval
        return {"linear_attention": n - full, "full_attention": full}

    def reduced_pair_kwargs(self) -> dict:
        kw = dict(self.overrides)
        kw.update(
            target_layers=self.reduced_layers,
            draft_layers=1,
            vocab_size=self.reduced_vocab,
            mask_token_id=self.reduced_vocab - 1,
            shards=1,
        )
        if self.hybrid:  # one layer of each kind
            kw["full_attention_interval"] = self.reduced_layers
        return kw


# Published configurations (Hugging Face config.json of each; DFlash b16 drafts: 5 layers
# tapping 5 target layers, REFERENCE §1). Qwen3.5-9B: 32 layers, 8 of them full attention
# (16 q / 4 kv heads of 256), Gated DeltaNet 16 qk / 32 v heads of 128, FFN 12288, vocab 248320.
SHAPES = {
    "qwen3-4b": Shape(
        "qwen3-4b", "Qwen3-4B", "qwen3-4b", {}, 36, None, 151936, "qwen3-4b-dflash-b16"
    ),
    "qwen3-8b": Shape(
        "qwen3-8b",
        "Qwen3-8B",
        "qwen3-4b",
        dict(hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False),
        36,
        None,
        151936,
        "qwen3-8b-dflash-b16",
    ),
    "qwen3.5-9b": Shape(
        "qwen3.5-9b",
        "Qwen3.5-9B",
        "qwen3.5-4b",
        dict(hidden_size=4096, intermediate_size=12288),
        32,
        4,
        248320,
        "qwen3.5-9b-dflash",
        reduced_layers=2,
    ),
}
DEFAULT_SHAPES = ("qwen3-4b", "qwen3-8b", "qwen3.5-9b")

# τ (tokens committed per step, the bonus included) when --tau/--tau-from do not give one:
# measured on the built-in pair's tree program (`make bench`'s artifacts/default-tree), T = 0,
# the 12 held-out prompts × 128 tokens: the chain verifying whole blocks (as the card does) and
# each tree budget fixed (docs/BENCHMARKS.md, Tree verification)
DEFAULT_TAU = {"chain": 9.29, 16: 9.47, 32: 10.30, 64: 10.89}
TAU_SOURCES = {
    k: "measured: built-in pair, tree program, T = 0, "
    + ("whole-block chain" if k == "chain" else f"budget {k}")
    for k in DEFAULT_TAU
}
DEFAULT_BUDGETS = (16, 32, 64)
GOAL_RATIO = 1.3  # the goal: tree ≥ 1.3× chain at Qwen3-4B, MXFP6, one SoC


def make_reduced_pair(shape: Shape, work: Path) -> Path:
    """The reduced real-dimension export of `shape` in work/<name> (made once, then reused):
    a random-weight pair from its preset, exported without compiling."""
    out = work / shape.name
    if (out / "artifacts" / "manifest.json").is_file():
        return out / "artifacts"
    import dflash_qaic
    from dflash_lab.tiny import make_tiny_pair
    from dflash_qaic.exporter.cli import load_recipe_options

    log.info("writing a reduced %s pair in %s", shape.title, out)
    t, d = make_tiny_pair(out / "pair", preset=shape.preset, **shape.reduced_pair_kwargs())
    r = load_recipe_options(shape.recipe)
    dflash_qaic.export(
        t,
        d,
        out / "artifacts",
        compile=False,
        fp16_check=False,
        block_size=r.get("block_size"),
        prefill_seq_len=r["prefill_seq_len"],
        ctx_len=r["ctx_len"],
        verify_lengths=[r.get("block_size") or 16],
        comp_ctx_lengths=[r["ctx_len"]],
    )
    import shutil

    shutil.rmtree(out / "pair", ignore_errors=True)  # the checkpoints are not needed again
    return out / "artifacts"


# ----------------------------------------------------------------------------------------------
# a projection


@dataclass
class Programs:
    """The counted programs of one shape: the target at each row count asked, the draft."""

    title: str
    hybrid: bool
    block_size: int
    ctx_len: int
    context: int
    target_nodes: int
    draft_nodes: int
    batch: int = 1  # sequences a call runs (continuous batching: full_batch_size)
    counts: dict[str, PartCounts] = field(default_factory=dict)  # "decode", "verify16", …
    scaled: bool = False
    notes: list[str] = field(default_factory=list)


def _spec(program, kind: str) -> dict:
    """The symbols of a program's (artifacts.manifest.ProgramRecord) first `kind` specialization."""
    for s in program.specializations:
        if s["kind"] == kind:
            return dict(s["symbols"])
    raise ProjectionError(f"the {program.onnx} program has no {kind} specialization")


def count_programs(
    artifacts: Path,
    budgets: tuple[int, ...],
    *,
    context: int | None = None,
    shape: Shape | None = None,
) -> Programs:
    """Count the decode, chain-verify (B rows), tree-verify (N rows) and draft calls of an
    export at `context` KV slots read (default: its ctx_len); with `shape`, scaled from the
    export's layers, vocabulary and taps to the published shape's."""
    mpath = Path(artifacts) / "manifest.json"
    if not mpath.is_file():
        raise ProjectionError(
            f"{artifacts}: no manifest.json: give a directory written by dflash-export"
        )
    from dflash_qaic.artifacts.manifest import read_manifest

    m = read_manifest(artifacts, check_files="none")  # counts the graphs; their bytes unread
    B, ctx = m.block_size, m.ctx_len
    window = context or ctx
    if window > ctx:
        raise ProjectionError(f"--context {window} exceeds the export's ctx_len {ctx}")
    hybrid = m.target.io.hybrid
    notes: list[str] = []
    weight_scale = None
    if shape is not None:
        vocab_ratio = shape.vocab / m.vocab_size
        taps_ratio = shape.taps / len(m.target_layer_ids)
        exported_vocab = m.vocab_size

        def weight_scale(name: str, dims: list[int]) -> float:
            f = vocab_ratio if exported_vocab in dims else 1.0
            if name.split(".")[0] == "fc":
                f *= taps_ratio
            return f

    graphs = {p: load_graph(Path(artifacts) / m.program(p).onnx) for p in m.roles}
    out = Programs(
        title=shape.title if shape else str(artifacts),
        hybrid=hybrid,
        block_size=B,
        ctx_len=ctx,
        context=window,
        target_nodes=0,
        draft_nodes=0,
        scaled=shape is not None,
        notes=notes,
    )

    def counted(program: str, symbols: dict, kinds: dict[str, int] | None) -> PartCounts:
        g = count_graph(
            graphs[program],
            symbols,
            window=window,
            weight_scale=weight_scale,
            state=m.program(program).state,
        )
        if g.uncounted_matmuls:
            notes.append(
                f"{program}: {g.uncounted_matmuls} MatMul(s) without inferred shapes, not counted"
            )
        return g.scaled(kinds) if kinds is not None else g.total()

    tkinds = shape.kinds() if shape else None
    dkinds = {"full_attention": shape.draft_layers} if shape else None
    decode = _spec(m.target, "Decode")
    out.batch = int(decode.get("batch_size", 1))
    out.counts["decode"] = counted("target", decode, tkinds)
    out.counts[f"verify{B}"] = counted("target", {**decode, "seq_len": B}, tkinds)
    if not hybrid:
        for n in budgets:
            out.counts[f"tree{n}"] = counted("target", {**decode, "seq_len": n}, tkinds)
    draft = _spec(m.draft, "DraftDecode")
    out.counts["draft"] = counted("draft", draft, dkinds)
    out.target_nodes = out.counts["decode"].nodes
    out.draft_nodes = out.counts["draft"].nodes
    return out


def tau_from(path: str | None) -> dict:
    """τ per mode from a `dflash-bench --tree-budgets` results.json: the benchmarked draft's
    T = 0 τ at each budget (0: the chain; the per-step choice, auto, is left out)."""
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ProjectionError(f"--tau-from {path}: {e}") from None
    if data.get("kind") == "card numerics":  # dflash-bench ARTIFACTS --card-numerics
        return {"chain": round(data["greedy"]["tau_card"], 2)}
    trees = data.get("trees")
    if not trees:
        raise ProjectionError(
            f"--tau-from {path}: no tree budgets measured in it (dflash-bench TREE_ARTIFACTS "
            "--tree-budgets 0,16,32,64 writes them)"
        )
    out = {}
    for t in trees:
        if t["draft"] != trees[0]["draft"] or t["budget"] is None:
            continue
        for s in t["temperatures"]:
            if s["temperature"] == 0 and s["status"] == "measured":
                out["chain" if t["budget"] == 0 else int(t["budget"])] = round(s["tau"], 2)
    return out


def tau_sources(path: str | None, tau_text: str | None) -> dict:
    """Where each τ of the projection comes from: given on the command line, a card-numerics
    run (its profile's numerics), a benchmark's results.json, or the built-in default."""
    out: dict = dict(TAU_SOURCES)
    if path:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        card = data.get("kind") == "card numerics"
        what = (
            f"measured under card numerics ({data.get('numerics')}), T = 0, whole-block chain, "
            f"{data['artifacts']}; fp32 τ there {data['greedy']['tau_fp32']:.2f}"
            if card
            else f"measured: {path}, T = 0"
        )
        out.update({k: what for k in tau_from(path)})
    out.update({k: "given (--tau)" for k in parse_tau(tau_text)})
    return out


def parse_tau(text: str | None) -> dict:
    """'chain=8.88,32=10.83' -> {"chain": 8.88, 32: 10.83} (each τ ≥ 1)."""
    out: dict = {}
    for part in filter(str.strip, (text or "").split(",")):
        key, sep, value = part.partition("=")
        key = key.strip()
        try:
            tau = float(value)
            k: Any = "chain" if key == "chain" else int(key)
        except ValueError:
            k, tau = None, float("nan")
        if not sep or k is None or not math.isfinite(tau) or tau < 1:
            raise ProjectionError(
                f"--tau: {part.strip()!r} is not chain=τ or BUDGET=τ with τ ≥ 1 "
                "(e.g. --tau chain=8.88,32=10.83)"
            )
        out[k] = tau
    return out


@dataclass
class Result:
    shape: str
    card: str
    profile: str
    context: int
    calls: dict[str, Call]
    tokens_per_s: dict[str, float | None]  # "ar", "chain", "tree16", …
    tau: dict[str, float | None]
    step_ratio: dict[str, float]  # a tree step's time over a chain step's
    break_even_tau: dict[str, float]  # the τ each tree needs to equal the chain
    goal_tau: dict[str, float]  # … and to reach GOAL_RATIO × the chain
    pick: str | None
    notes: list[str]
    batch: int = 1
    # the step policy's break-even on this card (runtime/policy.break_even): the τ per step at
    # which a chain step (draft + B-row verify) commits tokens as fast as decoding, and the
    # same once the draft call has run (verify alone); None when no τ ≤ B reaches it
    policy_tau: float | None = None
    policy_tau_drafted: float | None = None


def project(
    progs: Programs,
    profile,
    card: Card,
    tau: dict,
    budgets: tuple[int, ...],
) -> Result:
    """Call times on the roofline and tokens/s of AR (one decode call per token), the chain
    (draft + B-row verify per step) and the tree (draft + N-row verify per step)."""
    fmt = Formats.of(profile)
    tsocs, dsocs = profile.target.num_devices, profile.draft.num_devices
    tcores, dcores = profile.target.num_cores, profile.draft.num_cores
    calls = {}
    for key, c in progs.counts.items():
        cores, socs = (dcores, dsocs) if key == "draft" else (tcores, tsocs)
        rows = progs.block_size if key in ("draft",) or key.startswith("verify") else 1
        if key.startswith("tree"):
            rows = int(key[4:])
        calls[key] = project_call(key, rows, c, fmt, card, cores, socs)
    B = progs.block_size
    t_draft = calls["draft"].seconds
    t_chain = t_draft + calls[f"verify{B}"].seconds
    seqs = progs.batch  # every sequence of the batch commits its tokens in each call
    tps: dict[str, float | None] = {"ar": seqs / calls["decode"].seconds}
    taus: dict[str, float | None] = {"ar": 1.0, "chain": tau.get("chain")}
    tps["chain"] = seqs * tokens_per_second(tau["chain"], t_chain) if tau.get("chain") else None
    even, goal, ratio = {}, {}, {}
    best, pick = 0.0, None
    notes = list(progs.notes)
    for n in budgets:
        key = f"tree{n}"
        if key not in calls:
            continue
        t_tree = t_draft + calls[key].seconds
        ratio[key] = t_tree / t_chain
        taus[key] = tau.get(n)
        tps[key] = seqs * tokens_per_second(tau[n], t_tree) if tau.get(n) else None
        if tau.get("chain"):
            even[key] = tau["chain"] * t_tree / t_chain
            goal[key] = GOAL_RATIO * even[key]
        if tps[key] and tps[key] > best:
            best, pick = tps[key], key
    if progs.hybrid:
        notes.append("hybrid target: chain verification only (no tree)")
    even_tau = policy_break_even(calls, B)
    return Result(
        shape=progs.title,
        card=card.name,
        profile=profile.name,
        context=progs.context,
        calls=calls,
        tokens_per_s=tps,
        tau=taus,
        step_ratio=ratio,
        break_even_tau=even,
        goal_tau=goal,
        pick=pick,
        notes=notes,
        batch=progs.batch,
        policy_tau=even_tau[0],
        policy_tau_drafted=even_tau[1],
    )


def policy_break_even(calls: dict[str, Call], B: int) -> tuple[float | None, float | None]:
    """The break-even τ per step of the step policy (runtime/policy.break_even) on these
    projected calls, before and after the draft call has run (no host time: the card's calls
    queue back to back): where a verify is nearly free (weight-bound, B rows for the price of
    one), drafting pays at a τ barely above 1."""
    from dflash_qaic.runtime.policy import break_even

    verify, dec = {B: calls[f"verify{B}"].seconds}, calls["decode"].seconds
    out = [break_even(verify, d, dec)[0] for d in (calls["draft"].seconds, 0.0)]
    return tuple(1.0 + k if math.isfinite(k) else None for k in out)


# ----------------------------------------------------------------------------------------------
# specializations and their compile work


def recipe_specializations(recipe: str, *, default_lengths: bool = False) -> dict[str, int]:
    """Target and draft specialization counts of a recipe, through the options and the shape
    plan the export builds from them (`export.cli.load_recipe_options`,
    `ExportOptions.shape_plan`); default_lengths: as if the recipe gave no verify lengths and
    no windows (the export's defaults: what the recipes asked for before they chose)."""
    from dflash_qaic import contract
    from dflash_qaic.exporter.cli import load_recipe_options
    from dflash_qaic.exporter.options import RECIPE_OPTIONS, ExportOptions

    r = load_recipe_options(recipe)
    drop = {"verify_lengths", "comp_ctx_lengths"} if default_lengths else set()
    o = ExportOptions(**{k: r[k] for k in RECIPE_OPTIONS if k in r and k not in drop})
    if o.block_size is None:
        raise ProjectionError(f"recipe {recipe} has no block_size: give it (e.g. 16)")
    plan = o.shape_plan(o.block_size)
    return {
        "target": len(contract.target_specializations(plan)),
        "draft": len(contract.draft_specializations(plan)),
    }


def real_recipes() -> list[str]:
    """The shipped recipes of real models (every one but the built-in pair's default*)."""
    from dflash_qaic.exporter.cli import RECIPE_DIR

    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml") if not p.stem.startswith("default"))


# ----------------------------------------------------------------------------------------------
# output


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def table(results: list[Result], budgets: tuple[int, ...]) -> str:
    lines = [
        "| shape | call | rows | weights MB | KV+state MB | GFLOP | ms | bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for c in r.calls.values():
            kv = c.bytes["kv"] + c.bytes["state"]
            lines.append(
                f"| {r.shape} | {c.name} | {c.rows} | {c.bytes['weights'] / 1e6:.0f} | "
                f"{kv / 1e6:.1f} | {c.flops / 1e9:.1f} | {_ms(c.seconds)} | {c.bound} |"
            )
    lines += ["", "| shape | mode | τ | tokens/s | × AR | × chain | τ to equal chain |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in results:
        ar = r.tokens_per_s["ar"]
        chain = r.tokens_per_s.get("chain")
        for key, tps in r.tokens_per_s.items():
            t = r.tau.get(key)
            even = r.break_even_tau.get(key)
            lines.append(
                f"| {r.shape} | {key} | {t if t is not None else '—'} | "
                f"{f'{tps:.0f}' if tps else '—'} | {f'{tps / ar:.2f}×' if tps else '—'} | "
                f"{f'{tps / chain:.2f}×' if tps and chain else '—'} | "
                f"{f'{even:.2f}' if even else '—'} |"
            )
    return "\n".join(lines) + "\n"


def summary(
    results: list[Result], budgets, specs: dict[str, dict], header: str, work: dict | None = None
) -> str:
    lines = [header, ""]
    for r in results:
        c = r.calls
        parts = [f"decode {_ms(c['decode'].seconds)} ms"]
        parts += [f"{k} {_ms(v.seconds)} ms" for k, v in c.items() if k != "decode"]
        seqs = f", {r.batch} sequences a call" if r.batch > 1 else ""
        lines.append(f"{r.shape} (KV read at {r.context} slots{seqs}): " + ", ".join(parts))
        tps = "  ".join(f"{k} {v:.0f}" if v else f"{k} — (no τ)" for k, v in r.tokens_per_s.items())
        lines.append(f"  tokens/s: {tps}")
        if r.policy_tau is not None:
            lines.append(
                f"  step policy: drafting pays from τ {r.policy_tau:.2f} per step (draft + "
                f"verify{r.calls['draft'].rows} against decode; {r.policy_tau_drafted:.2f} once "
                "the draft call has run)"
            )
        if r.step_ratio:
            be = ", ".join(
                f"{k} {r.step_ratio[k]:.3f}× · {r.break_even_tau[k]:.2f} · {r.goal_tau[k]:.2f}"
                for k in r.step_ratio
            )
            lines.append(
                f"  trees (step time × the chain's · τ to equal it · τ for {GOAL_RATIO}×): {be}"
            )
        if r.pick:
            ratio = r.tokens_per_s[r.pick] / r.tokens_per_s["chain"]
            met = "met" if ratio >= GOAL_RATIO else "not met"
            lines.append(
                f"  best tree with a τ: {r.pick} at τ {r.tau[r.pick]}, {ratio:.2f}× the chain "
                f"(goal {GOAL_RATIO}×: {met})"
            )
        w = (work or {}).get(r.shape, {})
        if "node_compilations" in w:
            lines.append(
                f"  compile work (estimate, ∝ specializations × nodes): {w['recipe']} "
                f"{w['target_specializations']} + {w['draft_specializations']} specializations "
                f"× {w['target_nodes']} + {w['draft_nodes']} nodes = "
                f"{w['node_compilations'] / 1e3:.0f}k node-compilations "
                f"({w['node_compilations_with_default_lengths'] / 1e3:.0f}k with the default "
                "verify lengths and windows)"
            )
        for n in r.notes:
            lines.append(f"  note: {n}")
    if specs:
        lines += ["", "target specializations per real recipe (≤ 12; export defaults before):"]
        lines.append(
            "  "
            + ", ".join(
                f"{name} {s['target']} ({s['defaults']['target']})"
                for name, s in sorted(specs.items())
            )
        )
    return "\n".join(lines) + "\n"


def plot(results: list[Result], path: Path) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ProjectionError(
            "the projection's plot needs matplotlib: pip install 'dflash-qaic[bench]'"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys: list[str] = []  # the modes with a projected figure (a τ) somewhere
    for r in results:
        keys += [k for k, v in r.tokens_per_s.items() if v and k not in keys]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(results) + 2), 4))
    width = 0.8 / max(1, len(keys))
    for j, k in enumerate(keys):
        xs = [i + j * width for i in range(len(results))]
        ys = [r.tokens_per_s.get(k) or 0 for r in results]
        bars = ax.bar(xs, ys, width, label=k)
        for b, y in zip(bars, ys):
            if y:
                ax.annotate(f"{y:.0f}", (b.get_x() + b.get_width() / 2, y), ha="center",
                            va="bottom", fontsize=7)  # fmt: skip
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
    ax.set_xticklabels([r.shape for r in results])
    ax.set_ylabel("tokens/s (projected)")
    ax.set_title(f"PROJECTION on {results[0].card}, {results[0].profile} (roofline, not measured)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_json(results, budgets, tau, specs, compile_work, args, sources=None) -> dict:
    def call(c: Call) -> dict:
        return {**asdict(c), "total_bytes": c.total_bytes}

    return {
        "kind": "projection (roofline, not a measurement)",
        "card": asdict(card_of(args.card_family, args.card, args.bandwidth_gbs)),
        "profile": args.qpc_config,
        "budgets": list(budgets),
        "tau": {str(k): v for k, v in tau.items()},
        "tau_sources": {str(k): v for k, v in (sources or TAU_SOURCES).items() if k in tau},
        "bits_per_element": BITS,
        "results": [
            {
                **{k: v for k, v in asdict(r).items() if k != "calls"},
                "calls": {k: call(c) for k, c in r.calls.items()},
            }
            for r in results
        ],  # fmt: skip
        "specializations": specs,
        "compile_work": compile_work,
    }


# ----------------------------------------------------------------------------------------------
# the command line


def parser() -> argparse.ArgumentParser:
    p = doc_parser("dflash-bench --project", __doc__, artifacts=False)
    p.add_argument("card_family", choices=sorted(FAMILIES), help="the card family to project on")
    p.add_argument("--card", choices=sorted(CARDS), default="standard", help="an AI 100 card")
    p.add_argument(
        "--bandwidth-gbs",
        type=float,
        help="the card's memory bandwidth in GB/s: required for ai200 (unpublished), else "
        "replaces the AI 100 card's published one",
    )
    p.add_argument(
        "--qpc-config",
        help="compile profile (default: ai100_mxfp6_mxint8 on ai100, ai200_bf16 on ai200)",
    )
    p.add_argument(
        "--shapes",
        default=",".join(DEFAULT_SHAPES),
        help=f"published shapes, comma-separated: {', '.join(SHAPES)}",
    )
    p.add_argument(
        "--artifacts",
        help="project this export as it is (no scaling) instead of the published shapes",
    )
    p.add_argument("--context", type=int, help="KV slots a call reads (default: ctx_len)")
    p.add_argument("--tree-budgets", default="16,32,64", help="tree sizes N (rows of a call)")
    p.add_argument(
        "--tau",
        help="τ per mode, e.g. chain=8.88,32=10.83,64=11.5 (default: the built-in pair's, "
        "measured at T = 0: chain 9.29, 16 9.47, 32 10.30, 64 10.89)",
    )
    p.add_argument(
        "--tau-from",
        metavar="RESULTS_JSON",
        help="τ per budget from a `dflash-bench … --tree-budgets 0,16,32,64` results.json (the "
        "benchmarked draft at T = 0; budget 0 is the chain), or the chain's τ from a "
        "`dflash-bench ARTIFACTS --card-numerics` card_numerics.json (τ under the profile's "
        "MXFP6/MXINT8 numerics); --tau overrides single entries",
    )
    p.add_argument("--out", default="bench/projection", help="output directory")
    p.add_argument(
        "--work",
        default="artifacts/projection",
        help="where the reduced exports are made once and reused (default %(default)s)",
    )
    p.add_argument("--debug", action="store_true", help="tracebacks on errors")
    return p


def _budgets(text: str) -> tuple[int, ...]:
    try:
        out = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        out = ()
    if not out or out[0] < 2:
        raise ProjectionError(f"--tree-budgets: {text!r} is not a list of integers ≥ 2")
    return out


def _profile(args):
    """The compile profile (--qpc-config, else the card family's default), of that family."""
    from dflash_qaic.compiler.profiles import ProfileError, load_profile

    args.qpc_config = args.qpc_config or FAMILIES[args.card_family]
    try:
        profile = load_profile(args.qpc_config)
    except ProfileError as e:
        raise ProjectionError(str(e)) from e
    if profile.hw_version != args.card_family:
        raise ProjectionError(
            f"profile {profile.name} compiles for {profile.hw_version}, not {args.card_family}: "
            f"give --qpc-config {FAMILIES[args.card_family]} (or another {args.card_family} one)"
        )
    return profile


def run(args) -> int:
    card = card_of(args.card_family, args.card, args.bandwidth_gbs)
    profile = _profile(args)
    budgets = _budgets(args.tree_budgets)
    tau = {**DEFAULT_TAU, **tau_from(args.tau_from), **parse_tau(args.tau)}
    sources = tau_sources(args.tau_from, args.tau)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    if args.context is not None and args.context < 1:
        raise ProjectionError("--context must be ≥ 1 (KV slots a call reads)")

    progs: list[Programs] = []
    shape_names: list[str] = []
    if args.artifacts:
        progs.append(count_programs(Path(args.artifacts), budgets, context=args.context))
        shape_names.append("")
    else:
        names = [s.strip() for s in args.shapes.split(",") if s.strip()]
        unknown = [n for n in names if n not in SHAPES]
        if unknown or not names:
            raise ProjectionError(
                f"--shapes: unknown {unknown or names} (known: {', '.join(SHAPES)})"
            )
        for name in names:
            shape = SHAPES[name]
            arts = make_reduced_pair(shape, work)
            progs.append(count_programs(arts, budgets, context=args.context, shape=shape))
            shape_names.append(name)

    results = [project(p, profile, card, tau, budgets) for p in progs]
    specs = {
        r: {
            **recipe_specializations(r),
            "defaults": recipe_specializations(r, default_lengths=True),
        }
        for r in real_recipes()
    }
    compile_work = {}
    for p, name in zip(progs, shape_names):
        entry: dict[str, Any] = {"target_nodes": p.target_nodes, "draft_nodes": p.draft_nodes}
        if name in SHAPES and SHAPES[name].recipe in specs:
            sp = specs[SHAPES[name].recipe]
            entry.update(
                recipe=SHAPES[name].recipe,
                target_specializations=sp["target"],
                draft_specializations=sp["draft"],
                node_compilations=p.target_nodes * sp["target"] + p.draft_nodes * sp["draft"],
                node_compilations_with_default_lengths=p.target_nodes * sp["defaults"]["target"]
                + p.draft_nodes * sp["defaults"]["draft"],
            )
        entry["model"] = "estimate: compile work ∝ Σ specializations × graph nodes"
        compile_work[p.title] = entry
    header = (
        f"{args.card_family.upper().replace('AI', 'AI ')} PROJECTION (roofline, not "
        f"measured): {card.name}, profile {profile.name} "
        f"(weights {'MXFP6' if profile.mxfp6_matmul else _dtype(profile)}, KV "
        f"{profile.kv_dtype}, "
        f"target {profile.target.num_cores} + draft {profile.draft.num_cores} cores); "
        f"τ: "
        + ", ".join(f"{k} {v}" for k, v in tau.items())
        + f"\nτ chain from: {sources['chain']}"
    )
    text = summary(results, budgets, specs, header, compile_work)
    (out / "summary.txt").write_text(text)
    (out / "table.md").write_text(table(results, budgets))
    plot(results, out / "projection.png")
    data = results_json(results, budgets, tau, specs, compile_work, args, sources)
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    print(text, end="")
    print(f"wrote {out}/summary.txt, table.md, projection.png, results.json")
    return 0


def _dtype(profile) -> str:
    return "fp16" if profile.convert_to_fp16 else "bf16"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except ProjectionError as e:
        if args.debug:
            raise
        print(f"dflash-bench --project: error: {e}", file=sys.stderr)
        return 2
