"""The checks of an export that need no heavy work, run before any (docs/DESIGN.md, Artifacts):
the options against the pair, the compile profile and compiler, generation_config.json's EOS
ids, the tokenizer files; and the reuse key of an export's inputs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dflash_qaic import __version__, contract
from dflash_qaic import checkpoints as ck
from dflash_qaic.exporter.options import ExportError, ExportOptions

TOKENIZER_FILES = ck.TOKENIZER_FILES
GENERATION_CONFIG = "generation_config.json"


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


def eos_ids(target_dir: Path) -> list[int]:
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


@dataclass(frozen=True)
class Preflight:
    """What the preflight established: the pair, the shape plan both programs are exported
    for (built here, once: the exporters and the manifest take it), the compile profile (None:
    --no-compile)."""

    pair: ck.Pair
    plan: contract.ShapePlan
    profile: object | None

    @property
    def block_size(self) -> int:
        return self.plan.block_size


def preflight(target_dir, draft_dir, o: ExportOptions) -> Preflight:
    """Every check that needs no heavy work, and the shape plan."""
    pair = ck.read_pair(target_dir, draft_dir)  # validation: one clear error per problem
    B = validate_options(pair, o)
    profile = None
    if o.compile:
        from dflash_qaic.compiler.profiles import load_profile
        from dflash_qaic.compiler.qpc import compiler_search

        profile = o.compile_overrides.apply(load_profile(o.qpc_config))
        compiler_search(profile.compiler)  # a bad $QAIC_COMPILER fails now, not after export
    eos = eos_ids(pair.target.path)
    bad = [e for e in eos if e >= pair.target.vocab_size]
    if bad:
        raise ExportError(
            f"{pair.target.path}: eos_token_id {bad} is outside the vocabulary of "
            f"{pair.target.vocab_size}: fix generation_config.json"
        )
    _check_tokenizer(pair.target.path, pair.target.vocab_size)
    return Preflight(pair, o.shape_plan(B), profile)
