"""The DFlash draft in plain PyTorch (REFERENCE.md §2), loading the published checkpoint format.

    ctx   = hidden_norm(fc(concat(target features)))         # [b, n, H]  (done by the target program)
    h     = embed([anchor, MASK, …, MASK]) · input_scale     # [b, B, H]
    per layer:
        x      = input_layernorm(h)
        q      = rope(q_norm(q_proj(x)))                      # queries from the block only
        k, v   = [rope(k_norm(k_proj(ctx))) ; rope(k_norm(k_proj(x)))], [v_proj(ctx) ; v_proj(x)]
        h      = h + o_proj(attention(q, k, v))               # no mask: every key visible
        h      = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h)) · output_multiplier (softcapped); row j predicts position start + j.

The layers are written so that context K/V can come from anywhere: computed from the whole
context here (`DFlashDraft.forward`), or read from a static cache in the export module.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dflash_qaic.checkpoints import DraftConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, hd]; cos/sin [b, n, hd]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class Rope(nn.Module):
    """cos/sin at given positions. inv_freq and scaling come from transformers' own rope
    initialisation for this config, so every rope type a checkpoint names (llama3, yarn, …)
    is honoured exactly as Hugging Face and the reference draft honour it."""

    def __init__(self, raw_config: dict):
        super().__init__()
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        hf = Qwen3RotaryEmbedding(Qwen3Config(**raw_config))
        self.register_buffer("inv_freq", hf.inv_freq.float().clone(), persistent=False)
        self.scaling = float(hf.attention_scaling)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [b, n] -> cos, sin [b, n, hd]
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftAttention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        H, hd = c.hidden_size, c.head_dim
        self.n_heads, self.n_kv, self.hd = c.num_heads, c.num_kv_heads, hd
        self.q_proj = nn.Linear(H, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K/V rows of x [b, n, H] at the positions of cos/sin -> k, v [b, n_kv, n, hd]."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_mask=None):
        """x [b, B, H] (normed block); ctx_k/ctx_v [b, n_kv, n, hd] already roped;
        ctx_mask: optional additive [b, 1, 1, n] (0 visible, large negative hidden)."""
        b, B, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, B, self.n_heads, self.hd)).transpose(1, 2)
        q = apply_rope(q, cos, sin)  # [b, heads, B, hd]
        blk_k, blk_v = self.kv(x, cos, sin)  # the block's own K/V: used here, never cached
        k = torch.cat([ctx_k, blk_k], dim=2)  # [b, n_kv, n + B, hd]
        v = torch.cat([ctx_v, blk_v], dim=2)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.hd**-0.5  # [b, heads, B, n + B]
        if ctx_mask is not None:
            scores = scores + F.pad(ctx_mask, (0, B))  # block keys always visible
        out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v  # [b, heads, B, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, B, -1))


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, cos, sin, ctx_k, ctx_v, ctx_mask=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, ctx_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """The draft's own tensors (fc, hidden_norm, layers, norm). Embedding and head are the
    target's and are passed in (`embed_weight`, `head_weight`)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        H = c.hidden_size
        self.fc = nn.Linear(len(c.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.rope = Rope(c.raw)

    @classmethod
    def from_checkpoint(cls, c: DraftConfig, state: dict[str, torch.Tensor]) -> DFlashDraft:
        model = cls(c)
        model.load_state_dict(state, strict=True)
        return model.float().eval()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """concat of target layer outputs [b, n, k·H] -> context feature [b, n, H]."""
        return self.hidden_norm(self.fc(features))

    def embed(self, block_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        return F.embedding(block_ids, embed_weight) * self.config.input_embedding_scale

    def forward(self, ctx, ctx_positions, block_emb, block_positions) -> torch.Tensor:
        """ctx [b, n, H] fused features; block_emb [b, B, H] -> normed block hidden [b, B, H]."""
        ccos, csin = self.rope(ctx_positions)
        cos, sin = self.rope(block_positions)
        h = block_emb
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.kv(ctx, ccos, csin)  # no input_layernorm on ctx
            h = layer(h, cos, sin, ctx_k, ctx_v)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, head_weight) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def propose(self, features, ctx_positions, block_ids, block_positions, embed_w, head_w):
        """Greedy proposals for block rows 1 … B−1 from raw target features: [b, B−1]."""
        h = self.forward(
            self.fuse(features), ctx_positions, self.embed(block_ids, embed_w), block_positions
        )
        return self.logits(h[:, 1:], head_w).argmax(-1)


class RopeTable(nn.Module):
    """cos/sin for positions 0 … ctx_len−1 as constants, gathered by position. Computing
    cos(position · inv_freq) in the graph would break under fp16 (positions in the thousands
    lose all angle precision); a table is exact in any precision."""

    def __init__(self, rope: Rope, ctx_len: int):
        super().__init__()
        cos, sin = rope(torch.arange(ctx_len)[None])
        self.register_buffer("cos", cos[0], persistent=False)  # [ctx_len, hd]
        self.register_buffer("sin", sin[0], persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = positions.clamp(min=0)  # padding rows (−1) read row 0; their output is never used
        return self.cos[p], self.sin[p]


MASKED = -10000.0  # finite in fp16; exp() of it is 0 next to any real score


class ExportDraft(nn.Module):
    """The draft program: KV injection into a static cache, block forward, proposals.

    Inputs follow `contract.DraftIO`. Each call:
      1. writes K/V of the new context rows (`target_hidden`, already fused by the target
         program) into every layer's cache at `position_ids_target` (−1 → the padding slot);
      2. runs the block `[anchor, MASK…]` at `position_ids` against every cached slot below the
         block start plus the block's own K/V (bidirectional; the block K/V are not persisted);
      3. returns argmax of the target's head over rows 1 … B−1, and the updated caches.
    """

    def __init__(
        self,
        draft: DFlashDraft,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        ctx_len: int,
        emit_logits: bool = False,
    ):
        super().__init__()
        self.c = draft.config
        self.layers, self.norm = draft.layers, draft.norm
        self.rope = RopeTable(draft.rope, ctx_len)
        # The head is stored transposed, [H, V], so the graph multiplies by it directly. A tied
        # head also serves as the embedding (a Gather along V), so the V×H table is stored once
        # (a plain F.linear would leave a transposed copy next to the embedding).
        self.tied = head_weight.data_ptr() == embed_weight.data_ptr()
        self.head_t = nn.Parameter(head_weight.detach().float().t().contiguous(), False)
        self.embed = None if self.tied else nn.Parameter(embed_weight.detach().float(), False)
        self.ctx_len = ctx_len
        self.emit_logits = emit_logits

    def forward(self, target_hidden, position_ids_target, input_ids, position_ids, *past):
        from dflash_qaic.modeling.ops import cache_slots, ctx_scatter

        slots = cache_slots(position_ids_target, self.ctx_len)  # [b, s]
        ccos, csin = self.rope(position_ids_target)  # [b, s, hd]
        cos, sin = self.rope(position_ids)  # [b, B, hd]
        # Cached slot i is visible iff i < block start; this hides the padding slot
        # (ctx_len − 1) and every stale slot at or past the block after a rollback.
        start = position_ids[:, :1]  # [b, 1]
        kv_index = torch.arange(self.ctx_len, device=start.device)[None, :]  # [1, ctx]
        ctx_mask = torch.where(kv_index < start, 0.0, MASKED)[:, None, None, :]  # [b,1,1,ctx]

        if self.tied:  # [H, V] gathered along V -> [H, b·B] -> [b, B, H]
            rows = self.head_t.index_select(1, input_ids.reshape(-1)).t()
            h = rows.reshape(*input_ids.shape, -1)
        else:
            h = F.embedding(input_ids, self.embed)
        h = h * self.c.input_embedding_scale  # [b, B, H]
        retained = []
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(target_hidden, ccos, csin)  # [b, n_kv, s, hd]
            cache_k = ctx_scatter(past[2 * i], slots, k)  # [b, n_kv, ctx, hd]
            cache_v = ctx_scatter(past[2 * i + 1], slots, v)
            h = layer(h, cos, sin, cache_k, cache_v, ctx_mask)
            retained += [cache_k, cache_v]

        logits = (self.norm(h[:, 1:]) @ self.head_t) * self.c.output_multiplier  # [b, B−1, V]
        if self.c.final_logit_softcapping:
            cap = self.c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        draft_tokens = logits.argmax(-1)  # [b, B−1]
        return (draft_tokens, *([logits] if self.emit_logits else []), *retained)
