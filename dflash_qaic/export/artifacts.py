"""Build an artifacts directory: validate, export both programs, compile, write the manifest.

    OUT/manifest.json                    written last, atomically: its presence marks completion
    OUT/target/target.onnx (+ .data)     OUT/target/qpc-<hash>/{specializations.json, custom_io.yaml, compile.cmd, qpc/}
    OUT/draft/draft.onnx   (+ .data)     OUT/draft/qpc-<hash>/{...}
    OUT/tokenizer/                       the target's tokenizer files, when it has them

A rebuild first removes the manifest, so an interrupted run never leaves a directory that looks
complete. A second run with the same inputs and options reuses the exported programs (the
input hash is in the manifest) and the compiled QPCs (the compile step's own cache).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_qaic import __version__, contract
from dflash_qaic import checkpoints as ck
from dflash_qaic.manifest import NAME as MANIFEST
from dflash_qaic.manifest import ArtifactsError, read_manifest, write_manifest

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


class ExportError(ValueError):
    """Bad export options: says what is wrong and how to fix it."""


@dataclass(frozen=True)
class ExportOptions:
    block_size: int | None = None  # None: the draft's own block size
    prefill_seq_len: int = 128
    ctx_len: int = 4096
    batch_size: int = 1
    emit_logits: bool = False
    sampling: bool = True  # False: a greedy-only target program (no sampler in the graph)
    qpc_config: str = "ai100_fp16"
    compile: bool = True
    fp16_check: bool = True


def validate_options(pair: ck.Pair, o: ExportOptions) -> int:
    """Fail before any heavy work; returns the block size to use."""
    B = o.block_size or pair.draft.block_size
    if B < 2:
        raise ExportError(f"--block-size {B}: DFlash needs a block of at least 2")
    if o.prefill_seq_len < 1:
        raise ExportError(f"--prefill-seq-len {o.prefill_seq_len} must be ≥ 1")
    if B > o.prefill_seq_len:
        raise ExportError(
            f"--block-size {B} is larger than --prefill-seq-len {o.prefill_seq_len}: the prefill "
            f"chunk must hold at least one block; use --prefill-seq-len {B} or more"
        )
    need = o.prefill_seq_len + B + 2
    if o.ctx_len < need:
        raise ExportError(
            f"--ctx-len {o.ctx_len} is too small for prefill chunk {o.prefill_seq_len} and block "
            f"{B}: use --ctx-len {need} or more (one slot is reserved for padding rows)"
        )
    if o.batch_size != 1:
        raise ExportError(
            f"--batch-size {o.batch_size}: this version exports and runs batch 1 only; use 1"
        )
    return B


def input_hash(pair: ck.Pair, o: ExportOptions, block_size: int) -> str:
    h = hashlib.sha256()
    h.update(ck.fingerprint(pair.target.path).encode())
    h.update(ck.fingerprint(pair.draft.path).encode())
    opts = {**asdict(o), "block_size": block_size, "compile": None, "qpc_config": None}
    h.update(json.dumps(opts, sort_keys=True).encode())
    h.update(__version__.encode())
    return h.hexdigest()[:16]


def _eos_ids(target_dir: Path) -> list[int]:
    for name in ("generation_config.json", "config.json"):
        f = target_dir / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def _copy_tokenizer(target_dir: Path, out: Path) -> str | None:
    files = [target_dir / f for f in TOKENIZER_FILES if (target_dir / f).is_file()]
    if not files:
        return None
    tmp = out / ".tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in files:
        shutil.copy2(f, tmp / f.name)
    final = out / "tokenizer"
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return "tokenizer"


def _rel(facts: dict, out: Path) -> dict:
    """Facts of an exported program with paths relative to the artifacts directory."""
    facts = dict(facts)
    facts["onnx"] = str(Path(facts.pop("path")).relative_to(out))
    data = facts.pop("external_data")
    facts["external_data"] = str(Path(data).relative_to(out)) if data else None
    return facts


def build_artifacts(
    target_dir: str | Path,
    draft_dir: str | Path,
    out_dir: str | Path,
    options: ExportOptions = ExportOptions(),
    progress: Callable[[str], None] = print,
) -> dict:
    """Export (or reuse), compile (or skip), and write the manifest. Returns the manifest."""
    from dflash_qaic.compile.profiles import load_profile

    t_all = time.perf_counter()
    pair = ck.read_pair(target_dir, draft_dir)  # validation: one clear error per problem
    B = validate_options(pair, options)
    profile = load_profile(options.qpc_config) if options.compile else None
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    key = input_hash(pair, options, B)

    manifest = None
    if (out / MANIFEST).is_file():
        try:
            old = read_manifest(out)
            if old.get("input_hash") == key:
                manifest = old
        except ArtifactsError:
            pass
    steps: list[tuple[str, str, float]] = []
    if manifest is not None:
        progress(f"reusing the exported programs in {out} (inputs unchanged, hash {key})")
        steps.append(("export", "reused", 0.0))
    else:
        (out / MANIFEST).unlink(missing_ok=True)  # not an artifact until the manifest is back
        manifest = _export(pair, out, options, B, key, progress, steps)

    if profile is not None:
        manifest = _compile(manifest, out, profile, progress, steps)
    else:
        for prog in ("target", "draft"):
            manifest[prog]["qpc"] = []
        steps.append(("compile", "disabled (--no-compile)", 0.0))
    manifest["qpc_config"] = profile.name if profile is not None else None
    write_manifest(out, manifest)
    manifest = read_manifest(out)
    manifest["_steps"] = steps
    manifest["_seconds"] = time.perf_counter() - t_all
    return manifest


def _export(pair, out, o: ExportOptions, B: int, key: str, progress, steps) -> dict:
    """The streaming export (export/weights.py): placeholder modules are traced, and the
    weights go from the safetensors files to the programs one tensor at a time."""
    import torch

    from dflash_qaic.export import weights
    from dflash_qaic.export.draft import export_draft
    from dflash_qaic.export.target import export_target

    t = time.perf_counter()
    progress(f"reading {pair.target.path} and {pair.draft.path} (structure only)")
    target = weights.placeholder_target(pair.target)
    fc = weights.load_fp32(pair.draft_tensors["fc.weight"])
    hidden_norm = weights.load_fp32(pair.draft_tensors["hidden_norm.weight"])
    embed, head = weights.placeholder_head(pair.target)
    steps.append(("load checkpoints", "structure + fc", time.perf_counter() - t))
    common = dict(
        ctx_len=o.ctx_len,
        prefill_seq_len=o.prefill_seq_len,
        block_size=B,
        batch_size=o.batch_size,
        emit_logits=o.emit_logits,
        fp16_check=o.fp16_check,
        stream_from=pair,
    )

    t = time.perf_counter()
    progress(f"exporting the target program (ctx {o.ctx_len}, chunk {o.prefill_seq_len}, B {B})")
    with torch.no_grad():
        tfacts = export_target(
            target,
            fc,
            hidden_norm,
            pair.draft.rms_norm_eps,
            pair.draft.target_layer_ids,
            out / "target" / "target.onnx",
            sampling=o.sampling,
            **common,
        )
    del target
    steps.append(("export target", f"{tfacts['onnx_bytes'] / 1e6:.1f} MB", time.perf_counter() - t))

    t = time.perf_counter()
    progress("exporting the draft program")
    with torch.no_grad():
        dfacts = export_draft(pair.draft, None, embed, head, out / "draft" / "draft.onnx", **common)
    steps.append(("export draft", f"{dfacts['onnx_bytes'] / 1e6:.1f} MB", time.perf_counter() - t))
    tok = _copy_tokenizer(pair.target.path, out)
    progress("hashing the checkpoint files for the manifest")
    return {
        "input_hash": key,
        "block_size": B,
        "mask_token_id": pair.draft.mask_token_id,
        "target_layer_ids": list(pair.draft.target_layer_ids),
        "prefill_seq_len": o.prefill_seq_len,
        "ctx_len": o.ctx_len,
        "batch_size": o.batch_size,
        "vocab_size": pair.target.vocab_size,
        "hidden_size": pair.target.hidden_size,
        "eos_token_ids": _eos_ids(pair.target.path),
        "tokenizer": tok,
        "target": _rel(tfacts, out),
        "draft": _rel(dfacts, out),
        "sources": {
            "target": {
                "path": str(pair.target.path.resolve()),
                "family": pair.target.family,
                "sha256": ck.file_digest(pair.target.path),
            },
            "draft": {
                "path": str(pair.draft.path.resolve()),
                "sha256": ck.file_digest(pair.draft.path),
            },
        },
        "versions": _versions(),
    }


def _versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {
        "dflash_qaic": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def _program_io(m: dict, prog: str):
    f = m[prog]
    common = dict(
        n_layers=f["n_layers"],
        n_kv_heads=f["n_kv_heads"],
        head_dim=f["head_dim"],
        hidden_size=f["hidden_size"],
        vocab_size=f["vocab_size"],
        emit_logits=f["emit_logits"],
    )
    if prog == "target":
        return contract.TargetIO(**common)
    return contract.DraftIO(block_size=f["block_size"], **common)


def _compile(manifest: dict, out: Path, profile, progress, steps) -> dict:
    from dflash_qaic.compile.qpc import compile_program

    manifest.pop("compile_skipped", None)
    for prog in ("target", "draft"):
        t = time.perf_counter()
        res = compile_program(
            out / manifest[prog]["onnx"],
            out / prog,
            _program_io(manifest, prog),
            manifest[prog]["specializations"],
            profile,
            prog,
            progress=progress,
        )
        manifest[prog]["qpc"] = res.to_dict(relative_to=out)["qpcs"]
        manifest[prog]["compiler"] = str(res.compiler) if res.compiler else None
        status = "skipped" if res.skipped else ("cached" if res.cached else "compiled")
        steps.append((f"compile {prog}", status, time.perf_counter() - t))
        if res.skipped:
            skipped = manifest.setdefault(
                "compile_skipped", {"looked_in": list(res.looked_in), "commands": []}
            )
            skipped["commands"] += [q.command_line for q in res.qpcs]
    return manifest
