"""`dflash-bench`: measure DFlash against target-only decoding and write a report.

    dflash-bench artifacts/default --out bench
    dflash-bench ARTIFACTS [--prompts FILE] [--num-prompts N] [--max-new-tokens N]
                 [--backend ort|qaic|auto] [--out DIR] [--repeats R] [--warmup W] [--threads T]
                 [--temperatures 0,1 | --temperature T] [--top-k K] [--top-p P] [--seed S]
                 [--sampled-prompts N] [--sampled-repeats R]
                 [--no-peers] [--profile-shapes qwen3-0.6b,qwen3-4b:2:1]
    dflash-bench --profile-shapes qwen3-0.6b:8 --out bench-profile     # the cost profile alone

Each temperature gets the same alternating baseline / DFlash measurement. At T = 0 DFlash must
give the target's own tokens (the lossless check); at T > 0 every run samples with its own seed
(derived from --seed, T, prompt, round and mode), tokens differ, and a token-histogram sanity
check compares the two distributions. Artifacts exported with --no-sampling skip T > 0 (noted
in the report). The PyTorch peers run at T = 0 only.

Writes DIR/results.json, DIR/report.md and DIR/report.png. Exits 1 when the lossless check
fails (DFlash tokens differ from the target alone at T = 0), 2 on bad input.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

# Prompts and timed rounds at T > 0; 0 = as many as at T = 0. The full T = 1 measurement adds
# ~75 s to `make bench` on the default pair (2 cores, idle: ~170 s in all), well under its
# 15-minute budget, so nothing is cut by default; lower these when sampling is the slow part.
SAMPLED_PROMPTS = 0
SAMPLED_REPEATS = 0


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
    temps = p.add_mutually_exclusive_group()
    temps.add_argument(
        "--temperatures",
        default="0,1",
        help="comma-separated sampling temperatures to measure, 0 = greedy (default 0,1)",
    )
    temps.add_argument(
        "--temperature", type=float, default=None, help="one temperature (--temperatures T)"
    )
    p.add_argument("--top-k", type=int, default=0, help="top-k at T > 0 (default 0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p at T > 0 (default 1: off)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="base seed of the sampled runs (T > 0); each run's seed is derived from it, the "
        "temperature, the prompt index, the round and the mode (default 0)",
    )
    p.add_argument(
        "--sampled-prompts",
        type=int,
        default=SAMPLED_PROMPTS,
        help=f"at T > 0, use the first N prompts only (default {SAMPLED_PROMPTS}; 0 = all, as "
        "at T = 0)",
    )
    p.add_argument(
        "--sampled-repeats",
        type=int,
        default=SAMPLED_REPEATS,
        help=f"timed rounds at T > 0 (default {SAMPLED_REPEATS}; 0 = --repeats)",
    )
    p.add_argument("--no-peers", action="store_true", help="skip the PyTorch peers (T = 0 only)")
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
    for name in ("sampled_prompts", "sampled_repeats"):
        if getattr(args, name) < 0:
            raise BenchError(f"--{name.replace('_', '-')} must be ≥ 0 (0 = as at T = 0)")
    args.temperatures = parse_temperatures(
        args.temperatures if args.temperature is None else str(args.temperature)
    )
    if any(t > 0 for t in args.temperatures):
        from dflash_qaic.runtime.pipeline import GenerationError, Sampling

        try:
            Sampling.checked(1.0, args.top_k, args.top_p, args.seed)
        except GenerationError as e:
            raise BenchError(str(e).replace("top_k", "--top-k").replace("top_p", "--top-p")) from e
    if args.artifacts is None and not args.profile_shapes:
        raise BenchError("give an ARTIFACTS directory (or --profile-shapes for the profile alone)")


def parse_temperatures(text: str) -> list[float]:
    """'0,1' -> [0.0, 1.0]: distinct finite numbers ≥ 0, in the order given."""
    import math

    from dflash_qaic.bench.run import BenchError

    out: list[float] = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            t = float(part)
        except ValueError as e:
            raise BenchError(f"--temperatures: {part.strip()!r} is not a number") from e
        if not math.isfinite(t) or t < 0:
            raise BenchError(f"--temperatures: {part.strip()} must be a finite number ≥ 0")
        if t in out:
            raise BenchError(f"--temperatures: {t:g} is given twice")
        out.append(t)
    if not out:
        raise BenchError("--temperatures: give at least one temperature, e.g. 0,1")
    return out


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
    measurements = _measure(pipe, prompts, args)
    greedy = next((x for x in measurements if x["temperature"] == 0 and "runs" in x), None)
    copy_bw.append(run.copy_bandwidth())
    backend = pipe.backend
    del pipe
    d = Path(args.artifacts)
    weights = {p: run.onnx_weight_bytes(d / m[p]["onnx"]) for p in ("target", "draft")}

    if args.no_peers:
        peers = {"skipped": "skipped (--no-peers)"}
    elif greedy is None:
        peers = {"skipped": "skipped: they run at T = 0 only, and T = 0 was not measured"}
    else:
        _log("peers (T = 0): the reference dflash_generate and Hugging Face generate (PyTorch)")
        ours = [r[0]["baseline"].tokens if r else [] for r in greedy["runs"]]
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
        "temperatures": args.temperatures,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "sampled_prompts": args.sampled_prompts,
        "sampled_repeats": args.sampled_repeats,
    }
    res = report.build_results(
        manifest=m,
        artifacts=str(args.artifacts),
        backend=backend,
        config=config,
        machine=machine,
        prompts=prompts,
        prompts_source=source,
        measurements=measurements,
        weights=weights,
        copy_bw=copy_bw,
        peers=peers,
        profiles=profiles,
        command=command,
        seconds=time.perf_counter() - t0,
        started=started,
    )
    paths = report.write_outputs(res, args.out)
    for sec in res["temperatures"]:
        if sec["status"] == "skipped":
            _log(f"T={sec['temperature']:g}: skipped: {sec['note']}")
            continue
        a, bd = sec["aggregate"], sec["bound"]
        _log(
            f"T={sec['temperature']:g}: τ {a['tau']:.2f} · speedup {a['speedup']['median']:.2f}× "
            f"[{a['speedup']['min']:.2f}–{a['speedup']['max']:.2f}] · "
            f"{bd['fraction_of_bound']:.0%} of the bound {bd['bound']:.2f}×"
            + (
                f" · token histograms p = {sec['distribution_check']['p_permutation']:.2f}"
                if "distribution_check" in sec
                else ""
            )
        )
    _log(f"{res['seconds']:.0f} s in all")
    _log(f"wrote {', '.join(str(p) for p in paths.values())}")
    if res["lossless"]["passed"] is False:
        _log(
            f"dflash-bench: LOSSLESS CHECK FAILED: {len(res['lossless']['failures'])} problems "
            f"(see {paths['md']}); DFlash output differs from the target alone"
        )
        return 1
    return 0


def _measure(pipe, prompts, args) -> list[dict]:
    """Run every temperature in turn (same prompts, warm-up and rounds; at T > 0 possibly
    fewer, see --sampled-prompts / --sampled-repeats); T > 0 is skipped, with a note, when the
    artifacts have no sampler."""
    from dflash_qaic.bench import run

    can_sample = bool(getattr(pipe, "can_sample", False))
    sampled = [t for t in args.temperatures if t > 0]
    if sampled and can_sample:
        # fail on settings these programs cannot take (e.g. top_k above their candidates) now,
        # not after the T = 0 measurement
        pipe.generate(
            prompts[0].ids,
            max_new_tokens=1,
            stop_token_ids=[],
            temperature=sampled[0],
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
    if not can_sample and sampled and all(t > 0 for t in args.temperatures):
        raise run.BenchError(
            "these artifacts have no sampler (exported with --no-sampling), so only T = 0 can be "
            "measured: add 0 to --temperatures, or re-export without --no-sampling"
        )
    out = []
    for t in args.temperatures:
        head = {"temperature": t, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
        if t == 0:
            head.update(top_k=0, top_p=1.0, seed=None)  # greedy: the settings play no part
        if t > 0 and not can_sample:
            note = (
                "these artifacts' target program has no sampler (exported with "
                "`dflash-export --no-sampling`), so only greedy decoding (T = 0) can run; "
                "re-export without --no-sampling to measure sampling"
            )
            _log(f"T={t:g}: skipped: {note}")
            out.append({**head, "skipped": note})
            continue
        use, repeats, reduced = prompts, args.repeats, None
        if t > 0:
            if args.sampled_prompts and args.sampled_prompts < len(prompts):
                use = prompts[: args.sampled_prompts]
            if args.sampled_repeats:
                repeats = args.sampled_repeats
            if len(use) < len(prompts) or repeats != args.repeats:
                reduced = (
                    f"fewer runs than at T = 0 to keep the benchmark short: the first {len(use)} "
                    f"of {len(prompts)} prompts × {repeats} timed round(s) (T = 0: "
                    f"{len(prompts)} × {args.repeats}); --sampled-prompts 0 --sampled-repeats 0 "
                    "measures as many as at T = 0"
                )
        _log(
            f"measuring T={t:g}: {args.warmup} warm-up + {repeats} timed rounds × {len(use)} "
            f"prompts × (target alone, DFlash), {args.max_new_tokens} new tokens each"
        )
        meas = run.run_pipeline(
            pipe,
            use,
            args.max_new_tokens,
            repeats,
            args.warmup,
            progress=_log,
            temperature=t,
            top_k=head["top_k"],
            top_p=head["top_p"],
            seed=args.seed,
        )
        out.append({**head, **meas, "warmup": args.warmup, "reduced": reduced})
    return out


def _profiles(shapes: list[str], args) -> list[dict]:
    from dflash_qaic.bench import run

    out = []
    for s in shapes:
        _log(f"cost profile {s}")
        out.append(run.profile_shape(s, args.threads, ctx_len=args.profile_ctx_len, progress=_log))
    return out


if __name__ == "__main__":
    sys.exit(main())
