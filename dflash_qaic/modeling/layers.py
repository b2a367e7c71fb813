"""The one copy of each layer that the target and the draft share.

    RMSNorm          weight * x / sqrt(mean(x^2) + eps)                       # [..., n]
    apply_rope       x * cos + rotate_half(x) * sin                          # [b, heads, s, hd]
    Rope             cos/sin at given positions, from transformers' own rope initialisation
    RopeTable        the same cos/sin for positions 0 … ctx_len-1 as constants, gathered by position
    MLP              down(silu(gate(x)) * up(x))
    MASK_VALUE       the score of a masked key slot
    vocab_tables     the head stored transposed [H, V]; a tied head doubles as the embedding
    embed_rows       embedding rows of token ids, gathered from that table

Everything here computes in the dtype of its input (fp32 in the exported programs) and is written
for the card's fp16 arithmetic: see docs/DESIGN.md, fp16.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

# Score of a masked key slot: far enough below any real score that exp() of the difference is 0
# (in fp16 already at -17), finite and well inside fp16's range (max 65504, and below the fp16
# check's flag at 65504 / 16), so a row that sees nothing (padding, position -1) gets a uniform,
# finite average instead of NaN. In fp32 the weights are the same as with any larger value.
MASK_VALUE = -2048.0


def frozen(t: torch.Tensor) -> nn.Parameter:
    """A frozen fp32 parameter. .float() does not copy an fp32 tensor, so an fp32 Hugging Face
    model's weights are shared, not doubled."""
    return nn.Parameter(t.detach().float(), requires_grad=False)


def frozen_linear(hf: nn.Linear) -> nn.Linear:
    """An nn.Linear holding `hf`'s weight (and bias) as frozen parameters, without a copy."""
    lin = nn.Linear(hf.in_features, hf.out_features, bias=hf.bias is not None, device="meta")
    lin.weight = frozen(hf.weight)
    if hf.bias is not None:
        lin.bias = frozen(hf.bias)
    return lin


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, safe in fp16 arithmetic.

    fp16 squares overflow above |x| ≈ 256, and residual streams carry massive activations of
    thousands; an overflowed mean gives rsqrt(inf) = 0 and silently zeroes the row. RMSNorm is
    scale-invariant, so each row is first divided by s = max(max|x|, sqrt(eps)):

        x / sqrt(mean(x^2) + eps) = (x/s) / sqrt(mean((x/s)^2) + (sqrt(eps)/s)^2)

    exactly, with every intermediate in [0, 2] (|x/s| <= 1, sqrt(eps)/s <= 1), and eps keeping
    its meaning: a tiny row (max|x| below sqrt(eps)) is divided by sqrt(eps) and gets the usual
    x / sqrt(mean(x^2) + eps). A trainable weight of ones, or a frozen given `weight`. Inputs below
    fp32 (training in bf16) are normalised in fp32 and cast back.
    """

    def __init__(
        self, dim: int, eps: float, weight: torch.Tensor | None = None, zero_centred=False
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if weight is None else frozen(weight)
        self.eps = float(eps)
        # zero-centred (Qwen3.5): the row is scaled by 1 + weight, computed as y·w + y (an op
        # on the weight alone would be folded into a new tensor by the exporter)
        self.zero_centred = bool(zero_centred)

    @classmethod
    def from_hf(cls, hf: nn.Module, zero_centred: bool = False) -> RMSNorm:
        eps = getattr(hf, "variance_epsilon", None) or hf.eps
        return cls(hf.weight.shape[-1], eps, hf.weight, zero_centred)

    @staticmethod
    def normalize(x: torch.Tensor, eps: float, eps_root: torch.Tensor | None = None):
        """x / sqrt(mean(x^2) + eps) over the last axis, without a weight (see the class)."""
        root = math.sqrt(eps) if eps_root is None else eps_root
        peak = x.abs().amax(-1, keepdim=True)  # [..., 1]
        s = peak.clamp(min=root) if eps_root is None else torch.maximum(peak, root)
        xs, r = x / s, root / s  # |xs| <= 1, 0 < r <= 1
        return xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + r * r)

    def forward(self, x: torch.Tensor, eps_root: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., n] -> [..., n]. eps_root [..., 1]: sqrt of the eps to use per row (default
        sqrt(self.eps)); a caller that divided a row by f passes sqrt(eps) / f, and gets the
        norm of the undivided row."""
        dtype = x.dtype
        if dtype != torch.float32:  # a Python branch: an fp32 graph gets no Cast nodes
            x = x.float()
        y = self.normalize(x, self.eps, eps_root)
        y = y if dtype == torch.float32 else y.to(dtype)
        return y * self.weight + y if self.zero_centred else self.weight * y


