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
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_qaic import __version__, contract
from dflash_qaic import checkpoints as ck
from dflash_qaic.compile.profiles import CompileOverrides
from dflash_qaic.export.transaction import Transaction, TransactionError, link_tree
from dflash_qaic.manifest import FORMAT as _FORMAT
from dflash_qaic.manifest import NAME as MANIFEST
from dflash_qaic.manifest import VERSION as _VERSION
from dflash_qaic.manifest import (
    ArtifactsError,
    FileRecord,
    Manifest,
    QpcRecord,
    read_manifest,
    verify_file,
    write_manifest,
)

TOKENIZER_FILES = ck.TOKENIZER_FILES
GENERATION_CONFIG = "generation_config.json"
MAX_CTX_LEN = 1 << 18  # 262144 slots: beyond any supported model's context
MAX_BLOCK_SIZE = 1024
MAX_BATCH_SIZE = 1024


class ExportError(ValueError):
    """Bad export options or inputs: says what is wrong and how to fix it."""


@dataclass(frozen=True)
class ExportOptions:
    block_size: int | None = None  # None: the draft's own block size
    prefill_seq_len: int = 128
    ctx_len: int = 4096
    batch_size: int = 1
    full_batch_size: int | None = None  # continuous batching with this many cache rows
    comp_ctx_lengths: tuple[int, ...] | None = None  # attention windows; None: the default ones
    verify_lengths: tuple[int, ...] | None = None  # verify calls' rows; None: the default ones
    emit_logits: bool = False
    sampling: bool = True  # False: a greedy-only target program (no sampler in the graph)
    qpc_config: str = "ai100_fp16"
    compile: bool = True
    fp16_check: bool = True
    compile_overrides: CompileOverrides = field(default_factory=CompileOverrides)

    def __post_init__(self):
        ints = (
            ("block_size", 2, MAX_BLOCK_SIZE, True),
            ("prefill_seq_len", 1, MAX_CTX_LEN, False),
            ("ctx_len", 4, MAX_CTX_LEN, False),
            ("batch_size", 1, MAX_BATCH_SIZE, False),
            ("full_batch_size", 1, MAX_BATCH_SIZE, True),
        )
        for name, lo, hi, optional in ints:
            v = getattr(self, name)
            if optional and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                flag = "--" + name.replace("_", "-")
                raise ExportError(f"{flag} must be an integer in [{lo}, {hi}], got {v!r}")
        w = self.comp_ctx_lengths
        if w is not None:
            ok = isinstance(w, (list, tuple)) and all(
                isinstance(n, int) and not isinstance(n, bool) and 1 <= n for n in w
            )
            if not ok or not w or list(w) != sorted(set(w)) or w[-1] != self.ctx_len:
                raise ExportError(
                    f"--comp-ctx-lengths must be distinct ascending integers ending at --ctx-len "
                    f"{self.ctx_len}, got {w!r}: e.g. {self.ctx_len // 4},{self.ctx_len // 2},"
                    f"{self.ctx_len}"
                )
            object.__setattr__(self, "comp_ctx_lengths", tuple(w))
        v = self.verify_lengths
        if v is not None:
            if not isinstance(v, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in v
            ):
                raise ExportError(f"--verify-lengths must be integers, got {v!r}: e.g. 4,8,16")
            object.__setattr__(self, "verify_lengths", tuple(v))
        for name in ("emit_logits", "sampling", "compile", "fp16_check"):
            if not isinstance(getattr(self, name), bool):
                raise ExportError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.qpc_config, (str, os.PathLike)):
            raise ExportError(f"qpc_config must be a profile name or path, got {self.qpc_config!r}")
        if not isinstance(self.compile_overrides, CompileOverrides):
            raise ExportError("compile_overrides must be a CompileOverrides")

    def program_options(self, block_size: int) -> dict:
        """The options that change the exported programs (part of the reuse key)."""
        d = asdict(self)
        for k in ("compile", "qpc_config", "compile_overrides"):
            d.pop(k)
        return {**d, "block_size": block_size}


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


