"""Where a target decode call's time goes, layer by layer (ONNX Runtime's profiler), beside the
time to stream the program's weights once at this machine's read bandwidth.

    python -m dflash_lab.layer_cost ARTIFACTS --positions 1000,15000 [--repeats 5]

For each position p: a decode call at p (the attention window holding p, as the runtime picks
it; caches zero, which costs what any values cost), profiled `--repeats` times; the median of
each node's time, summed per decoder layer (`/layers.i/…` nodes) and over the rest (head,
embedding, rope tables); per layer its weights' bytes and its time over their stream time. The layer kinds come from the artifacts' config.json `layer_types`.
Then the weights' bytes (bench.run.weight_bytes: every initializer but Gather-only tables) and
the seconds numpy takes to sum a buffer of that size (single thread, median of 3 after one
touch; above 4 GiB a 4 GiB buffer, the time scaled): the time to stream them once. The routed
experts a decode call reads (the stacked `*.gate_up` / `*.down` tensors, which bench.run leaves
out as gathered tables) are counted at min(rows · k, E) of their E experts.

The session is the runtime's (runtime/ort_rewrite.py: routed experts on ONNX Runtime's MoE
kernel); `--plain` profiles the exported graph as written (the experts gathered, then multiplied).

The caches are bound as the runtime binds them (runtime/backends.py, OrtProgram): one OrtValue
per cache, both its input and its `_RetainedState` output, so the update writes its new rows in
place and no cache leaves the session (feeding them as numpy arrays instead would time a copy
of every cache per call that the runtime never makes). The accounting of the last line: the
bytes a decode call must read, the weights plus the cache slots its attention reads (a ring
whole, a ctx_len cache its window's slots, of the call's row), streamed at the measured rate;
`--top N` lists the N costliest nodes of each position.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def stream_seconds(nbytes: int, reps: int = 3, cap: int = 4 << 30) -> float:
    """Median seconds numpy takes to read `nbytes` once (a sum over an fp32 buffer); above `cap`
    bytes a buffer of `cap` is read and the time scaled (memory beside a large program)."""
    n = min(nbytes, cap)
    buf = np.ones(n // 4, np.float32)
    buf.sum()  # touch every page first
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * nbytes / n


def layer_kinds(artifacts: Path) -> list[str]:
    cfg = json.loads((artifacts / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return list(text.get("layer_types") or [])


def layer_bytes(onnx_path, rows: int, top_k: int) -> dict[str, int]:
    """Bytes a decode call of `rows` rows reads per decoder layer (`layers.i.*` initializers),
    and "routed": the routed experts of all layers. A stacked expert tensor [E, …]
    (`*.gate_up`, `*.down`) counts min(rows · top_k, E) of its E experts."""
    import math

    import onnx

    g = onnx.load(str(onnx_path), load_external_data=False).graph
    out: dict[str, int] = collections.Counter()
    for t in g.initializer:
        size = math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        if t.name.endswith((".gate_up", ".down")) and len(t.dims) == 3:
            size = size * min(rows * top_k, t.dims[0]) // t.dims[0]
            out["routed"] += size
        if t.name.startswith("layers."):
            out[".".join(t.name.split(".")[:2])] += size
    return out


def profile_decode(
    artifacts: Path, position: int, repeats: int, threads: int | None, plain: bool = False
):
    """(median wall seconds of the call, {group: median seconds}) for a decode call at p."""
    import onnxruntime as ort

    from dflash_qaic import contract
    from dflash_qaic.artifacts.manifest import read_manifest
    from dflash_qaic.bench.longctx import _feeds

    m = read_manifest(artifacts, check_files="none")
    io = m.target.io
    rows = m.full_batch_size or m.batch_size
    pos = np.full((rows, 1), contract.PAD_POSITION, np.int64)
    pos[0, 0] = position
    windows = list(m.comp_ctx_lengths or [m.ctx_len])
    window = np.arange(contract.window_for(windows, position + 1))
    sym = {contract.BATCH: rows, contract.SEQ: 1, contract.SAMPLE: 1, contract.CCL: len(window)}
    sym[contract.CTX] = m.ctx_len
    feeds = _feeds(io, sym, pos, window if m.comp_ctx_lengths else None, m.hidden_size)
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "decode")
    if threads:
        so.intra_op_num_threads = threads
    from dflash_qaic.runtime.ort_rewrite import ort_session

    sess, _kept = ort_session(artifacts / m.target.onnx, so, moe=not plain)
    binding = bind_inplace(sess, feeds, [(kv.name, kv.bind(**sym)) for kv in io.kv])
    walls = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        sess.run_with_iobinding(binding)
        walls.append(time.perf_counter() - t)
    profile = Path(sess.end_profiling())
    per_node = node_times(json.loads(profile.read_text()), repeats + 1)
    profile.unlink()  # the profiler's file, in a directory of its own
    profile.parent.rmdir()
    nodes = {n: statistics.median(v[1:]) for n, v in per_node.items()}
    groups: dict[str, float] = collections.defaultdict(float)
    for node, sec in nodes.items():
        part = node.split("/")[1] if node.count("/") > 1 else "rest"
        groups[part if part.startswith("layers.") else "rest"] += sec
    reads = cache_read_bytes(io.kv, sym, len(window))
    return statistics.median(walls[1:]), dict(groups), m, nodes, reads


def bind_inplace(sess, feeds: dict, caches: list[tuple[str, tuple]]):
    """An IOBinding as the runtime's (module docstring): each cache (zeros, which cost what any
    values cost) one OrtValue bound as its input and its retained output; the small inputs
    bound as given, the other outputs left to ONNX Runtime."""
    import onnxruntime as ort

    from dflash_qaic import contract

    b = sess.io_binding()
    for name, value in feeds.items():
        b.bind_cpu_input(name, value)
    retained = set()
    for name, shape in caches:
        value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
        b.bind_ortvalue_input(name, value)
        b.bind_ortvalue_output(contract.retained(name), value)
        retained.add(contract.retained(name))
    for o in sess.get_outputs():
        if o.name not in retained:
            b.bind_output(o.name)
    return b


def node_times(events: list, runs: int) -> dict[str, list[float]]:
    """{node: [seconds in run 0, 1, …]} from ONNX Runtime's profile events."""
    per_node: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * runs)
    run = -1
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            run += 1
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        node = e["name"][: -len("_kernel_time")]
        per_node[f"{node} ({e['args'].get('op_name', '')})"][max(run, 0)] += e["dur"] / 1e6
    return per_node


