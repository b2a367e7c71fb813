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

__version__ = "0.5.0"

# `dflash_qaic.export(...)` / `dflash_qaic.compile(...)`: callable packages (dflash_qaic.api);
# `load` is the runtime's own (its imports are light: numpy; a backend's on first use).
from dflash_qaic import compile, export  # noqa: E402, A004
from dflash_qaic.runtime import load  # noqa: E402

__all__ = ["__version__", "compile", "export", "load"]
