"""Build an artifacts directory: preflight, export both programs (or reuse them), compile,
record every file, write the manifest — as one transaction.

    OUT/manifest.json                    written last: the typed manifest (artifacts/manifest.py)
    OUT/target/target.onnx (+ .data)     OUT/target/qpc-<hash>/{specializations.json, custom_io.yaml, compile.cmd, qpc/}
    OUT/draft/draft.onnx   (+ .data)     OUT/draft/qpc-<hash>/{...}
    OUT/tokenizer/                       the target's tokenizer files, when it has them
    OUT/config.json                      the target's config.json (for vLLM)

An export is a transaction (artifacts/transaction.py, docs/DESIGN.md "Artifacts"): everything
that can be checked is checked before any heavy work (artifacts/preflight.py: options,
checkpoints, the compile profile and compiler, generation_config.json, the tokenizer, the model
features the exporter supports; then OUT itself); the result is built in a staging directory
beside OUT under a lock and swapped in whole. A previous good OUT stays byte for byte as it was
until that swap, whatever happens.

A second run with the same inputs and options reuses the exported programs (the reuse key
`input_hash` covers the checkpoints, tokenizer files, generation_config.json, every program
option and the package version; the old files must pass the load-time check) and the
compiled QPCs (the compile step's own cache).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_qaic.artifacts import files
from dflash_qaic.artifacts.files import check_files
from dflash_qaic.artifacts.manifest import NAME as MANIFEST
from dflash_qaic.artifacts.manifest import (
    ArtifactsError,
    FileRecord,
    Manifest,
    QpcRecord,
    read_manifest,
    write_manifest,
)
from dflash_qaic.artifacts.preflight import input_hash, preflight
from dflash_qaic.artifacts.programs import (
    MODEL_CONFIG,
    copy_model_config,
    copy_tokenizer,
    export_programs,
)
from dflash_qaic.artifacts.transaction import Transaction, TransactionError, link_tree
from dflash_qaic.compiler.profiles import CompileOverrides
from dflash_qaic.exporter.options import ExportError, ExportOptions
from dflash_qaic.logs import listening

log = logging.getLogger(__name__)

__all__ = ["ExportError", "ExportOptions", "ExportResult", "build_artifacts", "compile_artifacts"]


@dataclass
class ExportResult:
    """What `build_artifacts` / `compile_artifacts` did."""

    manifest: Manifest
    out: Path
    steps: list[tuple[str, str, float]]
    seconds: float


def build_artifacts(
    target_dir: str | Path,
    draft_dir: str | Path,
    out_dir: str | Path,
    options: ExportOptions | None = None,
    *,
    progress=None,
) -> ExportResult:
    """Export (or reuse), compile (or skip), and write the manifest, as one transaction
    (options: None = the defaults). Progress goes to the `dflash_qaic` loggers (and, when
    given, to `progress`, called with each message)."""
    with listening(progress):
        return _build(target_dir, draft_dir, out_dir, options or ExportOptions())


def _build(target_dir, draft_dir, out_dir, options: ExportOptions) -> ExportResult:
    t_all = time.perf_counter()
    pre = preflight(target_dir, draft_dir, options)
    pair, profile = pre.pair, pre.profile
    steps: list[tuple[str, str, float]] = []
    with _transaction(out_dir) as tx:
        out, staging = tx.out, tx.staging
        key = input_hash(pair, options, pre.block_size)
        old = _reusable(out, key)
        if old is not None:
            log.info("reusing the exported programs in %s (inputs unchanged, hash %s)", out, key)
            steps.append(("export", "reused", 0.0))
            for prog in old.roles:
                link_tree(out / prog, staging / prog)
            m = old.replace(tokenizer=copy_tokenizer(pair.target.path, staging))
            copy_model_config(pair.target.path, staging)
        else:
            m = export_programs(pre, staging, options, key, steps)
        m = m.replace(options=options.to_json())
        m = _stage(m, staging, out if old is not None else None, old, profile, steps)
        tx.commit()
    _remember(tx.out, m)
    return ExportResult(m, tx.out, steps, time.perf_counter() - t_all)


def compile_artifacts(
    out_dir: str | Path,
    qpc_config: str | os.PathLike | None = None,
    overrides: CompileOverrides | None = None,
    *,
    progress=None,
) -> ExportResult:
    """Compile (or re-compile with another profile) an existing artifacts directory, e.g. one
    exported with --no-compile and copied to an AI100 host. A transaction like an export.
    Messages as `build_artifacts`'."""
    with listening(progress):
        return _compile_dir(out_dir, qpc_config, overrides)


def _compile_dir(out_dir, qpc_config, overrides) -> ExportResult:
    from dflash_qaic.compiler.profiles import DEFAULT_PROFILE, load_profile
    from dflash_qaic.compiler.qpc import compiler_search

    t_all = time.perf_counter()
    name = qpc_config or DEFAULT_PROFILE
    profile = (overrides or CompileOverrides()).apply(load_profile(name))
    path, _ = compiler_search(profile.compiler)
    if path is not None:
        log.info("compiler: %s", path)
    steps: list[tuple[str, str, float]] = []
    with _transaction(out_dir) as tx:
        out, staging = tx.out, tx.staging
        old = read_manifest(out, check_files="none")
        log.info("checking the files of %s", out)
        check_files(out, old.files, "full")
        link_tree(out, staging, skip=(MANIFEST,))
        m = _stage(old, staging, out, old, profile, steps)
        tx.commit()
    _remember(tx.out, m)
    return ExportResult(m, tx.out, steps, time.perf_counter() - t_all)


