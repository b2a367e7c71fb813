"""gpt-oss (20b, 120b; docs/DESIGN.md, Layer kinds): attention with biases and per-head sinks,
alternating sliding (window 128) and full layers, YaRN RoPE, and in every layer a biased top-k
router over experts with biases, interleaved gate/up rows and the clamped SwiGLU. Its layers are
the skeleton's (modeling/target.py): attention with sinks, experts of modeling/gpt_oss.py.

Checkpoints come in two forms, both read:
- the published one: experts in MXFP4, `mlp.experts.{gate_up,down}_proj_blocks` (uint8
  [E, rows, cols/32, 16]) and `…_scales` (uint8 [E, rows, cols/32]), rows the projection's outputs
  (gate_up [E, 2I, H], down [E, H, I] once dequantized; dflash_qaic/mxfp4.py), with
  `quantization_config.quant_method` "mxfp4";
- the dequantized one (bf16 / fp32 copies, what `save_pretrained` of a loaded model writes):
  `mlp.experts.gate_up_proj` [E, H, 2I] and `mlp.experts.down_proj` [E, I, H], Hugging Face's
  in-memory layout (inputs first), which the streaming export transposes per expert.
The expert biases (`…_proj_bias`), the router (`mlp.router.weight` / `.bias`), attention and
norms are plain tensors in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_qaic.checkpoint_files.config import (
    NUMBER,
    POSITIVE_INT,
    STRING,
    CheckpointError,
    check_decoder_supported,
    positive,
)
from dflash_qaic.families.base import (
    ATTENTION,
    CLAMPED_MOE,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    Family,
    LayerKind,
    MoeSpec,
    MoeTiny,
    decoder_dims,
    experts_top_k,
)

SLIDING, FULL = SLIDING_ATTENTION, FULL_ATTENTION
MXFP4_BLOCK = 32  # values per E8M0 scale (dflash_qaic/mxfp4.py)
# program parameter (under `layers.{i}.`) -> its checkpoint name (under `{prefix}layers.{i}.`)
RENAMES = {
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.bias": "mlp.router.bias",
    "mlp.gate_up": "mlp.experts.gate_up_proj",
    "mlp.down": "mlp.experts.down_proj",
    "mlp.gate_up_bias": "mlp.experts.gate_up_proj_bias",
    "mlp.down_bias": "mlp.experts.down_proj_bias",
}
FIELDS = {
    "num_local_experts": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "experts_per_token": POSITIVE_INT,  # the published config's second spelling
    "swiglu_limit": NUMBER,
    "swiglu_alpha": NUMBER,
    "quantization_config": {"quant_method": STRING},
}


def experts_mxfp4(names) -> bool:
    """Whether a checkpoint (its tensor names) stores its experts in MXFP4 (`…_blocks`)."""
    return any(n.endswith("mlp.experts.gate_up_proj_blocks") for n in names)


@dataclass(frozen=True)
class GptOssTiny(MoeTiny):
    """A tiny gpt-oss target's fields: its experts (MXFP4 on disk) and its sliding window."""

    target_sliding_window: int = 8


