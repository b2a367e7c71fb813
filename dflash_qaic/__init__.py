"""dflash-qaic: DFlash speculative decoding for Qualcomm Cloud AI 100.

    import dflash_qaic
    dflash_qaic.export("models/Qwen3-4B", "models/Qwen3-4B-DFlash-b16", "artifacts/qwen3-4b",
                       num_speculative_tokens=15, ctx_len=4096, compile=False)
    dflash_qaic.compile("artifacts/qwen3-4b", num_cores=12, mxfp6_matmul=True)  # AI100 host
    pipe = dflash_qaic.load("artifacts/qwen3-4b", backend="ort")
    res = pipe.generate(prompt_ids, max_new_tokens=64)

Importing the package needs neither torch nor the AI100 SDK; `export` imports torch, `load`
imports what its backend needs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from dflash_qaic.manifest import Manifest
    from dflash_qaic.runtime.pipeline import Pipeline


def load(
    artifacts_dir: str | os.PathLike,
    backend: str = "ort",
    *,
    threads: int | None = None,
    tokenizer: bool = True,
    verify: str = "fast",
) -> Pipeline:
    """Load an artifacts directory written by `dflash-export` / `dflash_qaic.export`.

    backend: "ort" (ONNX Runtime, any machine), "qaic" (AI100), "auto" (qaic when available
        and compiled, else ort).
    threads: ONNX Runtime intra-op threads, 1 … 4 × cores; None = ONNX Runtime's default.
    tokenizer: load the tokenizer the artifacts carry (needed for text prompts).
    verify: "fast" (sizes of all files, sha256 of files ≤ 64 MiB), "full" (sha256 of all) or
        "none". A damaged or untrusted directory raises `dflash_qaic.runtime.ArtifactsError`.
    """
    from dflash_qaic.runtime import load as _load

    return _load(artifacts_dir, backend, threads=threads, tokenizer=tokenizer, verify=verify)


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
    prefill_seq_len, ctx_len, batch_size: the prefill chunk, KV slots and batch (1).
    emit_logits: also output full logits; sampling: False = a greedy-only target program;
    fp16_check: run the fp16 graph check; compile: False = ONNX only.
    qpc_config: a compile profile name or YAML path; num_cores (the target's), num_devices,
        mxfp6_matmul, mxint8_kv_cache, mos, aic_enable_depth_first, compile_timeout (seconds)
        override it, with QEfficient's names.
    progress: called with one-line progress messages (default: silent).
    Returns the typed manifest. Raises `ExportError`, `CheckpointError`, `ProfileError` or
    `CompileError` (all with a message naming the problem and the fix).
    """
    from dflash_qaic.compile.profiles import CompileOverrides
    from dflash_qaic.export.artifacts import ExportOptions, build_artifacts
    from dflash_qaic.export.cli import block_size as _block_size

    options = ExportOptions(
        block_size=_block_size(block_size, num_speculative_tokens),
        prefill_seq_len=prefill_seq_len,
        ctx_len=ctx_len,
        batch_size=batch_size,
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


def compile(  # noqa: A001 - the QEfficient-style name
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


__all__ = ["__version__", "compile", "export", "load"]
