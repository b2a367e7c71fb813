"""Gemma 4 (31B dense, 26B-A4B MoE; docs/DESIGN.md, Layer kinds): sliding and full attention
layers of their own shapes, four norms and a scalar per layer, routed experts beside the MLP in
the MoE. Published as `Gemma4ForConditionalGeneration` (the text model's fields under
`text_config`, its tensors under model.language_model.*, vision and audio towers ignored), or in
the text-only form. Its layers are SANDWICH layers (modeling/gemma4.py) of the sliding and full
attention kinds, built by the one target skeleton (modeling/target.py)."""

from __future__ import annotations

from dflash_qaic import kind_checkpoints as kinds
from dflash_qaic.checkpoint_files.config import CheckpointError
from dflash_qaic.families.base import (
    ATTENTION,
    MLP,
    MOE,
    SANDWICH,
    SLIDING_ATTENTION,
    Family,
    LayerKind,
)


class Gemma4(Family):
    name = "gemma4"
    architectures = kinds.KIND_TARGETS["gemma4"]
    model_types = ("gemma4", "gemma4_text")
    ignored_prefixes = kinds.GEMMA4_IGNORED
    tiny = dict(target_layers=4, block_size=4, input_embedding_scale=8.0)
    tiny |= dict(final_logit_softcapping=30.0)
    scaled_embeddings = True

    def text_config(self, cfg, cpath):
        try:
            return kinds.text_config(cfg, cpath)
        except kinds.KindCheckpointError as e:
            raise CheckpointError(str(e)) from None

    def check_supported(self, text, path):
        try:
            kinds.check_supported(dict(text), path)
        except kinds.KindCheckpointError as e:
            raise CheckpointError(str(e)) from None
        if not text.get("tie_word_embeddings", True):
            raise CheckpointError(
                f"{path}: Gemma 4 with `tie_word_embeddings` false is not a published form; "
                "not supported"
            )

    def layer_kinds(self, text):
        mlp = MOE if text.get("enable_moe_block") else MLP
        window = text.get("sliding_window")
        return [
            LayerKind(ATTENTION, mlp, k, window if k == SLIDING_ATTENTION else None, SANDWICH)
            for k in kinds.layer_types(dict(text))
        ]

    def expected_shapes(self, t, fused=False):
        return kinds.gemma4_shapes(t.text, t.prefix, t.tie_word_embeddings)

    def checkpoint_name(self, t, param):
        _, i, rest = param.split(".", 2)  # layers.{i}.…
        return f"{t.prefix}layers.{i}.{kinds.GEMMA4_RENAMES.get(rest, rest)}"

    def tiny_config(self, s):
        return kinds.gemma4_tiny_config(s, moe=False)


class Gemma4Moe(Gemma4):
    """A tiny-preset name only (dflash-make-tiny-pair --family gemma4_moe): a Gemma 4 checkpoint
    is the `gemma4` family whether its config enables the MoE block or not."""

    name = "gemma4_moe"
    architectures = ()
    model_types = ()

    def tiny_config(self, s):
        return kinds.gemma4_tiny_config(s, moe=True)


GEMMA4 = Gemma4()
GEMMA4_MOE = Gemma4Moe()