class GptOss(Family):
    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)
    moe = True
    qk_norm = False
    fields = FIELDS
    transposed_params = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    # the tiny preset: 4 layers alternating sliding (window 8) and full, 8 experts top-4, its
    # experts MXFP4 on disk; a Qwen3-shaped draft with attention biases, block 8
    tiny = dict(target_layers=4, block_size=8, num_experts=8, num_experts_per_tok=4)
    tiny |= dict(moe_intermediate_size=64, tie_word_embeddings=False, attention_bias=True)
    tiny_fields = GptOssTiny
    tiny_layout = "mxfp4"  # dflash_lab/tiny_writer.py make_gpt_oss

    def draft_layer_ids(self, target_layers: int) -> list[int]:
        """The published gpt-oss drafts' target layers (z-lab's: 1, 6, 11, 16, 21), those of a
        shortened target that exist (a real-shape tiny preset's draft)."""
        return [i for i in range(1, min(target_layers, 24), 5)] or [0]

    def read_fields(self, text, cpath, n_layers):
        E, k = experts_top_k(text, cpath, "num_local_experts", default_k=4)
        inter = positive(text, "intermediate_size", cpath)
        moe = MoeSpec(E, k, inter, norm_topk_prob=False, sparse=(True,) * n_layers)
        return {"intermediate_size": inter, "moe": moe}

    def check_supported(self, text, path: Path) -> None:
        check_decoder_supported({"rope_parameters": text.get("rope_parameters")}, path, "target")
        check_decoder_supported({"rope_scaling": text.get("rope_scaling")}, path, "target")
        kinds = set(text.get("layer_types") or [])
        if not kinds <= {SLIDING, FULL}:
            raise CheckpointError(
                f"{path}: gpt-oss `layer_types` {sorted(kinds)} are not supported (only "
                f"{SLIDING} and {FULL})"
            )
        if SLIDING in kinds and not text.get("sliding_window"):
            raise CheckpointError(f"{path}: gpt-oss sliding layers need `sliding_window` > 0")
        if text.get("tie_word_embeddings"):
            raise CheckpointError(
                f"{path}: gpt-oss with `tie_word_embeddings` true is not a published form; "
                "not supported"
            )
        quant = (text.get("quantization_config") or {}).get("quant_method")
        if quant not in (None, "mxfp4"):
            raise CheckpointError(
                f"{path}: gpt-oss `quantization_config.quant_method` {quant!r} is not supported "
                "(the published MXFP4 experts, or a bf16 / fp32 copy without quantization_config)"
            )
        H = int(text["hidden_size"])
        inter = int(text.get("intermediate_size") or 0)
        if quant == "mxfp4" and (H % MXFP4_BLOCK or inter % MXFP4_BLOCK):
            raise CheckpointError(
                f"{path}: MXFP4 experts need `hidden_size` {H} and `intermediate_size` {inter} "
                f"to be multiples of {MXFP4_BLOCK}"
            )

    def layer_kinds(self, text):
        n, window = int(text["num_hidden_layers"]), text.get("sliding_window")
        types = text.get("layer_types") or [FULL] * n
        return [
            LayerKind(ATTENTION, CLAMPED_MOE, k, window if k == SLIDING else None) for k in types
        ]

    def experts_fused(self, names) -> bool:
        """True: the experts are MXFP4 (`…_blocks` / `…_scales`); False: plain 3-D tensors."""
        return experts_mxfp4(names)

    def attention_shapes(self, t):
        return super().attention_shapes(t) | {"self_attn.sinks": [t.num_heads]}

    def mlp_shapes(self, t, i, fused):
        """Layer i's router and experts (`fused`: MXFP4) and its two norms."""
        H, E, inter = t.hidden_size, t.moe.num_experts, t.moe.intermediate_size
        out = {
            "mlp.router.weight": [E, H],
            "mlp.router.bias": [E],
            "mlp.experts.gate_up_proj_bias": [E, 2 * inter],
            "mlp.experts.down_proj_bias": [E, H],
        }
        if fused:
            g, d = H // MXFP4_BLOCK, inter // MXFP4_BLOCK
            out |= {
                "mlp.experts.gate_up_proj_blocks": [E, 2 * inter, g, MXFP4_BLOCK // 2],
                "mlp.experts.gate_up_proj_scales": [E, 2 * inter, g],
                "mlp.experts.down_proj_blocks": [E, H, d, MXFP4_BLOCK // 2],
                "mlp.experts.down_proj_scales": [E, H, d],
            }
        else:
            out |= {
                "mlp.experts.gate_up_proj": [E, H, 2 * inter],
                "mlp.experts.down_proj": [E, inter, H],
            }
        return out | {"input_layernorm.weight": [H], "post_attention_layernorm.weight": [H]}

    def checkpoint_name(self, t, param):
        _, i, rest = param.split(".", 2)  # layers.{i}.…
        return f"{t.prefix}layers.{i}.{RENAMES.get(rest, rest)}"

    def tiny_config(self, s):
        from transformers import GptOssConfig

        quant = {"quant_method": "mxfp4"}
        quant["modules_to_not_convert"] = [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ]  # fmt: skip
        types = [SLIDING if i % 2 == 0 else FULL for i in range(s.target_layers)]
        yarn = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0)
        yarn |= dict(truncate=False, original_max_position_embeddings=4096)
        return GptOssConfig(
            **(decoder_dims(s) | {"intermediate_size": s.moe_intermediate_size}),
            num_local_experts=s.num_experts,
            num_experts_per_tok=s.num_experts_per_tok,
            sliding_window=s.target_sliding_window,
            layer_types=types,
            rms_norm_eps=1e-5,
            rope_parameters={**yarn, "rope_theta": 150000.0},
            tie_word_embeddings=False,
            attention_bias=True,
            quantization_config=quant,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )


GPT_OSS = GptOss()