def rotate_half(x: torch.Tensor, head_dim: int | None = None) -> torch.Tensor:
    """HF's rotate_half. Pass head_dim (a Python int) when exporting, so the split point is a
    constant in the graph rather than computed from Shape."""
    half = (x.shape[-1] if head_dim is None else head_dim) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim=None):
    """x [b, heads, s, hd]; cos/sin [b, s, hd] -> [b, heads, s, hd]."""
    return x * cos[:, None] + rotate_half(x, head_dim) * sin[:, None]


class Rope(nn.Module):
    """cos/sin [b, s, hd] at positions [b, s], exactly as Hugging Face's rotary embedding computes
    them: inv_freq and attention_scaling come from transformers' own rope initialisation, so every
    rope type a config names (llama3, yarn, linear, …) is honoured as Hugging Face honours it."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.detach().float().clone(), persistent=False)
        self.scaling = float(scaling)

    @classmethod
    def from_hf(cls, rotary: nn.Module, kind: str | None = None) -> Rope:
        """From a model's rotary embedding (its inv_freq / attention_scaling hold the scaling);
        `kind`: the attention kind's own table where the model keeps one per kind (Gemma 4's
        `{kind}_inv_freq`), else the shared one."""
        if kind is not None and hasattr(rotary, f"{kind}_inv_freq"):
            inv_freq = getattr(rotary, f"{kind}_inv_freq")
            return cls(inv_freq, getattr(rotary, f"{kind}_attention_scaling"))
        return cls(rotary.inv_freq, rotary.attention_scaling)

    @classmethod
    def from_config(cls, raw_config: dict) -> Rope:
        """From a config dict (the draft's): transformers' Qwen3 rotary embedding on it."""
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        return cls.from_hf(Qwen3RotaryEmbedding(Qwen3Config(**raw_config)))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [b, s, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, hd]
        return emb.cos() * self.scaling, emb.sin() * self.scaling


class RopeTable(nn.Module):
    """`rope`'s cos/sin for positions 0 … ctx_len-1 as constants, gathered by position. Computing
    cos(position · inv_freq) in the graph would break under fp16 (positions in the thousands
    lose all angle precision); a table is exact in any precision."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.register_buffer("cos", cos, persistent=False)  # [ctx_len, hd]
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def from_rope(cls, rope: Rope, ctx_len: int) -> RopeTable:
        cos, sin = rope(torch.arange(ctx_len)[None])
        return cls(cos[0], sin[0])

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [b, s] -> cos, sin [b, s, hd]. Padding rows (-1) read row 0; their output
        # is never used.
        p = positions.clamp(min=0)
        return self.cos[p], self.sin[p]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """gelu with the tanh approximation (Hugging Face's gelu_pytorch_tanh: Gemma 4)."""
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)); act silu, or gelu_tanh (Gemma 4)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, act=F.silu):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = act

    @classmethod
    def from_hf(cls, hf: nn.Module, act=F.silu) -> MLP:
        """Sharing `hf`'s (frozen) weights, without building throwaway ones first."""
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        mlp.gate_proj = frozen_linear(hf.gate_proj)
        mlp.up_proj = frozen_linear(hf.up_proj)
        mlp.down_proj = frozen_linear(hf.down_proj)
        mlp.act = act
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def vocab_tables(embed: torch.Tensor, head: torch.Tensor):
    """(tied, head_t [H, V], embed [V, H] or None) as frozen parameters.

    The head is stored transposed and multiplied by directly. A tied head also serves as the
    embedding (a Gather along V, `embed_rows`), so the V×H table is stored once; with F.linear
    the exporter would fold a transposed copy next to the embedding (≈1.5 GB more for Qwen3-4B).
    """
    tied = head.data_ptr() == embed.data_ptr()
    head_t = frozen(head.detach().float().t().contiguous())
    return tied, head_t, (None if tied else frozen(embed))


def embed_rows(ids: torch.Tensor, head_t: torch.Tensor, embed: torch.Tensor | None):
    """ids [b, s] -> [b, s, H]: rows of `embed`, or (tied) columns of head_t [H, V]."""
    if embed is not None:
        return F.embedding(ids, embed)
    # [H, V] gathered along V -> [H, b·s] -> [b, s, H]
    return head_t.index_select(1, ids.reshape(-1)).t().reshape(*ids.shape, -1)
