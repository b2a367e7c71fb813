"""Program backends: one interface, the retained state kept where the program runs.

A `Program` runs one exported program (a role: target, draft) call after call. Callers pass
only the small per-call inputs (ids, positions, feature rows) and get only the small outputs
back; the retained buffers its state specs declare (state.py: caches, rings, recurrent states)
never cross to the host in a call. `read_slot(row, upto)` / `write_slot(row, SlotState)` copy
one cache row's state out and in (a sequence moving between rows; later a prefill/decode
hand-off or a prefix cache), outside the per-step loop:

- `OrtProgram`: ONNX Runtime. The caches are `OrtValue`s bound with IOBinding, each one bound
  as both its input and its `*_RetainedState` output, so the cache update writes only the new
  rows in place (see `inplace_cache_safe`); nothing crosses numpy and nothing per call is
  proportional to ctx_len but attention reading the cache. A slot read or write is a copy out
  of or into the arrays backing those OrtValues.
- `QaicProgram`: AI100 through a QAICInferenceSession-like session (QEfficient's, over qaicrt).
  Retained-state buffers are skipped (zero-size on the host, the cache stays on the card) and
  output buffers are pre-sized per specialization, which the card picks from the input shapes.
  A slot read or write is an *exchange*: one idle call (every row inactive) with the retained
  buffers not skipped, as QEfficient's disaggregated example hands a KV cache over: their
  `_RetainedState` outputs come back to the host (read), or the host sends the inputs (write);
  then they are skipped again.
- `StrictStandinSession`: a QAICInferenceSession stand-in that runs the ONNX in ONNX Runtime
  but refuses what the card would refuse: an input shape that is not a compiled
  specialization, a retained buffer that is neither skipped nor bound whole, an output buffer
  of the wrong size. It counts the exchanges (a generation makes none) and tests
  QaicProgram's buffer logic without a card.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from dflash_qaic import contract, state
from dflash_qaic.runtime.ort_rewrite import ort_session
from dflash_qaic.state import SlotState, StateSpec


class BackendError(RuntimeError):
    """A backend cannot be created or a call breaks its contract."""


@dataclass(frozen=True)
class Capabilities:
    """What a program declares: its role, the verify rules it runs (contract.VERIFY_RULES; a
    draft none), the inputs it takes and outputs it returns (the retained buffers apart) and its
    state specs."""

    role: str
    rules: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    state: tuple[StateSpec, ...]

    @classmethod
    def of(cls, role: str, io) -> Capabilities:
        """From a program's contract I/O (contract.TargetIO / DraftIO)."""
        kept = {b.name for b in state.buffers_of(io.state)}
        kept |= {contract.retained(n) for n in kept}
        rules = ()
        if isinstance(io, contract.TargetIO):
            rules = tuple(dict.fromkeys((contract.CHAIN, io.rule.effective(io.sampling).name)))
        return cls(
            role,
            rules,
            tuple(s.name for s in io.inputs if s.name not in kept),
            tuple(s.name for s in io.outputs if s.name not in kept),
            tuple(io.state),
        )


@runtime_checkable
class Program(Protocol):
    """One exported program on a backend (module docstring)."""

    capabilities: Capabilities | None

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One call: the small inputs by name in, the small outputs by name out."""
        ...

    def read_slot(self, row: int, upto: int) -> SlotState:
        """A copy of cache row `row`'s retained state: positional caches up to `upto`."""
        ...

    def write_slot(self, row: int, slot: SlotState) -> None:
        """`slot` into cache row `row` (shapes checked against the state specs)."""
        ...


def retained_names(inputs: list[dict], outputs: list[dict], specs) -> list[str]:
    """The retained inputs of a program (state.retained_inputs), or a BackendError."""
    try:
        return state.retained_inputs(
            [i["name"] for i in inputs], [o["name"] for o in outputs], specs
        )
    except ValueError as e:
        raise BackendError(str(e)) from e


