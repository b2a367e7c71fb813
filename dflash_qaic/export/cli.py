"""`dflash-export`: checkpoints -> artifacts directory (ONNX programs, QPCs, manifest).

dflash-export --out artifacts/default                       # the built-in default pair
dflash-export --recipe export/qwen3-4b-dflash-b16.yaml --out artifacts/qwen3-4b
dflash-export --target DIR --draft DIR --out DIR [--qpc-config qpc_configs/ai100_fp16.yaml]
              [--block-size N | --num-speculative-tokens N] [--prefill-seq-len N]
              [--ctx-len N] [--full-batch-size N] [--no-compile] [--emit-logits]
              [--num-cores N] [--num-devices N] [--mos N] [--[no-]mxfp6-matmul]
              [--[no-]mxint8-kv-cache] [--[no-]aic-enable-depth-first] [--compile-timeout S]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import yaml

RECIPE_KEYS = {
    "name",
    "description",
    "target",
    "draft",
    "block_size",
    "prefill_seq_len",
    "ctx_len",
    "batch_size",
    "full_batch_size",
    "comp_ctx_lengths",
    "verify_lengths",
    "qpc_config",
}
# Shipped recipes are package data (the repository's `export/` links here).
RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = "default"


FEWER_SPECIALIZATIONS = """\
specializations: every shape a program is compiled for (each one costs compile time and QPC
size; `dflash-export` prints the count and the manifest records it as specialization_count).
The default Qwen3-4B export (block 16, chunk 128, ctx 4096) has 44 target and 16 draft
specializations: target (2 prefill lengths x 2 + 3 verify lengths x 2 + decode) and draft
(decode + 3 prefill row counts), each at 4 attention windows. To export fewer:
  --verify-lengths 16        one verify length (the block): 28 target specializations
  --comp-ctx-lengths 4096    one attention window (ctx_len): 11 target, 4 draft
  --prefill-seq-len 64       a chunk <= 4 x block has one prefill length: 36 target, 12 draft
  --no-sampling              a greedy-only target (no *Sampled ones): 24 target
Fewer specializations compile faster; the runtime then pays for longer calls (a whole block,
the full context, whole chunks; docs/DESIGN.md, Specializations)."""


def _expand(value: str, recipe_path: Path) -> Path:
    """`{assets}` = the package's assets, `{models}` = $DFLASH_MODELS or ~/models; relative
    paths resolve against the current directory."""
    import dflash_qaic

    models = os.environ.get("DFLASH_MODELS", "~/models")
    s = str(value).replace("{assets}", str(Path(dflash_qaic.__file__).parent / "assets"))
    s = s.replace("{models}", models)
    return Path(os.path.expanduser(os.path.expandvars(s)))


def find_recipe(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    for cand in (RECIPE_DIR / f"{name_or_path}.yaml", RECIPE_DIR / name_or_path):
        if cand.is_file():
            return cand
    known = sorted(f.stem for f in RECIPE_DIR.glob("*.yaml")) if RECIPE_DIR.is_dir() else []
    raise SystemExit(f"dflash-export: no recipe {name_or_path!r} (known: {', '.join(known)})")


def load_recipe(name_or_path: str) -> dict:
    path = find_recipe(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise SystemExit(f"dflash-export: recipe {path} is not valid YAML: {e}") from e
    unknown = sorted(set(data) - RECIPE_KEYS)
    if unknown:
        raise SystemExit(
            f"dflash-export: recipe {path} has unknown keys {unknown}; allowed: "
            f"{', '.join(sorted(RECIPE_KEYS))}"
        )
    for key in ("target", "draft"):
        if key not in data:
            raise SystemExit(f"dflash-export: recipe {path} lacks `{key}` (a local directory)")
        data[key] = _expand(data[key], path)
        if not data[key].is_dir():
            raise SystemExit(
                f"dflash-export: recipe {path} names {key} directory {data[key]}, which does not "
                f"exist: download the checkpoint there (or set DFLASH_MODELS to the folder "
                "holding your models) and run again"
            )
    data["_path"] = path
    return data


def _int_flag(lo: int, hi: int):
    """argparse type: an integer in [lo, hi] (0, negatives and absurd sizes are refused)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is outside [{lo}, {hi}]")
        return v

    return parse


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds > 0")
    return v