def cache_read_bytes(kv_specs, sym: dict, window: int) -> int:
    """The cache bytes a one-row decode call's attention reads: of each cache [rows, kv_heads,
    slots, hd], one row's kv_heads · S · hd values, S the ring's slots or the window's."""
    from dflash_qaic import contract

    total = 0
    for spec in kv_specs:
        shape = spec.bind(**sym)
        slots = window if spec.shape[2] == contract.CTX else shape[2]
        total += int(np.prod(shape[1:])) // shape[2] * slots * np.dtype(spec.dtype).itemsize
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifacts")
    p.add_argument("--positions", default="1000", help="comma-separated decode positions")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--top", type=int, default=0, help="list the N costliest nodes per position")
    p.add_argument("--plain", action="store_true", help="the exported graph, not rewritten")
    a = p.parse_args(argv)
    art = Path(a.artifacts)
    kinds = layer_kinds(art)
    from dflash_qaic.bench.run import weight_bytes

    cfg = json.loads((art / "config.json").read_text())
    k = int(cfg.get("text_config", cfg).get("num_experts_per_tok") or 0)
    for position in [int(x) for x in a.positions.split(",")]:
        wall, groups, m, nodes, reads = profile_decode(art, position, a.repeats, a.threads, a.plain)
        onnx_path = art / m.target.onnx
        per = layer_bytes(onnx_path, m.full_batch_size or m.batch_size, k)
        nbytes = weight_bytes(onnx_path) + per["routed"]
        s = stream_seconds(nbytes)
        print(f"decode at {position} (ctx {m.ctx_len}): {1e3 * wall:.1f} ms (median wall)")
        for g in sorted(groups, key=lambda g: (g == "rest", g)):
            i = int(g.split(".")[1]) if g.startswith("layers.") else None
            kind = kinds[i] if i is not None and i < len(kinds) else ""
            ratio = (
                f"{per[g] / 1e9:6.3f} GB  {groups[g] / (s * per[g] / nbytes):5.2f}×"
                if per[g]
                else ""
            )
            print(f"  {g:10s} {kind:18s} {1e3 * groups[g]:8.2f} ms  {ratio}")
        for node in sorted(nodes, key=nodes.get, reverse=True)[: a.top]:
            print(f"    {1e3 * nodes[node]:8.2f} ms  {node}")
    print(f"routed experts read per call: {per['routed'] / 1e9:.3f} GB (counted in the weights)")
    report_stream(nbytes, reads, wall)
    return 0


def report_stream(weights: int, reads: int, wall: float) -> None:
    """The last position's call against streaming its weights, and its weights plus the cache
    bytes its attention reads (module docstring), once at this machine's read rate."""
    s = stream_seconds(weights)
    rate = weights / s
    print(
        f"weights {weights / 1e9:.3f} GB; streamed once in {1e3 * s:.1f} ms ({rate / 1e9:.1f} GB/s)"
    )
    print(
        f"cache read {reads / 1e9:.3f} GB; weights + cache at that rate {1e3 * (weights + reads) / rate:.1f} ms"
    )
    print(
        f"decode / stream = {wall / s:.2f}× (weights), {wall * rate / (weights + reads):.2f}× (weights + cache read; last position)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
