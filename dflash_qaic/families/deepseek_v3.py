"""DeepSeek-V3-shaped targets (DeepSeek-V3/R1, Kimi K2.x, Moonlight; docs/DESIGN.md, Latent
attention): multi-head latent attention in every layer (modeling/mla.py), the first
`first_k_dense_replace` layers with a dense MLP, the others routed experts chosen by sigmoid
scores with a correction bias, group-limited, beside shared experts (modeling/moe.py,
`SigmoidMoE`). Built by the one target skeleton (modeling/target.py).

Read from a `DeepseekV3ForCausalLM` checkpoint (`model_type` deepseek_v3, or Kimi's kimi_k2),
experts per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the published form) or fused.
The multi-token-prediction layer the published checkpoints carry (layer `num_hidden_layers` …,
`num_nextn_predict_layers` of them) is ignored by name. DeepSeek-V3.2's sparse-attention indexer
and Kimi's KDA (delta-attention) layers are refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dflash_qaic.checkpoint_files.config import (
    BOOLEAN,
    NUMBER,
    POSITIVE_INT,
    STRING,
    STRINGS,
    CheckpointError,
    check_decoder_supported,
    positive,
)
from dflash_qaic.checkpoint_files.quantized import row_slice
from dflash_qaic.families.base import (
    LATENT_ATTENTION,
    MLP,
    SIGMOID_MOE,
    Family,
    LayerKind,
    MoeSpec,
    MoeTiny,
    TargetConfig,
    decoder_common,
)

FIELDS = {
    "kv_lora_rank": POSITIVE_INT,
    "qk_rope_head_dim": POSITIVE_INT,
    "qk_nope_head_dim": POSITIVE_INT,
    "v_head_dim": POSITIVE_INT,
    "n_routed_experts": POSITIVE_INT,
    "n_shared_experts": POSITIVE_INT,
    "n_group": POSITIVE_INT,
    "topk_group": POSITIVE_INT,
    "first_k_dense_replace": NUMBER,
    "moe_layer_freq": POSITIVE_INT,
    "moe_intermediate_size": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "routed_scaling_factor": NUMBER,
    "norm_topk_prob": BOOLEAN,
    "topk_method": STRING,
    "scoring_func": STRING,
    "rope_interleave": BOOLEAN,
    "num_nextn_predict_layers": NUMBER,
    "mlp_layer_types": STRINGS,
}
# program parameter (under `layers.{i}.`) -> its checkpoint name (under `{prefix}layers.{i}.`)
RENAMES = {"mlp.bias": "mlp.gate.e_score_correction_bias"}
# the latent attention's W_UK / W_UV: row blocks of kv_b_proj (`weight_parts`)
KV_B = {"self_attn.w_uk": 0, "self_attn.w_uv": 1}
# what marks a variant this family does not build (config field -> what it is)
REFUSED = {
    "index_topk": "DeepSeek-V3.2's sparse-attention indexer (`index_topk`)",
    "index_n_heads": "DeepSeek-V3.2's sparse-attention indexer (`index_n_heads`)",
    "linear_attn_config": "Kimi delta attention (KDA) layers (`linear_attn_config`)",
}
REFUSED_TYPES = {
    "deepseek_v32": "DeepSeek-V3.2 (its sparse-attention indexer)",
    "kimi_linear": "Kimi delta attention (KDA) layers",
}


def sparse_layers(text, n_layers: int) -> tuple[bool, ...]:
    """Per layer: routed experts (True) or a dense MLP, by `mlp_layer_types` ("sparse" /
    "dense", GLM-4.7-Flash) or the leading `first_k_dense_replace` dense layers (DeepSeek-V3)."""
    types = text.get("mlp_layer_types")
    if types:
        return tuple(t == "sparse" for t in types[:n_layers])
    first = int(text.get("first_k_dense_replace") or 0)
    return tuple(i >= first for i in range(n_layers))


def latent_shapes(text, H: int) -> dict[str, list[int]]:
    """A latent-attention layer's tensors (names under `{prefix}layers.{i}.`)."""
    nh, r = int(text["num_attention_heads"]), int(text["kv_lora_rank"])
    dn, dr, dv = (int(text[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    ql, bias = text.get("q_lora_rank"), bool(text.get("attention_bias"))
    a = "self_attn."
    if ql:
        out = {a + "q_a_proj.weight": [ql, H], a + "q_a_layernorm.weight": [ql]}
        out[a + "q_b_proj.weight"] = [nh * (dn + dr), ql]
        out |= {a + "q_a_proj.bias": [ql]} if bias else {}
    else:
        out = {a + "q_proj.weight": [nh * (dn + dr), H]}
    out |= {
        a + "kv_a_proj_with_mqa.weight": [r + dr, H],
        a + "kv_a_layernorm.weight": [r],
        a + "kv_b_proj.weight": [nh * (dn + dv), r],
        a + "o_proj.weight": [H, nh * dv],
    }
    if bias:
        out |= {a + "kv_a_proj_with_mqa.bias": [r + dr], a + "o_proj.bias": [H]}
    return out


def routed_shapes(t: TargetConfig, fused: bool, bias: str) -> dict[str, list[int]]:
    """A routed layer's tensors: the router and its correction bias (`bias`: its name), the
    shared experts (when any) and the experts, per expert or fused."""
    m, H = t.moe, t.hidden_size
    E, inter = m.num_experts, m.intermediate_size
    out = {"mlp.gate.weight": [E, H], bias: [E]}
    if m.shared_intermediate_size:
        Is = m.shared_intermediate_size
        out |= {f"mlp.shared_experts.{p}_proj.weight": [Is, H] for p in ("gate", "up")}
        out["mlp.shared_experts.down_proj.weight"] = [H, Is]
    if fused:
        return (
            out
            | {"mlp.experts.gate_up_proj": [E, 2 * inter, H]}
            | {"mlp.experts.down_proj": [E, H, inter]}
        )
    for e in range(E):
        out |= {f"mlp.experts.{e}.{p}_proj.weight": [inter, H] for p in ("gate", "up")}
        out[f"mlp.experts.{e}.down_proj.weight"] = [H, inter]
    return out


def tiny_tensors(family: Family, s) -> list[tuple[str, tuple, str]]:
    """(name, shape, kind) of every tensor of a tiny (or real-shape preset) target of `family`
    (dflash_lab/tiny_writer.py writes them): its expected shapes, in order."""
    cfg = family.tiny_config(s).to_dict()
    t = family.read(Path("."), cfg)
    out = []
    for name, shape in family.expected_shapes(t).items():
        if name.endswith("embed_tokens.weight"):
            kind = "embed"
        elif name.endswith("correction_bias"):
            kind = "bias"
        elif len(shape) == 1:
            kind = "norm"
        else:
            kind = "experts" if len(shape) == 3 else "linear"
        out.append((name, tuple(shape), kind))
    return out


@dataclass(frozen=True)
class DeepseekTiny(MoeTiny):
    """A tiny DeepSeek-V3 target's fields: the latent attention's ranks and head parts, the
    grouped routing, the shared experts and the dense leading layers; YaRN with mscale (its
    softmax-scale correction) unless `yarn` is off. GLM-4.7-Flash's: its first layer dense."""

    kv_lora_rank: int = 32
    q_lora_rank: int | None = 48
    qk_nope_head_dim: int = 16
    v_head_dim: int = 24
    n_group: int = 2
    topk_group: int = 1
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    yarn: bool = True
    yarn_factor: float = 4.0  # original context = max_position_embeddings / factor


class DeepseekV3(Family):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3", "kimi_k2", *REFUSED_TYPES)
    moe = True
    qk_norm = False
    fields = FIELDS
    own_draft_attention = True  # a draft's attention is its own (the target's is latent)
    # 4 layers (the first dense), 8 experts in 2 groups, top-2; the RoPE part's head size is
    # the draft's head_dim (head_dim of a DeepSeek-V3 config is qk_rope_head_dim)
    tiny = dict(num_heads=4, num_kv_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2)
    tiny |= dict(tie_word_embeddings=False)
    tiny_fields = DeepseekTiny
    tiny_layout = "expected"

    def read_fields(self, text, cpath, n_layers):
        E = positive(text, "n_routed_experts", cpath)
        k = positive(text, "num_experts_per_tok", cpath)
        inter = positive(text, "moe_intermediate_size", cpath)
        shared = int(text.get("n_shared_experts") or 0) * inter
        sparse = sparse_layers(text, n_layers)
        if (
            len(sparse) != n_layers
            or (types := text.get("mlp_layer_types"))
            and set(types) - {"sparse", "dense"}
        ):
            raise CheckpointError(
                f"{cpath}: `mlp_layer_types` must name each of the {n_layers} layers "
                '"sparse" or "dense"'
            )
        norm = bool(text.get("norm_topk_prob", True))
        moe = MoeSpec(E, k, inter, norm, sparse, shared_intermediate_size=shared)
        return {"intermediate_size": positive(text, "intermediate_size", cpath), "moe": moe}

    def check_supported(self, text, path: Path) -> None:
        what = REFUSED_TYPES.get(text.get("model_type")) or next(
            (v for k, v in REFUSED.items() if text.get(k)), None
        )
        if what:
            raise CheckpointError(
                f"{path}: {what} is not supported; supported: DeepSeek-V3-shaped targets "
                "(multi-head latent attention with dense and routed MLPs: DeepSeek-V3/R1, "
                "Kimi K2.x, Moonlight)"
            )
        check_decoder_supported(text, path, "target")
        for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            if text.get(key) not in (None, want):
                raise CheckpointError(
                    f"{path}: `{key}` {text.get(key)!r} is not supported (DeepSeek-V3's {want!r})"
                )
        if int(text.get("moe_layer_freq") or 1) != 1:
            raise CheckpointError(f"{path}: `moe_layer_freq` other than 1 is not supported")
        E, k = int(text["n_routed_experts"]), int(text["num_experts_per_tok"])
        G, tg = int(text.get("n_group") or 1), int(text.get("topk_group") or 1)
        if E % G or (G > 1 and E // G < 2) or tg > G or k > tg * (E // G):
            raise CheckpointError(
                f"{path}: routing of {k} of {E} experts in {G} groups (top {tg} groups) is not "
                "well formed: n_routed_experts must split into n_group groups of at least 2, "
                "and num_experts_per_tok fit in the topk_group groups"
            )

    def layer_kinds(self, text):
        sparse = sparse_layers(text, int(text["num_hidden_layers"]))
        return [LayerKind(LATENT_ATTENTION, SIGMOID_MOE if s else MLP) for s in sparse]

    def ignored_tensors(self, t: TargetConfig, names) -> set[str]:
        """The multi-token-prediction layers: layer ids from num_hidden_layers on."""
        pat = re.compile(re.escape(t.prefix) + r"layers\.(\d+)\.")
        return {n for n in names if (m := pat.match(n)) and int(m.group(1)) >= t.num_layers}

    def experts_fused(self, names) -> bool:
        return any(n.endswith("mlp.experts.gate_up_proj") for n in names)

    def attention_shapes(self, t):
        return latent_shapes(t.text, t.hidden_size)

    def mlp_shapes(self, t, i, fused):
        dense = super().mlp_shapes(t, i, fused)
        if not t.moe.sparse[i]:
            return dense
        norms = {k: v for k, v in dense.items() if not k.startswith("mlp.")}
        return routed_shapes(t, fused, "mlp.gate.e_score_correction_bias") | norms

    def checkpoint_name(self, t, param):
        _, i, rest = param.split(".", 2)  # layers.{i}.…
        rest = RENAMES.get(rest, rest).replace("mlp.shared_expert.", "mlp.shared_experts.")
        return f"{t.prefix}layers.{i}.{rest}"

    def weight_parts(self, t, param: str, tensors: dict):
        """The checkpoint byte ranges a program weight is made of, in order, when it is no
        checkpoint tensor of its own (None otherwise): a latent layer's W_UK [nh, dn, r] and
        W_UV [nh, dv, r] are, per head h, rows h·(dn + dv) … of kv_b_proj [nh·(dn + dv), r]."""
        _, i, rest = param.split(".", 2)
        if rest not in KV_B:
            return None
        info = tensors[f"{t.prefix}layers.{i}.self_attn.kv_b_proj.weight"]
        nh = int(t.text["num_attention_heads"])
        dn, dv = int(t.text["qk_nope_head_dim"]), int(t.text["v_head_dim"])
        first, n = (0, dn) if KV_B[rest] == 0 else (dn, dv)
        parts = (row_slice(info, h * (dn + dv) + first, n, f"{info.name}[{h}]") for h in range(nh))
        return tuple(parts)

    def tiny_tensors(self, s):
        return tiny_tensors(self, s)

    def tiny_config(self, s):
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            **self.tiny_fields_of(s), first_k_dense_replace=s.first_k_dense_replace
        )

    def tiny_fields_of(self, s) -> dict:
        """The config fields of a tiny target (s: dflash_lab's TinySpec) this family and
        GLM-4.7-Flash's share."""
        rope = {"rope_type": "default", "rope_theta": s.rope_theta}
        if s.yarn:  # Kimi K2's form: the softmax scale gains mscale² (mscale_all_dim)
            f = s.yarn_factor
            rope = dict(rope_type="yarn", rope_theta=s.rope_theta, factor=f, beta_fast=32.0)
            rope |= dict(beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
            rope |= dict(original_max_position_embeddings=int(s.max_position_embeddings // f))
        return dict(
            **(decoder_common(s) | {"rope_parameters": rope}),
            kv_lora_rank=s.kv_lora_rank,
            q_lora_rank=s.q_lora_rank,
            qk_rope_head_dim=s.head_dim,
            qk_nope_head_dim=s.qk_nope_head_dim,
            v_head_dim=s.v_head_dim,
            n_routed_experts=s.num_experts,
            num_experts_per_tok=s.num_experts_per_tok,
            moe_intermediate_size=s.moe_intermediate_size,
            n_shared_experts=s.n_shared_experts,
            n_group=s.n_group,
            topk_group=s.topk_group,
            routed_scaling_factor=s.routed_scaling_factor,
            norm_topk_prob=True,
            rope_interleave=True,
        )


class Glm4MoeLite(DeepseekV3):
    """GLM-4.7-Flash (transformers `glm4_moe_lite`): DeepSeek-V3's latent attention and routing,
    its dense and routed layers named by `mlp_layer_types`."""

    name = "glm4_moe_lite"
    architectures = ("Glm4MoeLiteForCausalLM",)
    model_types = ("glm4_moe_lite",)

    def tiny_config(self, s):
        from transformers import Glm4MoeLiteConfig

        types = ["dense"] + ["sparse"] * (s.target_layers - 1)
        return Glm4MoeLiteConfig(**self.tiny_fields_of(s), mlp_layer_types=types)


DEEPSEEK_V3 = DeepseekV3()
GLM4_MOE_LITE = Glm4MoeLite()
