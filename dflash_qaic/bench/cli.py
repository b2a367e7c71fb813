"""`dflash-bench`: measure DFlash against target-only decoding and write a report.

    dflash-bench artifacts/default --out bench
    dflash-bench ARTIFACTS [--prompts FILE] [--num-prompts N] [--max-new-tokens N]
                 [--backend ort|qaic|auto] [--out DIR] [--repeats R] [--warmup W] [--threads T]
                 [--no-peers] [--profile-shapes qwen3-0.6b,qwen3-4b:2:1]
    dflash-bench --profile-shapes qwen3-0.6b:8 --out bench-profile     # the cost profile alone

Writes DIR/results.json, DIR/report.md and DIR/report.png. Exits 1 when the lossless check
fails (DFlash tokens differ from the target alone), 2 on bad input.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("artifacts", nargs="?", help="artifacts directory written by dflash-export")
    p.add_argument(
        "--prompts",
        help='.jsonl with "prompt" (text) or "prompt_ids" per line, or .txt with one prompt per '
        "line (default: the held-out prompts for the default pair, else random ids)",
    )
    p.add_argument(
        "--num-prompts", type=int, default=12, help="use at most this many prompts (default 12)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--backend", default="ort", choices=["ort", "qaic", "auto", "qaic-standin"])
    p.add_argument("--out", default="bench", help="output directory (default bench/)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime / PyTorch threads")
    p.add_argument("--no-peers", action="store_true", help="skip the PyTorch peers")
    p.add_argument(
        "--peer-repeats",
        type=int,
        default=2,
        help="timed rounds of the PyTorch peers (default 2; they are slow on a CPU)",
    )
    p.add_argument(
        "--profile-shapes",
        default=None,
        help="comma-separated real shapes to cost-profile with random weights: "
        "name[:target_layers[:draft_layers]], names qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b "
        "(slow: minutes per shape, ~12 GB of RAM for qwen3-0.6b:8)",
    )
    p.add_argument("--profile-ctx-len", type=int, default=512)
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    command = shlex.join(["dflash-bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return _main(args, command)
    except Exception as e:
        from dflash_qaic.bench.run import BenchError
        from dflash_qaic.runtime import ArtifactsError, BackendError, GenerationError

        if args.debug or not isinstance(
            e, BenchError | ArtifactsError | BackendError | GenerationError
        ):
            raise
        print(f"dflash-bench: error: {e}", file=sys.stderr)
        return 2


def _check_args(args) -> None:
    from dflash_qaic.bench.run import BenchError

    for name in ("repeats", "max_new_tokens", "num_prompts", "peer_repeats"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be ≥ 1")
    if args.warmup < 0:
        raise BenchError("--warmup must be ≥ 0")
    if args.artifacts is None and not args.profile_shapes:
        raise BenchError("give an ARTIFACTS directory (or --profile-shapes for the profile alone)")


def _main(args, command: str) -> int:
    from dflash_qaic.bench import report, run

    _check_args(args)
    t0 = time.perf_counter()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    shapes = [s for s in (args.profile_shapes or "").split(",") if s.strip()]
    for s in shapes:
        run.parse_shape(s)  # fail before any long work
    machine = run.machine_info(args.threads)

    if args.artifacts is None:
        profiles = _profiles(shapes, args)
        machine["load_average_end"] = run.load_average()
        res = {
            "schema": report.SCHEMA,
            "command": command,
            "started": started,
            "machine": machine,
            "profiles": profiles,
            "seconds": time.perf_counter() - t0,
        }
        paths = report.write_profile_outputs(res, args.out)
        _log(f"wrote {', '.join(str(p) for p in paths.values())}")
        return 0

    import dflash_qaic

    _log(f"dflash-bench: loading {args.artifacts} on {args.backend}")
    pipe = dflash_qaic.load(args.artifacts, backend=args.backend, threads=args.threads)
    m = pipe.manifest
    prompts, source = run.select_prompts(
        m, pipe.tokenizer, args.max_new_tokens, args.prompts, args.num_prompts
    )
    _log(f"{len(prompts)} prompts from {source}")
    copy_bw = [run.copy_bandwidth()]
    _log(
        f"measuring: {args.warmup} warm-up + {args.repeats} timed rounds × {len(prompts)} prompts "
        f"× (target alone, DFlash), {args.max_new_tokens} new tokens each"
    )
    measured = run.run_pipeline(
        pipe, prompts, args.max_new_tokens, args.repeats, args.warmup, progress=_log
    )
    copy_bw.append(run.copy_bandwidth())
    backend = pipe.backend
    del pipe
    d = Path(args.artifacts)
    weights = {p: run.onnx_weight_bytes(d / m[p]["onnx"]) for p in ("target", "draft")}

    if args.no_peers:
        peers = {"skipped": "skipped (--no-peers)"}
    else:
        _log("peers: the reference dflash_generate and Hugging Face generate (PyTorch, CPU)")
        ours = [r[0]["baseline"].tokens if r else [] for r in measured["runs"]]
        peers = run.run_peers(
            m,
            prompts,
            args.max_new_tokens,
            args.peer_repeats,
            args.warmup,
            args.threads,
            ours,
            progress=_log,
        )
        if "skipped" in peers:
            _log(f"peers {peers['skipped']}")
    profiles = _profiles(shapes, args)

    machine["load_average_end"] = run.load_average()
    config = {
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": args.threads,
        "backend": backend,
        "peer_repeats": args.peer_repeats,
    }
    res = report.build_results(
        manifest=m,
        artifacts=str(args.artifacts),
        backend=backend,
        config=config,
        machine=machine,
        prompts=prompts,
        prompts_source=source,
        measured=measured,
        weights=weights,
        copy_bw=copy_bw,
        peers=peers,
        profiles=profiles,
        command=command,
        seconds=time.perf_counter() - t0,
        started=started,
    )
    paths = report.write_outputs(res, args.out)
    a = res["aggregate"]
    _log(
        f"τ {a['tau']:.2f} · speedup {a['speedup']['median']:.2f}× "
        f"[{a['speedup']['min']:.2f}–{a['speedup']['max']:.2f}] · "
        f"{res['bound']['fraction_of_bound']:.0%} of the bound {res['bound']['bound']:.2f}× · "
        f"{res['seconds']:.0f} s"
    )
    _log(f"wrote {', '.join(str(p) for p in paths.values())}")
    if not res["lossless"]["passed"]:
        _log(
            f"dflash-bench: LOSSLESS CHECK FAILED: {len(res['lossless']['failures'])} problems "
            f"(see {paths['md']}); DFlash output differs from the target alone"
        )
        return 1
    return 0


def _profiles(shapes: list[str], args) -> list[dict]:
    from dflash_qaic.bench import run

    out = []
    for s in shapes:
        _log(f"cost profile {s}")
        out.append(run.profile_shape(s, args.threads, ctx_len=args.profile_ctx_len, progress=_log))
    return out


if __name__ == "__main__":
    sys.exit(main())
