"""`dflash-export`: checkpoints -> artifacts directory (ONNX programs, QPCs, manifest).

dflash-export --out artifacts/default                       # the built-in default pair
dflash-export --recipe export/qwen3-4b-dflash-b16.yaml --out artifacts/qwen3-4b
dflash-export --target DIR --draft DIR --out DIR [--qpc-config qpc_configs/ai100_fp16.yaml]
              [--block-size N | --num-speculative-tokens N] [--prefill-seq-len N]
              [--ctx-len N] [--full-batch-size N] [--no-compile] [--emit-logits]
              [--num-cores N] [--num-devices N] [--mos N] [--[no-]mxfp6-matmul]
              [--[no-]mxint8-kv-cache] [--[no-]aic-enable-depth-first] [--compile-timeout S]
              [--check-card-numerics [PROFILE]]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
from pathlib import Path

import yaml

from dflash_qaic import contract
from dflash_qaic.exporter.options import RECIPE_OPTIONS

RECIPE_KEYS = {"name", "description", "target", "draft", *RECIPE_OPTIONS}
# Shipped recipes are package data (the repository's `export/` links here).
RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = "default"


FEWER_SPECIALIZATIONS = """\
specializations: every shape a program is compiled for (each one costs compile time and QPC
size; `dflash-export` prints the count and the manifest records it as specialization_count).
A Qwen3-4B export with the default options (block 16, chunk 128, ctx 4096) has 44 target and 16
draft specializations: target (2 prefill lengths x 2 + 3 verify lengths x 2 + decode) and draft
(decode + 3 prefill row counts), each at 4 attention windows. The shipped real-model recipes
ask for 7 to 11 (docs/AI100_PROJECTION.md says why). To export fewer:
  --verify-lengths 16        one verify length (the block): 28 target specializations
  --comp-ctx-lengths 4096    one attention window (ctx_len): 11 target, 4 draft
  --prefill-seq-len 64       a chunk <= 4 x block has one prefill length: 36 target, 12 draft
  --no-sampling              a greedy-only target (no *Sampled ones): 24 target
Fewer specializations compile faster; the runtime then pays for longer calls (a whole block,
the full context, whole chunks; docs/DESIGN.md, Specializations)."""


def _expand(value: str, recipe_path: Path) -> Path:
    """`{assets}` = the package's assets, `{models}` = $DFLASH_MODELS or ~/models; relative
    paths resolve against the current directory."""
    models = os.environ.get("DFLASH_MODELS", "~/models")
    s = str(value).replace("{assets}", str(Path(__file__).resolve().parents[1] / "assets"))
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


def load_recipe_options(name_or_path: str) -> dict:
    """A recipe's keys as written (its checkpoint directories neither expanded nor checked)."""
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
    return data


def load_recipe(name_or_path: str) -> dict:
    path = find_recipe(name_or_path)
    data = load_recipe_options(name_or_path)
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


def parser() -> argparse.ArgumentParser:
    from dflash_qaic.exporter.options import add_arguments

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
    add_arguments(p)  # every export and compile option (dflash_qaic/exporter/options.py)
    p.add_argument(
        "--check-card-numerics",
        nargs="?",
        const="",
        metavar="PROFILE",
        help="after the export, run it under the compile profile's numerics (MXFP6 weights, "
        "MXINT8 KV, fp16; PROFILE, default the export's) against fp32: τ, greedy agreement, "
        "losslessness, T = 1 χ² (dflash-bench ARTIFACTS --card-numerics); report in "
        "OUT.card-numerics.json, the artifacts untouched",
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def resolve(args):
    """(target, draft, ExportOptions) from CLI > recipe > defaults."""
    from dflash_qaic.exporter.options import from_cli

    if bool(args.target) != bool(args.draft):
        raise SystemExit("dflash-export: give both --target and --draft, or neither")
    recipe = {}
    if args.recipe or not args.target:
        recipe = load_recipe(args.recipe or DEFAULT_RECIPE)
    target = Path(args.target) if args.target else recipe["target"]
    draft = Path(args.draft) if args.draft else recipe["draft"]
    return target, draft, from_cli(args, recipe)


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
    io = m.target.io
    if io.token_bitmask:  # structured output: what carrying the masks costs
        row = 4 * contract.bitmask_words(io.vocab_size)
        rows = m.plan.cache_rows * m.block_size
        lines.append(
            f"structured output: 0 more specializations; the token bitmask adds {row} B per row, "
            f"{rows * row} B per whole-block verify call ({m.plan.cache_rows} x {m.block_size} "
            "rows)"
        )
    lines += sampling_costs(io)
    return "\n".join(lines)


def sampling_costs(io) -> list[str]:
    """What --extended-sampling and --logprobs add to every target call, per batch row."""
    size = {"int64": 8, "float32": 4, "int32": 4}
    out = []
    if io.extended_sampling:
        per_row = sum(
            size[t.dtype] * math.prod(d for d in t.shape if isinstance(d, int))
            for t in contract.extended_specs(io.vocab_size)
        )
        out.append(f"extended sampling: 0 more specializations; {per_row} B in per batch row")
    if io.logprobs:
        per = 8 + 8 + 12 * io.logprobs  # logprob_ids in; two log p and the top K out
        out.append(f"logprobs: 0 more specializations; {per} B per row (top {io.logprobs})")
    return out


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
    from dflash_qaic.artifacts.build import ExportError, build_artifacts
    from dflash_qaic.artifacts.manifest import ArtifactsError
    from dflash_qaic.checkpoints import CheckpointError
    from dflash_qaic.compiler.profiles import ProfileError
    from dflash_qaic.compiler.qpc import CompileError
    from dflash_qaic.logs import show

    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"  # tqdm's own switch: no progress bars either
    show(logging.WARNING if args.quiet else logging.INFO)
    try:
        target, draft, opts = resolve(args)
        res = build_artifacts(target, draft, Path(args.out), opts)
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
    if args.check_card_numerics is not None:
        return check_card_numerics(res.out, args.check_card_numerics or None, args.debug)
    return 0


def check_card_numerics(out: Path, profile: str | None, debug: bool) -> int:
    """`--check-card-numerics`: the evaluation of dflash-bench --card-numerics on the new
    export, its report beside the artifacts directory (OUT.card-numerics.json)."""
    from dflash_qaic.bench import card_numerics

    try:
        result = card_numerics.evaluate(out, profile, log=lambda m: print(m, file=sys.stderr))
    except card_numerics.CardNumericsRunError as e:
        if debug:
            raise
        print(f"dflash-export: --check-card-numerics: error: {e}", file=sys.stderr)
        return 2
    report = out.with_name(out.name + ".card-numerics.json")
    card_numerics.write(result, report)
    print(card_numerics.summary(result) + f"wrote {report}")
    return 0 if result["greedy"]["lossless_card"] else 1


if __name__ == "__main__":
    sys.exit(main())
