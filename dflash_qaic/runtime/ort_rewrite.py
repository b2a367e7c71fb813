"""A session-time rewrite for ONNX Runtime only: routed experts through ORT's `com.microsoft.MoE`.

The exported program stays standard ONNX (the AI100 path compiles it unchanged). Its routed
experts (modeling/moe.py) gather the union's weights and then multiply; on ONNX Runtime's CPU
provider a `Gather` of weights is a copy, so each routed weight byte is read, written and read
again (docs/DESIGN.md, Mixture of experts). ORT's contrib MoE kernel multiplies the chosen
experts' weights where they lie. This module finds each union-gather expert block of a program
and replaces it, in an in-memory copy of the graph, by

    S = ReduceSum(weight, axis 1)                   [T, 1]   the token's routing mass
    y = MoE(x, Log(weight), fc1, down; k) · S       [T, H]

weight [T, E] is the graph's own routing weight (0 where a token did not choose the expert), so
softmax(log weight) over the k chosen is weight / S, exactly the token's chosen experts. fc1 is
gate_up with its gate and up rows interleaved (the layout the CPU kernel reads), built once here;
down is the program's own initializer. A graph with no such block comes back as None (the
session opens the file as before); gpt-oss's experts (biases, clamped activation) do not match.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
# the CPU MoE kernel with interleaved SwiGLU: checked on 1.32, the version this project runs
MIN_ORT = (1, 32)
log = logging.getLogger(__name__)


@dataclass
class Rewritten:
    """The rewritten model's bytes and the initializers to add (name -> array, kept alive)."""

    model: bytes
    folder: str
    initializers: dict[str, np.ndarray]
    blocks: int


class _Graph:
    def __init__(self, g):
        self.g = g
        self.inits = {t.name: t for t in g.initializer}
        self.prod = {o: n for n in g.node for o in n.output}
        self.cons: dict[str, list] = {}
        for n in g.node:
            for i in n.input:
                self.cons.setdefault(i, []).append(n)

    def users(self, name: str, op: str) -> list:
        return [n for n in self.cons.get(name, []) if n.op_type == op]

    def const_int(self, name: str) -> int | None:
        from onnx import numpy_helper

        if name in self.inits:
            return int(numpy_helper.to_array(self.inits[name]).reshape(-1)[0])
        n = self.prod.get(name)
        if n is not None and n.op_type == "Constant":
            return int(numpy_helper.to_array(n.attribute[0].t).reshape(-1)[0])
        return None


def _axis(node) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _route_k(G: _Graph, weight: str) -> int | None:
    """k of the routing TopK nearest upstream of the routing weight (breadth first)."""
    seen, todo = set(), deque([weight])
    while todo:
        n = G.prod.get(todo.popleft())
        if n is None or n.name in seen:
            continue
        seen.add(n.name)
        if n.op_type == "TopK":
            return G.const_int(n.input[1])
        todo.extend(n.input)
    return None


def _silu_gate(G: _Graph, slices: list) -> bool:
    """The slice starting at 0 (the gate rows) goes through silu, g · sigmoid(g), as the
    families' SparseMoeBlock writes it (not Gemma 4's gelu-tanh experts)."""
    gate = [s for s in slices if G.const_int(s.input[1]) == 0]
    if len(gate) != 1:
        return False
    g = gate[0].output[0]
    for sig in G.users(g, "Sigmoid"):
        if any(g in n.input for n in G.users(sig.output[0], "Mul")):
            return True
    return False


def _match(G: _Graph, gather_gu) -> dict | None:
    """The pieces of one union-gather expert block, or None if any is not as exported."""
    gu, union = gather_gu.input
    mm1 = G.users(gather_gu.output[0], "MatMul")
    slices = G.cons.get(mm1[0].output[0], []) if len(mm1) == 1 else []
    if len(slices) != 2 or any(s.op_type != "Slice" for s in slices) or not _silu_gate(G, slices):
        return None  # an added bias (gpt-oss) or another activation (Gemma 4): not this block
    tr = G.prod.get(mm1[0].input[1])
    by_axis = {}
    for n in G.users(union, "Gather"):
        by_axis.setdefault(_axis(n), []).append(n)
    downs = [n for n in by_axis.get(0, []) if n is not gather_gu and n.input[0] in G.inits]
    routes = [n for n in by_axis.get(1, []) if G.prod.get(n.input[0]) is not None]
    weights = [n.input[0] for n in routes if G.prod[n.input[0]].op_type == "ReduceSum"]
    if tr is None or tr.op_type != "Transpose" or len(downs) != 1 or len(weights) != 1:
        return None
    mm2 = G.users(downs[0].output[0], "MatMul")
    red = G.users(mm2[0].output[0], "ReduceSum") if len(mm2) == 1 else []
    out = G.users(red[0].output[0], "Transpose") if len(red) == 1 else []
    k = _route_k(G, weights[0])
    if len(out) != 1 or not k:
        return None
    return dict(x=tr.input[0], weight=weights[0], gu=gu, down=downs[0].input[0], out=out[0], k=k)


