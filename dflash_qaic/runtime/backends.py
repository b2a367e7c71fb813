"""Program backends: one interface, the KV caches kept where the program runs.

A `Program` runs one exported program (target or draft) call after call. Callers pass only the
small per-call inputs (ids, positions, feature rows) and get only the small outputs back; the
`past_*` caches are retained state that never crosses to the host:

- `OrtProgram`: ONNX Runtime. The caches are `OrtValue`s bound with IOBinding, each one bound
  as both the `past_*` input and its `*_RetainedState` output, so the cache update writes only
  the new rows in place (see `inplace_cache_safe`); nothing crosses numpy and nothing per call
  is proportional to ctx_len but attention reading the cache.
- `QaicProgram`: AI100 through a QAICInferenceSession-like session (QEfficient's, over qaicrt).
  Retained-state buffers are skipped (zero-size on the host, the cache stays on the card) and
  output buffers are pre-sized per specialization, which the card picks from the input shapes.
- `StrictStandinSession`: a QAICInferenceSession stand-in that runs the ONNX in ONNX Runtime
  but refuses what the card would refuse: an input shape that is not a compiled
  specialization, a retained-state buffer sent from the host, an output buffer of the wrong
  size. It tests QaicProgram's buffer logic without a card.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_qaic import contract


class BackendError(RuntimeError):
    """A backend cannot be created or a call breaks its contract."""


def _is_kv(name: str) -> bool:
    return name.startswith("past_")


def inplace_cache_safe(onnx_path, kv_names: list[str]) -> bool:
    """Whether every `past_*` cache may be bound as both input and `*_RetainedState` output.

    It may when the only reader of each `past_X` is the cache update (`CtxScatter` or
    `CtxScatterCB`, whose ONNX bodies read the data only through `Shape` and `ScatterND`; or a
    bare `ScatterND`, as data)
    and that update's output is `past_X_RetainedState` itself. Then every reader of the cache
    inside the graph (attention) reads the updated cache, which is the same bytes whether the
    update copied the cache first or not; ONNX Runtime's ScatterND kernel skips its
    input-to-output copy when both are one buffer and writes the updated rows only, so the
    update costs O(rows), not O(ctx_len). ONNX Runtime's memory planner writes a node's graph
    output straight into the pre-bound output buffer, and its CPU optimizers do not fuse
    ScatterND, so the optimized graph keeps this shape (tests/test_runtime.py checks the
    optimized graph and that a whole generation equals the double-buffered one, token for
    token, with the same OrtValues bound throughout). Both exported programs have this shape;
    a graph that does not gets double buffering instead.
    """
    readers: dict[str, list] = {}
    nodes = graph_nodes(onnx_path)
    for node in nodes:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))
    producer = {out: node for node in nodes for out in node.output}
    for name in kv_names:
        uses = [(n, i) for n, i in readers.get(name, []) if n.op_type != "Shape"]
        update = [(n, i) for n, i in uses if list(n.output) == [contract.retained(name)]]
        if len(uses) == 2 and len(update) == 1:
            # a recurrent state (hybrid targets): its rows are read by a Gather that the update
            # depends on, so the read happens before the in-place write
            read = next(n for n, _ in uses if n is not update[0][0])
            if read.op_type != "Gather" or not _feeds(read, update[0][0], producer):
                return False
            uses = update
        if len(uses) != 1:
            return False
        node, i = uses[0]
        if node.op_type not in ("CtxScatter", "CtxScatterCB", "ScatterND") or i != 0:
            return False
        if list(node.output) != [contract.retained(name)]:
            return False
    return True


def _feeds(src, dst, producer: dict) -> bool:
    """Whether node `src`'s output reaches node `dst` (walking dst's inputs back)."""
    seen, todo = set(), list(dst.input)
    while todo:
        name = todo.pop()
        node = producer.get(name)
        if node is None or id(node) in seen:
            continue
        if node is src:
            return True
        seen.add(id(node))
        todo.extend(node.input)
    return False


@dataclass
class Node:
    op_type: str
    input: list[str]
    output: list[str]


def _fields(buf, lo: int, hi: int):
    """(field number, wire type, value) of the protobuf message in buf[lo:hi]; a
    length-delimited value is its (start, end) in buf, others are skipped (None)."""
    pos = lo
    while pos < hi:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            n, pos = _varint(buf, pos)
            yield field, wire, (pos, pos + n)
            pos += n
        elif wire == 0:
            _, pos = _varint(buf, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} at byte {pos}")
        if pos > hi:
            raise ValueError("truncated protobuf message")


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def graph_nodes(onnx_path) -> list[Node]:
    """The nodes (op_type, inputs, outputs) of an ONNX file's main graph, read straight from
    the protobuf wire format (ModelProto.graph = 7, GraphProto.node = 1; NodeProto input = 1,
    output = 2, op_type = 4), so that running exported programs needs no `onnx` package.
    Weights in the file are skipped over, not decoded; the file is memory-mapped."""
    import mmap

    with open(onnx_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        text = lambda span: bytes(buf[span[0] : span[1]]).decode("utf-8")
        nodes = []
        for field, wire, graph in _fields(buf, 0, len(buf)):
            if field != 7 or wire != 2:
                continue
            for gfield, gwire, span in _fields(buf, *graph):
                if gfield != 1 or gwire != 2:
                    continue
                node = Node("", [], [])
                for nfield, nwire, v in _fields(buf, *span):
                    if nwire != 2:
                        continue
                    if nfield == 1:
                        node.input.append(text(v))
                    elif nfield == 2:
                        node.output.append(text(v))
                    elif nfield == 4:
                        node.op_type = text(v)
                nodes.append(node)
        return nodes


class OrtProgram:
    """A program on ONNX Runtime's CPU provider, caches retained as bound `OrtValue`s.

    Per call only the small inputs are bound (they are the caller's arrays, not copies) and the
    small outputs land in buffers preallocated per input shape (returned as numpy views that the
    next call with the same shapes overwrites, as on the card). The caches are updated in place
    when `inplace_cache_safe` holds, else double buffered (a call reads one set, writes the
    other). `threads`: intra-op threads (None: ONNX Runtime's default); worker threads do not
    spin between calls, so an idle program costs no CPU and the host loop keeps its core.
    """

    def __init__(
        self,
        onnx_path,
        inputs: list[dict],
        outputs: list[dict],
        symbols: dict,
        threads: int | None = None,
        inplace: bool | None = None,
    ):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads:
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
        self.sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        self.kv_names = [i["name"] for i in inputs if _is_kv(i["name"])]
        self.inputs = [i for i in inputs if not _is_kv(i["name"])]
        self.outputs = [o for o in outputs if not o["name"].endswith(contract.RETAINED_SUFFIX)]
        self.out_names = [o["name"] for o in self.outputs]
        self.symbols = dict(symbols)
        safe = inplace_cache_safe(onnx_path, self.kv_names)
        if inplace and not safe:
            raise BackendError(f"{onnx_path}: a cache has readers besides its update, in place")
        self.inplace = safe if inplace is None else inplace
        kv_shapes = [_bind(i["shape"], self.symbols) for i in inputs if _is_kv(i["name"])]
        self._kv = [  # one OrtValue per cache, each of its own shape, in kv_names' order
            [ort.OrtValue.ortvalue_from_numpy(_touched_zeros(shape)) for shape in kv_shapes]
            for _ in range(1 if self.inplace else 2)
        ]
        self._cur = 0
        self._bindings: dict[tuple, tuple] = {}  # input shapes -> (IOBinding, output arrays)
        self.device_s = 0.0
        self.calls = 0

    def _binding(self, feeds: dict[str, np.ndarray]):
        """The IOBinding for these input shapes: caches (in place) and outputs bound once."""
        key = tuple(a.shape for a in feeds.values())
        hit = self._bindings.get(key)
        if hit is not None:
            return hit
        sym = dict(self.symbols)
        for spec in self.inputs:  # the symbols the feeds bind (seq_len, sample_len, …)
            for d, n in zip(spec["shape"], feeds[spec["name"]].shape):
                if isinstance(d, str):
                    sym[d] = n
        b = self.sess.io_binding()
        out = {}
        for o in self.outputs:
            arr = out[o["name"]] = np.zeros(_bind(o["shape"], sym), np.dtype(o["dtype"]))
            b.bind_output(o["name"], "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        if self.inplace:
            for name, value in zip(self.kv_names, self._kv[0]):
                b.bind_ortvalue_input(name, value)
                b.bind_ortvalue_output(contract.retained(name), value)
        self._bindings[key] = (b, out)
        return b, out

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        b, out = self._binding(feeds)
        for name, arr in feeds.items():
            b.bind_cpu_input(name, arr)
        if not self.inplace:  # double buffering: read `cur`, write the other set, swap
            cur, nxt = self._kv[self._cur], self._kv[1 - self._cur]
            for name, src, dst in zip(self.kv_names, cur, nxt):
                b.bind_ortvalue_input(name, src)
                b.bind_ortvalue_output(contract.retained(name), dst)
            self._cur = 1 - self._cur
        t = time.perf_counter()
        self.sess.run_with_iobinding(b)
        self.device_s += time.perf_counter() - t
        self.calls += 1
        return out

    @property
    def caches(self) -> list:
        """The cache OrtValues the next call reads (for tests and inspection)."""
        return self._kv[self._cur]


def _touched_zeros(shape) -> np.ndarray:
    """A zero cache whose pages are already mapped: np.zeros maps pages lazily, so the first
    call to write a cache would pay a page fault per 4 KiB of it (hundreds of ms at 0.6B scale)."""
    arr = np.empty(shape, np.float32)
    arr.fill(0.0)
    return arr


def _bind(shape, symbols: dict) -> tuple[int, ...]:
    """A contract shape (ints and symbol names) with its symbols bound."""
    return tuple(symbols[d] if isinstance(d, str) else d for d in shape)


class QaicProgram:
    """A program on a QAICInferenceSession-like `session` (QEfficient's API)."""

    def __init__(self, session, inputs: list[dict], outputs: list[dict], specializations):
        self.session = session
        retained = [o["name"] for o in outputs if o["name"].endswith(contract.RETAINED_SUFFIX)]
        session.skip_buffers([i["name"] for i in inputs if _is_kv(i["name"])] + retained)
        self.outputs = [o for o in outputs if o["name"] not in retained]
        # Output buffers pre-sized per specialization, keyed by (batch_size, seq_len): the card
        # picks the specialization from the input shapes (sample_len changes no output).
        self._buffers = {}
        for spec in specializations:
            sym = spec["symbols"]
            self._buffers[sym[contract.BATCH], sym[contract.SEQ]] = {
                o["name"]: np.zeros(_bind(o["shape"], sym), np.dtype(o["dtype"]))
                for o in self.outputs
            }
        self._active = None
        self.device_s = 0.0
        self.calls = 0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # The target's rows pick its specialization; the draft's context chunk picks its.
        key = feeds.get(contract.TARGET_HIDDEN, feeds[contract.INPUT_IDS]).shape[:2]
        if key not in self._buffers:
            raise BackendError(f"no compiled specialization has (batch_size, seq_len) {key}")
        if self._active != key:
            self.session.set_buffers(self._buffers[key])
            self._active = key
        t = time.perf_counter()
        out = self.session.run(feeds)
        self.device_s += time.perf_counter() - t
        self.calls += 1
        return {o["name"]: out[o["name"]] for o in self.outputs}


class StrictStandinSession:
    """QAICInferenceSession stand-in over ONNX Runtime that refuses what the card refuses."""

    def __init__(self, onnx_path, inputs: list[dict], outputs: list[dict], specializations):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        self.input_names = [i["name"] for i in inputs]
        self.output_names = [o["name"] for o in outputs]
        self._in = {i["name"]: i for i in inputs}
        self._out = {o["name"]: o for o in outputs}
        self._specs = [s["symbols"] for s in specializations]
        self._names = [s["name"] for s in specializations]
        self.used: list[str] = []  # the specialization of every run, in order
        self._skipped: set[str] = set()
        self._buffers: dict[str, np.ndarray] = {}
        sym0 = self._specs[0]
        self._state = {
            n: np.zeros(_bind(i["shape"], sym0), np.float32)
            for n, i in self._in.items()
            if _is_kv(n)
        }

    def skip_buffers(self, names):
        self._skipped.update(names)

    def set_buffers(self, buffers: dict[str, np.ndarray]):
        for name, arr in buffers.items():
            if name not in self._out and name not in self._in:
                raise BackendError(f"set_buffers: no binding named {name}")
            if name.endswith(contract.RETAINED_SUFFIX) or _is_kv(name):
                raise BackendError(f"set_buffers: {name} is retained state, it stays on device")
            self._buffers[name] = arr

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        kv_in = [n for n in self._in if _is_kv(n)]
        kv_out = [n for n in self._out if n.endswith(contract.RETAINED_SUFFIX)]
        if not set(kv_in + kv_out) <= self._skipped:
            raise BackendError("retained-state buffers were not skipped before run()")
        for n in inputs:
            if _is_kv(n):
                raise BackendError(f"retained-state buffer {n} sent from the host")
        spec = next(
            (
                s
                for s in self._specs
                if all(tuple(inputs[n].shape) == _bind(self._in[n]["shape"], s) for n in inputs)
            ),
            None,
        )
        if spec is None or set(inputs) != {n for n in self._in if not _is_kv(n)}:
            shapes = {n: a.shape for n, a in inputs.items()}
            raise BackendError(f"input shapes {shapes} match no compiled specialization")
        for name, o in self._out.items():
            if name in kv_out:
                continue
            buf = self._buffers.get(name)
            if buf is None or buf.shape != _bind(o["shape"], spec):
                raise BackendError(f"output buffer {name} is not sized for specialization {spec}")
        self.used.append(self._names[self._specs.index(spec)])
        # outputs requested by name: the graph's order is never relied on
        res = dict(
            zip(self.output_names, self.sess.run(self.output_names, {**inputs, **self._state}))
        )
        for n in kv_in:
            self._state[n] = res[contract.retained(n)]
        out = {}
        for name in self._out:
            if name not in kv_out:
                self._buffers[name][...] = res[name]
                out[name] = self._buffers[name]
        return out


QAICRT_PATHS = (f"/opt/qti-aic/dev/lib/{platform.machine()}", "/opt/qti-aic/dev/python")


def qaic_session_factory():
    """QEfficient's QAICInferenceSession (over qaicrt), or a clear error naming what is missing."""
    try:
        from QEfficient.generation.cloud_infer import QAICInferenceSession  # noqa: F401
    except Exception as e:  # ImportError, or qaicrt missing inside QEfficient
        found = [p for p in QAICRT_PATHS if Path(p).is_dir()]
        raise BackendError(
            "the 'qaic' backend needs the AI100 runtime: QEfficient's QAICInferenceSession over "
            f"qaicrt (looked for the Python module QEfficient and qaicrt in {list(QAICRT_PATHS)}; "
            f"found: {found or 'nothing'}; import error: {e}). Install the AI100 Platform and "
            "Apps SDKs and QEfficient on the AI100 host, or use backend='ort'"
        ) from e
    return QAICInferenceSession


def qaic_available() -> bool:
    try:
        qaic_session_factory()
        return True
    except BackendError:
        return False
