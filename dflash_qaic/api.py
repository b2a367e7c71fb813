"""The Python export and compile API (QEfficient-like), reached as `dflash_qaic.export(...)`
and `dflash_qaic.compile(...)`: the packages `dflash_qaic.export` and `dflash_qaic.compile` are
callable and call these functions (see their `__init__`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from dflash_qaic.extras import require

if TYPE_CHECKING:  # pragma: no cover
    from dflash_qaic.manifest import Manifest


def export(
    target: str | os.PathLike,
    draft: str | os.PathLike,
    out: str | os.PathLike,
    *,
    block_size: int | None = None,
    num_speculative_tokens: int | None = None,
    prefill_seq_len: int = 128,
    ctx_len: int = 4096,
    batch_size: int = 1,
    full_batch_size: int | None = None,
    comp_ctx_lengths: list[int] | None = None,
    verify_lengths: list[int] | None = None,
    emit_logits: bool = False,
    sampling: bool = True,
    fp16_check: bool = True,
    compile: bool = True,
    qpc_config: str | os.PathLike = "ai100_fp16",
    num_cores: int | None = None,
    num_devices: int | None = None,
    mxfp6_matmul: bool | None = None,
    mxint8_kv_cache: bool | None = None,
    mos: int | None = None,
    aic_enable_depth_first: bool | None = None,
    compile_timeout: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> Manifest:
    """Export a target + DFlash draft pair to an artifacts directory (`dflash-export` in Python).

    target, draft: local checkpoint directories (Hugging Face target; z-lab DFlash draft).
    out: the artifacts directory; written as a transaction (a previous good directory survives
        any failure), refused when it holds files the exporter did not write.
    block_size / num_speculative_tokens: B, or N = B − 1 as QEfficient and vLLM say it
        (default: the draft's block size); both given must agree.
    prefill_seq_len, ctx_len, batch_size: the prefill chunk C (and C/4 beside it when that
        exceeds B: a prompt's rest takes the fewest rows), KV slots and batch (1).
    full_batch_size: continuous batching with N cache rows, N sequences at once (None: off).
    comp_ctx_lengths: the attention windows, ascending, ending at ctx_len (None: ctx_len / 8,
        / 4, / 2 and ctx_len); each call reads the smallest one holding its positions.
    verify_lengths: the verify calls' row counts, ascending, ending at the block size (None:
        B/4, B/2, B); each step verifies the head of the block worth verifying (README).
    emit_logits: also output full logits; sampling: False = a greedy-only target program;
    fp16_check: run the fp16 graph check; compile: False = ONNX only.
    qpc_config: a compile profile name or YAML path; num_cores (the target's), num_devices,
        mxfp6_matmul, mxint8_kv_cache, mos, aic_enable_depth_first, compile_timeout (seconds)
        override it, with QEfficient's names.
    progress: called with one-line progress messages (default: silent).
    Returns the typed manifest. Raises `ExportError`, `CheckpointError`, `ProfileError` or
    `CompileError` (all with a message naming the problem and the fix); `MissingExtraError`
    without the `export` extra (pip install 'dflash-qaic[export]').
    """
    require("export", "dflash_qaic.export")
    from dflash_qaic.compile.profiles import CompileOverrides
    from dflash_qaic.export.artifacts import ExportOptions, build_artifacts
    from dflash_qaic.export.cli import block_size as _block_size

    options = ExportOptions(
        block_size=_block_size(block_size, num_speculative_tokens),
        prefill_seq_len=prefill_seq_len,
        ctx_len=ctx_len,
        batch_size=batch_size,
        full_batch_size=full_batch_size,
        comp_ctx_lengths=comp_ctx_lengths,
        verify_lengths=verify_lengths,
        emit_logits=emit_logits,
        sampling=sampling,
        qpc_config=qpc_config,
        compile=compile,
        fp16_check=fp16_check,
        compile_overrides=CompileOverrides(
            num_cores=num_cores,
            mxfp6_matmul=mxfp6_matmul,
            mxint8_kv_cache=mxint8_kv_cache,
            num_devices=num_devices,
            mos=mos,
            aic_enable_depth_first=aic_enable_depth_first,
            timeout_s=compile_timeout,
        ),
    )
    res = build_artifacts(target, draft, out, options, progress=progress or (lambda _m: None))
    return res.manifest


def compile(  # noqa: A001 - QEfficient's name
    artifacts_dir: str | os.PathLike,
    *,
    qpc_config: str | os.PathLike | None = None,
    num_cores: int | None = None,
    num_devices: int | None = None,
    mxfp6_matmul: bool | None = None,
    mxint8_kv_cache: bool | None = None,
    mos: int | None = None,
    aic_enable_depth_first: bool | None = None,
    compile_timeout: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> Manifest:
    """Compile the programs of an artifacts directory to QPCs (e.g. one exported with
    `compile=False` elsewhere and copied to an AI100 host). Options as in `export`; the
    manifest is rewritten as a transaction. Returns the typed manifest."""
    require("export", "dflash_qaic.compile")
    from dflash_qaic.compile.profiles import CompileOverrides
    from dflash_qaic.export.artifacts import compile_artifacts

    overrides = CompileOverrides(
        num_cores=num_cores,
        mxfp6_matmul=mxfp6_matmul,
        mxint8_kv_cache=mxint8_kv_cache,
        num_devices=num_devices,
        mos=mos,
        aic_enable_depth_first=aic_enable_depth_first,
        timeout_s=compile_timeout,
    )
    say = progress or (lambda _m: None)
    return compile_artifacts(artifacts_dir, qpc_config, overrides, progress=say).manifest
