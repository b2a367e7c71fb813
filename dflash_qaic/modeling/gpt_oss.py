"""gpt-oss targets: attention sinks, alternating sliding and full layers, a biased top-4 router and
the clamped SwiGLU experts. See docs/DESIGN.md, gpt-oss targets.

Built by the one target skeleton (modeling/target.py) from a Hugging Face `GptOssForCausalLM`
(a loaded model, or the streaming export's placeholder model of a checkpoint; families/gpt_oss.py,
exporter/weights.py): PRE_NORM layers of the sliding and full attention kinds, their attention
modeling/attention.py's with sinks, their MLP the experts here (`GptOssMoE`).

    x = embed(input_ids)                                                       # [b, s, H]
    per layer i (`layer_types`: sliding_attention (window W = 128) and full_attention, alternating):
        h = input_layernorm(x)
        q, k, v = q/k/v_proj(h) (+ bias);  RoPE (YaRN: its cos/sin scaled by attention_scaling)
        scores = q·kᵀ / √hd + mask           # sliding: key p visible iff Q − W < p <= Q
        probs  = softmax([scores ‖ sink_h])[..., :-1]   # a learned per-head logit, then dropped
        x += o_proj(probs · v) (+ bias)
        h = post_attention_layernorm(x)
        top_v, top_i = topk(h · routerᵀ + router_bias, 4);  r = softmax(top_v)       # [T, 4]
        per chosen expert e: gu = W_gu[e] h + b_gu[e]        # [2I], rows interleaved gate, up
            gate = min(gu[0::2], 7);  up = clamp(gu[1::2], −7, 7)
            y_e = W_d[e] ((up + 1) · gate · σ(1.702 · gate)) + b_d[e]
        x += Σ_e r_e y_e
    logits = lm_head(norm(x)) (untied); next_tokens and hidden_states as the dense target

The experts keep the checkpoint's layout (gate_up [E, 2I, H] with interleaved rows, down [E, H, I],
which is what MXFP4 `*_blocks` dequantize to, dflash_qaic/mxfp4.py), so the streaming export
writes them in order; Hugging Face's in-memory [E, H, 2I] / [E, I, H] are transposed once.
The union of the call's experts is read as for Qwen3-MoE (modeling/moe.py).

The sliding layers keep a ring of W + S − 1 slots when the export bounds the call rows S
(modeling/attention.py, Ring caches), else a ctx_len cache hidden past the window by the mask.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_qaic.modeling.layers import frozen
from dflash_qaic.modeling.moe import SparseMoeBlock, routed


class GptOssMoE(SparseMoeBlock):
    """gpt-oss's MoE block: router with a bias, softmax over the top-k logits only, experts with
    biases, interleaved gate/up rows and the clamped SwiGLU (module docstring)."""

    def __init__(self, router, gate_up, gate_up_bias, down, down_bias, top_k, alpha, limit):
        super().__init__(router, gate_up, down, top_k, norm_topk_prob=False)
        self.gate_up_bias = frozen(gate_up_bias)  # [E, 2I]
        self.down_bias = frozen(down_bias)  # [E, H]
        self.alpha, self.limit = float(alpha), float(limit)

    @classmethod
    def from_hf(cls, hf: nn.Module) -> GptOssMoE:
        ex, r = hf.experts, hf.router
        router = nn.Linear(r.weight.shape[1], r.weight.shape[0], device="meta")
        router.weight, router.bias = frozen(r.weight), frozen(r.bias)  # [E, H], [E]
        return cls(
            router,
            ex.gate_up_proj.detach().transpose(1, 2),  # [E, H, 2I] -> [E, 2I, H]
            ex.gate_up_proj_bias,
            ex.down_proj.detach().transpose(1, 2),  # [E, I, H] -> [E, H, I]
            ex.down_proj_bias,
            hf.router.top_k,
            ex.alpha,
            ex.limit,
        )

    def route(self, x: torch.Tensor):
        """x [T, H] -> (weights [T, k], experts [T, k]): softmax over the top-k logits."""
        top_v, top_i = self.gate(x).topk(self.top_k, dim=-1)  # [T, k]
        return top_v.softmax(dim=-1), top_i

    def experts(self, xt, union, weight, chosen) -> torch.Tensor:
        """As `SparseMoeBlock.experts`, with biases and the clamped SwiGLU; the routing weight
        applies after the down projection (its bias is per expert)."""
        h = self.gate_up[union] @ xt.t() + self.gate_up_bias[union][:, :, None]  # [U, 2I, T]
        gate = h[:, 0::2].clamp(max=self.limit)  # [U, I, T]
        up = h[:, 1::2].clamp(min=-self.limit, max=self.limit)
        a = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [U, I, T]
        y = self.down[union] @ a + self.down_bias[union][:, :, None]  # [U, H, T]
        r, hit = routed(weight, chosen, union)
        y = torch.where(hit, y * r, 0.0)  # an unchosen (expert, token) pair adds exactly 0
        return y.sum(0).t()
