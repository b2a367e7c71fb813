"""Qwen3.5-MoE (Qwen3.5-35B-A3B): the Qwen3.5 hybrid with every layer's MLP a MoE block, top-k
always renormalised, plus a sigmoid-gated shared expert."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_qaic.checkpoint_files.config import positive
from dflash_qaic.families.base import MoeSpec, MoeTiny
from dflash_qaic.families.qwen3_5 import HybridTiny, Qwen3_5, deltanet_dims, hybrid_tiny_config
from dflash_qaic.families.qwen3_moe import MOE_FIELDS, expert_shapes, experts_fused, read_experts


@dataclass(frozen=True)
class HybridMoeTiny(HybridTiny, MoeTiny):
    """A tiny Qwen3.5-MoE target's fields: the hybrid's, its experts, and a gated shared expert
    of shared_expert_intermediate_size."""

    shared_expert_intermediate_size: int = 48


class Qwen3_5Moe(Qwen3_5):
    name = "qwen3_5_moe"
    architectures = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    moe = True
    fields = Qwen3_5.fields | MOE_FIELDS
    tiny_fields = HybridMoeTiny

    def read_fields(self, text, cpath, n_layers):
        experts, top_k, inter = read_experts(text, cpath)
        shared = positive(text, "shared_expert_intermediate_size", cpath)
        moe = MoeSpec(experts, top_k, inter, True, (True,) * n_layers, shared)
        return {
            "deltanet": deltanet_dims(text, cpath),
            "intermediate_size": positive(text, "intermediate_size", cpath, 0),
            "moe": moe,
        }

    def experts_fused(self, names) -> bool:
        return experts_fused(names)

    def mlp_shapes(self, t, i, fused):
        H = t.hidden_size
        norms = {"input_layernorm.weight": [H], "post_attention_layernorm.weight": [H]}
        return expert_shapes(t, fused) | norms

    def tiny_config(self, s):
        return hybrid_tiny_config(s, moe=True)


QWEN3_5_MOE = Qwen3_5Moe()
