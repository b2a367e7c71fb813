"""`dflash-export`: checkpoints -> artifacts directory (ONNX programs, QPCs, manifest).

dflash-export --out artifacts/default                       # the built-in default pair
dflash-export --recipe export/qwen3-4b-dflash-b16.yaml --out artifacts/qwen3-4b
dflash-export --target DIR --draft DIR --out DIR [--qpc-config qpc_configs/ai100_fp16.yaml]
              [--block-size N] [--prefill-seq-len N] [--ctx-len N] [--batch-size N]
              [--no-compile] [--emit-logits]
"""

from __future__ import annotations

import argparse
import os
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
    "qpc_config",
}
# Shipped recipes are package data (the repository's `export/` links here).
RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = "default"


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-export",
        description="Export a target + DFlash draft pair to ONNX programs and AI100 QPCs.",
    )
    p.add_argument("--target", help="Hugging Face target directory (Qwen3 / Llama)")
    p.add_argument("--draft", help="DFlash draft directory (published z-lab format)")
    p.add_argument("--out", required=True, help="artifacts directory to write")
    p.add_argument("--recipe", help="export/<name>.yaml (or a name); default: the built-in pair")
    p.add_argument(
        "--qpc-config", help="qpc_configs/<name>.yaml (or a name); default: recipe's or ai100_fp16"
    )
    p.add_argument("--block-size", type=int, help="draft block B (default: the draft's)")
    p.add_argument("--prefill-seq-len", type=int, help="prefill chunk (default 128)")
    p.add_argument("--ctx-len", type=int, help="context length in slots (default 4096)")
    p.add_argument("--batch-size", type=int, help="batch size (default 1)")
    p.add_argument("--no-compile", action="store_true", help="export ONNX only")
    p.add_argument("--emit-logits", action="store_true", help="also output full logits")
    p.add_argument(
        "--no-sampling",
        action="store_true",
        help="greedy-only target program (no on-device sampler: cheaper verify calls)",
    )
    p.add_argument("--no-fp16-check", action="store_true", help="skip the fp16 graph run")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def resolve(args) -> tuple[Path, Path, dict]:
    """(target, draft, options) from CLI > recipe > defaults."""
    if bool(args.target) != bool(args.draft):
        raise SystemExit("dflash-export: give both --target and --draft, or neither")
    recipe = {}
    if args.recipe or not args.target:
        recipe = load_recipe(args.recipe or DEFAULT_RECIPE)
    target = Path(args.target) if args.target else recipe["target"]
    draft = Path(args.draft) if args.draft else recipe["draft"]
    opts = {
        "block_size": args.block_size or recipe.get("block_size"),
        "prefill_seq_len": args.prefill_seq_len or recipe.get("prefill_seq_len", 128),
        "ctx_len": args.ctx_len or recipe.get("ctx_len", 4096),
        "batch_size": args.batch_size or recipe.get("batch_size", 1),
        "emit_logits": args.emit_logits,
        "sampling": not args.no_sampling,
        "qpc_config": str(args.qpc_config or recipe.get("qpc_config", "ai100_fp16")),
        "compile": not args.no_compile,
        "fp16_check": not args.no_fp16_check,
    }
    return target, draft, opts


def summary_table(m: dict, out: Path) -> str:
    rows = [("step", "result", "seconds")] + [(s, r, f"{t:.1f}") for s, r, t in m["_steps"]]
    w = [max(len(str(r[i])) for r in rows) for i in range(3)]
    lines = [" | ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "-+-".join("-" * x for x in w))
    lines.append("")
    lines.append(
        f"artifacts: {out}  (block {m['block_size']}, prefill chunk {m['prefill_seq_len']}, "
        f"ctx {m['ctx_len']}, layers {m['target_layer_ids']}, {m['_seconds']:.1f} s)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        from dflash_qaic.checkpoints import CheckpointError
        from dflash_qaic.compile.profiles import ProfileError
        from dflash_qaic.compile.qpc import CompileError
        from dflash_qaic.export.artifacts import ExportError, ExportOptions, build_artifacts

        target, draft, opts = resolve(args)
        say = (lambda _m: None) if args.quiet else (lambda m: print(f"· {m}", flush=True))
        out = Path(args.out)
        m = build_artifacts(target, draft, out, ExportOptions(**opts), progress=say)
    except (CheckpointError, ProfileError, CompileError, ExportError, ValueError) as e:
        if args.debug:
            raise
        print(f"dflash-export: error: {e}", file=sys.stderr)
        return 2
    print(summary_table(m, out))
    skipped = m.get("compile_skipped")
    if skipped:
        print(
            "compilation skipped: no AI100 compiler (looked in "
            f"{', '.join(skipped['looked_in'])}); the ONNX artifacts are complete for ONNX "
            "Runtime. On an AI100 host run:\n  " + "\n  ".join(skipped["commands"])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