def _remember(out: Path, m: Manifest) -> None:
    """Record the files just hashed (or checked) as checked (`files.CheckedFiles`): the first
    load after an export does not hash them again."""
    files.remember((out / r.path, r.sha256) for r in m.files)


class _transaction(Transaction):
    """A Transaction whose filesystem errors become ExportErrors saying OUT is unchanged."""

    def __init__(self, out_dir):
        try:
            super().__init__(out_dir)
        except TransactionError as e:
            raise ExportError(str(e)) from None

    def __enter__(self):
        try:
            return super().__enter__()
        except TransactionError as e:
            raise ExportError(str(e)) from None
        except OSError as e:
            raise _os_error(e, self.out) from e

    def __exit__(self, kind, exc, tb):
        super().__exit__(kind, exc, tb)
        if isinstance(exc, OSError) and not isinstance(exc, ExportError):
            raise _os_error(exc, self.out) from exc


def _os_error(e: OSError, out: Path) -> ExportError:
    where = f" ({e.filename})" if e.filename else ""
    return ExportError(
        f"could not write the artifacts: {e.strerror or e}{where}. {out} is unchanged; free "
        f"space, fix the permissions of {out.parent}, or choose another --out"
    )


def _reusable(out: Path, key: str) -> Manifest | None:
    """The old manifest when its programs can be reused: same key, files intact — the load-time
    check (every size and sha256, from the cache of checked files when unchanged), so deciding
    to reuse multi-GB programs costs well under a second (docs/DESIGN.md, Artifacts)."""
    if not (out / MANIFEST).is_file():
        return None
    try:
        old = read_manifest(out, check_files="none")
    except ArtifactsError as e:
        log.info("not reusing %s: %s", out, e)
        return None
    if old.input_hash != key:
        return None
    try:
        check_files(out, old.files, "fast")
    except ArtifactsError as e:
        log.info("not reusing %s: %s", out, e)
        return None
    return old


def _stage(m: Manifest, staging: Path, old_root, old, profile, steps) -> Manifest:
    """Compile in the staging directory, record every file, write the manifest there."""
    m = m.with_programs(lambda p: replace(p, qpc=None, compiler=None)).replace(
        compile_skipped=None,
        files=(),
        qpc_config=None,
    )
    if profile is not None:
        m = _compile(m, staging, profile, steps)
    else:
        steps.append(("compile", "disabled (--no-compile)", 0.0))
    known = {r.path: r for r in old.files} if old is not None else {}
    m = m.replace(files=tuple(_records(m, staging, known, old_root)))
    write_manifest(staging, m)
    return m


def _records(m: Manifest, root: Path, known: dict, old_root: Path | None) -> list[FileRecord]:
    """Size + sha256 of every file the manifest names (and the tokenizer's). A file hard-linked
    from a checked old directory keeps its record instead of being hashed again."""
    paths = m.named_files()
    if m.tokenizer:
        paths += sorted(f"{m.tokenizer}/{f.name}" for f in (root / m.tokenizer).iterdir())
    if (root / MODEL_CONFIG).is_file():
        paths.append(MODEL_CONFIG)
    out = []
    for rel in paths:
        rec = known.get(rel)
        same = rec is not None and old_root is not None and (old_root / rel).is_file()
        if same and os.path.samefile(root / rel, old_root / rel):
            out.append(rec)
        else:
            out.append(FileRecord.of(root, rel))
    return out


def _compile(m: Manifest, root: Path, profile, steps) -> Manifest:
    """Compile both programs inside `root`; the manifest with their QPC records."""
    from dflash_qaic.compiler.qpc import compile_program

    programs, skipped = {}, None
    for prog in m.programs.values():
        t = time.perf_counter()
        res = compile_program(
            root / prog.onnx,
            root / prog.kind,
            prog.io,
            list(prog.specializations),
            profile,
            prog.kind,
            root=root,
        )
        compiler = str(res.compiler) if res.compiler else None
        programs[prog.kind] = replace(prog, qpc=QpcRecord.of(res), compiler=compiler)
        status = "skipped" if res.skipped else ("cached" if res.cached else "compiled")
        steps.append((f"compile {prog.kind}", status, time.perf_counter() - t))
        if res.skipped:
            skipped = skipped or {"looked_in": list(res.looked_in), "commands": []}
            skipped["commands"].append(res.command)
    if skipped:  # a warning: shown even when logging is not configured
        log.warning(
            "no AI100 compiler found (looked in %s); the ONNX programs are complete for ONNX "
            "Runtime. On an AI100 host, in the artifacts directory, run: %s",
            ", ".join(skipped["looked_in"]),
            " ; ".join(skipped["commands"]),
        )
    return m.replace(
        programs=programs,
        qpc_config=profile.name,
        compile_skipped=skipped,
    )
