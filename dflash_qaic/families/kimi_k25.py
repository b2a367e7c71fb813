"""Kimi K2.5's published multimodal wrapper (transformers `kimi_k25`, docs/DESIGN.md, Latent
attention): a DeepSeek-V3-shaped text model (families/deepseek_v3.py) with a vision tower and a
projector beside it. config.json keeps the text model's fields in `text_config` (its
`model_type` kimi_k2 or deepseek_v3); the checkpoint stores the text model under
`language_model.model.*` and its head as `language_model.lm_head.weight` (the layout the
published checkpoint uses, and transformers' `kimi_k25` conversion renames from); the vision
tower's and projector's tensors (`vision_tower.*`, `mm_projector.*`) are ignored by name, as
no program reads them. Hugging Face's causal-LM auto class does not build the wrapper, so the
model is built from its text config (`text_model`): DeepSeek-V3's.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_qaic.checkpoint_files.config import CheckpointError
from dflash_qaic.families.deepseek_v3 import DeepseekTiny, DeepseekV3, tiny_tensors

PREFIX = "language_model.model."
HEAD = "language_model.lm_head.weight"
# a tiny vision tower and projector (names as published; no program reads them)
TINY_VISION = {
    "vision_tower.patch_embed.proj.weight": (32, 3, 14, 14),
    "vision_tower.encoder.blocks.0.wqkv.weight": (96, 32),
    "vision_tower.encoder.blocks.0.wo.weight": (32, 32),
    "vision_tower.encoder.blocks.0.norm0.weight": (32,),
    "vision_tower.encoder.final_layernorm.weight": (32,),
    "mm_projector.proj.0.weight": (64, 128),
    "mm_projector.proj.2.weight": (64, 64),
}


@dataclass(frozen=True)
class KimiK25Tiny(DeepseekTiny):
    """A tiny Kimi K2.5 target: DeepSeek-V3's fields, in the wrapper form; multimodal: with a
    tiny vision tower's and projector's tensors beside the text model's."""

    multimodal: bool = False


class KimiK25(DeepseekV3):
    name = "kimi_k25"
    architectures = ("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration")
    model_types = ("kimi_k25",)
    ignored_prefixes = ("vision_tower.", "mm_projector.")
    text_model = True  # built from its text config (no causal-LM class of the wrapper)
    head = HEAD
    tiny_fields = KimiK25Tiny

    def text_config(self, cfg, cpath):
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(
                f"{cpath}: a Kimi K2.5 config (model_type kimi_k25) keeps the text model's "
                "fields in `text_config`, an object of config fields; it has none"
            )
        return text, PREFIX

    def text_model_config(self, text):
        # the published text config's model_type kimi_k2 is DeepSeek-V3's (as transformers'
        # Kimi_K25Config reads it)
        return super().text_model_config(text) | {"model_type": "deepseek_v3"}

    def tiny_tensors(self, s):
        out = tiny_tensors(self, s)
        if s.multimodal:
            out += [(k, v, "norm" if len(v) == 1 else "linear") for k, v in TINY_VISION.items()]
        return out

    def tiny_config(self, s):
        from transformers import DeepseekV3Config, Kimi_K25Config

        text = DeepseekV3Config(
            **self.tiny_fields_of(s), first_k_dense_replace=s.first_k_dense_replace
        )
        vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1)
        vision |= dict(num_attention_heads=2, patch_size=14)
        cfg = Kimi_K25Config(
            text_config=text.to_dict(),
            vision_config=vision,
            projection_hidden_size=32,
            tie_word_embeddings=s.tie_word_embeddings,
        )
        cfg.architectures = [self.architectures[0]]
        return cfg


KIMI_K25 = KimiK25()