def parser() -> argparse.ArgumentParser:
    from dflash_qaic.export.artifacts import MAX_BATCH_SIZE, MAX_BLOCK_SIZE, MAX_CTX_LEN

    p = argparse.ArgumentParser(
        prog="dflash-export",
        description="Export a target + DFlash draft pair to ONNX programs and AI100 QPCs.",
        epilog=FEWER_SPECIALIZATIONS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", help="Hugging Face target directory (Qwen3 / Llama)")
    p.add_argument("--draft", help="DFlash draft directory (published z-lab format)")
    p.add_argument("--out", required=True, help="artifacts directory to write")
    p.add_argument("--recipe", help="export/<name>.yaml (or a name); default: the built-in pair")
    p.add_argument(
        "--qpc-config", help="qpc_configs/<name>.yaml (or a name); default: recipe's or ai100_fp16"
    )
    size = _int_flag
    p.add_argument(
        "--block-size", type=size(2, MAX_BLOCK_SIZE), help="draft block B (default: the draft's)"
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=size(1, MAX_BLOCK_SIZE - 1),
        help="proposals per step, as QEfficient and vLLM say it (= block size - 1)",
    )
    p.add_argument(
        "--prefill-seq-len",
        type=size(1, MAX_CTX_LEN),
        help="prefill chunk C (default 128; a C/4 chunk beside it when C/4 > the block size)",
    )
    p.add_argument(
        "--ctx-len", type=size(4, MAX_CTX_LEN), help="context length in slots (default 4096)"
    )
    p.add_argument("--batch-size", type=size(1, MAX_BATCH_SIZE), help="batch size (default 1)")
    p.add_argument(
        "--comp-ctx-lengths",
        type=_int_list,
        help="attention windows, e.g. 512,1024,2048,4096 (must end at --ctx-len; default: "
        "ctx/8, ctx/4, ctx/2, ctx)",
    )
    p.add_argument(
        "--verify-lengths",
        type=_int_list,
        help="verify calls' row counts, e.g. 4,8,16 (must end at the block size; default: B/4, "
        "B/2, B); B alone compiles the fewest specializations",
    )
    p.add_argument(
        "--full-batch-size",
        type=size(1, MAX_BATCH_SIZE),
        help="continuous batching: N sequences at once (QEfficient's name; default: off)",
    )
    p.add_argument("--no-compile", action="store_true", help="export ONNX only")
    p.add_argument("--emit-logits", action="store_true", help="also output full logits")
    p.add_argument(
        "--no-sampling",
        action="store_true",
        help="greedy-only target program (no on-device sampler: cheaper verify calls)",
    )
    p.add_argument("--no-fp16-check", action="store_true", help="skip the fp16 graph run")
    c = p.add_argument_group(
        "compile options (QEfficient's names; override the --qpc-config profile)"
    )
    c.add_argument("--num-cores", type=size(1, 16), help="the target's AI100 cores per device")
    c.add_argument("--num-devices", type=size(1, 64), help="slice the target over N devices")
    c.add_argument("--mos", type=size(1, 16), help="maximum output channel split (-mos)")
    bool_flag = argparse.BooleanOptionalAction
    c.add_argument("--mxfp6-matmul", action=bool_flag, default=None, help="MXFP6 MatMul weights")
    c.add_argument("--mxint8-kv-cache", action=bool_flag, default=None, help="MXINT8 KV cache")
    c.add_argument(
        "--aic-enable-depth-first", action=bool_flag, default=None, help="depth-first scheduling"
    )
    c.add_argument(
        "--compile-timeout", type=_seconds, help="seconds per compiler run (default: profile's)"
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def _pick(cli, recipe: dict, key: str, default=None):
    """CLI value when given (0 is a value, not 'absent'), else the recipe's, else the default."""
    return cli if cli is not None else recipe.get(key, default)


def block_size(block: int | None, num_speculative_tokens: int | None) -> int | None:
    """B from --block-size and/or --num-speculative-tokens N (B = N + 1); both must agree."""
    if num_speculative_tokens is None:
        return block
    from dflash_qaic.export.artifacts import ExportError

    if block is not None and block != num_speculative_tokens + 1:
        raise ExportError(
            f"--block-size {block} and --num-speculative-tokens {num_speculative_tokens} "
            f"disagree (block size = speculative tokens + 1): give one of them"
        )
    return num_speculative_tokens + 1


def resolve(args) -> tuple[Path, Path, dict]:
    """(target, draft, options) from CLI > recipe > defaults."""
    from dflash_qaic.compile.profiles import CompileOverrides

    if bool(args.target) != bool(args.draft):
        raise SystemExit("dflash-export: give both --target and --draft, or neither")
    recipe = {}
    if args.recipe or not args.target:
        recipe = load_recipe(args.recipe or DEFAULT_RECIPE)
    target = Path(args.target) if args.target else recipe["target"]
    draft = Path(args.draft) if args.draft else recipe["draft"]
    B = block_size(args.block_size, args.num_speculative_tokens)
    opts = {
        "block_size": _pick(B, recipe, "block_size"),
        "prefill_seq_len": _pick(args.prefill_seq_len, recipe, "prefill_seq_len", 128),
        "ctx_len": _pick(args.ctx_len, recipe, "ctx_len", 4096),
        "batch_size": _pick(args.batch_size, recipe, "batch_size", 1),
        "full_batch_size": _pick(args.full_batch_size, recipe, "full_batch_size"),
        "comp_ctx_lengths": _pick(args.comp_ctx_lengths, recipe, "comp_ctx_lengths"),
        "verify_lengths": _pick(args.verify_lengths, recipe, "verify_lengths"),
        "emit_logits": args.emit_logits,
        "sampling": not args.no_sampling,
        "qpc_config": str(_pick(args.qpc_config, recipe, "qpc_config", "ai100_fp16")),
        "compile": not args.no_compile,
        "fp16_check": not args.no_fp16_check,
        "compile_overrides": CompileOverrides(
            num_cores=args.num_cores,
            mxfp6_matmul=args.mxfp6_matmul,
            mxint8_kv_cache=args.mxint8_kv_cache,
            num_devices=args.num_devices,
            mos=args.mos,
            aic_enable_depth_first=args.aic_enable_depth_first,
            timeout_s=args.compile_timeout,
        ),
    }
    return target, draft, opts


def summary_table(res, out: Path) -> str:
    m = res.manifest
    rows = [("step", "result", "seconds")] + [(s, r, f"{t:.1f}") for s, r, t in res.steps]
    w = [max(len(str(r[i])) for r in rows) for i in range(3)]
    lines = [" | ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "-+-".join("-" * x for x in w))
    lines.append("")
    lines.append(
        f"artifacts: {out}  (block {m.block_size}, prefill chunk {m.prefill_seq_len}, "
        f"ctx {m.ctx_len}, layers {list(m.target_layer_ids)}, {res.seconds:.1f} s)"
    )
    n = m.specialization_count
    lines.append(
        f"specializations: target {n['target']}, draft {n['draft']} (fewer: see "
        "`dflash-export --help`)"
    )
    return "\n".join(lines)


class Interrupted(BaseException):
    """SIGTERM, raised in the main thread so that cleanup (compiler, staging) runs."""


def _on_sigterm(signum, frame):
    raise Interrupted


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(args)
    except (KeyboardInterrupt, Interrupted) as e:
        if args.debug:
            raise
        what = "interrupted" if isinstance(e, KeyboardInterrupt) else "terminated"
        print(
            f"dflash-export: {what}; {args.out} is unchanged (a previous export there is intact)",
            file=sys.stderr,
        )
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args) -> int:
    from dflash_qaic.checkpoints import CheckpointError
    from dflash_qaic.compile.profiles import ProfileError
    from dflash_qaic.compile.qpc import CompileError
    from dflash_qaic.export.artifacts import ExportError, ExportOptions, build_artifacts
    from dflash_qaic.manifest import ArtifactsError

    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"  # tqdm's own switch: no progress bars either
    try:
        target, draft, opts = resolve(args)
        say = (lambda _m: None) if args.quiet else (lambda m: print(f"· {m}", flush=True))
        res = build_artifacts(target, draft, Path(args.out), ExportOptions(**opts), progress=say)
    except (
        CheckpointError,
        ProfileError,
        CompileError,
        ExportError,
        ArtifactsError,
        ValueError,
    ) as e:
        if args.debug:
            raise
        print(f"dflash-export: error: {e}", file=sys.stderr)
        return 2
    print(summary_table(res, res.out))
    skipped = res.manifest.compile_skipped
    if skipped:
        print(
            "compilation skipped: no AI100 compiler (looked in "
            f"{', '.join(skipped['looked_in'])}); the ONNX artifacts are complete for ONNX "
            f"Runtime. On an AI100 host, in {res.out}, run:\n  " + "\n  ".join(skipped["commands"])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
