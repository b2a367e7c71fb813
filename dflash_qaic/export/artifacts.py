"""Build an artifacts directory: validate, export both programs, compile, write the manifest.

    OUT/manifest.json                    written last: the typed manifest (dflash_qaic.manifest)
    OUT/target/target.onnx (+ .data)     OUT/target/qpc-<hash>/{specializations.json, custom_io.yaml, compile.cmd, qpc/}
    OUT/draft/draft.onnx   (+ .data)     OUT/draft/qpc-<hash>/{...}
    OUT/tokenizer/                       the target's tokenizer files, when it has them

An export is a transaction (`export.transaction`, docs/DESIGN.md "Artifacts"): everything that
can be checked is checked before any heavy work (options, checkpoints, the compile profile and
compiler, generation_config.json, the tokenizer, the model features the exporter supports, OUT
itself); the result is built in a staging directory beside OUT under a lock and swapped in
whole. A previous good OUT stays byte for byte as it was until that swap, whatever happens.

A second run with the same inputs and options reuses the exported programs (the reuse key
`input_hash` covers the checkpoints, tokenizer files, generation_config.json, every program
option and the package version; the old files must pass the load-time check) and the
compiled QPCs (the compile step's own cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_qaic import __version__, contract, files
from dflash_qaic import checkpoints as ck
from dflash_qaic.compile.profiles import CompileOverrides
from dflash_qaic.export.options import ExportError, ExportOptions
from dflash_qaic.export.transaction import Transaction, TransactionError, link_tree
from dflash_qaic.logs import listening
from dflash_qaic.manifest import NAME as MANIFEST
from dflash_qaic.manifest import (
    ArtifactsError,
    FileRecord,
    Manifest,
    Program,
    read_manifest,
    verify_files,
    write_manifest,
)

log = logging.getLogger(__name__)

TOKENIZER_FILES = ck.TOKENIZER_FILES
GENERATION_CONFIG = "generation_config.json"

__all__ = ["ExportError", "ExportOptions", "ExportResult", "build_artifacts", "compile_artifacts"]


@dataclass
class ExportResult:
    """What `build_artifacts` / `compile_artifacts` did."""

    manifest: Manifest
    out: Path
    steps: list[tuple[str, str, float]]
    seconds: float


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
    try:
        contract.check_verify_lengths(o.verify_lengths and list(o.verify_lengths), B)
    except ValueError as e:
        raise ExportError(f"--verify-lengths: {e}") from None
    if o.batch_size != 1:
        raise ExportError(
            f"--batch-size {o.batch_size}: a batch of independent sequences is served by "
            f"continuous batching; use --full-batch-size {o.batch_size} (and --batch-size 1)"
        )
    return B


def input_hash(pair: ck.Pair, o: ExportOptions, block_size: int) -> str:
    """The reuse key: every input and option that changes a program or the runtime (the
    fingerprints cover config, index, tokenizer and generation-config contents and the weight
    files' identity; see `checkpoints.fingerprint`)."""
    h = hashlib.sha256()
    h.update(ck.fingerprint(pair.target.path).encode())
    h.update(ck.fingerprint(pair.draft.path).encode())
    h.update(json.dumps(o.program_options(block_size), sort_keys=True).encode())
    h.update(__version__.encode())
    return h.hexdigest()[:16]


def _read_json_object(f: Path) -> dict:
    try:
        data = json.loads(f.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ExportError(f"{f} is not valid JSON ({e}): fix it or remove it") from e
    if not isinstance(data, dict):
        raise ExportError(f"{f} must hold a JSON object, not {type(data).__name__}: fix it")
    return data


def _eos_ids(target_dir: Path) -> list[int]:
    """EOS ids from generation_config.json (else config.json), validated."""
    for name in (GENERATION_CONFIG, "config.json"):
        f = target_dir / name
        if not f.is_file():
            continue
        eos = _read_json_object(f).get("eos_token_id")
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in ids
        ):
            raise ExportError(
                f"{f}: eos_token_id {eos!r} must be a token id or a list of token ids: fix it"
            )
        return ids
    return []


def _check_tokenizer(target_dir: Path, vocab_size: int) -> None:
    """The tokenizer files the artifacts will carry must load (the runtime loads them), and
    every token id they can produce must be in the model's vocabulary."""
    if not any((target_dir / f).is_file() for f in TOKENIZER_FILES):
        return
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    except Exception as e:  # transformers raises many kinds for a broken tokenizer
        raise ExportError(
            f"the tokenizer files in {target_dir} do not load ({type(e).__name__}: {e}): fix "
            f"or remove them ({', '.join(TOKENIZER_FILES)})"
        ) from e
    # refused, not warned: a prompt holding such a token would fail at generation, and a
    # tokenizer that outgrows its model is most often another model's
    beyond = sorted((i, t) for t, i in tok.get_vocab().items() if i >= vocab_size)
    if beyond:
        (first, name), n = beyond[0], len(beyond)
        raise ExportError(
            f"the tokenizer in {target_dir} has {n} token{'s' if n > 1 else ''} beyond the "
            f"model's vocabulary of {vocab_size} (vocab_size in config.json), from id {first} "
            f"({name!r}): a prompt holding one would fail at generation; use the model's own "
            f"tokenizer files, or resize its embeddings to cover them"
        )


def preflight(target_dir, draft_dir, o: ExportOptions):
    """Every check that needs no heavy work. Returns (pair, block size, profile or None)."""
    pair = ck.read_pair(target_dir, draft_dir)  # validation: one clear error per problem
    B = validate_options(pair, o)
    profile = None
    if o.compile:
        from dflash_qaic.compile.profiles import load_profile
        from dflash_qaic.compile.qpc import compiler_search

        profile = o.compile_overrides.apply(load_profile(o.qpc_config))
        compiler_search(profile.compiler)  # a bad $QAIC_COMPILER fails now, not after export
    eos = _eos_ids(pair.target.path)
    bad = [e for e in eos if e >= pair.target.vocab_size]
    if bad:
        raise ExportError(
            f"{pair.target.path}: eos_token_id {bad} is outside the vocabulary of "
            f"{pair.target.vocab_size}: fix generation_config.json"
        )
    _check_tokenizer(pair.target.path, pair.target.vocab_size)
    return pair, B, profile


def _copy_tokenizer(target_dir: Path, out: Path) -> str | None:
    """Copy the tokenizer files into `out/tokenizer` (a fresh staging directory)."""
    files = [target_dir / f for f in TOKENIZER_FILES if (target_dir / f).is_file()]
    if not files:
        return None
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, out / "tokenizer" / f.name)  # umask permissions, not the source's
    return "tokenizer"


