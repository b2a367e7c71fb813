"""`dflash-bench`: DFlash against target-only decoding on the same programs, and a report.

    dflash-bench artifacts/default                # writes bench/latest/{report.md,.png,results.json}
    dflash-bench artifacts/default --temperatures 0 --no-peers --repeats 1    # a quick look
    dflash-bench artifacts/default --compare artifacts/default-dflash2   # two drafts, one target
    dflash-bench artifacts/default-cb8 --concurrency 1,2,4,8   # continuous batching (batch.py)
    dflash-bench artifacts/default-cb8 --concurrency 1,8 --peers vllm  # upstream vLLM beside us
    dflash-bench --export …  /  dflash-bench --serve …   # the export and server benchmarks
    dflash-bench --long-context artifacts/DIR --prompt-len 8000     # cost, speedup by context
    dflash-bench --router artifacts/default-cb8    # vllm-router's cost per request (TTFT)
    dflash-bench --pd artifacts/pd-bench    # P/D against aggregated: ITL while long prompts arrive
    dflash-bench ARTIFACTS --response-format schema.json   # under a grammar (bench/structured.py)
    dflash-bench --project ai100     # projected AI 100 decode/chain/tree tokens/s (bench/project.py)
    dflash-bench --project ai200 --bandwidth-gbs N   # AI 200: its bandwidth is unpublished
    dflash-bench ARTIFACTS --card-numerics   # τ and tokens under the profile's MXFP6/MXINT8 numerics

Prints the summary screen. Exits 1 when DFlash's tokens differ from the target's at T = 0 (the
lossless check), 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shlex
import sys

from dflash_qaic.bench.frame import _log, bench, check_common, parse_list

MODES = {"--export": "dflash_lab.export_bench", "--serve": "dflash_lab.serve_bench"}
MODES["--long-context"] = "dflash_qaic.bench.longctx"  # prefill, memory, call cost by position
MODES["--router"] = "dflash_qaic.bench.router"  # vllm-router's cost per request (TTFT)
MODES["--pd"] = "dflash_qaic.bench.pd"  # P/D against aggregated: ITL while long prompts arrive
MODES["--project"] = "dflash_qaic.bench.project"  # AI 100 roofline projection (no run)
MODES["--card-numerics"] = "dflash_qaic.bench.card_numerics"  # τ, tokens under MXFP6/MXINT8
MODES["--multi-turn"] = "dflash_qaic.bench.multi_turn"  # agent-like turns, prefix cache off/on
PEER_ROUNDS = 2  # the PyTorch peers are slow on a CPU


OPTIONS = [  # flag, type, default, help
    ("--prompts", str, None, '.jsonl with "prompt" or "prompt_ids" per line, or one text prompt '
     "per line; None: the default pair's held-out prompts, else random ids"),
    ("--num-prompts", int, 12, "use at most this many prompts"),
    ("--max-new-tokens", int, 128, "tokens per run"),
    ("--out", str, "bench/latest", "output directory"),
    ("--repeats", int, 3, "timed rounds"),
    ("--warmup", int, 1, "discarded rounds first"),
    ("--threads", int, None, "ONNX Runtime and PyTorch threads; None: the runtime's default "
     "for ours (1 for small programs) and the usable CPUs for the PyTorch peers"),
    ("--temperatures", str, "0,1", "comma-separated temperatures, 0 = greedy"),
    ("--top-k", int, 0, "top-k at T > 0 (0: off)"),
    ("--top-p", float, 1.0, "top-p at T > 0 (1: off)"),
    ("--seed", int, 0, "base seed of the sampled runs"),
]  # fmt: skip


def common_parser(doc: str, artifacts: str, options) -> argparse.ArgumentParser:
    """A dflash-bench parser: the module's docstring as help, the artifacts argument, the
    backend, and `options` (flag, type, default, help)."""
    from dflash_qaic.runtime import options as load_options

    p = argparse.ArgumentParser(
        prog="dflash-bench",
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("artifacts", help=artifacts)
    load_options.add_arguments(p, "backend", "check_files")
    load_options.add_engine_arguments(p)
    # rounds repeat each prompt and the target alone runs it too: each from position 0 unless
    # --enable-prefix-caching asks for the cache (--multi-turn measures it both ways)
    p.set_defaults(enable_prefix_caching=False)
    for flag, typ, default, text in options:
        p.add_argument(flag, type=typ, default=default, help=f"{text} (default %(default)s)")
    p.add_argument("--debug", action="store_true", help="tracebacks on errors")
    return p


def parser() -> argparse.ArgumentParser:
    p = common_parser(__doc__, "artifacts directory written by dflash-export", OPTIONS)
    p.add_argument("--no-peers", action="store_true", help="skip the PyTorch peers")
    p.add_argument("--no-profile", action="store_true", help="skip the cost profile")
    p.add_argument(
        "--peers",
        help="vllm: upstream vLLM's DFlash beside ours, a benchmark of one request and of "
        "concurrent ones: give it with --concurrency (e.g. --concurrency 1,8 --peers vllm)",
    )
    p.add_argument(
        "--compare",
        metavar="OTHER_ARTIFACTS",
        help="artifacts of another draft of the same target: measured after ARTIFACTS in the "
        "same run, the same way (prompts, temperatures, rounds, seeds), τ and speedup side by "
        "side in the report (no cost profile or peers for it)",
    )
    p.add_argument(
        "--tree-budgets",
        metavar="N,…",
        help="artifacts exported with --tree-budgets: DFlash measured again with each tree "
        "budget (0: chains on the same program; auto: the size picked per step), the --compare "
        "artifacts too; a table of τ and speedup per budget (docs/DESIGN.md, Tree verification)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--concurrency" or a.startswith("--concurrency=") for a in argv):
        from dflash_qaic.bench import batch  # continuous batching: its own flags and report

        p = common_parser(batch.__doc__, "artifacts exported with --full-batch-size", batch.OPTIONS)
        return guarded(batch._main, p.parse_args(argv), argv)
    if any(a == "--response-format" or a.startswith("--response-format=") for a in argv):
        from dflash_qaic.bench import structured  # structured output: its own flags

        return structured.main(argv)
    for flag, module in MODES.items():
        if flag in argv:
            return _delegate(flag, module, [a for a in argv if a != flag])
    return guarded(_main, parser().parse_args(argv), argv)


def guarded(main_fn, args, argv: list[str]) -> int:
    """main_fn(args, command) with a user error as one line on stderr and exit 2 (no
    traceback unless --debug)."""
    from dflash_qaic.bench.run import BenchError
    from dflash_qaic.runtime import ArtifactsError, BackendError, GenerationError

    try:
        return main_fn(args, shlex.join(["dflash-bench", *argv]))
    except (BenchError, ArtifactsError, BackendError, GenerationError) as e:
        if args.debug:
            raise
        print(f"dflash-bench: error: {e}", file=sys.stderr)
        return 2


def _delegate(flag: str, module: str, argv: list[str]) -> int:
    """The export / server benchmarks live in their own modules, imported only when asked for."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        print(f"dflash-bench: error: {flag} needs {module}, not installed", file=sys.stderr)
        return 2
    sys.argv[0] = f"dflash-bench {flag}"  # their usage lines name the command the user typed
    return int(mod.main(argv) or 0)


