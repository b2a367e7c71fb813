"""The mixture-of-experts MLP (Qwen3-MoE, Qwen3.5-MoE; DeepSeek-V3 and MiniMax-M2's sigmoid
routing in `SigmoidMoE`), reading only the experts its tokens chose.

    x      [T, H]                   the call's tokens (T = batch · seq_len)
    probs  = softmax(x · routerᵀ)   [T, E]   (the row max subtracted first: fp16-safe)
    top_p, top_i = topk(probs, k)   [T, k]   renormalised to sum 1 when norm_topk_prob
    union  = the experts any token chose, first, in index order, then the others: the first
             U = min(T·k, E) of them                                          [U]
    y[t]   = Σ_u route[t, u] · down_u(silu(gate_u(x_t)) · up_u(x_t))          [T, H]
             (+ sigmoid(shared_expert_gate(x_t)) · shared_expert(x_t), Qwen3.5-MoE)

Only the U experts of the union are gathered (Gather on the stacked expert weights) and run, for
every token of the call, each token's unchosen experts masked to 0. U is computed from the call's
shape, so it is static in every specialization of the one graph (no Loop/If): a decode call of one
token reads exactly its k experts; a call of T tokens reads min(T·k, E), never more than the
per-token gather (T·k expert reads) nor than all experts; a prefill chunk (T·k ≥ E) runs every
expert densely. docs/DESIGN.md, Mixture of experts, gives the reasoning and the figures.

The expert weights stay in Hugging Face's layout, so the module shares (never copies) the loaded
model's tensors and the streaming export writes the checkpoint's bytes in order:
gate_up [E, 2I, H] (gate rows then up rows per expert), down [E, H, I].
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.onnx.operators import shape_as_tensor

from dflash_qaic.modeling.layers import MLP, frozen, frozen_linear


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        router: nn.Linear,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert: MLP | None = None,
        shared_expert_gate: nn.Linear | None = None,
    ):
        super().__init__()
        self.gate = router  # [E, H] as a Linear: router logits
        self.gate_up = frozen(gate_up)  # [E, 2I, H]
        self.down = frozen(down)  # [E, H, I]
        self.num_experts, self.inter = int(down.shape[0]), int(down.shape[2])
        self.top_k = int(top_k)
        self.norm_topk_prob = bool(norm_topk_prob)
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.act = F.silu  # the experts' gate activation

    @classmethod
    def from_hf(cls, hf: nn.Module) -> SparseMoeBlock:
        """From a Hugging Face sparse MoE block (`gate` router, `experts` with gate_up_proj /
        down_proj, optionally `shared_expert` and `shared_expert_gate`), sharing its weights."""
        router = hf.gate
        lin = nn.Linear(router.weight.shape[1], router.weight.shape[0], bias=False, device="meta")
        lin.weight = frozen(router.weight)
        shared = getattr(hf, "shared_expert", None)
        shared_gate = getattr(hf, "shared_expert_gate", None)
        return cls(
            lin,
            hf.experts.gate_up_proj,
            hf.experts.down_proj,
            router.top_k,
            getattr(router, "norm_topk_prob", True),  # Qwen3.5-MoE always renormalises
            MLP.from_hf(shared) if shared is not None else None,
            frozen_linear(shared_gate) if shared_gate is not None else None,
        )

    def route(self, x: torch.Tensor):
        """x [T, H] -> (top_p [T, k], top_i [T, k]): Hugging Face's router, fp16-safe."""
        logits = self.gate(x)  # [T, E]
        probs = (logits - logits.amax(-1, keepdim=True)).softmax(-1)  # in [0, 1], exp(<= 0)
        # a tie at the k-th place: the lower expert index in the graph (ONNX TopK); eager
        # torch.topk may take either (docs/DESIGN.md, Mixture of experts)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_p = top_p / top_p.sum(-1, keepdim=True)  # the sum is >= 1/E: no underflow
        return top_p, top_i

    def union(self, chosen: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
        """The experts a call reads: chosen [E] (1 where any token chose the expert), n_tokens
        (0-d, from the call's shape) -> expert ids [U], U = min(n_tokens · k, E): the chosen
        experts in index order, then unchosen ones in index order to fill the U slots (a
        static count: at most T·k experts are chosen). The score E + (E-1-e) of a chosen
        expert, E-1-e of another, is distinct per expert and exact in fp16."""
        E = self.num_experts
        u = torch.clamp(n_tokens * self.top_k, max=E)
        score = chosen * E + (E - 1 - torch.arange(E)).to(chosen.dtype)  # [E]
        return score.topk(u).indices

    def forward(self, x: torch.Tensor, route_from: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, H] -> [b, s, H]; route_from [b, s, H]: what the router reads (x if None).
        The one MoE forward: a family differs in `route` and `experts` only."""
        b, s, H = x.shape
        E = self.num_experts
        xt = x.reshape(-1, H)  # [T, H]
        top_p, top_i = self.route(xt if route_from is None else route_from.reshape(-1, H))
        experts = torch.arange(E)
        onehot = (top_i[..., None] == experts).to(x.dtype)  # [T, k, E]
        chosen = onehot.amax(1)  # [T, E]: 1 where the token chose the expert
        weight = (onehot * top_p[..., None]).sum(1)  # [T, E]: its routing weight, else 0

        union = self.union(chosen.amax(0), shape_as_tensor(xt)[0])  # [U], U traced from T
        y = self.experts(xt, union, weight, chosen)  # [T, H]
        if self.shared_expert is not None and self.shared_expert_gate is None:
            y = y + self.shared_expert(xt)  # always on, ungated (DeepSeek-V3)
        elif self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(xt))  # [T, 1]
            y = y + gate * self.shared_expert(xt)
        return y.reshape(b, s, H)

    def experts(self, xt, union, weight, chosen) -> torch.Tensor:
        """Σ_u route[t, u] · down_u(act(gate_u(x_t)) · up_u(x_t)) over the union's experts:
        xt [T, H]; union [U]; weight, chosen [T, E] -> [T, H]."""
        inter = self.inter
        w_gu = self.gate_up[union]  # [U, 2I, H]: the only expert weights read
        w_d = self.down[union]  # [U, H, I]
        h = w_gu @ xt.t()  # [U, 2I, T]
        a = self.act(h[:, :inter]) * h[:, inter:]  # [U, I, T]
        r, hit = routed(weight, chosen, union)
        # an unchosen (expert, token) pair contributes exactly 0, even were its activation inf
        a = torch.where(hit, a * r, 0.0)
        return (w_d @ a).sum(0).t()  # [U, H, T] -> [T, H]


def routed(weight: torch.Tensor, chosen: torch.Tensor, union: torch.Tensor):
    """(r [U, 1, T]: each union expert's routing weight per token, hit [U, 1, T]: chosen)."""
    r = weight[:, union].t()[:, None]  # [U, 1, T]
    hit = chosen[:, union].t()[:, None] > 0  # [U, 1, T]
    return r, hit


class SigmoidMoE(SparseMoeBlock):
    """Routing by sigmoid scores with a correction bias that only chooses (DeepSeek-V3's
    `noaux_tc`, MiniMax-M2), optionally group-limited, with shared experts always on:

        s      = sigmoid(x · routerᵀ)                                   # [T, E]
        c      = s + e_score_correction_bias                            # choosing only
        groups : the topk_group of n_group groups by the sum of each group's top-2 c;
                 the experts of the other groups out of the choice      (n_group > 1)
        top_i  = topk(c, k);  w = s[top_i]  (/ Σ w when norm_topk_prob) · routed_scaling_factor
        y      = Σ_e w_e expert_e(x)  (+ shared_experts(x))

    The experts read are the call's union, as every MoE here (`SparseMoeBlock`)."""

    def __init__(self, router, bias, gate_up, down, top_k, norm_topk_prob, groups, scaling, shared):
        super().__init__(router, gate_up, down, top_k, norm_topk_prob, shared_expert=shared)
        self.bias = frozen(bias)  # [E]
        self.n_group, self.topk_group = groups  # (1, 1): no group limit
        self.scaling = float(scaling)

    @classmethod
    def from_hf(cls, hf: nn.Module) -> SigmoidMoE:
        """From a Hugging Face DeepSeek-V3 MoE (`gate` a TopkRouter holding the bias and the
        group fields, `experts`, `shared_experts`) or MiniMax-M2's (`gate`, `experts`, the
        bias on the block, no groups, no shared experts)."""
        r = hf.gate
        lin = nn.Linear(r.weight.shape[1], r.weight.shape[0], bias=False, device="meta")
        lin.weight = frozen(r.weight)
        bias = getattr(r, "e_score_correction_bias", None)
        bias = hf.e_score_correction_bias if bias is None else bias
        shared = getattr(hf, "shared_experts", None)
        return cls(
            lin,
            bias,
            hf.experts.gate_up_proj,
            hf.experts.down_proj,
            r.top_k,
            getattr(r, "norm_topk_prob", True),
            (getattr(r, "num_group", 1) or 1, getattr(r, "topk_group", 1) or 1),
            getattr(r, "routed_scaling_factor", 1.0),
            MLP.from_hf(shared) if shared is not None else None,
        )

    def route(self, x: torch.Tensor):
        """x [T, H] -> (weights [T, k], experts [T, k]) as the class docstring."""
        scores = torch.sigmoid(self.gate(x))  # [T, E] in (0, 1)
        choice = scores + self.bias
        E, G = self.num_experts, self.n_group
        if G > 1:
            per = choice.reshape(-1, G, E // G)  # [T, G, E/G]
            group = per.topk(2, dim=-1).values.sum(-1)  # [T, G]
            top_g = group.topk(self.topk_group, dim=-1).indices  # [T, tg]
            keep = (top_g[..., None] == torch.arange(G)).to(x.dtype).amax(1)  # [T, G]: 1 kept
            keep = keep[..., None].expand(-1, G, E // G).reshape(-1, E)  # [T, E]
            # the other groups' experts score below every expert of the row: never chosen while
            # k fits in the kept groups (families check it), and of the row's own magnitude
            # (fp16-safe, unlike a large constant)
            floor = choice.amin(-1, keepdim=True) - 1.0  # [T, 1]
            choice = torch.where(keep > 0, choice, floor)
        top_i = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        top_w = scores.gather(1, top_i)  # the unbiased scores weigh
        if self.norm_topk_prob:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_w * self.scaling, top_i
