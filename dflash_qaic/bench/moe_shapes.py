"""The AI 100 projection's arithmetic for the large routed targets (DeepSeek-V3, Kimi K2.5,
MiniMax-M2.5), from their published dimensions alone: a reduced real-width export of them does
not fit a build machine, and a decode call is bytes anyway.

Per call of T rows at a context of C tokens (docs/AI100_PROJECTION.md, Routed targets):

    weights  = attention + dense MLPs + (router + shared experts) per routed layer + head
    routed   = min(T · k, E) experts per routed layer (the call's union), 3 · H · I_moe each
    cache    = C · layers · (kv_lora_rank + qk_rope_head_dim)   (latent attention)
               C · layers · 2 · kv_heads · head_dim              (GQA)
    bytes    = weights · bits_w/8 + routed · bits_e/8 + cache · bits_kv/8
    seconds  = bytes / bandwidth of the cards it spans (each card's SoCs streaming in parallel)

The whole model must be resident: cards = ⌈(all weights + experts) / card memory⌉.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash_qaic.bench.project import BITS, CARDS, MX_BLOCK

ULTRA_MEMORY = 128e9  # AI 100 Ultra: 4 SoCs × 32 GB
EXPERT_BITS = {"mxfp6": BITS["mxfp6"], "mxfp4": 4 + 8 / MX_BLOCK}


@dataclass(frozen=True)
class RoutedShape:
    """A published routed target's dimensions (Hugging Face config.json)."""

    title: str
    hidden: int
    layers: int
    dense_layers: int  # first_k_dense_replace
    dense_inter: int
    moe_inter: int
    experts: int
    top_k: int
    shared: int  # shared experts of moe_inter
    vocab: int
    heads: int
    kv_heads: int = 0  # GQA only
    head_dim: int = 0  # GQA only
    q_lora: int = 0  # latent attention only (below)
    kv_lora: int = 0
    rope: int = 0
    nope: int = 0
    v_head: int = 0

    @property
    def latent(self) -> bool:
        return self.kv_lora > 0

    def attention(self) -> int:
        H, n = self.hidden, self.heads
        if self.latent:
            qk = self.nope + self.rope
            return (
                H * self.q_lora
                + self.q_lora * n * qk
                + H * (self.kv_lora + self.rope)
                + self.kv_lora * n * (self.nope + self.v_head)
                + n * self.v_head * H
            )
        return 2 * H * n * self.head_dim + 2 * H * self.kv_heads * self.head_dim

    def cache_per_token(self) -> int:
        """Cache values per token per layer."""
        if self.latent:
            return self.kv_lora + self.rope
        return 2 * self.kv_heads * self.head_dim

    def expert(self) -> int:
        return 3 * self.hidden * self.moe_inter

    def dense_weights(self) -> int:
        """Every weight a call reads whatever it routes: attention, dense MLPs, routers, shared
        experts, the head (the embedding reads a row per token: left out)."""
        routed_layers = self.layers - self.dense_layers
        per_routed = self.experts * self.hidden + self.shared * self.expert()
        return (
            self.layers * self.attention()
            + self.dense_layers * 3 * self.hidden * self.dense_inter
            + routed_layers * per_routed
            + self.vocab * self.hidden
        )

    def routed(self, rows: int) -> int:
        """Routed expert weights a call of `rows` tokens reads: the union in every layer."""
        return (
            (self.layers - self.dense_layers) * min(rows * self.top_k, self.experts) * self.expert()
        )

    def resident(self) -> int:
        """Every weight the card holds (all experts, the embedding too)."""
        return self.dense_weights() + self.vocab * self.hidden + self.routed(self.experts)


# Published configurations (the dflash-make-tiny-pair presets of the same names)
_DEEPSEEK = dict(hidden=7168, dense_inter=18432, moe_inter=2048, top_k=8, shared=1)
_MLA = dict(q_lora=1536, kv_lora=512, rope=64, nope=128, v_head=128)
ROUTED_SHAPES = {
    "deepseek-v3": RoutedShape(
        "DeepSeek-V3", layers=61, dense_layers=3, experts=256, vocab=129280, heads=128,
        **_DEEPSEEK, **_MLA,
    ),
    "kimi-k2.5": RoutedShape(
        "Kimi K2.5", layers=61, dense_layers=1, experts=384, vocab=163840, heads=64,
        **_DEEPSEEK, **_MLA,
    ),
    "minimax-m2.5": RoutedShape(
        "MiniMax-M2.5", hidden=3072, layers=62, dense_layers=0, dense_inter=0, moe_inter=1536,
        experts=256, top_k=8, shared=0, vocab=200064, heads=48, kv_heads=8, head_dim=128,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class RoutedCall:
    shape: str
    rows: int
    weights_gb: float
    routed_gb: float
    cache_gb: float
    cards: int
    ms: float


def project_routed(
    shape: RoutedShape, rows: int, ctx: int, experts: str = "mxfp6", card: str = "ultra"
) -> RoutedCall:
    """One call of `rows` tokens at `ctx` on the fewest `card`s that hold the model
    (weights MXFP6, experts `experts`, cache MXINT8: the ai100_mxfp6_mxint8 profile)."""
    if experts not in EXPERT_BITS:
        raise ValueError(f"experts format {experts!r}: one of {', '.join(EXPERT_BITS)}")
    w, e, kv = BITS["mxfp6"] / 8, EXPERT_BITS[experts] / 8, BITS["mxint8"] / 8
    routed_share = shape.routed(shape.experts)
    held = (shape.resident() - routed_share) * w + routed_share * e
    cards = math.ceil(held / ULTRA_MEMORY)
    weights = shape.dense_weights() * w
    routed = shape.routed(rows) * e
    cache = ctx * shape.layers * shape.cache_per_token() * kv
    seconds = (weights + routed + cache) / (cards * CARDS[card].bandwidth)
    return RoutedCall(
        shape.title, rows, weights / 1e9, routed / 1e9, cache / 1e9, cards, 1e3 * seconds
    )
