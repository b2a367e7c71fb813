"""MiniMax-M2 (M2, M2.5, M2.7; transformers `minimax_m2`): GQA attention with q/k RMSNorm over
the whole projection and RoPE on the first `rotary_dim` of each head (modeling/attention.py), and
in every layer routed experts chosen by sigmoid scores with a correction bias, renormalised, no
shared experts (modeling/moe.py, `SigmoidMoE`). Built by the one target skeleton
(modeling/target.py).

The published form names the MoE block `block_sparse_moe`, its router `gate`, its bias
`e_score_correction_bias` and each expert's `w1` (gate), `w3` (up) and `w2` (down); the program's
stacked experts are read from those tensors in order (`weight_parts`). MiniMax-M1's lightning
(linear) attention layers (`attn_type_list` with 0s) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_qaic.checkpoint_files.config import (
    BOOLEAN,
    POSITIVE_INT,
    STRING,
    CheckpointError,
    check_decoder_supported,
    positive,
)
from dflash_qaic.families.base import (
    ATTENTION,
    SIGMOID_MOE,
    Family,
    LayerKind,
    MoeSpec,
    MoeTiny,
    decoder_common,
    experts_top_k,
)
from dflash_qaic.families.deepseek_v3 import tiny_tensors

FIELDS = {
    "num_local_experts": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "rotary_dim": POSITIVE_INT,
    "scoring_func": STRING,
    "use_routing_bias": BOOLEAN,
    "use_qk_norm": BOOLEAN,
    "qk_norm_type": STRING,
}
MOE = "block_sparse_moe."
# program parameter (under `layers.{i}.`) -> its checkpoint name (under `{prefix}layers.{i}.`)
RENAMES = {"mlp.gate.weight": MOE + "gate.weight", "mlp.bias": MOE + "e_score_correction_bias"}
EXPERT_PARTS = {"mlp.gate_up": ("w1", "w3"), "mlp.down": ("w2",)}  # gate rows, then up rows


@dataclass(frozen=True)
class MiniMaxM2Tiny(MoeTiny):
    """A tiny MiniMax-M2 target's fields: its experts and the rotated part of each head."""

    rotary_dim: int = 8


class MiniMaxM2(Family):
    name = "minimax_m2"
    architectures = ("MiniMaxM2ForCausalLM",)
    model_types = ("minimax_m2",)
    moe = True
    fields = FIELDS
    tiny = dict(num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    tiny_fields = MiniMaxM2Tiny
    tiny_layout = "expected"

    def read_fields(self, text, cpath, n_layers):
        E, k = experts_top_k(text, cpath, "num_local_experts")
        inter = positive(text, "intermediate_size", cpath)
        moe = MoeSpec(E, k, inter, norm_topk_prob=True, sparse=(True,) * n_layers)
        return {"intermediate_size": inter, "moe": moe}

    def check_supported(self, text, path: Path) -> None:
        check_decoder_supported(text, path, "target")
        if 0 in (text.get("attn_type_list") or []):
            raise CheckpointError(
                f"{path}: lightning (linear) attention layers (`attn_type_list` 0, MiniMax-M1) "
                "are not supported; supported: MiniMax-M2's full attention in every layer"
            )
        for key, want in (("scoring_func", "sigmoid"), ("qk_norm_type", "per_layer")):
            if text.get(key) not in (None, want):
                raise CheckpointError(
                    f"{path}: `{key}` {text.get(key)!r} is not supported (MiniMax-M2's {want!r})"
                )
        for key in ("use_routing_bias", "use_qk_norm"):
            if text.get(key) is False:
                raise CheckpointError(f"{path}: `{key}` false is not supported (MiniMax-M2's)")

    def layer_kinds(self, text):
        return [LayerKind(ATTENTION, SIGMOID_MOE)] * int(text["num_hidden_layers"])

    def attention_shapes(self, t):
        q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
        out = super().attention_shapes(t)
        return out | {"self_attn.q_norm.weight": [q], "self_attn.k_norm.weight": [kv]}

    def mlp_shapes(self, t, i, fused):
        H, E, inter = t.hidden_size, t.moe.num_experts, t.moe.intermediate_size
        out = {MOE + "gate.weight": [E, H], MOE + "e_score_correction_bias": [E]}
        for e in range(E):
            out |= {f"{MOE}experts.{e}.{w}.weight": [inter, H] for w in ("w1", "w3")}
            out[f"{MOE}experts.{e}.w2.weight"] = [H, inter]
        return out | {"input_layernorm.weight": [H], "post_attention_layernorm.weight": [H]}

    def checkpoint_name(self, t, param):
        _, i, rest = param.split(".", 2)  # layers.{i}.…
        return f"{t.prefix}layers.{i}.{RENAMES.get(rest, rest)}"

    def weight_parts(self, t, param: str, tensors: dict):
        """The stacked experts [E, 2I, H] / [E, H, I] from each expert's w1, w3 / w2."""
        _, i, rest = param.split(".", 2)
        if rest not in EXPERT_PARTS:
            return None
        base = f"{t.prefix}layers.{i}.{MOE}experts."
        return tuple(
            tensors[f"{base}{e}.{w}.weight"]
            for e in range(t.moe.num_experts)
            for w in EXPERT_PARTS[rest]
        )

    def tiny_tensors(self, s):
        return tiny_tensors(self, s)

    def tiny_config(self, s):
        from transformers import MiniMaxM2Config

        rope = {"rope_type": "default", "rope_theta": s.rope_theta}
        return MiniMaxM2Config(
            **(decoder_common(s) | {"rope_parameters": rope}),
            num_local_experts=s.num_experts,
            num_experts_per_tok=s.num_experts_per_tok,
            rotary_dim=s.rotary_dim,
        )


MINIMAX_M2 = MiniMaxM2()
