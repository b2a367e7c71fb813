"""Checkpoint facts of the targets with layer kinds (Gemma 4; docs/DESIGN.md, Layer kinds): what
their config.json may hold, their text model's config and tensor prefix, every tensor the target
program reads with its shape, the checkpoint tensors no program uses, and the program parameters
whose checkpoint names differ. dflash_qaic/checkpoints.py and exporter/weights.py ask here.
"""

from __future__ import annotations

from pathlib import Path

KIND_TARGETS = {"gemma4": ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM")}
KIND_TEXT_MODEL_TYPES = {"gemma4_text": "gemma4"}
# the published multimodal form's towers and embedders (Hugging Face's text model ignores them)
GEMMA4_IGNORED = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.")
GEMMA4_IGNORED += ("model.embed_audio.",)
# refused, naming the field: what the 31B / 26B-A4B targets leave unset
GEMMA4_REFUSED = {
    "hidden_size_per_layer_input": "per-layer input embeddings (Gemma 4 E2B/E4B)",
    "num_kv_shared_layers": "KV-shared layers (Gemma 4 E2B/E4B)",
    "use_bidirectional_attention": "bidirectional attention",
    "use_double_wide_mlp": "double-wide MLPs",
    "attention_bias": "attention biases",
}


class KindCheckpointError(ValueError):
    """Raised as checkpoints.CheckpointError by the caller's wrapper (same message)."""


def text_config(cfg: dict, cpath: Path) -> tuple[dict, str]:
    """(text config, tensor prefix): the published multimodal form keeps the text model's config
    in `text_config` and its tensors under model.language_model.*; the text-only form at the top."""
    if "text_config" in cfg:
        text = cfg["text_config"]
        if not isinstance(text, dict):
            raise KindCheckpointError(f"{cpath}: `text_config` must be an object of config fields")
        return text, "model.language_model."
    return cfg, "model."


def check_supported(text: dict, cpath: Path) -> None:
    for field, what in GEMMA4_REFUSED.items():
        if text.get(field):
            raise KindCheckpointError(
                f"{cpath}: Gemma 4 field `{field}` = {text[field]!r} ({what}) is not supported; "
                "the 31B and 26B-A4B targets leave it unset"
            )
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise KindCheckpointError(f"{cpath}: Gemma 4 `hidden_activation` {act!r} is not supported")
    kinds = set(text.get("layer_types") or [])
    if not kinds <= {"sliding_attention", "full_attention"}:
        raise KindCheckpointError(f"{cpath}: Gemma 4 `layer_types` {sorted(kinds)} not supported")


def layer_types(text: dict) -> list[str]:
    """Hugging Face's default when absent: 5 sliding : 1 full, the last layer full."""
    n = int(text["num_hidden_layers"])
    types = list(text.get("layer_types") or [])
    if not types:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    types[-1] = "full_attention"
    return types


def gemma4_shapes(text: dict, prefix: str, tied: bool) -> dict[str, list[int]]:
    """Every tensor a Gemma 4 target program reads (Hugging Face names) with its shape."""
    H, V, nh = int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_attention_heads"])
    hd, kvh = int(text.get("head_dim") or 256), int(text.get("num_key_value_heads") or nh)
    ghd = int(text.get("global_head_dim") or 512)
    gkvh = text.get("num_global_key_value_heads") if text.get("attention_k_eq_v") else None
    gkvh = int(gkvh or kvh)
    inter = int(text["intermediate_size"])
    shapes = {prefix + "embed_tokens.weight": [V, H], prefix + "norm.weight": [H]}
    if not tied:
        shapes["lm_head.weight"] = [V, H]
    norms = ("input", "post_attention", "pre_feedforward", "post_feedforward")
    # per-layer overrides: `per_layer_config` (what transformers writes), else the full layers'
    # `global_head_dim` / `num_global_key_value_heads` (the published configs' fields)
    per_layer = text.get("per_layer_config")
    for i, kind in enumerate(layer_types(text)):
        full = kind == "full_attention"
        d, k = (ghd, gkvh) if full else (hd, kvh)
        if isinstance(per_layer, dict):
            o = per_layer.get(str(i)) or per_layer.get(i) or {}
            d, k = int(o.get("head_dim", hd)), int(o.get("num_key_value_heads", kvh))
        layer = {
            "self_attn.q_proj.weight": [nh * d, H],
            "self_attn.k_proj.weight": [k * d, H],
            "self_attn.o_proj.weight": [H, nh * d],
            "self_attn.q_norm.weight": [d],
            "self_attn.k_norm.weight": [d],
            "mlp.gate_proj.weight": [inter, H],
            "mlp.up_proj.weight": [inter, H],
            "mlp.down_proj.weight": [H, inter],
            "layer_scalar": [1],
            **{f"{n}_layernorm.weight": [H] for n in norms},
        }
        if not (full and text.get("attention_k_eq_v")):
            layer["self_attn.v_proj.weight"] = [k * d, H]
        if text.get("enable_moe_block"):
            E, mi = int(text["num_experts"]), int(text["moe_intermediate_size"])
            layer |= {
                "router.proj.weight": [E, H],
                "router.scale": [H],
                "router.per_expert_scale": [E],
                "experts.gate_up_proj": [E, 2 * mi, H],
                "experts.down_proj": [E, H, mi],
                "post_feedforward_layernorm_1.weight": [H],
                "post_feedforward_layernorm_2.weight": [H],
                "pre_feedforward_layernorm_2.weight": [H],
            }
        shapes.update({f"{prefix}layers.{i}.{n}": s for n, s in layer.items()})
    return shapes


# program parameter (under `layers.{i}.`) -> its checkpoint name (under `{prefix}layers.{i}.`)
GEMMA4_RENAMES = {
    "moe.gate.weight": "router.proj.weight",
    "moe.router_scale": "router.scale",
    "moe.per_expert_scale": "router.per_expert_scale",
    "moe.gate_up": "experts.gate_up_proj",
    "moe.down": "experts.down_proj",
}