def _interleaved(tensor, folder: Path) -> np.ndarray:
    """gate_up [E, 2I, H] (gate rows, then up rows) -> [E, 2I, H] rows g0, u0, g1, u1, …"""
    from onnx import numpy_helper

    w = numpy_helper.to_array(tensor, base_dir=str(folder))
    E, two_i, H = w.shape
    return np.ascontiguousarray(w.reshape(E, 2, two_i // 2, H).transpose(0, 2, 1, 3)).reshape(
        E, two_i, H
    )


def _placeholder(tensor, name: str):
    """An initializer of `tensor`'s type and shape under `name`, its bytes `tensor`'s own
    (external data or raw), replaced at session time by the interleaved array."""
    from onnx import TensorProto

    t = TensorProto()
    t.CopyFrom(tensor)
    t.name = name
    return t


def _drop_dead(g, keep: set[str]) -> None:
    """Remove nodes none of whose outputs is read (iteratively) or a graph output."""
    while True:
        used = {i for n in g.node for i in n.input} | keep
        dead = [n for n in g.node if not any(o in used for o in n.output)]
        if not dead:
            return
        alive = [n for n in g.node if any(o in used for o in n.output)]
        del g.node[:]
        g.node.extend(alive)


def _replace(g, m: dict, i: int, fc1_name: str) -> None:
    """Nodes computing the MoE output into the old block's output name."""
    from onnx import helper

    p = f"{m['out'].name.rsplit('/', 1)[0]}/moe_rewrite_{i}/"  # the block's scope kept
    y = m["out"].output[0]
    g.node.remove(m["out"])
    g.node.extend(
        [
            helper.make_node(
                "ReduceSum", [m["weight"], p + "ax1"], [p + "S"], p + "ReduceSum", keepdims=1
            ),
            helper.make_node("Log", [m["weight"]], [p + "L"], p + "Log"),
            helper.make_node(
                "MoE",
                [m["x"], p + "L", fc1_name, "", m["down"]],
                [p + "y"],
                p + "MoE",
                domain="com.microsoft",
                k=m["k"],
                activation_type="swiglu",
                swiglu_fusion=1,
                activation_alpha=1.0,
                activation_beta=0.0,
                swiglu_limit=float("inf"),
                normalize_routing_weights=0,
            ),
            helper.make_node("Mul", [p + "y", p + "S"], [y], p + "Mul"),
        ]
    )
    g.initializer.append(helper.make_tensor(p + "ax1", 7, [1], [1]))


def rewrite_moe(onnx_path) -> Rewritten | None:
    """The program at `onnx_path` with its union-gather expert blocks on ORT's MoE kernel, or
    None when it has none."""
    try:
        import onnx
        from onnx import helper
    except ImportError:  # a runtime-only install (the vLLM environment, a wheel without extras)
        log.warning(
            "%s: the `onnx` package is not installed: routed experts run as exported (gathered, "
            "then multiplied: slower on ONNX Runtime); `pip install onnx` for the rewrite",
            onnx_path,
        )
        return None

    path = Path(onnx_path)
    model = onnx.load(str(path), load_external_data=False)
    G = _Graph(model.graph)
    gathers = [
        n
        for n in model.graph.node
        if n.op_type == "Gather" and _axis(n) == 0 and n.input[0] in G.inits
    ]
    matches = [m for m in (_match(G, n) for n in gathers) if m is not None]
    if not matches:
        return None
    added: dict[str, np.ndarray] = {}
    for i, m in enumerate(matches):
        name = f"{m['gu']}.interleaved"
        added[name] = _interleaved(G.inits[m["gu"]], path.parent)
        model.graph.initializer.append(_placeholder(G.inits[m["gu"]], name))
        _replace(model.graph, m, i, name)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _drop_dead(model.graph, {o.name for o in model.graph.output})
    read = {i for n in model.graph.node for i in n.input}
    kept = [t for t in model.graph.initializer if t.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return Rewritten(model.SerializeToString(), str(path.parent), added, len(matches))


def _multiplies_gathered(onnx_path) -> bool:
    """Whether some MatMul multiplies a Gather's output and is sliced in two (gate and up: the
    union-gather expert block's start, `_match`): read from the wire format
    (runtime/backends.graph_nodes), so that a program without routed experts never loads
    `onnx`, which running exported programs does not need."""
    from dflash_qaic.runtime.backends import graph_nodes

    nodes = graph_nodes(onnx_path)
    gathered = {o for n in nodes if n.op_type == "Gather" for o in n.output}
    sliced: dict[str, int] = {}
    for n in nodes:
        if n.op_type == "Slice":
            sliced[n.input[0]] = sliced.get(n.input[0], 0) + 1
    return any(
        n.op_type == "MatMul" and gathered.intersection(n.input) and sliced.get(n.output[0]) == 2
        for n in nodes
    )


def ort_session(onnx_path, so, moe: bool = True):
    """An ONNX Runtime CPU session of `onnx_path`, its routed experts rewritten when `moe` and
    the program has them; returns (session, arrays the session borrows: keep them alive)."""
    import onnxruntime as ort

    rw = rewrite_moe(onnx_path) if moe and _multiplies_gathered(onnx_path) else None
    version = tuple(int(p) for p in ort.__version__.split(".")[:2] if p.isdigit())
    if rw is not None and version < MIN_ORT:
        log.warning(
            "%s: ONNX Runtime %s predates the CPU MoE kernel this rewrite was checked on "
            "(%d.%d): its routed experts run as exported (gathered, then multiplied: slower); "
            "install onnxruntime>=%d.%d for the rewrite",
            onnx_path, ort.__version__, *MIN_ORT, *MIN_ORT,
        )  # fmt: skip
        rw = None
    if rw is None:
        return ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"]), {}
    so.add_session_config_entry(EXTERNAL_FOLDER, rw.folder)
    kept = {}
    for name, arr in rw.initializers.items():
        kept[name] = (arr, ort.OrtValue.ortvalue_from_numpy(arr))
        so.add_initializer(name, kept[name][1])
    sess = ort.InferenceSession(rw.model, so, providers=["CPUExecutionProvider"])
    return sess, kept
