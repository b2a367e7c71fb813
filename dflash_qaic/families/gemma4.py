"""Gemma 4 (31B dense, 26B-A4B MoE; docs/DESIGN.md, Layer kinds): sliding and full attention
layers of their own shapes, four norms and a scalar per layer, routed experts beside the MLP in
the MoE. Published as `Gemma4ForConditionalGeneration` (the text model's fields under
`text_config`, its tensors under model.language_model.*, vision and audio towers ignored), or in
the text-only form. Its layers are SANDWICH layers (modeling/gemma4.py) of the sliding and full
attention kinds, built by the one target skeleton (modeling/target.py)."""

from __future__ import annotations

from dataclasses import dataclass

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
    MoeTiny,
    TinyFields,
    decoder_dims,
)


@dataclass(frozen=True)
class Gemma4Tiny(TinyFields):
    """A tiny Gemma 4 target's fields (None: the tiny shapes of kind_checkpoints'
    `gemma4_tiny_config`): its sliding window, the full layers' head size and KV heads (V = K
    there); multimodal: the published Gemma4ForConditionalGeneration form."""

    target_sliding_window: int | None = None
    global_head_dim: int | None = None
    num_global_kv_heads: int | None = None
    multimodal: bool = False


@dataclass(frozen=True)
class Gemma4MoeTiny(Gemma4Tiny, MoeTiny):
    """Gemma 4's with routed experts beside every MLP."""


class Gemma4(Family):
    name = "gemma4"
    architectures = kinds.KIND_TARGETS["gemma4"]
    model_types = ("gemma4", "gemma4_text")
    ignored_prefixes = kinds.GEMMA4_IGNORED
    tiny = dict(target_layers=4, block_size=4, input_embedding_scale=8.0)
    tiny |= dict(final_logit_softcapping=30.0)
    scaled_embeddings = True
    tiny_fields = Gemma4Tiny
    tiny_layout = "gemma4"

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
        return gemma4_tiny_config(s, moe=False)


class Gemma4Moe(Gemma4):
    """A tiny-preset name only (dflash-make-tiny-pair --family gemma4_moe): a Gemma 4 checkpoint
    is the `gemma4` family whether its config enables the MoE block or not."""

    name = "gemma4_moe"
    architectures = ()
    model_types = ()
    tiny_fields = Gemma4MoeTiny

    def tiny_config(self, s):
        return gemma4_tiny_config(s, moe=True)


GEMMA4 = Gemma4()
GEMMA4_MOE = Gemma4Moe()


def gemma4_tiny_config(s, moe: bool):
    """A tiny Gemma 4 target (s: dflash_lab's TinySpec): sliding layers of window 8 and the last
    layer full (head_dim 2x and one KV head, V = K), √H embeddings, soft-capped logits; `moe`:
    routed experts beside every MLP; `s.multimodal`: the published Gemma4ForConditionalGeneration
    form with a one-layer vision tower."""
    from transformers import Gemma4Config, Gemma4TextConfig

    extra = {}
    if moe:
        extra = dict(enable_moe_block=True, num_experts=s.num_experts)
        extra |= dict(top_k_experts=s.num_experts_per_tok)
        extra |= dict(moe_intermediate_size=s.moe_intermediate_size)
    text = Gemma4TextConfig(
        **decoder_dims(s),
        # the tiny defaults, or a real-shape preset's (dflash_lab.tiny PRESETS["gemma-4-31b"])
        global_head_dim=getattr(s, "global_head_dim", None) or 2 * s.head_dim,
        num_global_key_value_heads=getattr(s, "num_global_kv_heads", None) or 1,
        attention_k_eq_v=True,
        sliding_window=getattr(s, "target_sliding_window", None) or 8,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,  # the multimodal model's forward reads it
        **extra,
    )
    if not s.multimodal:
        return text
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1)
    vision |= dict(num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    return Gemma4Config(text_config=text.to_dict(), vision_config=vision, audio_config=None)
