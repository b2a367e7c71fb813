"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention, and in the sparse layers a
router with top-k experts in place of the MLP (modeling/moe.py). The experts' tensors come per
expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the published form) or fused
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], the form transformers
5.x holds in memory); both are read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dflash_qaic.checkpoint_files.config import (
    BOOLEAN,
    LAYER_IDS,
    POSITIVE_INT,
    CheckpointError,
    positive,
)
from dflash_qaic.families.base import (
    ATTENTION,
    MLP,
    MOE,
    Family,
    LayerKind,
    MoeSpec,
    MoeTiny,
    TargetConfig,
    decoder_common,
)

MOE_FIELDS = {
    "num_experts": POSITIVE_INT,
    "num_local_experts": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "decoder_sparse_step": POSITIVE_INT,
    "moe_intermediate_size": POSITIVE_INT,
    "shared_expert_intermediate_size": POSITIVE_INT,
    "mlp_only_layers": LAYER_IDS,
    "norm_topk_prob": BOOLEAN,
}


def read_experts(cfg: Mapping, cpath: Path) -> tuple[int, int, int]:
    """(experts, top_k, moe_intermediate_size), checked."""
    # `num_experts` in the published configs; transformers 5.x writes `num_local_experts`
    key = "num_local_experts" if "num_experts" not in cfg and "num_local_experts" in cfg else ""
    key = key or "num_experts"
    experts = positive(cfg, key, cpath)
    top_k = positive(cfg, "num_experts_per_tok", cpath)
    if top_k > experts:
        raise CheckpointError(
            f"{cpath}: `num_experts_per_tok` {top_k} exceeds `{key}` {experts} (fix config.json)"
        )
    return experts, top_k, positive(cfg, "moe_intermediate_size", cpath)


def sparse_layers(cfg: Mapping, cpath: Path, n_layers: int) -> tuple[bool, ...]:
    """Hugging Face's rule: layer i has experts iff i is not in `mlp_only_layers` and
    (i + 1) % `decoder_sparse_step` == 0."""
    step = positive(cfg, "decoder_sparse_step", cpath, 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise CheckpointError(f"{cpath}: `mlp_only_layers` must be a list of layer ids")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))


def expert_shapes(t: TargetConfig, fused: bool) -> dict[str, list[int]]:
    """A sparse layer's MLP tensors (names under `{prefix}layers.{i}.`): the router, a shared
    expert when there is one, and the experts, per expert or fused."""
    m, H = t.moe, t.hidden_size
    E, inter = m.num_experts, m.intermediate_size
    out = {"mlp.gate.weight": [E, H]}
    if m.shared_intermediate_size:
        Is = m.shared_intermediate_size
        out |= {f"mlp.shared_expert.{p}_proj.weight": [Is, H] for p in ("gate", "up")}
        out |= {
            "mlp.shared_expert.down_proj.weight": [H, Is],
            "mlp.shared_expert_gate.weight": [1, H],
        }
    if fused:
        out |= {"mlp.experts.gate_up_proj": [E, 2 * inter, H]}
        return out | {"mlp.experts.down_proj": [E, H, inter]}
    for e in range(E):
        out |= {f"mlp.experts.{e}.{p}_proj.weight": [inter, H] for p in ("gate", "up")}
        out[f"mlp.experts.{e}.down_proj.weight"] = [H, inter]
    return out


def experts_fused(names) -> bool:
    """Whether a checkpoint stores its experts fused (see `expert_shapes`)."""
    return any(n.endswith("mlp.experts.gate_up_proj") for n in names)


@dataclass(frozen=True)
class Qwen3MoeTiny(MoeTiny):
    """A tiny Qwen3-MoE target's fields: its experts (MoeTiny), renormalised top-k, the dense
    mlp_only_layers (None: [1], one dense layer) and the sparse step."""

    norm_topk_prob: bool = True
    mlp_only_layers: list[int] | None = None
    decoder_sparse_step: int = 1


class Qwen3Moe(Family):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    moe = True
    fields = MOE_FIELDS
    tiny = {}  # 8 experts, top-2, layer 1 dense (Qwen3MoeTiny's defaults)
    tiny_fields = Qwen3MoeTiny

    def read_fields(self, text, cpath, n_layers):
        experts, top_k, inter = read_experts(text, cpath)
        moe = MoeSpec(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=inter,
            norm_topk_prob=bool(text.get("norm_topk_prob", False)),
            sparse=sparse_layers(text, cpath, n_layers),
        )
        return super().read_fields(text, cpath, n_layers) | {"moe": moe}

    def layer_kinds(self, text):
        sparse = sparse_layers(text, Path("config.json"), int(text["num_hidden_layers"]))
        return [LayerKind(ATTENTION, MOE if s else MLP) for s in sparse]

    def experts_fused(self, names) -> bool:
        return experts_fused(names)

    def mlp_shapes(self, t, i, fused):
        dense = super().mlp_shapes(t, i, fused)
        if not t.moe.sparse[i]:
            return dense
        norms = {k: v for k, v in dense.items() if not k.startswith("mlp.")}
        return expert_shapes(t, fused) | norms

    def tiny_config(self, s):
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **decoder_common(s),
            num_experts=s.num_experts,
            num_experts_per_tok=s.num_experts_per_tok,
            moe_intermediate_size=s.moe_intermediate_size,
            norm_topk_prob=s.norm_topk_prob,
            mlp_only_layers=[1] if s.mlp_only_layers is None else list(s.mlp_only_layers),
            decoder_sparse_step=s.decoder_sparse_step,
        )


QWEN3_MOE = Qwen3Moe()
