"""Where a target decode call's time goes, layer by layer (ONNX Runtime's profiler), beside the
time to stream the program's weights once at this machine's read bandwidth.

    python -m dflash_lab.layer_cost ARTIFACTS --positions 1000,15000 [--repeats 5]

For each position p: a decode call at p (the attention window holding p, as the runtime picks
it; caches zero, which costs what any values cost), profiled `--repeats` times; the median of
each node's time, summed per decoder layer (`/layers.i/…` nodes) and over the rest (head,
embedding, rope tables). The layer kinds come from the artifacts' config.json `layer_types`.
Then the weights' bytes (bench.run.weight_bytes: every initializer but Gather-only tables) and
the seconds numpy takes to sum a buffer of that size (single thread, median of 3 after one
touch): the time to stream them once.
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


def stream_seconds(nbytes: int, reps: int = 3) -> float:
    """Median seconds numpy takes to read `nbytes` once (a sum over an fp32 buffer)."""
    buf = np.ones(nbytes // 4, np.float32)
    buf.sum()  # touch every page first
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def layer_kinds(artifacts: Path) -> list[str]:
    cfg = json.loads((artifacts / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return list(text.get("layer_types") or [])


def profile_decode(artifacts: Path, position: int, repeats: int, threads: int | None):
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
    for kv in io.kv:
        feeds[kv.name] = np.zeros(kv.bind(**sym), np.float32)
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "decode")
    if threads:
        so.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(artifacts / m.target.onnx), so, ["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    walls = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        sess.run(names, feeds)
        walls.append(time.perf_counter() - t)
    events = json.loads(Path(sess.end_profiling()).read_text())
    per_run: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * (repeats + 1))
    run = -1
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            run += 1
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        node = e["name"][: -len("_kernel_time")]
        part = node.split("/")[1] if node.count("/") > 1 else "rest"
        group = part if part.startswith("layers.") else "rest"
        per_run[group][max(run, 0)] += e["dur"] / 1e6
    groups = {g: statistics.median(v[1:]) for g, v in per_run.items()}
    return statistics.median(walls[1:]), groups, m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifacts")
    p.add_argument("--positions", default="1000", help="comma-separated decode positions")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    art = Path(a.artifacts)
    kinds = layer_kinds(art)
    from dflash_qaic.bench.run import weight_bytes

    for position in [int(x) for x in a.positions.split(",")]:
        wall, groups, m = profile_decode(art, position, a.repeats, a.threads)
        print(f"decode at {position} (ctx {m.ctx_len}): {1e3 * wall:.1f} ms (median wall)")
        for g in sorted(groups, key=lambda g: (g == "rest", g)):
            i = int(g.split(".")[1]) if g.startswith("layers.") else None
            kind = kinds[i] if i is not None and i < len(kinds) else ""
            print(f"  {g:10s} {kind:18s} {1e3 * groups[g]:8.2f} ms")
    nbytes = weight_bytes(art / m.target.onnx)
    s = stream_seconds(nbytes)
    print(
        f"weights {nbytes / 1e9:.3f} GB; streamed once in {1e3 * s:.1f} ms ({nbytes / s / 1e9:.1f} GB/s)"
    )
    print(f"decode / stream = {wall / s:.2f}× (last position)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
