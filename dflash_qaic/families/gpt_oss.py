"""gpt-oss (20b, 120b; docs/DESIGN.md, Layer kinds): attention sinks, alternating sliding and full
layers, a biased top-4 router and clamped SwiGLU experts. Its program is modeling/gpt_oss.py's,
built from a loaded `GptOssForCausalLM` (export.target.export_target); the published checkpoints'
MXFP4 experts are dequantized exactly by dflash_qaic/mxfp4.py, but reading a gpt-oss checkpoint
directory for the streamed export is not built yet, and is refused."""

from __future__ import annotations

from dflash_qaic.checkpoint_files.config import CheckpointError
from dflash_qaic.families.base import ATTENTION, MOE, Family


class GptOss(Family):
    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)
    moe = True
    program = "gpt_oss"  # modeling/gpt_oss.py ExportGptOssTarget

    def read(self, directory, cfg):
        raise CheckpointError(
            f"{directory / 'config.json'}: gpt-oss checkpoints are not read by dflash-export yet "
            "(the program is built from a loaded GptOssForCausalLM: "
            "dflash_qaic.export.target.export_target)"
        )

    def check_supported(self, text, path):
        kinds = set(text.get("layer_types") or [])
        if not kinds <= {"sliding_attention", "full_attention"}:
            raise CheckpointError(f"{path}: gpt-oss `layer_types` {sorted(kinds)} not supported")

    def tiny_config(self, s):
        raise ValueError(
            "no tiny gpt-oss pair yet: its checkpoints are not read by dflash-export (build the "
            "program from a loaded GptOssForCausalLM, as tests/test_gpt_oss.py does)"
        )

    def layer_kinds(self, text):
        return [(ATTENTION, MOE)] * int(text["num_hidden_layers"])


GPT_OSS = GptOss()
