"""dflash-qaic: DFlash speculative decoding for Qualcomm Cloud AI 100.

    import dflash_qaic
    pipe = dflash_qaic.load("artifacts/", backend="ort")
    res = pipe.generate(prompt_ids, max_new_tokens=64)

Importing the package needs neither torch nor the AI100 SDK; the runtime imports what its
backend needs when `load` is called.
"""

from __future__ import annotations

__version__ = "0.1.0"


def load(artifacts_dir, backend: str = "ort", **kwargs):
    """Load an artifacts directory; see `dflash_qaic.runtime.load`."""
    from dflash_qaic.runtime import load as _load

    return _load(artifacts_dir, backend=backend, **kwargs)


__all__ = ["__version__", "load"]