def _main(args, command: str) -> int:
    from dflash_qaic.bench import report, run

    if args.peers is not None:
        raise run.BenchError(
            f"--peers {args.peers} runs in the continuous-batching benchmark: add --concurrency "
            "(e.g. `--concurrency 1,8 --peers vllm` on artifacts exported with "
            "--full-batch-size 8)"
        )
    check_common(args, ("num_prompts", "max_new_tokens", "repeats"))
    args.temperatures = parse_list("--temperatures", args.temperatures)
    args.tree_budgets = tree_budgets(args.tree_budgets)
    other = run.same_target(args.artifacts, args.compare) if args.compare else None
    return bench(args, command, report, lambda pipe, f: _decode(pipe, f, args, other))


def _decode(pipe, f: dict, args, other: dict | None = None) -> tuple[dict, dict]:
    """Both modes at every temperature, the cost profile and the peers; then, with --compare
    (`other`: its manifest), the other draft's artifacts on the same prompts."""
    from dflash_qaic.bench import report, run

    if not pipe.can_sample and all(t > 0 for t in args.temperatures):
        raise run.BenchError(
            "these artifacts have no sampler (--no-sampling): add 0 to --temperatures"
        )
    prompts, source = run.select_prompts(
        f, pipe.tokenizer, args.max_new_tokens, args.prompts, args.num_prompts
    )
    if other is not None:  # the same prompts must fit both: cut to the tighter room
        room = run.prompt_room(other["ctx_len"], other["block_size"], args.max_new_tokens)
        prompts = [run.Prompt(p.name, p.ids[-room:]) for p in prompts]
    _log(f"{len(prompts)} prompts from {source}")
    sections, ours = _measure(pipe, prompts, args, f["block_size"])
    copy_Bps = run.copy_bandwidth()
    weights = {p: run.weight_bytes(f[p]["onnx"]) for p in ("target", "draft")}
    profile = {"skipped": "--no-profile"}
    if not args.no_profile:
        w_s = {k: weights["draft" if k == "draft" else "target"] / copy_Bps for k in run.KINDS}
        s_s = run.state_seconds(f, copy_Bps)  # None: a dense target
        profile = run.cost_profile(pipe, f, prompts[0].ids, pipe.threads, w_s, s_s, log=_log)
    peers = {"skipped": "--no-peers" if args.no_peers else "T = 0 was not measured"}
    if ours and not args.no_peers:
        from dflash_qaic.bench.peers import run_peers

        _log("peers (T = 0): the reference dflash_generate and Hugging Face generate")
        rounds = min(PEER_ROUNDS, args.repeats)
        peers = run_peers(f, prompts, args.max_new_tokens, rounds, args.threads, ours, _log)
    bandwidth = {"copy_Bps": copy_Bps, "weight_bytes": weights}  # the LLC: in "machine"
    parts = {"temperatures": sections, "profile": profile, "bandwidth": bandwidth, "peers": peers}
    if args.tree_budgets:
        parts["trees"] = _trees(pipe, prompts, args, f)
    if other is not None:
        c = parts["compare"] = _compare(prompts, args)
        parts["drafts"] = [
            report.draft_summary(*x) for x in ((f, sections), (c["artifacts"], c["temperatures"]))
        ]
        parts["trees"] = parts.get("trees", []) + c.pop("trees", [])
    return parts, {"prompts_source": source, "num_prompts": len(prompts)}


