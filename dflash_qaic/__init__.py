"""dflash-qaic: DFlash speculative decoding for Qualcomm Cloud AI 100.

    import dflash_qaic
    dflash_qaic.export("models/Qwen3-4B", "models/Qwen3-4B-DFlash-b16", "artifacts/qwen3-4b",
                       num_speculative_tokens=15, ctx_len=4096, compile=False)
    dflash_qaic.compile("artifacts/qwen3-4b", num_cores=12, mxfp6_matmul=True)  # AI100 host
    pipe = dflash_qaic.load("artifacts/qwen3-4b", backend="ort")
    res = pipe.generate(prompt_ids, max_new_tokens=64)

Importing the package needs neither torch nor the AI100 SDK; `export` imports torch, `load`
imports what its backend needs. The library logs through the `dflash_qaic` logger.
"""

from __future__ import annotations

__version__ = "0.6.1"

from dflash_qaic.api import _document, compile, export  # noqa: A004
from dflash_qaic.runtime import load

_document()

__all__ = ["AutoDFlashModel", "__version__", "compile", "export", "load"]


def __getattr__(name: str):
    """`dflash_qaic.AutoDFlashModel` (QEfficient's habits, dflash_qaic/qeff.py), imported on
    first use so that importing the package stays light."""
    if name == "AutoDFlashModel":
        from dflash_qaic.qeff import AutoDFlashModel

        return AutoDFlashModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
