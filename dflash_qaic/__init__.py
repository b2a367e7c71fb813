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
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
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


# `dflash_qaic.export(...)` / `dflash_qaic.compile(...)`: callable packages (dflash_qaic.api).
from dflash_qaic import compile, export  # noqa: E402, A004

__all__ = ["__version__", "compile", "export", "load"]