#: the target's config.json, copied to OUT/config.json (and OUT/tokenizer/): what vLLM reads to
#: know the target when it serves the artifacts (`vllm serve OUT`, docs/DESIGN.md, vLLM platform plugin)
MODEL_CONFIG = "config.json"


def _copy_model_config(target_dir: Path, out: Path) -> None:
    """OUT/config.json, and one beside the tokenizer files (vLLM reads a tokenizer directory's
    config.json too)."""
    shutil.copyfile(target_dir / MODEL_CONFIG, out / MODEL_CONFIG)
    if (out / "tokenizer").is_dir():
        shutil.copyfile(target_dir / MODEL_CONFIG, out / "tokenizer" / MODEL_CONFIG)


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
    pair, B, profile = preflight(target_dir, draft_dir, options)
    steps: list[tuple[str, str, float]] = []
    with _transaction(out_dir) as tx:
        out, staging = tx.out, tx.staging
        key = input_hash(pair, options, B)
        old = _reusable(out, key)
        if old is not None:
            log.info("reusing the exported programs in %s (inputs unchanged, hash %s)", out, key)
            steps.append(("export", "reused", 0.0))
            for prog in ("target", "draft"):
                link_tree(out / prog, staging / prog)
            m = old.replace(tokenizer=_copy_tokenizer(pair.target.path, staging))
            _copy_model_config(pair.target.path, staging)
        else:
            m = _export(pair, staging, options, B, key, steps)
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
    from dflash_qaic.compile.profiles import DEFAULT_PROFILE, load_profile
    from dflash_qaic.compile.qpc import compiler_search

    t_all = time.perf_counter()
    name = qpc_config or DEFAULT_PROFILE
    profile = (overrides or CompileOverrides()).apply(load_profile(name))
    path, _ = compiler_search(profile.compiler)
    if path is not None:
        log.info("compiler: %s", path)
    steps: list[tuple[str, str, float]] = []
    with _transaction(out_dir) as tx:
        out, staging = tx.out, tx.staging
        old = read_manifest(out, verify="none")
        log.info("verifying the files of %s", out)
        verify_files(out, old.files, "full")
        link_tree(out, staging, skip=(MANIFEST,))
        m = _stage(old, staging, out, old, profile, steps)
        tx.commit()
    _remember(tx.out, m)
    return ExportResult(m, tx.out, steps, time.perf_counter() - t_all)