def _check_target_support(pair: ck.Pair) -> None:
    """What the modeling code refuses at export time, checked from the configs up front."""
    for what, raw, path in (
        ("target", pair.target.text or pair.target.raw, pair.target.path),
        ("draft", pair.draft.raw or {}, pair.draft.path),
    ):
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ExportError(
                f"{path / 'config.json'}: hidden_act {act!r} is not supported (the {what} "
                "modules implement silu only)"
            )
        for key in ("rope_parameters", "rope_scaling"):
            _check_rope(raw.get(key) or {}, path / "config.json")
    types = pair.target.raw.get("layer_types") or []
    if pair.target.hybrid is None and any(t != "full_attention" for t in types):
        raise ExportError(
            f"{pair.target.path / 'config.json'}: sliding-window layers are not supported "
            f"(layer_types {sorted(set(types))})"
        )


def _check_rope(rope, where: Path) -> None:
    rtype = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if not isinstance(rtype, str) or rtype in ck.UNSUPPORTED_ROPE_TYPES:
        raise ExportError(
            f"{where}: rope type {rtype!r} is not supported (it depends on the sequence "
            "length); supported: default and the static scalings (linear, llama3, yarn, …)"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rtype != "default" and rtype not in ROPE_INIT_FUNCTIONS:
        raise ExportError(f"{where}: unknown rope type {rtype!r}")


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
    _check_target_support(pair)
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
) -> ExportResult:
    """Export (or reuse), compile (or skip), and write the manifest, as one transaction."""
    t_all = time.perf_counter()
    pair, B, profile = preflight(target_dir, draft_dir, options)
    steps: list[tuple[str, str, float]] = []
    with _transaction(out_dir) as tx:
        out, staging = tx.out, tx.staging
        key = input_hash(pair, options, B)
        old = _reusable(out, key, progress)
        if old is not None:
            progress(f"reusing the exported programs in {out} (inputs unchanged, hash {key})")
            steps.append(("export", "reused", 0.0))
            for prog in ("target", "draft"):
                link_tree(out / prog, staging / prog)
            data = old.to_json()
            data["tokenizer"] = _copy_tokenizer(pair.target.path, staging)
        else:
            data = _export(pair, staging, options, B, key, progress, steps)
        data["options"] = json.loads(json.dumps(asdict(options), default=str))
        m = _stage(data, staging, out if old is not None else None, old, profile, progress, steps)
        tx.commit()
    return ExportResult(m, tx.out, steps, time.perf_counter() - t_all)


def compile_artifacts(
    out_dir: str | Path,
    qpc_config: str | os.PathLike | None = None,
    overrides: CompileOverrides | None = None,
    progress: Callable[[str], None] = print,
) -> ExportResult:
    """Compile (or re-compile with another profile) an existing artifacts directory, e.g. one
    exported with --no-compile and copied to an AI100 host. A transaction like an export."""
    from dflash_qaic.compile.profiles import DEFAULT_PROFILE, load_profile
    from dflash_qaic.compile.qpc import compiler_search

    t_all = time.perf_counter()
    name = qpc_config or DEFAULT_PROFILE
    profile = (overrides or CompileOverrides()).apply(load_profile(name))
    compiler_search(profile.compiler)
    steps: list[tuple[str, str, float]] = []
    with _transaction(out_dir) as tx:
        out, staging = tx.out, tx.staging
        old = read_manifest(out, verify="none")
        progress(f"verifying the files of {out}")
        for rec in old.files:
            verify_file(out, rec, "full", progress)
        link_tree(out, staging, skip=(MANIFEST,))
        data = old.to_json()
        m = _stage(data, staging, out, old, profile, progress, steps)
        tx.commit()
    return ExportResult(m, tx.out, steps, time.perf_counter() - t_all)


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


