"""Qwen3.5 / Qwen3.6 dense hybrids (docs/DESIGN.md, Hybrid targets): Gated DeltaNet layers
(`linear_attention`) beside output-gated full attention with partial RoPE, zero-centred RMSNorm
weights. Published multimodal (`Qwen3_5ForConditionalGeneration`: the text model's fields under
`text_config`, its tensors under `model.language_model.*`, a vision tower and an MTP head no
program uses) or text-only (`Qwen3_5ForCausalLM`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dflash_qaic.checkpoint_files.config import (
    POSITIVE_INT,
    CheckpointError,
    check_decoder_supported,
    positive,
)
from dflash_qaic.families.base import (
    DELTANET,
    GATED_ATTENTION,
    MLP,
    MOE,
    Family,
    LayerKind,
    TinyFields,
)

DELTANET_FIELDS = {
    "full_attention_interval": POSITIVE_INT,
    "linear_num_key_heads": POSITIVE_INT,
    "linear_num_value_heads": POSITIVE_INT,
    "linear_key_head_dim": POSITIVE_INT,
    "linear_value_head_dim": POSITIVE_INT,
    "linear_conv_kernel_dim": POSITIVE_INT,
}


def hybrid_layer_types(cfg: Mapping, cpath: Path) -> list[str]:
    """`layer_types` (linear_attention and full_attention, at least one full layer); Hugging
    Face's default when absent: every `full_attention_interval`-th layer full."""
    n = positive(cfg, "num_hidden_layers", cpath)
    types = cfg.get("layer_types")
    if types is None:
        every = positive(cfg, "full_attention_interval", cpath, 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if (
        not isinstance(types, list)
        or len(types) != n
        or not set(types) <= {"linear_attention", "full_attention"}
        or "full_attention" not in types
    ):
        raise CheckpointError(
            f"{cpath}: `layer_types` must list {n} entries of linear_attention / full_attention "
            f"with at least one full_attention layer, got {types!r}"
        )
    return list(types)


def deltanet_dims(cfg: Mapping, cpath: Path) -> dict:
    """The Gated DeltaNet fields of a hybrid text config, validated: layer_types, the linear
    heads and dims, and the conv kernel."""
    types = hybrid_layer_types(cfg, cpath)
    dims = {
        k: positive(cfg, k, cpath, dflt)
        for k, dflt in (
            ("linear_num_key_heads", 16),
            ("linear_num_value_heads", 32),
            ("linear_key_head_dim", 128),
            ("linear_value_head_dim", 128),
            ("linear_conv_kernel_dim", 4),
        )
    }
    if dims["linear_num_value_heads"] % dims["linear_num_key_heads"]:
        raise CheckpointError(
            f"{cpath}: `linear_num_value_heads` {dims['linear_num_value_heads']} must be a "
            f"multiple of `linear_num_key_heads` {dims['linear_num_key_heads']}"
        )
    return {"layer_types": types, **dims}


@dataclass(frozen=True)
class HybridTiny(TinyFields):
    """A tiny Qwen3.5 target's fields: its Gated DeltaNet heads, conv kernel and full-attention
    interval (every full_attention_interval-th layer full); its full attention's heads (None:
    the draft's num_heads / num_kv_heads / head_dim); multimodal: the published
    Qwen3_5ForConditionalGeneration form (text_config, a token vision tower)."""

    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_head_dim: int = 16
    conv_kernel: int = 4
    full_attention_interval: int = 4
    attn_heads: int | None = None
    attn_kv_heads: int | None = None
    attn_head_dim: int | None = None
    multimodal: bool = False


class Qwen3_5(Family):
    name = "qwen3_5"
    architectures = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
    model_types = ("qwen3_5", "qwen3_5_text")  # the text-only form's model_type
    hybrid = True
    zero_centred_norms = True
    fields = DELTANET_FIELDS
    # the vision tower and the multi-token-prediction head (Hugging Face ignores them too)
    ignored_prefixes = ("model.visual.", "mtp.")
    tiny_fields = HybridTiny
    tiny_layout = "hybrid"

    def text_config(self, cfg, cpath):
        if "text_config" not in cfg:  # the text-only form
            return cfg, "model."
        text = cfg["text_config"]
        if not isinstance(text, dict):
            raise CheckpointError(f"{cpath}: `text_config` must be an object of config fields")
        return text, "model.language_model."

    def read_fields(self, text, cpath, n_layers):
        return {
            "deltanet": deltanet_dims(text, cpath),
            **super().read_fields(text, cpath, n_layers),
        }

    def check_supported(self, text, path):
        # its layer_types are its linear / full attention layers
        check_decoder_supported(text, path, "target")
        hybrid_layer_types(text, path)

    def layer_kinds(self, text):
        types = hybrid_layer_types(text, Path("config.json"))
        mixer = {"linear_attention": DELTANET, "full_attention": GATED_ATTENTION}
        return [LayerKind(mixer[k], MOE if self.moe else MLP) for k in types]

    def attention_shapes(self, t):
        out = super().attention_shapes(t)  # q_proj twice as wide: the query and its gate
        return out | {"self_attn.q_proj.weight": [2 * t.num_heads * t.head_dim, t.hidden_size]}

    def deltanet_shapes(self, t) -> dict[str, list[int]]:
        H, h = t.hidden_size, t.deltanet
        kd = h["linear_num_key_heads"] * h["linear_key_head_dim"]
        hv = h["linear_num_value_heads"]
        vd = hv * h["linear_value_head_dim"]
        conv = 2 * kd + vd
        return {
            "linear_attn.in_proj_qkv.weight": [conv, H],
            "linear_attn.in_proj_z.weight": [vd, H],
            "linear_attn.in_proj_b.weight": [hv, H],
            "linear_attn.in_proj_a.weight": [hv, H],
            "linear_attn.conv1d.weight": [conv, 1, h["linear_conv_kernel_dim"]],
            "linear_attn.A_log": [hv],
            "linear_attn.dt_bias": [hv],
            "linear_attn.norm.weight": [h["linear_value_head_dim"]],
            "linear_attn.out_proj.weight": [H, vd],
        }

    def layer_shapes(self, t, i, fused):
        mixer = t.deltanet["layer_types"][i] == "linear_attention"
        mix = self.deltanet_shapes(t) if mixer else self.attention_shapes(t)
        return self.mlp_shapes(t, i, fused) | mix

    def tiny_config(self, s):
        return hybrid_tiny_config(s, moe=False)


# The tiny preset's token vision tower in the published form (the exporter must ignore it).
TINY_VISION_TENSORS = {"model.visual.patch_embed.proj.weight": (32, 3, 2, 16, 16)}
TINY_VISION_TENSORS |= {"model.visual.merger.linear_fc2.weight": (64, 128)}


def hybrid_tiny_config(s, moe: bool):
    """Qwen3_5(Moe)TextConfig (the text-only form) or Qwen3_5(Moe)Config around it (the
    published form, `s.multimodal`)."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5MoeConfig,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    text = dict(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.target_layers,
        num_attention_heads=s.attn_heads or s.num_heads,
        num_key_value_heads=s.attn_kv_heads or s.num_kv_heads,
        head_dim=s.attn_head_dim or s.head_dim,
        linear_num_key_heads=s.linear_key_heads,
        linear_num_value_heads=s.linear_value_heads,
        linear_key_head_dim=s.linear_head_dim,
        linear_value_head_dim=s.linear_head_dim,
        linear_conv_kernel_dim=s.conv_kernel,
        layer_types=[
            "full_attention" if (i + 1) % s.full_attention_interval == 0 else "linear_attention"
            for i in range(s.target_layers)
        ],
        max_position_embeddings=s.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=s.tie_word_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": s.rope_theta,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if moe:
        del text["intermediate_size"]
        text |= dict(
            num_experts=s.num_experts,
            num_experts_per_tok=s.num_experts_per_tok,
            moe_intermediate_size=s.moe_intermediate_size,
            shared_expert_intermediate_size=s.shared_expert_intermediate_size,
        )
    if not s.multimodal:
        return (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**text)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)
    vision |= dict(out_hidden_size=s.hidden_size)
    cfg = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=text, vision_config=vision)
    cfg.tie_word_embeddings = s.tie_word_embeddings
    return cfg


QWEN3_5 = Qwen3_5()
