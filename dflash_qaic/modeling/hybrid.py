"""Gated DeltaNet, the recurrent layer kind of the hybrid targets (Qwen3.5 / Qwen3.6, docs/DESIGN.md,
Hybrid targets): it retains a state and a conv window per row instead of a KV cache. Built from a
loaded Hugging Face `Qwen3_5GatedDeltaNet` (its weights only; the forward is ours). The target
skeleton (modeling/target.py) puts it beside gated full attention (modeling/attention.py).

        linear_attention (GatedDeltaNet, state S [hv, dk, dv] and conv window [C, K-1] per row):
            qkv = silu(causal depthwise conv(window ‖ in_proj_qkv(h)))       # [b, s, C]
            q, k = l2norm(q) / sqrt(dk), l2norm(k);  β = sigmoid(in_proj_b h)
            g = -exp(A_log) · softplus(in_proj_a h + dt_bias)                  # log decay <= 0
            per position t: S ← e^g S;  S ← S + k ⊗ β (v − Sᵀk);  o = Sᵀq    (computed in closed
            form over the whole call, below)
            h = out_proj(rmsnorm(o) · w · silu(in_proj_z h))
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

from dflash_qaic import state
from dflash_qaic.modeling.layers import RMSNorm, frozen, frozen_linear

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

    forward(h, call, past_state, past_conv) -> (out [b, s, H], past_state, past_conv, pending),
    the buffers unchanged; `commit(pending, count, idx)` -> (state buffer, conv buffer) after
    position count - 1 of each row (count 0: as they were). past_state [N, hv, dk, dv];
    past_conv [N, C, K-1]."""

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

    @property
    def state_dims(self) -> tuple[int, ...]:
        """(v_heads, k_head_dim, v_head_dim, conv_dim, kernel - 1): its buffers' dims."""
        return (self.hv, self.dk, self.dv, self.conv_dim, self.kernel - 1)

    def state(self, i: int, rows: str, ring: int | None = None) -> state.GatedDeltaNetSpec:
        """What layer i keeps between calls (state.py): its recurrent state and conv window."""
        return state.GatedDeltaNetSpec.of(i, rows, self.state_dims)

    def forward(self, h, call, past_state, past_conv):
        # call (modeling/target.py, Call): rows [b, 1] (`state_rows`); fresh [b, 1, 1] bool: the
        # row starts a sequence (its first position is 0) and starts from a zero state and
        # window, whatever its buffers hold from an earlier sequence; dc: `DeltaContext`
        rows, fresh, dc = call.deltanet
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
        pending = (s0, kt, delta, gam_mat, gam, seq, rows, past_state, past_conv)
        return out, past_state, past_conv, pending

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


def delta_levels(max_rows: int) -> int:
    """Doubling levels `unit_lower_inverse` needs for calls of up to max_rows rows."""
    return max(0, math.ceil(math.log2(max(max_rows, 1))))