def _compare(prompts, args) -> dict:
    """The --compare artifacts loaded after ours and measured the same way: same prompts,
    temperatures, rounds and seeds, each DFlash run against the target alone of its round."""
    import dflash_qaic
    from dflash_qaic.bench import run
    from dflash_qaic.runtime.options import engine_values

    pipe = dflash_qaic.load(
        args.compare, backend=args.backend, threads=args.ort_threads, check_files=args.check_files
    )
    _log(f"dflash-bench: loaded {args.compare} (--compare) on {args.backend}")
    pipe.configure(**engine_values(args))  # as ours
    f = run.facts(pipe, args.compare)
    sections, _ = _measure(pipe, prompts, args, f["block_size"])
    skipped = {"skipped": "measured for the benchmarked artifacts only"}
    return {
        "trees": _trees(pipe, prompts, args, f) if args.tree_budgets else [],
        "artifacts": {**f, "backend": pipe.backend},
        "temperatures": sections,
        "profile": skipped,
        "peers": skipped,
    }


def tree_budgets(text: str | None) -> list:
    """--tree-budgets: integers ≥ 0 and `auto` (None: the size picked per step)."""
    from dflash_qaic.bench.run import BenchError

    if not text:
        return []
    out = []
    for part in text.split(","):
        part = part.strip()
        if part == "auto":
            out.append(None)
        elif part.isdigit():
            out.append(int(part))
        else:
            raise BenchError(f"--tree-budgets takes integers ≥ 0 and auto, got {part!r}")
    return out


def _trees(pipe, prompts, args, f: dict) -> list[dict]:
    """DFlash at each tree budget (the target alone beside it in each round, as everywhere),
    each entry labelled with the draft of `f` (run.facts)."""
    from dflash_qaic.bench.report import draft_label
    from dflash_qaic.bench.run import BenchError

    if not pipe.plan.tree_budgets:
        raise BenchError(
            "--tree-budgets: these artifacts have no tree budgets: export them with "
            "--tree-budgets (e.g. 16,32,64)"
        )
    out = []
    old = pipe.configure()
    try:
        for budget in args.tree_budgets:
            try:
                pipe.configure(tree_budget=budget)
            except ValueError as e:
                raise BenchError(f"--tree-budgets: {e}") from None
            _log(f"tree budget {'auto' if budget is None else budget}:")
            sections, _ = _measure(pipe, prompts, args, pipe.B)
            label = draft_label({"form": f["draft_form"], "path": f["path"]})
            out.append({"draft": label, "budget": budget, "temperatures": sections})
    finally:
        pipe.configure(old)
    return out


def drafted_share(runs) -> float:
    """The share of DFlash steps that drafted (the others decoded: the step policy's choice)."""
    st = [pair["dflash"].stats for per in runs for pair in per]
    steps = sum(s["steps"] for s in st)
    return sum(s["drafted_steps"] for s in st) / steps if steps else 0.0


def _measure(pipe, prompts, args, B: int) -> tuple[list[dict], list | None]:
    """One section per temperature (T > 0 skipped, with a note, without a sampler), and our
    DFlash tokens per prompt at T = 0 (None when T = 0 was not measured)."""
    from dflash_qaic.bench import run, stats

    out, ours = [], None
    for T in args.temperatures:
        if T > 0 and not pipe.can_sample:
            note = "the target program has no sampler (exported with --no-sampling)"
            out.append({"temperature": T, "status": "skipped", "note": note})
            continue
        _log(f"T={T:g}: {args.warmup} warm-up + {args.repeats} rounds × {len(prompts)} prompts")
        runs, problems = run.run_pairs(
            pipe, prompts, args.max_new_tokens, args.repeats, args.warmup, T,
            args.top_k, args.top_p, args.seed, _log,
        )  # fmt: skip
        out.append(stats.section(T, runs, problems, prompts, B, args.seed))
        out[-1]["drafted_share"] = drafted_share(runs)
        ours = [per[0]["dflash"].tokens for per in runs] if T == 0 else ours
    return out, ours


if __name__ == "__main__":
    sys.exit(main())
