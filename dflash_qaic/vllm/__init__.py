"""vLLM platform plugin: `vllm serve ARTIFACTS` and `LLM(model=ARTIFACTS)` run our exported
programs (docs/DESIGN.md, vLLM platform plugin).

vLLM finds this package through the `vllm.platform_plugins` entry point and calls `register()`;
only vLLM imports this subpackage (`import dflash_qaic` never does). The plugin is active only
with `DFLASH_QAIC_VLLM=1` in the environment: otherwise `register()` returns None and vLLM picks
its own platform as if this package were not installed, so it never competes with vLLM's CPU
platform or with another out-of-tree platform (vLLM refuses two).

    DFLASH_QAIC_VLLM=1 vllm serve ARTIFACTS --max-num-seqs 4
    DFLASH_QAIC_VLLM=1 vllm serve TARGET --speculative-config \\
        '{"method": "dflash", "model": DRAFT, "num_speculative_tokens": 15}' \\
        --additional-config '{"dflash_qaic": {"artifacts": ARTIFACTS, "backend": "ort"}}'
"""

from __future__ import annotations

import os

#: the environment variable that turns the plugin on ("1")
ENV = "DFLASH_QAIC_VLLM"


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


def register() -> str | None:
    """vLLM's platform-plugin hook: the platform's qualified name when enabled, else None."""
    if not enabled():
        return None
    return "dflash_qaic.vllm.platform.DFlashQaicPlatform"