def _reusable(out: Path, key: str, progress) -> Manifest | None:
    """The old manifest when its programs can be reused: same key, files intact — the load-time
    check (every size, the sha256 of every file up to HASH_AT_LOAD_BYTES), so deciding to reuse
    multi-GB programs costs well under a second (docs/DESIGN.md, Artifacts)."""
    if not (out / MANIFEST).is_file():
        return None
    try:
        old = read_manifest(out, verify="none")
    except ArtifactsError as e:
        progress(f"not reusing {out}: {e}")
        return None
    if old.input_hash != key:
        return None
    try:
        for rec in old.files:
            verify_file(out, rec, "fast", progress)
    except ArtifactsError as e:
        progress(f"not reusing {out}: {e}")
        return None
    return old


def _stage(data: dict, staging: Path, old_root, old, profile, progress, steps) -> Manifest:
    """Compile in the staging directory, record every file, write the manifest there."""
    for prog in ("target", "draft"):
        data[prog] = {**data[prog], "qpc": [], "compiler": None}
    data.update(compile_skipped=None, files=[], qpc_config=None)
    m = Manifest.from_json({"format": _FORMAT, "version": _VERSION, **data}, "export", False)
    if profile is not None:
        m = _compile(m, staging, profile, progress, steps)
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
    out = []
    for rel in paths:
        rec = known.get(rel)
        same = rec is not None and old_root is not None and (old_root / rel).is_file()
        if same and os.path.samefile(root / rel, old_root / rel):
            out.append(rec)
        else:
            out.append(FileRecord.of(root, rel))
    return out


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
        full_batch_size=o.full_batch_size,
        comp_ctx_lengths=o.comp_ctx_lengths and list(o.comp_ctx_lengths),
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
            verify_lengths=o.verify_lengths and list(o.verify_lengths),  # None: the default
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
    plan = contract.shape_plan(
        B,
        o.prefill_seq_len,
        o.ctx_len,
        batch_size=o.batch_size,
        full_batch_size=o.full_batch_size,
        windows=tfacts["comp_ctx_lengths"],
        verify_lengths=o.verify_lengths and list(o.verify_lengths),
        sampling=o.sampling,
    )
    progress("hashing the checkpoint files for the manifest")
    return {
        "input_hash": key,
        "block_size": B,
        "mask_token_id": pair.draft.mask_token_id,
        "target_layer_ids": list(pair.draft.target_layer_ids),
        "prefill_seq_len": o.prefill_seq_len,
        "ctx_len": o.ctx_len,
        "batch_size": o.batch_size,
        "full_batch_size": o.full_batch_size,
        "comp_ctx_lengths": tfacts["comp_ctx_lengths"],
        "prefill_lengths": list(plan.prefill_lengths),
        "verify_lengths": list(plan.verify_lengths),
        "draft_prefill_rows": list(plan.draft_prefill_rows),
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


def _compile(m: Manifest, root: Path, profile, progress, steps) -> Manifest:
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
            progress=progress,
            root=root,
        )
        qpcs = []
        for q in res.to_dict(relative_to=root)["qpcs"]:
            q.update(specializations=tuple(q["specializations"]), device_ids=tuple(q["device_ids"]))
            qpcs.append(QpcRecord(**q))
        compiler = str(res.compiler) if res.compiler else None
        programs[prog.kind] = prog.__class__(
            **{**prog.__dict__, "qpcs": tuple(qpcs), "compiler": compiler}
        )
        status = "skipped" if res.skipped else ("cached" if res.cached else "compiled")
        steps.append((f"compile {prog.kind}", status, time.perf_counter() - t))
        if res.skipped:
            skipped = skipped or {"looked_in": list(res.looked_in), "commands": []}
            skipped["commands"] += res.commands
    return m.replace(
        target=programs["target"],
        draft=programs["draft"],
        qpc_config=profile.name,
        compile_skipped=skipped,
    )
