"""Gemma 4 targets (dense 31B, 26B-A4B MoE): sliding and full layers of different shapes, four norms
per layer, √H embeddings and soft-capped logits. See docs/DESIGN.md, Gemma 4 targets.

Built from a loaded Hugging Face `Gemma4ForCausalLM` or `Gemma4ForConditionalGeneration` (its text
model only: weights and rotary tables; the forward is ours, modeling/kinds.py).

    x = embed(input_ids) · √H                                                   # [b, s, H]
    per layer i (`layer_types`: 5 sliding_attention (window W) : 1 full_attention, the last full):
        h = input_layernorm(x)
        q = q_norm(q_proj h);  k = k_norm(k_proj h);  v = v_norm(v_proj h)      # per head
            (v_norm has no weight; full layers with attention_k_eq_v: v = v_norm(k_proj h))
            sliding: hd = head_dim, θ 1e4;  full: hd = global_head_dim, kv heads may differ,
            "proportional" RoPE (only the first partial_rotary_factor of the pairs rotate)
        x += post_attention_layernorm(o_proj(softmax(q·kᵀ + mask) · v))      # scaling 1.0
        r = x;  h = mlp(pre_feedforward_layernorm(r))                          # gelu (tanh) MLP
        MoE (26B-A4B), in parallel with the MLP:
            p = softmax(proj(rmsnorm(r) · scale · H^−½));  top-k, renormalised, · per_expert_scale
            h = post_feedforward_layernorm_1(h)
                + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(r)))
        x = (r + post_feedforward_layernorm(h)) · layer_scalar
    logits = 30 · tanh(norm(x) · embedᵀ / 30)            (final_logit_softcapping; tied head)

Every RMSNorm is x̂ · w (not 1 + w). The experts keep Hugging Face's layout (gate_up [E, 2I, H],
gate rows then up rows; down [E, H, I]), the union of the call's experts read as in
modeling/moe.py.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.onnx.operators import shape_as_tensor

from dflash_qaic.modeling.attention import attend
from dflash_qaic.modeling.kinds import (
    FULL,
    SLIDING,
    Call,
    Kind,
    KindTarget,
    check_taps,
    ring_size,
)
from dflash_qaic.modeling.layers import RMSNorm, Rope, RopeTable, apply_rope, frozen, frozen_linear
from dflash_qaic.modeling.moe import SparseMoeBlock
from dflash_qaic.modeling.sampler import SAMPLING_CANDIDATES
from dflash_qaic.modeling.target import fp16_safe_fc_weight

# model_type of the published multimodal form (text under model.language_model) and the text form
GEMMA4_TYPES = ("gemma4", "gemma4_text")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Gemma4MLP(nn.Module):
    def __init__(self, hf: nn.Module):
        super().__init__()
        self.gate_proj = frozen_linear(hf.gate_proj)
        self.up_proj = frozen_linear(hf.up_proj)
        self.down_proj = frozen_linear(hf.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Gemma4Attention(nn.Module):
    def __init__(self, hf: nn.Module, n_heads: int):
        super().__init__()
        self.head_dim = hf.head_dim
        self.n_heads, self.n_kv_heads = n_heads, hf.k_proj.out_features // hf.head_dim
        self.scale = hf.scaling  # 1.0: q_norm and k_norm set the scores' scale
        self.q_proj = frozen_linear(hf.q_proj)
        self.k_proj = frozen_linear(hf.k_proj)
        self.v_proj = frozen_linear(hf.v_proj) if hf.v_proj is not None else None  # None: V = K
        self.o_proj = frozen_linear(hf.o_proj)
        self.q_norm = RMSNorm.from_hf(hf.q_norm)
        self.k_norm = RMSNorm.from_hf(hf.k_norm)
        self.eps = float(hf.v_norm.eps)  # the weightless v_norm

    def forward(self, x, call: Call, cache_k, cache_v):
        b, s, _ = x.shape
        nh, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        c = call
        q = self.q_norm(self.q_proj(x).view(b, s, nh, hd))
        k_raw = self.k_proj(x).view(b, s, kvh, hd)
        v_raw = k_raw if self.v_proj is None else self.v_proj(x).view(b, s, kvh, hd)
        k = self.k_norm(k_raw)
        v = RMSNorm.normalize(v_raw, self.eps).transpose(1, 2)  # [b, kvh, s, hd]
        q = apply_rope(q.transpose(1, 2), c.cos, c.sin, hd)  # [b, nh, s, hd]
        k = apply_rope(k.transpose(1, 2), c.cos, c.sin, hd)  # [b, kvh, s, hd]
        out, cache_k, cache_v = attend(
            q, k, v, (b, s, nh, kvh, hd), self.scale, c.slots, c.rows, c.reads, c.mask,
            cache_k, cache_v,
        )  # fmt: skip
        return self.o_proj(out), cache_k, cache_v


class Gemma4MoE(SparseMoeBlock):
    """Gemma 4's routed experts (module docstring): the router normalises its input without a
    weight, scales it by `scale` · H^−½; the top-k softmax weights are renormalised and
    multiplied by `per_expert_scale`; the experts are gelu (tanh) SwiGLUs."""

    def __init__(self, router: nn.Module, experts: nn.Module, top_k: int):
        proj = frozen_linear(router.proj)
        super().__init__(proj, experts.gate_up_proj, experts.down_proj, top_k, True)
        H = router.scale.shape[0]
        self.router_scale = frozen(router.scale)  # [H]
        self.root = H**-0.5
        self.per_expert_scale = frozen(router.per_expert_scale)  # [E]
        self.eps = float(router.norm.eps)

    def route(self, x: torch.Tensor):
        """x [T, H] (the residual stream) -> (weights [T, k], experts [T, k])."""
        logits = self.gate(RMSNorm.normalize(x, self.eps) * self.router_scale * self.root)
        probs = (logits - logits.amax(-1, keepdim=True)).softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        return top_p * self.per_expert_scale[top_i], top_i

    def forward(self, x: torch.Tensor, route_from: torch.Tensor) -> torch.Tensor:
        # x [b, s, H]: the experts' input; route_from [b, s, H]: what the router reads
        b, s, H = x.shape
        E, inter = self.num_experts, self.inter
        xt = x.reshape(-1, H)  # [T, H]
        top_p, top_i = self.route(route_from.reshape(-1, H))  # [T, k]
        onehot = (top_i[..., None] == torch.arange(E)).to(x.dtype)  # [T, k, E]
        chosen = onehot.amax(1)  # [T, E]
        weight = (onehot * top_p[..., None]).sum(1)  # [T, E]
        union = self.union(chosen.amax(0), shape_as_tensor(xt)[0])  # [U]
        h = self.gate_up[union] @ xt.t()  # [U, 2I, T]
        a = gelu_tanh(h[:, :inter]) * h[:, inter:]  # [U, I, T]
        r = weight[:, union].t()[:, None]  # [U, 1, T]
        hit = chosen[:, union].t()[:, None] > 0
        a = torch.where(hit, a * r, 0.0)
        return (self.down[union] @ a).sum(0).t().reshape(b, s, H)


class Gemma4DecoderLayer(nn.Module):
    mixer_name = "self_attn"  # what modeling/target.py's skeleton asks of a layer

    def __init__(self, hf: nn.Module, kind: str, n_heads: int, top_k: int | None):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm.from_hf(hf.input_layernorm)
        self.self_attn = Gemma4Attention(hf.self_attn, n_heads)
        self.post_attention_layernorm = RMSNorm.from_hf(hf.post_attention_layernorm)
        self.pre_feedforward_layernorm = RMSNorm.from_hf(hf.pre_feedforward_layernorm)
        self.mlp = Gemma4MLP(hf.mlp)
        self.post_feedforward_layernorm = RMSNorm.from_hf(hf.post_feedforward_layernorm)
        self.moe = None
        if getattr(hf, "enable_moe_block", False):
            self.moe = Gemma4MoE(hf.router, hf.experts, top_k)
            self.post_feedforward_layernorm_1 = RMSNorm.from_hf(hf.post_feedforward_layernorm_1)
            self.pre_feedforward_layernorm_2 = RMSNorm.from_hf(hf.pre_feedforward_layernorm_2)
            self.post_feedforward_layernorm_2 = RMSNorm.from_hf(hf.post_feedforward_layernorm_2)
        self.layer_scalar = frozen(hf.layer_scalar)  # [1]

    def forward(self, x, call: Call, cache_k, cache_v):
        a, cache_k, cache_v = self.self_attn(self.input_layernorm(x), call, cache_k, cache_v)
        x = x + self.post_attention_layernorm(a)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:  # the routed experts, beside the MLP, both from x
            e = self.moe(self.pre_feedforward_layernorm_2(x), x)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(e)
        x = x + self.post_feedforward_layernorm(h)
        return x * self.layer_scalar, cache_k, cache_v


def text_parts(hf_model: nn.Module):
    """(text config, text model, lm_head) of a Gemma4ForCausalLM or Gemma4ForConditionalGeneration
    (whose vision and audio towers are ignored)."""
    cfg = hf_model.config
    if cfg.model_type == "gemma4":  # the multimodal form: model.language_model
        return cfg.get_text_config(), hf_model.model.language_model, hf_model.lm_head
    return cfg, hf_model.model, hf_model.lm_head


def rope_table(rotary: nn.Module, kind: str, ctx_len: int) -> RopeTable:
    inv_freq = getattr(rotary, f"{kind}_inv_freq")
    return RopeTable.from_rope(
        Rope(inv_freq, getattr(rotary, f"{kind}_attention_scaling")), ctx_len
    )


class ExportGemma4Target(KindTarget):
    """The Gemma 4 target program: ExportTarget's contract with per-layer cache shapes (sliding
    layers [rows, kvh, ctx, head_dim], full layers [rows, global kvh, ctx, global_head_dim])."""

    @classmethod
    def from_hf(
        cls,
        hf_model: nn.Module,
        fc_weight: torch.Tensor,
        hidden_norm_weight: torch.Tensor,
        hidden_norm_eps: float,
        target_layer_ids,
        ctx_len: int,
        emit_logits: bool = False,
        sampling: bool = True,
        sampling_candidates: int = SAMPLING_CANDIDATES,
        continuous_batching: bool = False,
        token_bitmask: bool = False,
        max_rows: int | None = None,
    ) -> ExportGemma4Target:
        cfg, base, lm_head = text_parts(hf_model)
        check_gemma4(cfg, fc_weight, target_layer_ids)
        nh = cfg.num_attention_heads
        top_k = cfg.top_k_experts if cfg.enable_moe_block else None
        layers = [
            Gemma4DecoderLayer(layer, cfg.layer_types[i], nh, top_k)
            for i, layer in enumerate(base.layers)
        ]
        kinds, ropes = {}, {}
        for kind in sorted(set(cfg.layer_types)):
            attn = next(lay.self_attn for lay in layers if lay.kind == kind)
            rope = "rope" if kind == SLIDING else f"rope_{kind}"
            w = cfg.sliding_window if kind == SLIDING else None
            kinds[kind] = Kind(w, rope, nh, attn.n_kv_heads, ring_size(w, max_rows, ctx_len))
            ropes[rope] = rope_table(base.rotary_emb, kind, ctx_len)
        first = ropes.pop("rope") if "rope" in ropes else ropes[next(iter(ropes))]
        fc_w, fc_scale = fp16_safe_fc_weight(fc_weight)
        return cls(
            embed=base.embed_tokens.weight,
            layers=layers,
            norm=RMSNorm.from_hf(base.norm),
            lm_head=lm_head,
            rope_cos=first.cos,
            rope_sin=first.sin,
            fc_weight=fc_w,
            hidden_norm=RMSNorm(hidden_norm_weight.shape[-1], hidden_norm_eps, hidden_norm_weight),
            target_layer_ids=target_layer_ids,
            emit_logits=emit_logits,
            sampling=sampling,
            sampling_candidates=sampling_candidates,
            fc_scale=fc_scale,
            continuous_batching=continuous_batching,
            token_bitmask=token_bitmask,
            kinds=kinds,
            ropes=ropes,
            embed_scale=math.sqrt(cfg.hidden_size),
            final_logit_softcapping=cfg.final_logit_softcapping,
        )

    def cache_shapes(self) -> list[tuple[int, int]]:
        """(kv heads, head dim) of each layer's cache, in layer order."""
        return [(la.self_attn.n_kv_heads, la.self_attn.head_dim) for la in self.layers]