def _remember(out: Path, m: Manifest) -> None:
    """Record the files just hashed (or verified) as verified (`files.VerifiedFiles`): the first
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
    check (every size and sha256, from the cache of verified files when unchanged), so deciding
    to reuse multi-GB programs costs well under a second (docs/DESIGN.md, Artifacts)."""
    if not (out / MANIFEST).is_file():
        return None
    try:
        old = read_manifest(out, verify="none")
    except ArtifactsError as e:
        log.info("not reusing %s: %s", out, e)
        return None
    if old.input_hash != key:
        return None
    try:
        verify_files(out, old.files, "fast")
    except ArtifactsError as e:
        log.info("not reusing %s: %s", out, e)
        return None
    return old


def _stage(m: Manifest, staging: Path, old_root, old, profile, steps) -> Manifest:
    """Compile in the staging directory, record every file, write the manifest there."""
    m = m.replace(
        target=replace(m.target, qpcs=(), compiler=None),
        draft=replace(m.draft, qpcs=(), compiler=None),
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
    from a verified old directory keeps its record instead of being hashed again."""
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


def _export(pair, out, o: ExportOptions, B: int, key: str, steps) -> Manifest:
    """The streaming export (export/weights.py): placeholder modules are traced, and the
    weights go from the safetensors files to the programs one tensor at a time."""
    import torch

    from dflash_qaic.export import weights
    from dflash_qaic.export.draft import export_draft
    from dflash_qaic.export.target import export_target

    t = time.perf_counter()
    # before any tracing: every weight finite and within fp16's range, read once (that read
    # gives the manifest's sha256 of each checkpoint too); fc's fp16 scale finite
    log.info("checking the weights of %s and %s", pair.target.path, pair.draft.path)
    digests = ck.check_weight_values(pair)
    fc_info = pair.draft_tensors["fc.weight"]
    fc = weights.load_fp32(fc_info)
    ck.fp16_fc_scale(fc, fc_info)
    steps.append(("check weights", "finite, within fp16", time.perf_counter() - t))
    t = time.perf_counter()
    log.info("reading %s and %s (structure only)", pair.target.path, pair.draft.path)
    target = weights.placeholder_target(pair.target)
    hidden_norm = weights.load_fp32(pair.draft_tensors["hidden_norm.weight"])
    embed, head = weights.placeholder_head(pair.target)
    steps.append(("load checkpoints", "structure + fc", time.perf_counter() - t))
    plan = o.shape_plan(B)
    windows = plan.windows
    common = dict(
        ctx_len=o.ctx_len,
        prefill_seq_len=o.prefill_seq_len,
        block_size=B,
        batch_size=o.batch_size,
        full_batch_size=o.full_batch_size,
        comp_ctx_lengths=list(windows),
        emit_logits=o.emit_logits,
        fp16_check=o.fp16_check,
        stream_from=pair,
    )
    # a DFlash-2 draft, sampling, a dense target: the draft samples its path and returns its q,
    # the target verifies q-aware (docs/DESIGN.md, DFlash-2 drafts)
    # With --verify-rule block any draft samples its proposals and returns its q (a DFlash
    # draft from its top-k), and the target verifies the block jointly (docs/DESIGN.md, Block
    # verification)
    block = o.verify_rule == contract.BLOCK and o.sampling
    q_aware = (pair.draft.dflash2 or block) and o.sampling and pair.target.hybrid is None
    k = pair.draft.selector_top_k if pair.draft.dflash2 else contract.DRAFT_SAMPLE_TOP_K
    draft_q = (B - 1, min(k, pair.target.vocab_size)) if q_aware else ()
    t = time.perf_counter()
    log.info(
        "exporting the target program (ctx %d, chunk %d, B %d)", o.ctx_len, o.prefill_seq_len, B
    )
    with torch.no_grad():
        tfacts = export_target(
            target,
            fc,
            hidden_norm,
            pair.draft.rms_norm_eps,
            pair.draft.target_layer_ids,
            out / "target" / "target.onnx",
            sampling=o.sampling,
            verify_lengths=list(plan.verify_lengths),
            draft_q=draft_q,
            token_bitmask=o.structured_output,
            verify_rule=o.verify_rule,
            **common,
        )
    del target
    steps.append(("export target", f"{tfacts['onnx_bytes'] / 1e6:.1f} MB", time.perf_counter() - t))

    t = time.perf_counter()
    log.info("exporting the draft program")
    with torch.no_grad():
        dfacts = export_draft(
            pair.draft,
            None,
            embed,
            head,
            out / "draft" / "draft.onnx",
            sampling=q_aware,
            sample_top_k=k if block else 0,
            top_k=o.draft_top_k,
            **common,
        )
    steps.append(("export draft", f"{dfacts['onnx_bytes'] / 1e6:.1f} MB", time.perf_counter() - t))
    tok = _copy_tokenizer(pair.target.path, out)
    _copy_model_config(pair.target.path, out)
    return Manifest(
        block_size=B,
        mask_token_id=pair.draft.mask_token_id,
        target_layer_ids=tuple(pair.draft.target_layer_ids),
        prefill_seq_len=plan.prefill_seq_len,
        ctx_len=plan.ctx_len,
        batch_size=plan.batch_size,
        vocab_size=pair.target.vocab_size,
        hidden_size=pair.target.hidden_size,
        target=Program.from_facts("target", tfacts, out),
        draft=Program.from_facts("draft", dfacts, out),
        prefill_lengths=plan.prefill_lengths,
        verify_lengths=plan.verify_lengths,
        draft_prefill_rows=plan.draft_prefill_rows,
        full_batch_size=plan.full_batch_size,
        comp_ctx_lengths=plan.windows,
        eos_token_ids=tuple(_eos_ids(pair.target.path)),
        tokenizer=tok,
        input_hash=key,
        sources={
            "target": {
                "path": str(pair.target.path.resolve()),
                "family": pair.target.family,
                "sha256": digests["target"],
            },
            "draft": {
                "path": str(pair.draft.path.resolve()),
                "sha256": digests["draft"],
            },
        },
        versions=_versions(),
    )


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


def _compile(m: Manifest, root: Path, profile, steps) -> Manifest:
    """Compile both programs inside `root`; the manifest with their QPC records."""
    from dflash_qaic.compile.qpc import compile_program

    programs, skipped = {}, None
    for prog in (m.target, m.draft):
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
        programs[prog.kind] = replace(prog, qpcs=res.qpcs, compiler=compiler)
        status = "skipped" if res.skipped else ("cached" if res.cached else "compiled")
        steps.append((f"compile {prog.kind}", status, time.perf_counter() - t))
        if res.skipped:
            skipped = skipped or {"looked_in": list(res.looked_in), "commands": []}
            skipped["commands"] += res.commands
    if skipped:  # a warning: shown even when logging is not configured
        log.warning(
            "no AI100 compiler found (looked in %s); the ONNX programs are complete for ONNX "
            "Runtime. On an AI100 host, in the artifacts directory, run: %s",
            ", ".join(skipped["looked_in"]),
            " ; ".join(skipped["commands"]),
        )
    return m.replace(
        target=programs["target"],
        draft=programs["draft"],
        qpc_config=profile.name,
        compile_skipped=skipped,
    )
