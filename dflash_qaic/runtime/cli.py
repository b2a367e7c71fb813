"""`dflash-run`: generate from an artifacts directory and print the output and statistics.

dflash-run artifacts/default --prompt "def fib(n):" --max-new-tokens 64
dflash-run artifacts/default --prompt-ids 1,2,3 --json
dflash-run artifacts/default --prompt "Once" --temperature 0.8 --top-p 0.95 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dflash_qaic.runtime.streamer import IncrementalDetokenizer


def parser() -> argparse.ArgumentParser:
    from dflash_qaic.runtime import options

    p = argparse.ArgumentParser(prog="dflash-run", description=__doc__.split("\n\n")[0])
    p.add_argument("artifacts", help="artifacts directory written by dflash-export")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs the target's tokenizer)")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    p.add_argument("--max-new-tokens", type=int, default=64)
    options.add_arguments(p, "backend", "threads", "check_files")
    options.add_engine_arguments(p)  # --spec-policy, prefix caching, the host tier
    p.add_argument(
        "--stop-token-ids",
        default=None,
        help="comma-separated stop ids (default: the target's EOS; '' for none)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (default 0: greedy); sampling is lossless",
    )
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="keep the smallest head of mass ≥ p (1: off)"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="seed of the sampling (default: fresh entropy)"
    )
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also run the target alone and print the speedup (both modes warmed up first)",
    )
    p.add_argument("--stream", action="store_true", help="print text as it is committed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


class UsageError(ValueError):
    """A bad command-line value: one line on stderr, exit 2."""


INT64_MAX = 2**63 - 1


def _ids(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    ids = []
    for t in text.replace(" ", "").split(","):
        if t == "":
            continue
        try:
            ids.append(int(t))
        except ValueError:
            raise UsageError(f"{flag} must be comma-separated integers (got {t!r})") from None
        if not -INT64_MAX - 1 <= ids[-1] <= INT64_MAX:
            raise UsageError(f"{flag}: id {t} does not fit in 64 bits: ids are vocabulary indices")
    return ids


def _check_args(args) -> None:
    """Refuse bad values before loading anything."""
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            # argparse keeps undecodable bytes as lone surrogates (surrogateescape): U+DC80 + b
            c = ord(args.prompt[e.start])
            what = f"byte {c - 0xDC00:#04x}" if 0xDC80 <= c <= 0xDCFF else f"U+{c:04X}"
            raise UsageError(
                f"--prompt is not valid UTF-8 ({what} at character {e.start}): pass UTF-8 "
                "text, or token ids with --prompt-ids"
            ) from None
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be ≥ 1 (got {args.max_new_tokens})")
    most = (os.cpu_count() or 1) * 4
    if args.threads is not None and not 1 <= args.threads <= most:
        raise UsageError(
            f"--threads must be in 1 … {most} (4 × the {most // 4} cores; got {args.threads}); "
            "leave it out for ONNX Runtime's default"
        )


def format_stats(s: dict) -> str:
    drafted = ""
    if s.get("decode_steps"):  # the step policy decoded some steps
        drafted = f" ({s['drafted_steps']} drafted, {s['decode_steps']} decoded)"
    return (
        f"τ {s['tau']:.2f} over {s['steps']} steps{drafted} · {s['new_tokens']} tokens · "
        f"TTFT {s['ttft_s'] * 1e3:.1f} ms · {s['tpot_s'] * 1e3:.2f} ms/token · "
        f"{s['tokens_per_s']:.1f} tok/s · host {s['host_s'] / max(s['decode_s'], 1e-12):.0%} · "
        f"{s['bytes_per_step'] / 1e3:.1f} kB/step"
    )


def _printer(tokenizer):
    """on_tokens for --stream: whole characters only (runtime/streamer.py), or ids."""
    if tokenizer is None:
        return lambda chunk: print(" ".join(map(str, chunk)), end=" ", flush=True), lambda: None
    streamer = IncrementalDetokenizer(tokenizer)
    return (
        lambda chunk: print(streamer.push(chunk), end="", flush=True),
        lambda: print(streamer.flush(), end="", flush=True),
    )


def warm_up(pipe, prompt, max_new_tokens: int) -> None:
    """One short greedy run of each mode before the timed ones: a program's first calls pay
    ONNX Runtime's one-time costs (memory arenas, kernel choice, the caches' first touch), which
    would otherwise land on whichever mode runs first and skew the speedup."""
    n = min(max_new_tokens, 2 * pipe.B)
    pipe.generate(prompt, n, [], temperature=0)
    pipe.generate_baseline(prompt, n, [], temperature=0)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _check_args(args)
        prompt = args.prompt if args.prompt is not None else _ids(args.prompt_ids, "--prompt-ids")
        stop = _ids(args.stop_token_ids, "--stop-token-ids")
    except UsageError as e:
        print(f"dflash-run: error: {e}", file=sys.stderr)
        return 2
    try:
        import dflash_qaic
        from dflash_qaic.logs import show
        from dflash_qaic.runtime import ArtifactsError, BackendError, GenerationError, options

        show(stream="stderr")
        pipe = dflash_qaic.load(
            args.artifacts, **options.from_args(args, "backend", "threads", "check_files")
        )
        pipe.configure(**options.engine_values(args))
        stream, flush = None, None
        if args.stream and not args.json:
            stream, flush = _printer(pipe.tokenizer)

        sampling = dict(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
        )
        if args.baseline:
            warm_up(pipe, prompt, args.max_new_tokens)
        res = pipe.generate(prompt, args.max_new_tokens, stop, on_tokens=stream, **sampling)
        if flush is not None:
            flush()
        base = None
        if args.baseline:
            # the same seed as the DFlash run (the one it drew when --seed was not given)
            sampling["seed"] = res.stats.get("seed", args.seed)
            base = pipe.generate_baseline(prompt, args.max_new_tokens, stop, **sampling)
    except (ArtifactsError, BackendError, GenerationError) as e:
        if args.debug:
            raise
        print(f"dflash-run: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        obj = {
            "tokens": res.tokens,
            "text": res.text,
            "acceptance_lengths": res.acceptance_lengths,
            "stop_reason": res.stop_reason,
            "stats": res.stats,
            "backend": pipe.backend,
        }
        if base is not None:
            obj["baseline"] = {"tokens": base.tokens, "stats": base.stats}
            obj["speedup"] = base.stats["tpot_s"] / res.stats["tpot_s"]
        print(json.dumps(obj))
        return 0
    if args.stream:
        print()
    else:
        print(res.text if res.text is not None else " ".join(map(str, res.tokens)))
    print(f"[dflash] {format_stats(res.stats)} · stop: {res.stop_reason}", file=sys.stderr)
    if base is not None:
        # sampled outputs are equal in distribution, not token for token
        differ = "DIFFERENT" if args.temperature == 0 else "different (sampled)"
        same = "identical" if base.tokens == res.tokens else differ
        print(f"[target] {format_stats(base.stats)} · output {same}", file=sys.stderr)
        print(f"speedup {base.stats['tpot_s'] / res.stats['tpot_s']:.2f}×", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
