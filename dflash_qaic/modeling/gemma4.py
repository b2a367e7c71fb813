"""Gemma 4 targets (dense 31B, 26B-A4B MoE): sliding and full layers of different shapes, four norms
per layer, √H embeddings and soft-capped logits. See docs/DESIGN.md, Gemma 4 targets.

Built by the one target skeleton (modeling/target.py) from a loaded Hugging Face
`Gemma4ForCausalLM` or `Gemma4ForConditionalGeneration` (its text model only): the family
(families/gemma4.py) names SANDWICH layers of the sliding and full attention kinds, whose
attention is modeling/attention.py's with q/k norms, the weightless v norm and k = v.

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

import torch
from torch import nn

from dflash_qaic.families.base import MOE, LayerKind
from dflash_qaic.modeling.attention import Attention
from dflash_qaic.modeling.layers import MLP, RMSNorm, frozen, frozen_linear, gelu_tanh
from dflash_qaic.modeling.moe import SparseMoeBlock


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
        self.act = gelu_tanh

    def route(self, x: torch.Tensor):
        """x [T, H] (the residual stream) -> (weights [T, k], experts [T, k])."""
        logits = self.gate(RMSNorm.normalize(x, self.eps) * self.router_scale * self.root)
        probs = (logits - logits.amax(-1, keepdim=True)).softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        return top_p * self.per_expert_scale[top_i], top_i


class Gemma4DecoderLayer(nn.Module):
    """A SANDWICH layer (families.base.LayerKind.block): the module docstring's per-layer
    equations; forward as modeling/target.py's DecoderLayer."""

    mixer_name = "self_attn"

    def __init__(self, hf: nn.Module, cfg, kind: LayerKind, zero_centred: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm.from_hf(hf.input_layernorm)
        self.self_attn = Attention(hf.self_attn, cfg.num_attention_heads, kind.attention)
        self.post_attention_layernorm = RMSNorm.from_hf(hf.post_attention_layernorm)
        self.pre_feedforward_layernorm = RMSNorm.from_hf(hf.pre_feedforward_layernorm)
        self.mlp = MLP.from_hf(hf.mlp, act=gelu_tanh)
        self.post_feedforward_layernorm = RMSNorm.from_hf(hf.post_feedforward_layernorm)
        self.moe = None
        if kind.mlp == MOE:
            self.moe = Gemma4MoE(hf.router, hf.experts, cfg.top_k_experts)
            self.post_feedforward_layernorm_1 = RMSNorm.from_hf(hf.post_feedforward_layernorm_1)
            self.pre_feedforward_layernorm_2 = RMSNorm.from_hf(hf.pre_feedforward_layernorm_2)
            self.post_feedforward_layernorm_2 = RMSNorm.from_hf(hf.post_feedforward_layernorm_2)
        self.layer_scalar = frozen(hf.layer_scalar)  # [1]

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def forward(self, x, call, cache_k, cache_v):
        a, cache_k, cache_v, pending = self.self_attn(
            self.input_layernorm(x), call, cache_k, cache_v
        )
        x = x + self.post_attention_layernorm(a)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:  # the routed experts, beside the MLP, both from x
            e = self.moe(self.pre_feedforward_layernorm_2(x), x)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(e)
        x = x + self.post_feedforward_layernorm(h)
        return x * self.layer_scalar, cache_k, cache_v, pending
