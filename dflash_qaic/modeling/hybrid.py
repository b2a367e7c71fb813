"""Hybrid targets (Qwen3.5 / Qwen3.6 dense): Gated DeltaNet layers beside gated full attention.

Built from a loaded Hugging Face `Qwen3_5ForCausalLM` (its weights and rotary tables only; the
forward is ours). See docs/DESIGN.md, Hybrid targets.

    per layer i (3 linear : 1 full, `layer_types`):
        h = input_layernorm(x)                       # zero-centred: x̂ · (1 + w)
        linear_attention (GatedDeltaNet, state S [hv, dk, dv] and conv window [C, K-1] per row):
            qkv = silu(causal depthwise conv(window ‖ in_proj_qkv(h)))       # [b, s, C]
            q, k = l2norm(q) / sqrt(dk), l2norm(k);  β = sigmoid(in_proj_b h)
            g = -exp(A_log) · softplus(in_proj_a h + dt_bias)                  # log decay <= 0
            per position t: S ← e^g S;  S ← S + k ⊗ β (v − Sᵀk);  o = Sᵀq    (computed in closed
            form over the whole call, below)
            h = out_proj(rmsnorm(o) · w · silu(in_proj_z h))
        full_attention (GatedAttention):
            q | gate = q_proj(h);  q, k = q_norm, k_norm (zero-centred);  RoPE on the first
            partial_rotary_factor of head_dim;  h = o_proj(attend(q, k, v) · sigmoid(gate))
        x += h;  x += mlp(post_attention_layernorm(x))
    next_tokens, hidden_states as the dense target (modeling/target.py)
    count = committed positions (`committed_count`); each linear layer writes back the state and
    the conv window after position count - 1 only (`GatedDeltaNet.commit`)

The recurrence over a call of s rows (symbolic: one graph serves prefill, verify and decode), with
S0 the state before the call, D[i, j] = Σ_{j<u<=i} g_u, Γ = exp(D) on and below the diagonal,
γ_t = exp(Σ_{u<=t} g_u):

    S_t = γ_t S0 + Σ_{j<=t} Γ[t, j] k_j δ_jᵀ
    (I + A) Δ = β ⊙ (V − γ ⊙ K S0),   A[t, j] = β_t Γ[t, j] (k_t · k_j) for j < t
    O = γ ⊙ (Q S0) + ((Q Kᵀ) ⊙ Γ) Δ

(I + A)⁻¹ is built by block doubling (`unit_lower_inverse`): a fixed number of levels, enough for
the longest call, each two [s, s] products; no Loop, Scan or If, and every intermediate is an
entry of a true sub-block inverse, so nothing grows that the answer does not hold. The state after
position m is γ_m S0 + Kᵀ (Γ[m, :]ᵀ ⊙ Δ): one more product, for the committed m only. Nothing per
position is stored: a verify call never writes a rejected position into the state.

fp16: D comes from a masked product (not a difference of two long cumulative sums, which would
lose the small exponents that matter), g is floored at -G_FLOOR (e^-G_FLOOR is 0 to every
precision that matters, and D then stays inside fp16's range over any call), Γ, γ <= 1, the L2
norms divide by the row's max first (as RMSNorm does), softplus is written in its stable form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dflash_qaic.contract import (
    BATCH_INDEX,
    COMP_CTX_LENGTHS,
    INPUT_IDS,
    POSITION_IDS,
    SAMPLING_INPUTS,
    past_conv,
    past_key,
    past_state,
    past_value,
)
from dflash_qaic.modeling.layers import (
    MASK_VALUE,
    RMSNorm,
    Rope,
    RopeTable,
    apply_rope,
    embed_rows,
    frozen,
    frozen_linear,
)
from dflash_qaic.modeling.moe import mlp_from_hf
from dflash_qaic.modeling.ops import cache_reads, cache_rows, cache_slots
from dflash_qaic.modeling.sampler import SAMPLING_CANDIDATES, sample_next_tokens
from dflash_qaic.modeling.target import ExportTarget, attend, fp16_safe_fc_weight

# Floor of the per-position log decay: exp(-64) ≈ 1.6e-28, so a state decayed by it is gone in
# fp32 as in fp16, and a call of up to 1023 rows keeps |D| <= 64 · 1023 < 65504.
G_FLOOR = 64.0
L2_EPS = 1e-6  # Hugging Face's l2norm eps (the FLA library's)


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last axis, fp16-safe: that is RMSNorm with eps / n, divided
    by sqrt(n) (n = the axis length), and RMSNorm divides by the row's max before squaring."""
    n = x.shape[-1]
    return RMSNorm.normalize(x, eps / n) * (n**-0.5)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x) = max(x, 0) + log(1 + e^-|x|): no exp of a large argument."""
    return x.clamp(min=0) + torch.log(1 + torch.exp(-x.abs()))


@dataclass
class DeltaContext:
    """Per-call masks shared by every Gated DeltaNet layer, [s, s] floats (s = the call's rows):
    incl[i, j] = j <= i, strict[i, j] = j < i, eye, and levels[l] = the pairs (i, j), j < i, in one
    block of 2^(l+1) rows but different blocks of 2^l (see `unit_lower_inverse`)."""

    incl: torch.Tensor
    strict: torch.Tensor
    eye: torch.Tensor
    levels: list[torch.Tensor]

    @classmethod
    def build(cls, idx: torch.Tensor, n_levels: int) -> DeltaContext:
        # idx [s] int64: 0 … s-1 (a cumulative sum of ones, so its length stays symbolic)
        i, j = idx[:, None], idx[None, :]
        levels = []
        for lv in range(n_levels):
            same_pair = (i // 2 ** (lv + 1)) == (j // 2 ** (lv + 1))
            other_half = (i // 2**lv) != (j // 2**lv)
            levels.append((same_pair & other_half & (j < i)).float())
        return cls((j <= i).float(), (j < i).float(), (j == i).float(), levels)


def unit_lower_inverse(a: torch.Tensor, dc: DeltaContext) -> torch.Tensor:
    """(I + a)⁻¹ for a strictly lower triangular a [..., s, s], by block doubling.

    X starts as I, the inverse of the 1×1 diagonal blocks. Level l adds the part E of a that links
    the two halves of each 2^(l+1) block: (T + E)⁻¹ = X − X E X exactly, since (E X)² = 0. After
    ceil(log2(s)) levels X = (I + a)⁻¹. A level past that finds E = 0 and changes nothing, so one
    graph serves every call length up to 2^levels. Each X is made of diagonal blocks of the true
    inverse (a block of a triangular matrix's inverse is the inverse of its block), so no
    intermediate is larger than what the answer holds (unlike the Neumann series' powers)."""
    x = dc.eye.expand(a.shape)
    for mask in dc.levels:
        e = a * mask
        x = x - x @ (e @ x)
    return x


class _ScatterRows(torch.autograd.Function):
    """buf[rows[b, 0]] = new[b]: one ScatterND over whole rows of a retained state buffer."""

    @staticmethod
    def forward(ctx, buf: torch.Tensor, rows: torch.Tensor, new: torch.Tensor):
        return buf.index_copy(0, rows[:, 0], new)

    @staticmethod
    def symbolic(g, buf, rows, new):
        return g.op("ScatterND", buf, rows, new)


def scatter_rows(buf: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """rows [b, 1] int64, distinct (see `state_rows`); new [b, ...] -> the updated buffer."""
    return _ScatterRows.apply(buf, rows, new)


def state_rows(batch_index: torch.Tensor | None, ones: torch.Tensor) -> torch.Tensor:
    """The state row of each call row, [b, 1]: its batch_index; without continuous batching (or
    for an inactive row, batch_index -1) the call row's own index. An inactive row commits nothing
    and writes back the state it read; the runtime puts active call rows of a full-batch call on
    their own cache rows (row r on cache row r), so an inactive row r rewrites an unused row r
    with its own bytes and never collides with an active row's write (docs/DESIGN.md, Hybrid
    targets). ones [b, s]."""
    own = ones[:, :1].cumsum(0) - 1  # [b, 1]: 0 … b-1
    if batch_index is None:
        return own
    return torch.where(batch_index < 0, own, batch_index)


def committed_count(input_ids, position_ids, next_tokens, ones, block_size: int):
    """Positions each row commits to the recurrent state, [b] int64 (docs/DESIGN.md, Hybrid
    targets): the leading real rows (position >= 0) of a prefill call; in a verify or decode call
    (at most block_size rows: every prefill length exceeds it) 1 + the accepted proposals, by the
    host's rule: row j + 1's input token is accepted while it equals next_tokens[j] (the argmax, or
    the on-device sampler's lossless choice), capped by the leading real rows."""
    real = (position_ids < 0).long().cumsum(1) == 0  # [b, s]
    n_real = real.long().sum(1)
    proposal = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)  # row j: input j + 1
    next_pos = torch.cat([position_ids[:, 1:], position_ids[:, :1] * 0 - 1], dim=1)
    match = (proposal == next_tokens) & (next_pos >= 0)
    accepted = ((~match).long().cumsum(1) == 0).long().sum(1)
    verify = ones.sum(1) <= block_size
    return torch.where(verify, torch.minimum(accepted + 1, n_real), n_real)


class GatedDeltaNet(nn.Module):
    """Hugging Face's `Qwen3_5GatedDeltaNet` over a call, with the state committed apart.

    forward(h, past_state, past_conv, rows, dc) -> (out [b, s, H], pending); `commit(pending,
    count)` -> (state buffer, conv buffer) after position count - 1 of each row (count 0: as
    they were). past_state [N, hv, dk, dv]; past_conv [N, C, K-1]; rows [b, 1] (`state_rows`)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hk, self.hv = hf.num_k_heads, hf.num_v_heads
        self.dk, self.dv = hf.head_k_dim, hf.head_v_dim
        self.kernel = hf.conv_kernel_size
        self.eps = float(hf.layer_norm_epsilon)
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            setattr(self, name, frozen_linear(getattr(hf, name)))
        self.conv1d = nn.Module()
        self.conv1d.weight = frozen(hf.conv1d.weight)  # [C, 1, K]
        self.A_log = frozen(hf.A_log)  # [hv]
        self.dt_bias = frozen(hf.dt_bias)  # [hv]
        self.norm = nn.Module()
        self.norm.weight = frozen(hf.norm.weight)  # [dv], a plain (not zero-centred) weight

    @property
    def conv_dim(self) -> int:
        return self.conv1d.weight.shape[0]

    def forward(self, h, past_state, past_conv, rows, fresh, dc: DeltaContext):
        # fresh [b, 1, 1] bool: the row starts a sequence (its first position is 0) and starts
        # from a zero state and window, whatever its buffers hold from an earlier sequence
        b, s, _ = h.shape
        hk, r, dk, dv, K = self.hk, self.hv // self.hk, self.dk, self.dv, self.kernel
        # causal depthwise conv over [the row's last K-1 inputs ‖ this call's], K static slices
        window = past_conv.index_select(0, rows[:, 0])  # [b, C, K-1]
        window = torch.where(fresh, 0.0, window)
        seq = torch.cat([window, self.in_proj_qkv(h).transpose(1, 2)], dim=2)  # [b, C, K-1+s]
        taps = [seq[:, :, t : t - (K - 1)] for t in range(K - 1)] + [seq[:, :, K - 1 :]]
        # [b, C, s, K] · weight [C, 1, K] (whole: a slice of a weight alone would be folded
        # into a tensor the streaming export has no source for), summed over the kernel
        conv = (torch.stack(taps, dim=-1) * self.conv1d.weight).sum(-1)  # [b, C, s]
        mixed = F.silu(conv).transpose(1, 2)  # [b, s, C]
        q, k, v = mixed.split([hk * dk, hk * dk, self.hv * dv], dim=-1)
        # value head h uses key head h // r: value heads as [hk, r], q/k broadcast over r
        q = l2norm(q.reshape(b, s, hk, dk)).transpose(1, 2)[:, :, None] * dk**-0.5
        k = l2norm(k.reshape(b, s, hk, dk)).transpose(1, 2)[:, :, None]  # [b, hk, 1, s, dk]
        v = v.reshape(b, s, hk, r, dv).permute(0, 2, 3, 1, 4)  # [b, hk, r, s, dv]
        beta = torch.sigmoid(self.in_proj_b(h)).reshape(b, s, hk, r).permute(0, 2, 3, 1)
        a = self.in_proj_a(h) + self.dt_bias  # [b, s, hv]
        # exp(A_log) per element (+ 0·a): an op on the weight alone would be folded by the
        # exporter into a tensor that has no checkpoint source
        g = -torch.exp(self.A_log + a * 0) * softplus(a)
        g = g.clamp(min=-G_FLOOR).reshape(b, s, hk, r).permute(0, 2, 3, 1)  # [b, hk, r, s]
        s0 = past_state.index_select(0, rows[:, 0]).reshape(b, hk, r, dk, dv)
        s0 = torch.where(fresh[..., None, None], 0.0, s0)

        # the closed form of the recurrence over the call (module docstring)
        rg = dc.incl * g[..., None, :]  # [b, hk, r, s, s]: g_u for u <= i
        gam_mat = torch.exp(rg @ dc.strict) * dc.incl  # Γ[i, j] = exp(Σ_{j<u<=i} g_u), j <= i
        gam = torch.exp(rg.sum(-1))  # γ [b, hk, r, s]
        kt = k.transpose(-1, -2)  # [b, hk, 1, dk, s]
        a_mat = (beta[..., None] * (k @ kt)) * gam_mat * dc.strict  # A, strictly lower
        rhs = beta[..., None] * (v - gam[..., None] * (k @ s0))  # [b, hk, r, s, dv]
        delta = unit_lower_inverse(a_mat, dc) @ rhs  # Δ
        o = gam[..., None] * (q @ s0) + ((q @ kt) * gam_mat) @ delta  # [b, hk, r, s, dv]

        o = o.permute(0, 3, 1, 2, 4)  # [b, s, hk, r, dv] = [b, s, hv, dv]
        z = self.in_proj_z(h).reshape(b, s, hk, r, dv)
        o = RMSNorm.normalize(o, self.eps) * self.norm.weight * F.silu(z)
        out = self.out_proj(o.reshape(b, s, self.hv * dv))
        return out, (s0, kt, delta, gam_mat, gam, seq, rows, past_state, past_conv)

    def commit(self, pending, count: torch.Tensor, idx: torch.Tensor):
        """The state and conv window after position count - 1 of each row, written back to the
        row's buffers (count [b] int64; idx [s] = 0 … s-1). count 0 leaves them as they were."""
        s0, kt, delta, gam_mat, gam, seq, rows, past_state, past_conv = pending
        b = s0.shape[0]
        sel = (idx[None, :] == count[:, None] - 1).float()[:, None, None]  # [b, 1, 1, s]
        w = sel[..., None, :] @ gam_mat  # [b, hk, r, 1, s]: Γ[m, :]
        gm = (gam * sel).sum(-1)[..., None, None]  # γ_m [b, hk, r, 1, 1]
        state = gm * s0 + kt @ (w.transpose(-1, -2) * delta)  # [b, hk, r, dk, dv]
        state = torch.where((count > 0)[:, None, None, None, None], state, s0)
        state = state.reshape(b, self.hv, self.dk, self.dv)
        # the window after position m: inputs m+1 … m+K-1 of [old window ‖ call]
        ahead = torch.arange(self.kernel - 1)[None, :]  # [1, K-1]
        index = (count[:, None] + ahead)[:, None, :].expand(b, self.conv_dim, self.kernel - 1)
        window = seq.gather(2, index)  # [b, C, K-1]
        return scatter_rows(past_state, rows, state), scatter_rows(past_conv, rows, window)


class GatedAttention(nn.Module):
    """Hugging Face's `Qwen3_5Attention`: q_proj yields the query and an output gate; q/k
    zero-centred RMSNorm; RoPE on the first `rotary_dim` of each head; output · sigmoid(gate)."""

    def __init__(self, hf: nn.Module, n_heads: int, n_kv_heads: int, rotary_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hf.head_dim
        self.rotary_dim = rotary_dim
        self.scale = hf.scaling
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, frozen_linear(getattr(hf, name)))
        self.q_norm = RMSNorm.from_hf(hf.q_norm, zero_centred=True)
        self.k_norm = RMSNorm.from_hf(hf.k_norm, zero_centred=True)

    def forward(self, h, cos, sin, slots, rows, reads, mask, cache_k, cache_v):
        b, s, _ = h.shape
        nh, kvh, hd, rd = self.n_heads, self.n_kv_heads, self.head_dim, self.rotary_dim
        q, gate = self.q_proj(h).view(b, s, nh, 2 * hd).split([hd, hd], dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # [b, nh, s, hd]
        k = self.k_norm(self.k_proj(h).view(b, s, kvh, hd)).transpose(1, 2)
        v = self.v_proj(h).view(b, s, kvh, hd).transpose(1, 2)  # [b, kvh, s, hd]
        q = torch.cat([apply_rope(q[..., :rd], cos, sin, rd), q[..., rd:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :rd], cos, sin, rd), k[..., rd:]], dim=-1)
        dims = (b, s, nh, kvh, hd)
        out, cache_k, cache_v = attend(
            q, k, v, dims, self.scale, slots, rows, reads, mask, cache_k, cache_v
        )
        out = out * torch.sigmoid(gate.reshape(b, s, nh * hd))
        return self.o_proj(out), cache_k, cache_v


class HybridDecoderLayer(nn.Module):
    """One decoder layer of a hybrid target: a token mixer (`linear_attn` or `self_attn`) and the
    MLP, each behind a zero-centred RMSNorm. `mlp` is any module of the same signature (a MoE
    block takes its place in MoE hybrids)."""

    def __init__(self, hf: nn.Module, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm.from_hf(hf.input_layernorm, zero_centred=True)
        self.post_attention_layernorm = RMSNorm.from_hf(
            hf.post_attention_layernorm, zero_centred=True
        )
        self.linear = hf.block_type == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(hf.linear_attn)
        else:
            rd = rotary_dim(cfg)
            heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
            self.self_attn = GatedAttention(hf.self_attn, heads, kv, rd)
        self.mlp = mlp_from_hf(hf.mlp)  # dense, or sparse MoE (modeling/moe.py)

    def forward(self, x, past_a, past_b, call):
        """x [b, s, H]; past_a, past_b: the layer's retained pair (key/value caches, or state and
        conv window); call: `HybridCall`. -> (x, past_a, past_b, pending): a linear layer
        returns its buffers unchanged and `pending` for `GatedDeltaNet.commit`."""
        h = self.input_layernorm(x)
        pending = None
        if self.linear:
            args = (call.state_rows, call.fresh, call.delta)
            h, pending = self.linear_attn(h, past_a, past_b, *args)
        else:
            args = (call.cos, call.sin, call.slots, call.rows, call.reads, call.mask)
            h, past_a, past_b = self.self_attn(h, *args, past_a, past_b)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, past_a, past_b, pending


@dataclass
class HybridCall:
    """What every layer of one call shares (computed once per call)."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor | None
    reads: torch.Tensor | None
    mask: torch.Tensor
    state_rows: torch.Tensor
    fresh: torch.Tensor  # [b, 1, 1] bool: the row's first position is 0 (a new sequence)
    delta: DeltaContext


def rotary_dim(cfg) -> int:
    rp = getattr(cfg, "rope_parameters", None) or {}
    factor = rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return int(cfg.head_dim * factor)


def delta_levels(max_rows: int) -> int:
    """Doubling levels `unit_lower_inverse` needs for calls of up to max_rows rows."""
    return max(0, math.ceil(math.log2(max(max_rows, 1))))


class ExportHybridTarget(ExportTarget):
    """The target program of a hybrid model: ExportTarget's inputs, and per layer i either
    past_key.i / past_value.i (full attention) or past_state.i / past_conv.i (Gated DeltaNet);
    outputs next_tokens, hidden_states, [logits], num_committed [b] (`committed_count`), then the
    retained buffers in the same order (contract.TargetIO with `linear_layers`).

    block_size: a call of at most this many rows is a verify (or decode) call, a longer one a
    prefill chunk (every prefill length exceeds it). max_rows: the longest call (the prefill
    chunk), which sets the doubling levels of `unit_lower_inverse`."""

    def __init__(self, *args, block_size: int, max_rows: int, **kw):
        super().__init__(*args, **kw)
        self.block_size = int(block_size)
        self.n_levels = delta_levels(max_rows)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.linear]

    @property
    def full_attention(self) -> GatedAttention:
        return next(layer.self_attn for layer in self.layers if not layer.linear)

    @classmethod
    def from_hf(
        cls,
        hf_model: nn.Module,
        fc_weight: torch.Tensor,
        hidden_norm_weight: torch.Tensor,
        hidden_norm_eps: float,
        target_layer_ids,
        ctx_len: int,
        block_size: int,
        max_rows: int,
        emit_logits: bool = False,
        sampling: bool = True,
        sampling_candidates: int = SAMPLING_CANDIDATES,
        continuous_batching: bool = False,
    ) -> ExportHybridTarget:
        cfg = hf_model.config
        _check_hybrid(hf_model, fc_weight, target_layer_ids)
        base = hf_model.model
        layers = [HybridDecoderLayer(layer, cfg) for layer in base.layers]
        rope = RopeTable.from_rope(Rope.from_hf(base.rotary_emb), ctx_len)  # [ctx, rotary_dim]
        fc_w, fc_scale = fp16_safe_fc_weight(fc_weight)
        return cls(
            embed=base.embed_tokens.weight,
            layers=layers,
            norm=RMSNorm.from_hf(base.norm, zero_centred=True),
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
            block_size=block_size,
            max_rows=max_rows,
        )

    def forward(self, *inputs: torch.Tensor):
        # the contract's inputs (TargetIO), bound by the names the exporter gives them, as
        # ExportTarget.forward; past[2i], past[2i+1] = layer i's key/value caches
        # [b or N, kvh, ctx, hd], or its state [b or N, hv, dk, dv] and conv window [b or N, C, K-1]
        x = dict(zip(self.input_names, inputs, strict=True))
        input_ids, position_ids = x[INPUT_IDS], x[POSITION_IDS]
        batch_index = x[BATCH_INDEX] if self.continuous_batching else None
        rows = cache_rows(batch_index) if batch_index is not None else None  # -1 -> row 0
        window = x[COMP_CTX_LENGTHS] if self.comp_ctx else None  # [L]
        sampling = [x[n] for n in SAMPLING_INPUTS] if self.sampling else []
        past = [
            x[n]
            for i, layer in enumerate(self.layers)
            for n in (
                (past_state(i), past_conv(i)) if layer.linear else (past_key(i), past_value(i))
            )
        ]
        ctx_len = self.ctx_len
        ones = position_ids * 0 + 1  # [b, s]
        idx = ones[0].cumsum(0) - 1  # [s]: 0 … s-1
        attn = self.full_attention
        kv_index = window if window is not None else torch.arange(ctx_len)  # [L]
        visible = kv_index <= position_ids[..., None]  # [b, s, L]: slot j visible iff j <= pos
        g = attn.n_heads // attn.n_kv_heads
        mask = (~visible).to(torch.float32) * MASK_VALUE  # [b, s, L]
        cos, sin = self.rope(position_ids)  # [b, s, rotary_dim]
        call = HybridCall(
            cos=cos,
            sin=sin,
            slots=cache_slots(position_ids, ctx_len),
            rows=rows,
            reads=cache_reads(rows, window, attn.n_kv_heads, ctx_len),
            mask=torch.cat([mask] * g, dim=1)[:, None],  # [b, 1, g*s, L]
            state_rows=state_rows(batch_index, ones),
            fresh=(position_ids[:, :1] == 0)[:, :, None],
            delta=DeltaContext.build(idx, self.n_levels),
        )
        x = embed_rows(input_ids, self.head_t, self.embed)  # [b, s, H]
        last = len(self.layers) - 1
        taps, retained, pending = {}, list(past), {}
        for i, layer in enumerate(self.layers):
            x, retained[2 * i], retained[2 * i + 1], pend = layer(
                x, past[2 * i], past[2 * i + 1], call
            )
            if pend is not None:
                pending[i] = pend
            if i in self.target_layer_ids and i != last:
                taps[i] = x  # raw decoder-layer output = HF hidden_states[i + 1]
        x = self.norm(x)
        if last in self.target_layer_ids:
            taps[last] = x

        logits = x @ self.head_t  # [b, s, V]
        if self.sampling:
            next_tokens = sample_next_tokens(
                logits,
                input_ids,
                position_ids,
                *sampling,
                self.vocab_size,
                self.sampling_candidates,
            )
        else:
            next_tokens = logits.argmax(dim=-1)
        count = committed_count(input_ids, position_ids, next_tokens, ones, self.block_size)
        for i, pend in pending.items():  # the state after the committed positions only
            retained[2 * i], retained[2 * i + 1] = self.layers[i].linear_attn.commit(
                pend, count, idx
            )
        hidden = self.fuse(torch.cat([taps[j] for j in self.target_layer_ids], dim=-1))
        extra = (logits,) if self.emit_logits else ()
        return (next_tokens, hidden, *extra, count, *retained)


def _check_hybrid(hf_model: nn.Module, fc_weight: torch.Tensor, target_layer_ids) -> None:
    cfg = hf_model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (only silu)")
    types = set(cfg.layer_types)
    if not types <= {"linear_attention", "full_attention"} or "full_attention" not in types:
        raise ValueError(
            f"hybrid layer_types {sorted(types)}: expected linear_attention and full_attention"
        )
    n_layers = cfg.num_hidden_layers
    ids = list(target_layer_ids)
    if not ids or any(not 0 <= j < n_layers for j in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids {ids} must be distinct layer ids in [0, {n_layers})")
    expected = (cfg.hidden_size, len(ids) * cfg.hidden_size)
    if tuple(fc_weight.shape) != expected:
        raise ValueError(f"fc weight shape {tuple(fc_weight.shape)} != {expected}")