def _slot_specs(program) -> list:
    if program.state is None:
        raise BackendError(
            "this program was created without its state specs (state.py): pass state=io.state "
            "to read or write a slot"
        )
    return program.state


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
    Routed experts run on ONNX Runtime's MoE kernel (ort_rewrite.py; the file is unchanged).
    """

    def __init__(
        self,
        onnx_path,
        inputs: list[dict],
        outputs: list[dict],
        symbols: dict,
        threads: int | None = None,
        inplace: bool | None = None,
        *,
        state: list[StateSpec] | None = None,
        capabilities: Capabilities | None = None,
    ):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads:
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
        # routed experts on ORT's MoE kernel (ort_rewrite.py); the arrays it adds stay alive here
        self.sess, self._borrowed = ort_session(onnx_path, so)
        self.state, self.capabilities = state, capabilities
        self.kv_names = retained_names(inputs, outputs, state)
        kept = {*self.kv_names, *map(contract.retained, self.kv_names)}
        self.inputs = [i for i in inputs if i["name"] not in kept]
        self.outputs = [o for o in outputs if o["name"] not in kept]
        self.out_names = [o["name"] for o in self.outputs]
        self.symbols = dict(symbols)
        safe = inplace_cache_safe(onnx_path, self.kv_names)
        if inplace and not safe:
            raise BackendError(f"{onnx_path}: a cache has readers besides its update, in place")
        self.inplace = safe if inplace is None else inplace
        shapes = {i["name"]: i["shape"] for i in inputs}
        # per buffer set, the arrays backing the OrtValues (the same memory: a slot read or
        # write is a copy out of or into them), in kv_names' order
        self._host = [
            [_touched_zeros(_bind(shapes[n], self.symbols)) for n in self.kv_names]
            for _ in range(1 if self.inplace else 2)
        ]
        self._kv = [[ort.OrtValue.ortvalue_from_numpy(a) for a in arrays] for arrays in self._host]
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

    def _arrays(self) -> dict[str, np.ndarray]:
        """The retained buffers the next call reads, by name (every row)."""
        return dict(zip(self.kv_names, self._host[self._cur]))

    def read_slot(self, row: int, upto: int) -> SlotState:
        arrays = state.read_rows(_slot_specs(self), self._arrays(), row, upto)
        return SlotState(upto, arrays, meta=_meta(self))

    def write_slot(self, row: int, slot: SlotState) -> None:
        state.write_rows(_slot_specs(self), self._arrays(), row, slot)


def _meta(program) -> dict:
    return {"role": program.capabilities.role} if program.capabilities else {}


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

    def __init__(
        self,
        session,
        inputs: list[dict],
        outputs: list[dict],
        specializations,
        *,
        state: list[StateSpec] | None = None,
        capabilities: Capabilities | None = None,
    ):
        self.session = session
        self.state, self.capabilities = state, capabilities
        self.kv_names = retained_names(inputs, outputs, state)
        self.retained_out = [contract.retained(n) for n in self.kv_names]
        session.skip_buffers(self.kv_names + self.retained_out)
        kept = {*self.kv_names, *self.retained_out}
        self.inputs = [i for i in inputs if i["name"] not in kept]
        self.outputs = [o for o in outputs if o["name"] not in kept]
        self._shapes = {i["name"]: i["shape"] for i in inputs}
        self._dtypes = {i["name"]: i["dtype"] for i in inputs}
        self._specs = [s["symbols"] for s in specializations]
        # Output buffers pre-sized per specialization, keyed by (batch_size, seq_len): the card
        # picks the specialization from the input shapes (sample_len changes no output).
        self._buffers = {}
        for sym in self._specs:
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

    def read_slot(self, row: int, upto: int) -> SlotState:
        arrays = state.read_rows(_slot_specs(self), self._exchange(), row, upto)
        return SlotState(upto, arrays, meta=_meta(self))

    def write_slot(self, row: int, slot: SlotState) -> None:
        full = self._exchange()
        state.write_rows(_slot_specs(self), full, row, slot)
        self._exchange(full)

    def _exchange(self, send: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """One idle call with the retained state crossing: every buffer comes back whole to the
        host (send None), or `send` (every buffer, whole) goes to the card; then they are
        skipped again. An idle call's rows are all inactive (batch_index and positions -1):
        its writes go to padding slots, which nothing reads (contract.py)."""
        sym = min(
            self._specs, key=lambda s: (s[contract.BATCH] * s[contract.SEQ], s.get(contract.CCL, 0))
        )
        feeds = idle_feeds(self.inputs, sym)
        back = {}
        if send is None:
            back = {
                contract.retained(n): np.zeros(_bind(self._shapes[n], sym), self._dtypes[n])
                for n in self.kv_names
            }
            self.session.set_buffers(back)
        self.run({**feeds, **(send or {})})
        self.session.skip_buffers(self.kv_names + self.retained_out)
        return {n: back[contract.retained(n)] for n in self.kv_names} if send is None else send


def idle_feeds(inputs: list[dict], symbols: dict) -> dict[str, np.ndarray]:
    """The inputs of a call that changes no state a query reads: every row inactive (batch_index
    and positions -1, contract.py), windows 0 … n − 1, greedy, every token allowed."""
    fill = {
        contract.BATCH_INDEX: contract.INACTIVE_ROW,
        contract.POSITION_IDS: contract.PAD_POSITION,
        contract.POSITION_IDS_TARGET: contract.PAD_POSITION,
        contract.TOP_P: 1,
        contract.TOKEN_BITMASK: -1,
    }
    out = {}
    for i in inputs:
        shape = _bind(i["shape"], symbols)
        if i["name"] == contract.COMP_CTX_LENGTHS:
            out[i["name"]] = np.arange(shape[0], dtype=np.int64)
        else:
            out[i["name"]] = np.full(shape, fill.get(i["name"], 0), np.dtype(i["dtype"]))
    return out


class StrictStandinSession:
    """QAICInferenceSession stand-in over ONNX Runtime that refuses what the card refuses."""

    def __init__(
        self, onnx_path, inputs: list[dict], outputs: list[dict], specializations, state=None
    ):
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
        self.exchanges = 0  # runs in which retained state crossed to or from the host
        self._skipped: set[str] = set()
        self._buffers: dict[str, np.ndarray] = {}
        self.kv_in = retained_names(inputs, outputs, state)
        self.kv_out = [contract.retained(n) for n in self.kv_in]
        self._retained = {*self.kv_in, *self.kv_out}
        sym0 = self._specs[0]
        self._full = {n: _bind((self._in | self._out)[n]["shape"], sym0) for n in self._retained}
        self._state = {n: np.zeros(self._full[n], np.float32) for n in self.kv_in}

    def skip_buffers(self, names):
        self._skipped.update(names)
        for n in names:
            self._buffers.pop(n, None)

    def set_buffers(self, buffers: dict[str, np.ndarray]):
        for name, arr in buffers.items():
            if name not in self._out and name not in self._in:
                raise BackendError(f"set_buffers: no binding named {name}")
            if name in self._retained:  # an exchange: the whole buffer or nothing
                if arr.shape != self._full[name] or arr.dtype != np.float32:
                    raise BackendError(
                        f"set_buffers: {name} is retained state: only the whole buffer "
                        f"float32{list(self._full[name])} crosses, got {arr.dtype}{list(arr.shape)}"
                    )
                self._skipped.discard(name)
            self._buffers[name] = arr

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sent = [n for n in inputs if n in self._retained]
        if sent and sorted(sent) != sorted(self.kv_in):
            raise BackendError(
                f"retained-state buffers {sent} sent from the host: a call takes none of them, "
                "or (an exchange) every one, whole"
            )
        self.set_buffers({n: inputs[n] for n in sent})
        loose = [n for n in self._retained if n not in self._skipped and n not in self._buffers]
        if loose:
            raise BackendError(f"retained-state buffers {loose} neither skipped nor bound")
        feeds = {n: a for n, a in inputs.items() if n not in self._retained}
        spec = self._spec(feeds)
        for name, o in self._out.items():
            if name in self._retained:
                continue
            buf = self._buffers.get(name)
            if buf is None or buf.shape != _bind(o["shape"], spec):
                raise BackendError(f"output buffer {name} is not sized for specialization {spec}")
        self.used.append(self._names[self._specs.index(spec)])
        crossing = [n for n in self._retained if n not in self._skipped]
        self.exchanges += bool(crossing)
        kv = {n: self._buffers[n] if n in crossing else self._state[n] for n in self.kv_in}
        # outputs requested by name: the graph's order is never relied on
        res = dict(zip(self.output_names, self.sess.run(self.output_names, {**feeds, **kv})))
        for n in self.kv_in:
            self._state[n] = res[contract.retained(n)]
        out = {}
        for name in self._out:
            if name in crossing or name not in self._retained:
                self._buffers[name][...] = res[name]
                out[name] = self._buffers[name]
        return out

    def _spec(self, feeds: dict[str, np.ndarray]) -> dict:
        """The compiled specialization the feeds' shapes select (BackendError: none)."""
        spec = next(
            (
                s
                for s in self._specs
                if all(tuple(feeds[n].shape) == _bind(self._in[n]["shape"], s) for n in feeds)
            ),
            None,
        )
        if spec is None or set(feeds) != {n for n in self._in if n not in self._retained}:
            shapes = {n: a.shape for n, a in feeds.items()}
            raise BackendError(f"input shapes {shapes} match no compiled specialization")
        return spec


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
