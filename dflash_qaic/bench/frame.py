"""The frame the decode and the continuous-batching benchmarks share (bench/cli.py, bench/batch.py):
the checks of their common flags, a list flag's parsing, and `bench` (load, run a body, write the
report, print its screen)."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_common(args, counts: tuple[str, ...]) -> None:
    """The flags both benchmarks share: counts ≥ 1, --warmup, --threads, --top-k / --top-p,
    --out (created or refused)."""
    from dflash_qaic.bench.run import BenchError
    from dflash_qaic.runtime.pipeline import GenerationError, Sampling

    if importlib.util.find_spec("scipy") is None:
        raise BenchError("dflash-bench needs scipy: pip install 'dflash-qaic[bench]'")
    for name in counts:
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be ≥ 1")
    if args.warmup < 0:
        raise BenchError("--warmup must be ≥ 0")
    cpus = len(os.sched_getaffinity(0))
    args.ort_threads = args.threads  # None: dflash_qaic.load's default
    args.threads = cpus if args.threads is None else args.threads
    if not 1 <= args.threads <= 4 * cpus:
        raise BenchError(f"--threads must be 1 … {4 * cpus} (this machine has {cpus} CPUs)")
    try:
        Sampling.checked(1.0, args.top_k, args.top_p, args.seed)
    except GenerationError as e:
        raise BenchError(str(e).replace("top_", "--top-")) from e
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} is a file: give a directory (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"cannot create --out {out}: {e.strerror or e}") from e
    if not os.access(out, os.W_OK):
        raise BenchError(f"--out {out} is not writable: give another directory")


def parse_list(flag: str, text: str | None, kind=float) -> list:
    """'0,1' -> [0.0, 1.0]: distinct finite numbers, ≥ 0 (integers: ≥ 1), in the order given."""
    from dflash_qaic.bench.run import BenchError

    out: list = []
    for part in filter(str.strip, (text or "").split(",")):
        try:
            v = kind(part)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise BenchError(f"{flag}: {part.strip()!r} is not {what}") from None
        if not math.isfinite(v) or v < (kind is int) or v in out:
            raise BenchError(f"{flag}: {v} must be finite, ≥ {kind is int:d}, not repeated")
        out.append(v)
    if not out:
        raise BenchError(f"{flag}: give at least one, e.g. 1,2")
    return out


def bench(args, command: str, out, body) -> int:
    """The frame of both benchmarks: load, `body(pipe, facts) -> (results' measured parts,
    config notes)`, write `out`'s report (batch_report or report), print its screen; exit 1 when
    `out.problems` finds tokens that differ."""
    import dflash_qaic
    from dflash_qaic.bench import run
    from dflash_qaic.runtime.options import engine_values

    t0, started = time.perf_counter(), datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = run.machine(args.threads)
    from dflash_qaic.logs import show

    show(stream="stderr")
    pipe = dflash_qaic.load(
        args.artifacts, backend=args.backend, threads=args.ort_threads, check_files=args.check_files
    )
    machine["ort_threads"] = pipe.threads  # None: ONNX Runtime's default
    # the step policy of every DFlash run; prefix caching off unless asked (bench/cli.py)
    pipe.configure(**engine_values(args))
    _log(
        f"dflash-bench: loaded {args.artifacts} on {args.backend} ({pipe.threads or 'default'} threads)"
    )
    f = run.facts(pipe, args.artifacts)
    parts, notes = body(pipe, f)
    config = {k: v for k, v in vars(args).items() if k not in ("artifacts", "debug")}
    res = {
        "schema": out.SCHEMA,
        "command": command,
        "started": started,
        "seconds": time.perf_counter() - t0,
        "artifacts": {**f, "backend": pipe.backend},
        "config": {**config, **notes},
        "machine": {**machine, "load_end": [round(x, 2) for x in os.getloadavg()]},
        **parts,
    }
    paths = out.write_outputs(res, Path(args.out))
    print(out.summary_screen(res))
    _log(f"wrote {', '.join(map(str, paths.values()))} ({res['seconds']:.0f} s)")
    if problems := out.problems(res):
        _log(f"dflash-bench: TOKENS DIFFER: {'; '.join(problems[:3])}")
        return 1
    return 0
