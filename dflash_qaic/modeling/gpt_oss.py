"""gpt-oss targets: attention sinks, alternating sliding and full layers, a biased top-4 router and
the clamped SwiGLU experts. See docs/DESIGN.md, gpt-oss targets.

Built from a Hugging Face `GptOssForCausalLM` (its weights and rotary tables only; the forward is
ours, the same program contract as the dense target, modeling/target.py): a loaded model, or the
streaming export's placeholder model of a checkpoint (families/gpt_oss.py, exporter/weights.py).

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

The sliding layers keep a full-length cache here, hidden past the window by the mask: exact, with
the full layers' memory.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.onnx.operators import shape_as_tensor

from dflash_qaic.modeling.kinds import (
    FULL,
    SLIDING,
    Call,
    Kind,
    KindTarget,
    check_taps,
    ring_size,
)
from dflash_qaic.modeling.layers import (
    RMSNorm,
    Rope,
    RopeTable,
    apply_rope,
    frozen,
    frozen_linear,
)
from dflash_qaic.modeling.moe import SparseMoeBlock
from dflash_qaic.modeling.ops import update_cache
from dflash_qaic.modeling.sampler import SAMPLING_CANDIDATES
from dflash_qaic.modeling.target import fp16_safe_fc_weight


def attend_with_sinks(q, k, v, sinks, dims, scale, slots, rows, reads, mask, cache_k, cache_v):
    """`modeling.target.attend` with a per-head sink logit: q [b, nh, s, hd]; k, v [b, kvh, s, hd];
    sinks [1, kvh, nh / kvh, 1, 1]; the rest as `attend` takes them. The softmax runs over the keys and the sink
    together, and the sink's share is dropped: out = Σ_j p_j v_j with Σ_j p_j = 1 − p_sink."""
    b, s, nh, kvh, hd = dims
    cache_k, keys = update_cache(cache_k, rows, slots, k, reads)  # [b, kvh, L, hd]
    cache_v, values = update_cache(cache_v, rows, slots, v, reads)
    g = nh // kvh
    q = q.reshape(b, kvh, g * s, hd) * scale  # query head h = kv head h // g (see `attend`)
    scores = q @ keys.transpose(2, 3) + mask  # [b, kvh, g*s, L]
    # the sink column of row (head, t): head = kvh·g + its group index, g blocks of s rows;
    # sinks [1, kvh, g, 1, 1] as held (a view of the checkpoint's [nh]: a weight the exporter
    # would constant-fold if the module reshaped it)
    sink = sinks.expand(b, kvh, g, s, 1).reshape(b, kvh, g * s, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # [b, kvh, g*s, L]
    out = (probs @ values).view(b, nh, s, hd)
    return out.transpose(1, 2).reshape(b, s, nh * hd), cache_k, cache_v


class SinkAttention(nn.Module):
    def __init__(self, hf: nn.Module, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hf.head_dim
        self.scale = hf.scaling
        self.q_proj = frozen_linear(hf.q_proj)
        self.k_proj = frozen_linear(hf.k_proj)
        self.v_proj = frozen_linear(hf.v_proj)
        self.o_proj = frozen_linear(hf.o_proj)
        g = n_heads // n_kv_heads
        self.sinks = frozen(hf.sinks.view(1, n_kv_heads, g, 1, 1))  # [nh] by kv head and group

    def forward(self, x, cos, sin, slots, rows, reads, mask, cache_k, cache_v):
        # as modeling/target.py Attention.forward; mask is this layer kind's (modeling/kinds.py)
        b, s, _ = x.shape
        nh, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(self.q_proj(x).view(b, s, nh, hd).transpose(1, 2), cos, sin, hd)
        k = apply_rope(self.k_proj(x).view(b, s, kvh, hd).transpose(1, 2), cos, sin, hd)
        v = self.v_proj(x).view(b, s, kvh, hd).transpose(1, 2)  # [b, kvh, s, hd]
        out, cache_k, cache_v = attend_with_sinks(
            q, k, v, self.sinks, (b, s, nh, kvh, hd), self.scale, slots, rows, reads, mask,
            cache_k, cache_v,
        )  # fmt: skip
        return self.o_proj(out), cache_k, cache_v


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, H = x.shape
        E = self.num_experts
        xt = x.reshape(-1, H)  # [T, H]
        top_p, top_i = self.route(xt)  # [T, k]
        onehot = (top_i[..., None] == torch.arange(E)).to(x.dtype)  # [T, k, E]
        chosen = onehot.amax(1)  # [T, E]
        weight = (onehot * top_p[..., None]).sum(1)  # [T, E]
        union = self.union(chosen.amax(0), shape_as_tensor(xt)[0])  # [U]
        h = self.gate_up[union] @ xt.t() + self.gate_up_bias[union][:, :, None]  # [U, 2I, T]
        gate = h[:, 0::2].clamp(max=self.limit)  # [U, I, T]
        up = h[:, 1::2].clamp(min=-self.limit, max=self.limit)
        a = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [U, I, T]
        y = self.down[union] @ a + self.down_bias[union][:, :, None]  # [U, H, T]
        r = weight[:, union].t()[:, None]  # [U, 1, T]
        hit = chosen[:, union].t()[:, None] > 0
        y = torch.where(hit, y * r, 0.0)  # an unchosen (expert, token) pair adds exactly 0
        return y.sum(0).t().reshape(b, s, H)


class GptOssDecoderLayer(nn.Module):
    mixer_name = "self_attn"  # what modeling/target.py's skeleton asks of a layer

    def __init__(self, hf: nn.Module, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.kind = SLIDING if hf.self_attn.sliding_window is not None else FULL
        self.input_layernorm = RMSNorm.from_hf(hf.input_layernorm)
        self.self_attn = SinkAttention(hf.self_attn, n_heads, n_kv_heads)
        self.post_attention_layernorm = RMSNorm.from_hf(hf.post_attention_layernorm)
        self.mlp = GptOssMoE.from_hf(hf.mlp)

    def forward(self, x, call: Call, cache_k, cache_v):
        c = call  # this layer kind's (modeling/kinds.py)
        a, cache_k, cache_v = self.self_attn(
            self.input_layernorm(x), c.cos, c.sin, c.slots, c.rows, c.reads, c.mask,
            cache_k, cache_v,
        )  # fmt: skip
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache_k, cache_v


class ExportGptOssTarget(KindTarget):
    """The gpt-oss target program: ExportTarget's contract; sliding and full layer kinds sharing
    one RoPE table (modeling/kinds.py)."""

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
    ) -> ExportGptOssTarget:
        cfg = hf_model.config
        check_gpt_oss(hf_model, fc_weight, target_layer_ids)
        base = hf_model.model
        nh, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        layers = [GptOssDecoderLayer(layer, nh, kvh) for layer in base.layers]
        rope = RopeTable.from_rope(Rope.from_hf(base.rotary_emb), ctx_len)
        fc_w, fc_scale = fp16_safe_fc_weight(fc_weight)
        return cls(
            embed=base.embed_tokens.weight,
            layers=layers,
            norm=RMSNorm.from_hf(base.norm),
            lm_head=hf_model.lm_head,
            rope_cos=rope.cos,
            rope_sin=rope.sin,
            fc_weight=fc_w,
            hidden_norm=RMSNorm(hidden_norm_weight.shape[-1], hidden_norm_eps, hidden_norm_weight),
            target_layer_ids=target_layer_ids,
            emit_logits=emit_logits,
            sampling=sampling,
            sampling_candidates=sampling_candidates,
            fc_scale=fc_scale,
            continuous_batching=continuous_batching,
            token_bitmask=token_bitmask,
            kinds={
                kind: Kind(w, "rope", nh, kvh, ring_size(w, max_rows, ctx_len))
                for kind in sorted(set(cfg.layer_types))
                for w in [cfg.sliding_window if kind == SLIDING else None]
            },
            ropes={},
        )


def check_gpt_oss(hf_model: nn.Module, fc_weight: torch.Tensor, target_layer_ids) -> None:
    """What ExportGptOssTarget builds; anything else refused, naming the field."""
    cfg = hf_model.config
    if cfg.model_type != "gpt_oss":
        raise ValueError(f"not a gpt-oss model: model_type {cfg.model_type!r}")
    kinds = set(cfg.layer_types)
    if not kinds <= {SLIDING, FULL}:
        raise ValueError(f"gpt-oss layer_types {sorted(kinds)}: only {SLIDING}, {FULL}")
    if SLIDING in kinds and not (cfg.sliding_window and cfg.sliding_window > 0):
        raise ValueError(
            f"gpt-oss sliding layers need sliding_window > 0, got {cfg.sliding_window}"
        )
    if cfg.tie_word_embeddings:
        raise ValueError("gpt-oss with tie_word_embeddings is not a published form; not supported")
    check_taps(cfg, fc_weight, target_layer_ids)