def check_gemma4(cfg, fc_weight: torch.Tensor, target_layer_ids) -> None:
    """What ExportGemma4Target builds (Gemma 4 31B / 26B-A4B text); anything else is refused,
    naming the field."""
    if cfg.model_type != "gemma4_text":
        raise ValueError(f"not a Gemma 4 text model: model_type {cfg.model_type!r}")
    kinds = set(cfg.layer_types)
    if not kinds <= {SLIDING, FULL}:
        raise ValueError(f"Gemma 4 layer_types {sorted(kinds)}: only {SLIDING}, {FULL}")
    refused = {
        "hidden_size_per_layer_input": "per-layer input embeddings (Gemma 4 E2B/E4B)",
        "num_kv_shared_layers": "KV-shared layers (Gemma 4 E2B/E4B)",
        "use_bidirectional_attention": "bidirectional attention",
        "use_double_wide_mlp": "double-wide MLPs of KV-shared layers",
        "attention_bias": "attention biases",
    }
    for field, what in refused.items():
        if getattr(cfg, field, None):
            raise ValueError(
                f"Gemma 4 config field {field}={getattr(cfg, field)!r} ({what}) is not supported; "
                "the 31B and 26B-A4B targets leave it unset"
            )
    if cfg.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"Gemma 4 hidden_activation {cfg.hidden_activation!r}: only gelu_pytorch_tanh"
        )
    if not cfg.tie_word_embeddings:
        raise ValueError("Gemma 4 with tie_word_embeddings false is not a published form")
    check_taps(cfg, fc_weight, target_layer_ids)
