"""The target LLM as one export-friendly program: prefill, verify and decode in one forward.

One skeleton for every family (docs/DESIGN.md, Seams): built from a loaded Hugging Face model,
whose weights and rotary tables only are used (the forward is ours: static buffers, masks from
positions only). Each layer is what its family names (`families.Family.layer_kinds`, a
`LayerKind`): a token mixer, attention (full or sliding, with the variants of
modeling/attention.py; a KV cache or ring per layer), gated attention or Gated DeltaNet
(modeling/hybrid.py, a state and a conv window); an MLP, dense or routed experts
(modeling/moe.py, modeling/gpt_oss.py); wired PRE_NORM (`DecoderLayer`) or SANDWICH (Gemma 4,
modeling/gemma4.py). Each mixer declares the buffers it retains, so the program's inputs and
outputs follow from the layers.

    call   = per attention kind: RoPE, slots, mask, reads (+ DeltaNet's rows and masks)  # once
    x      = embed(input_ids) (· √H, Gemma 4)                                  # [b, s, H]
    per layer i:
        x += mixer_i(input_layernorm(x), call, buffers_i)       # attention / Gated DeltaNet
        x += mlp_i(post_attention_layernorm(x))                 # dense MLP / MoE
    logits      = lm_head(norm(x)) (soft-capped when the config says so)           # [b, s, V]
    next_tokens = argmax(logits) where temperature == 0, else the rule's acceptance  # [b, s]
    count       = committed positions; DeltaNet layers commit their state there  # hybrids
    hidden      = hidden_norm(fc(concat(taps)))      # [b, s, H], the draft's context feature

Verification (dflash_qaic/contract.py): the program verifies by one rule (`rule`), among
those it supports (`verify_rules`); the rule names its acceptance in modeling/sampler.py. The
chain's (docs/DESIGN.md, Sampling): p = softmax(logits / T) restricted by top-k and top-p. Row
j's proposal d is the next row's input token (when that row exists and is not padding); it is
kept with probability p(d), else row j samples from p with d removed; a row without a proposal
samples from p. The host's "accept while next_tokens[j] == proposal" then commits exactly the
lossless speculative-sampling output, and a decode call (no proposal) is plain sampling from p.
The random numbers come from the host (`random_u`).

Taps follow Hugging Face's `output_hidden_states`: layer id j is `hidden_states[j + 1]`, the raw
output of decoder layer j, except the last layer, whose entry is taken after the final norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash_qaic import contract, families, state
from dflash_qaic.checkpoint_files.values import fp16_fc_scale
from dflash_qaic.contract import (
    BATCH_INDEX,
    COMP_CTX_LENGTHS,
    DRAFT_Q_IDS,
    DRAFT_Q_PROBS,
    HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    NEXT_TOKENS,
    NUM_ACCEPTED,
    NUM_COMMITTED,
    POSITION_IDS,
    SAMPLING_INPUTS,
    TREE_MASK,
    VerifyRule,
)
from dflash_qaic.contract import retained as retained_name
from dflash_qaic.families import base as kinds
from dflash_qaic.modeling.attention import (
    Attention,
    AttentionCall,
    AttentionKind,
    GatedAttention,
    kind_call,
    ring_size,
    rotary_dim,
    visible_keys,
)
from dflash_qaic.modeling.gemma4 import Gemma4DecoderLayer
from dflash_qaic.modeling.gpt_oss import GptOssMoE
from dflash_qaic.modeling.hybrid import (
    DeltaContext,
    GatedDeltaNet,
    committed_count,
    delta_levels,
    state_rows,
)
from dflash_qaic.modeling.layers import (
    MLP,
    RMSNorm,
    Rope,
    RopeTable,
    embed_rows,
    frozen,
    vocab_tables,
)
from dflash_qaic.modeling.mla import LatentAttention
from dflash_qaic.modeling.moe import SigmoidMoE, SparseMoeBlock
from dflash_qaic.modeling.ops import cache_rows, cache_slots, write_cache
from dflash_qaic.modeling.penalties import choice_logits
from dflash_qaic.modeling.sampler import (
    ACCEPTANCE,
    SAMPLING_CANDIDATES,
    logprob_outputs,
)


def fp16_safe_fc_weight(fc_weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """fc.weight / s with s = max(sqrt(in_features) * max_row_norm / 128, 1) (as QEfficient's DFlash export).

    With inputs of |x| <= 1 (the taps are divided by their row's max |x| first, see
    `ExportTarget.fuse`), |fc(x)_i| <= |w_i| |x| / s <= 128 |x| / sqrt(in) <= 128: fc's output
    stays far inside fp16's range whatever the weights. hidden_norm is given the matching eps
    (sqrt(eps) / s), so the fused feature is exactly hidden_norm(fc(taps)).
    """
    s = fp16_fc_scale(fc_weight)
    w = fc_weight.detach().float()
    return (w / s if s > 1.0 else w), s


# The module of each layer kind (families.base.LayerKind), from the Hugging Face decoder layer
# and its (text) config.
MIXERS = {
    kinds.ATTENTION: lambda hf, cfg, kind: Attention(
        hf.self_attn, cfg.num_attention_heads, kind.attention, rotary_dim(cfg)
    ),
    kinds.GATED_ATTENTION: lambda hf, cfg, kind: GatedAttention(
        hf.self_attn, cfg.num_attention_heads, cfg.num_key_value_heads, rotary_dim(cfg)
    ),
    kinds.DELTANET: lambda hf, cfg, kind: GatedDeltaNet(hf.linear_attn),
    kinds.LATENT_ATTENTION: lambda hf, cfg, kind: LatentAttention(
        hf.self_attn, cfg.num_attention_heads, bool(getattr(cfg, "rope_interleave", False))
    ),
}
MLPS = {
    kinds.MLP: lambda hf: MLP.from_hf(hf.mlp),
    kinds.MOE: lambda hf: SparseMoeBlock.from_hf(hf.mlp),
    kinds.CLAMPED_MOE: lambda hf: GptOssMoE.from_hf(hf.mlp),
    kinds.SIGMOID_MOE: lambda hf: SigmoidMoE.from_hf(hf.mlp),
}


class DecoderLayer(nn.Module):
    """A PRE_NORM layer: a token mixer and an MLP, each behind an RMSNorm (zero-centred in
    Qwen3.5), each added to the residual stream. The mixer is `self_attn` (attention kinds) or
    `linear_attn` (Gated DeltaNet), as Hugging Face names them."""

    def __init__(self, hf: nn.Module, cfg, kind: kinds.LayerKind, zero_centred: bool):
        super().__init__()
        self.input_layernorm = RMSNorm.from_hf(hf.input_layernorm, zero_centred=zero_centred)
        self.mixer_name = "linear_attn" if kind.mixer == kinds.DELTANET else "self_attn"
        setattr(self, self.mixer_name, MIXERS[kind.mixer](hf, cfg, kind))
        self.post_attention_layernorm = RMSNorm.from_hf(
            hf.post_attention_layernorm, zero_centred=zero_centred
        )
        self.mlp = MLPS[kind.mlp](hf)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x, call: Call, past_a, past_b):
        """x [b, s, H]; past_a, past_b: the mixer's retained pair (key / value caches, or state /
        conv window). -> (x, past_a, past_b, pending): a DeltaNet layer returns its buffers
        unchanged and `pending` for `GatedDeltaNet.commit`; a tree call's attention its K/V."""
        h, past_a, past_b, pending = self.mixer(self.input_layernorm(x), call, past_a, past_b)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, past_a, past_b, pending


# How each layer wires its mixer and MLP (families.base.LayerKind.block)
BLOCKS = {kinds.PRE_NORM: DecoderLayer, kinds.SANDWICH: Gemma4DecoderLayer}


@dataclass
class Call:
    """What every layer of one call shares, computed once per call: each attention kind's
    `AttentionCall` (by kind name) and Gated DeltaNet's (state rows [b, 1], fresh [b, 1, 1],
    DeltaContext; None without)."""

    attention: dict[str, AttentionCall]
    deltanet: tuple | None = None
    ones: torch.Tensor | None = None  # [b, s] ones, idx [s] = 0 … s-1 (DeltaNet's commit)
    idx: torch.Tensor | None = None


class ExportTarget(nn.Module):
    """forward(*inputs) -> outputs, both as contract.TargetIO lists them and bound by name:
    input_ids, position_ids, [batch_index], [comp_ctx_lengths], [temperature, top_k, top_p,
    random_u], [draft q], [token_bitmask], [the rule's inputs], each layer's retained pair ->
    next_tokens, hidden_states, [logits], [num_committed], [the rule's outputs], the retained
    buffers. The sampling inputs are there when `sampling` (the default), batch_index with
    `continuous_batching`, comp_ctx_lengths with `comp_ctx` (the default); num_committed when a
    layer is Gated DeltaNet. The verification rule is `rule` (contract.py; set by the
    exporter among `verify_rules`).

    kinds: the attention kinds (modeling/attention.py, AttentionKind) by name; ropes: their
    RoPE tables by module name ("rope" first). embed_scale multiplies the embeddings (Gemma 4:
    √H); final_logit_softcapping c: logits = c · tanh(logits / c).

    block_size, max_rows: a call of at most block_size rows is a verify (or decode) call, a
    longer one a prefill chunk (a model with Gated DeltaNet layers: every prefill length exceeds
    it); max_rows, the longest call, sets the doubling levels of `hybrid.unit_lower_inverse`
    and the sliding kinds' rings (the caller's `kinds`).
    """

    rule: VerifyRule = contract.CHAIN_RULE

    def __init__(
        self,
        embed: torch.Tensor,
        layers: Sequence[nn.Module],
        norm: RMSNorm,
        lm_head: nn.Linear,
        ropes: dict[str, RopeTable],
        kinds: dict[str, AttentionKind],
        fc_weight: torch.Tensor,
        hidden_norm: RMSNorm,
        target_layer_ids: Sequence[int],
        emit_logits: bool = False,
        sampling: bool = True,
        sampling_candidates: int = SAMPLING_CANDIDATES,
        fc_scale: float = 1.0,
        continuous_batching: bool = False,
        comp_ctx: bool = True,
        token_bitmask: bool = False,
        block_size: int | None = None,
        max_rows: int | None = None,
        embed_scale: float = 1.0,
        final_logit_softcapping: float | None = None,
        logprobs: int = 0,
        logprobs_mode: str = contract.RAW_LOGPROBS,
        extended_sampling: bool = False,
    ):
        super().__init__()
        self.extended = extended_sampling  # contract.TargetIO.extended_sampling
        self.logprobs, self.logprobs_mode = int(logprobs), logprobs_mode  # contract.TargetIO
        self.continuous_batching = continuous_batching
        self.token_bitmask = token_bitmask  # structured output: contract.TOKEN_BITMASK
        self.comp_ctx = comp_ctx
        if lm_head.bias is not None:
            raise ValueError("an lm_head with a bias is not supported")
        self.vocab_size = lm_head.out_features
        # head_t [H, V]; a tied head is also the embedding table (embed is then None)
        self.tied, self.head_t, self.embed = vocab_tables(embed, lm_head.weight)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        for name, table in ropes.items():  # [ctx_len, hd] each
            self.add_module(name, table)
        self.kinds = dict(kinds)
        self.fc = nn.Linear(fc_weight.shape[1], fc_weight.shape[0], bias=False, device="meta")
        self.fc.weight = frozen(fc_weight)
        self.hidden_norm = hidden_norm
        self.target_layer_ids = [int(j) for j in target_layer_ids]
        self.emit_logits = emit_logits
        self.sampling = sampling
        self.sampling_candidates = min(int(sampling_candidates), self.vocab_size)
        self.fc_scale = float(fc_scale)  # fc_weight is fc.weight divided by this
        if self.linear_layers and (block_size is None or max_rows is None):
            raise ValueError("a target with Gated DeltaNet layers needs block_size and max_rows")
        self.block_size = None if block_size is None else int(block_size)
        self.n_levels = None if max_rows is None else delta_levels(max_rows)
        self.embed_scale = float(embed_scale)
        self.softcap = float(final_logit_softcapping) if final_logit_softcapping else None

    @property
    def ctx_len(self) -> int:
        return self.rope.cos.shape[0]

    @property
    def linear_layers(self) -> list[int]:
        """The Gated DeltaNet layers (a hybrid target's)."""
        return [i for i, layer in enumerate(self.layers) if layer.mixer_name == "linear_attn"]

    @property
    def attention_layers(self) -> list[nn.Module]:
        """Every attention layer's mixer, in layer order."""
        return [layer.self_attn for layer in self.layers if layer.mixer_name == "self_attn"]

    @property
    def retained_inputs(self) -> list[str]:
        """Every layer's retained pair, in layer order, as its mixer names them."""
        return [b.name for b in state.buffers_of(self.state_specs())]

    def state_specs(self) -> list[state.StateSpec]:
        """Every layer's retained state as its mixer declares it (state.py): the layers own
        their state, and the program's contract records it (`io_dims`)."""
        rows = state.rows_symbol(self.continuous_batching)
        return [
            layer.mixer.state(i, rows, self._ring(layer.mixer))
            for i, layer in enumerate(self.layers)
        ]

    def _ring(self, mixer: nn.Module) -> int | None:
        """R of the mixer's attention kind's ring (None: a ctx_len cache, or no attention)."""
        kind = getattr(mixer, "kind", None)
        return self.kinds[kind].ring if kind in self.kinds else None

    def unsupported(self, rule: VerifyRule) -> str | None:
        """Why this program cannot verify by `rule` (None: it can; `verify_rules`)."""
        if rule.name == contract.CHAIN:
            return None
        if self.linear_layers:
            return (
                "not built for hybrid targets (their recurrent state commits by the chain's count)"
            )
        if rule.takes_tree and any(k.window is not None for k in self.kinds.values()):
            return "not built for targets with sliding-window layers (Gemma 4, gpt-oss) yet"
        return None

    @property
    def verify_rules(self) -> tuple[str, ...]:
        """The verification rules this program supports, by name."""
        return tuple(n for n, r in contract.RULES.items() if self.unsupported(r) is None)

    def io_dims(self) -> dict:
        """The contract.TargetIO fields that record the layers' state specs (contract.state_fields):
        the cache shape, each layer's when they differ (`layer_kv`), the sliding layers' rings
        (`ring_slots`), a hybrid's DeltaNet layers and their state dims."""
        return contract.state_fields(self.state_specs())

    @classmethod
    def from_hf(
        cls,
        hf_model: nn.Module,
        fc_weight: torch.Tensor,
        hidden_norm_weight: torch.Tensor,
        hidden_norm_eps: float,
        target_layer_ids: Sequence[int],
        ctx_len: int,
        **options,
    ) -> ExportTarget:
        """The program of `hf_model` (its text model: weights and rotary tables), its layers of
        the kinds its family names; the family refuses what it does not support
        (`Family.check_supported`). options: the constructor's (emit_logits, sampling,
        sampling_candidates, continuous_batching, token_bitmask, block_size, max_rows)."""
        family = families.for_hf(hf_model.config)
        cfg = hf_model.config.get_text_config()
        text = cfg.to_dict()
        family.check_supported(text, _config_path(cfg))
        _check_taps(cfg, fc_weight, target_layer_ids)
        base = hf_model.model
        base = getattr(base, "language_model", base)  # a multimodal form's text model
        zc = family.zero_centred_norms
        layer_kinds = family.layer_kinds(text)
        layers = [
            BLOCKS[kind.block](hf, cfg, kind, zc)
            for hf, kind in zip(base.layers, layer_kinds, strict=True)
        ]
        ropes, attn_kinds = attention_kinds(
            base.rotary_emb, layers, layer_kinds, ctx_len, options.get("max_rows")
        )
        fc_w, fc_scale = fp16_safe_fc_weight(fc_weight)
        hidden_norm = RMSNorm(hidden_norm_weight.shape[-1], hidden_norm_eps, hidden_norm_weight)
        return cls(
            embed=base.embed_tokens.weight,
            layers=layers,
            norm=RMSNorm.from_hf(base.norm, zero_centred=zc),
            lm_head=hf_model.lm_head,  # tied or not: whatever HF's head holds
            ropes=ropes,
            kinds=attn_kinds,
            fc_weight=fc_w,
            hidden_norm=hidden_norm,
            target_layer_ids=target_layer_ids,
            fc_scale=fc_scale,
            embed_scale=math.sqrt(cfg.hidden_size) if family.scaled_embeddings else 1.0,
            final_logit_softcapping=text.get("final_logit_softcapping"),
            **options,
        )

    def call(self, position_ids, batch_index, window, tree_mask=None) -> Call:
        """What every layer of a call shares (see `Call`)."""
        rows = cache_rows(batch_index) if batch_index is not None else None  # -1 -> row 0
        slots = cache_slots(position_ids, self.ctx_len)  # [b, s]; -1 -> padding slot ctx_len - 1
        tables, visible, attention = {}, None, {}
        for name, kind in self.kinds.items():
            if kind.rope not in tables:
                tables[kind.rope] = getattr(self, kind.rope)(position_ids)  # [b, s, rotary dim]
            if visible is None:
                visible = visible_keys(position_ids, window, tree_mask, self.ctx_len)
            attention[name] = kind_call(
                kind, *tables[kind.rope], slots, rows, position_ids, window, visible, self.ctx_len
            )
            attention[name].tree = tree_mask is not None
        call = Call(attention)
        if self.linear_layers:
            call.ones = position_ids * 0 + 1  # [b, s]
            call.idx = call.ones[0].cumsum(0) - 1  # [s]: 0 … s-1
            fresh = (position_ids[:, :1] == 0)[:, :, None]  # [b, 1, 1]: a new sequence
            dc = DeltaContext.build(call.idx, self.n_levels)
            call.deltanet = (state_rows(batch_index, call.ones), fresh, dc)
        return call

    def forward(self, *inputs: torch.Tensor):
        # the contract's inputs (TargetIO), bound by the names the exporter gives them
        # (exporter/onnx_export.py sets input_names and output_names):
        # input_ids, position_ids [b, s] int64 (position -1 = padding); with continuous
        # batching, batch_index [b, 1]; comp_ctx_lengths [L] = 0 … L-1, the slots attention
        # reads; with sampling, temperature, top_k, top_p [b] and random_u [b, sample_len, 2];
        # the rule's inputs (a tree's tree_mask [b, s, s]); each layer's retained pair (key /
        # value caches [b or N, kvh, L, hd], or a DeltaNet layer's state [b or N, hv, dk, dv]
        # and conv window [b or N, C, K-1])
        x = dict(zip(self.input_names, inputs, strict=True))
        input_ids, position_ids = x[INPUT_IDS], x[POSITION_IDS]
        batch_index = x[BATCH_INDEX] if self.continuous_batching else None
        window = x[COMP_CTX_LENGTHS] if self.comp_ctx else None  # [L]
        names = self.retained_inputs
        past = [x[n] for n in names]
        tree_mask = x[TREE_MASK] if self.rule.takes_tree else None  # [b, s, s]
        call = self.call(position_ids, batch_index, window, tree_mask)

        h = embed_rows(input_ids, self.head_t, self.embed)  # [b, s, H]
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        last = len(self.layers) - 1
        taps, retained, pending = {}, list(past), {}
        for i, layer in enumerate(self.layers):
            h, retained[2 * i], retained[2 * i + 1], pend = layer(
                h, call, past[2 * i], past[2 * i + 1]
            )
            if pend is not None:  # a DeltaNet layer's commit, a tree layer's K/V rows
                pending[i] = pend
            if i in self.target_layer_ids and i != last:
                taps[i] = h  # raw decoder-layer output = HF hidden_states[i + 1]
        h = self.norm(h)  # [b, s, H]
        if last in self.target_layer_ids:
            taps[last] = h  # HF's last hidden_states entry is taken after the final norm

        logits = h @ self.head_t  # [b, s, V]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        out = self.choose(logits, h, x)
        if self.logprobs:  # a few floats per row of the raw or processed logits
            out.update(logprob_outputs(logits, out, x, self.logprobs, self.logprobs_mode))
        hidden = self.fuse(torch.cat([taps[j] for j in self.target_layer_ids], dim=-1))
        if self.rule.path_order:  # the accepted path: its K/V written, the outputs in its order
            rows = next(iter(call.attention.values())).rows
            hidden = commit_tree(out, hidden, rows, tree_mask, retained, pending, x, self.ctx_len)
        if pending:  # DeltaNet layers: the state after the committed positions only
            count = committed_count(
                input_ids, position_ids, out[NEXT_TOKENS], call.ones, self.block_size
            )
            for i, pend in pending.items():
                net = self.layers[i].linear_attn
                retained[2 * i], retained[2 * i + 1] = net.commit(pend, count, call.idx)
            out[NUM_COMMITTED] = count
        out[HIDDEN_STATES] = hidden
        out.update((retained_name(n), t) for n, t in zip(names, retained, strict=True))
        return tuple(out[n] for n in self.output_names)  # the contract's outputs, by name

    def choose(self, logits, h, x: dict) -> dict:
        """{next_tokens, logits[, num_accepted]}: the argmax, or the rule's acceptance
        (modeling/sampler.py, `ACCEPTANCE`) with the draft's q and the grammar's mask."""
        q = {"q_ids": x[DRAFT_Q_IDS], "q_probs": x[DRAFT_Q_PROBS]} if DRAFT_Q_IDS in x else {}
        # the grammar's mask, the extended sampling adjustments (modeling/penalties.py)
        logits, kw = choice_logits(logits, x, self.vocab_size, self.token_bitmask, self.extended)
        out, q = {LOGITS: logits}, {**q, **kw}
        if not self.sampling:
            out[NEXT_TOKENS] = logits.argmax(dim=-1)  # [b, s] int64
            return out
        sampling = [x[n] for n in SAMPLING_INPUTS]
        accept = ACCEPTANCE[self.rule.acceptance]
        picked = accept(
            logits, x[INPUT_IDS], x[POSITION_IDS], *sampling, self.vocab_size,
            self.sampling_candidates, **q,
        )  # fmt: skip
        if isinstance(picked, tuple):  # the accepted count decided in the graph (BLOCK)
            picked, out[NUM_ACCEPTED] = picked
        out[NEXT_TOKENS] = picked
        return out

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(feats)), safe in fp16: feats [b, s, k*H] -> [b, s, H].

        The raw taps carry massive activations (thousands), so each row is divided by
        m = max(max|x|, 1) before fc; fc.weight is already divided by fc_scale, so |fc(x / m)|
        <= 128 (see fp16_safe_fc_weight). hidden_norm is scale-invariant given the matching
        eps, sqrt(eps) / (fc_scale * m), floored at 2^-24 (fp16's smallest value) so it never rounds
        to 0; the floor changes the result by under 1e-10 relative.
        """
        m = feats.abs().amax(-1, keepdim=True).clamp(min=1.0)  # [b, s, 1]
        eps_root = math.sqrt(self.hidden_norm.eps) / self.fc_scale
        return self.hidden_norm(self.fc(feats / m), (eps_root / m).clamp(min=2.0**-24))


def commit_tree(out, hidden, rows, tree_mask, retained, pending, x, ctx_len: int):
    """The tree rule after the call: the accepted path's K/V (`pending`, per layer) written into
    the caches (`retained`), next_tokens (in `out`) and the returned hidden states in path
    order; num_accepted. Returns the hidden states."""
    path, slots, out[NUM_ACCEPTED] = accept_path(
        x[INPUT_IDS], x[POSITION_IDS], out[NEXT_TOKENS], tree_mask, ctx_len
    )
    for i, (k, v) in pending.items():
        retained[2 * i] = write_cache(retained[2 * i], rows, slots, k)
        retained[2 * i + 1] = write_cache(retained[2 * i + 1], rows, slots, v)
    pending.clear()
    out[NEXT_TOKENS] = out[NEXT_TOKENS].gather(1, path)
    return hidden.gather(1, path[..., None].expand_as(hidden))


def accept_path(input_ids, position_ids, choice, tree_mask, ctx_len: int):
    """Tree verification's acceptance (docs/DESIGN.md, Tree verification), every row at once.

    input_ids, position_ids, choice (the token picked at each node) [b, s]; tree_mask [b, s, s]
    (row r sees row c: c is r or an ancestor; ancestors come before their descendants). Node r
    is accepted when every node on its path from the root carries the token picked at its
    parent; siblings carry distinct tokens, so the accepted nodes form one path. Returns
    (path [b, s]: the accepted node at depth d for d ≤ accepted, d itself past it;
    slots [b, s]: where each row's K/V goes, its position on the path, row r's own slot
    start + r past the path (a prefill chunk's rows), the padding slot otherwise;
    accepted [b]: the path's nodes after the root)."""
    idx = (input_ids[0] * 0 + 1).cumsum(0) - 1  # [s]: 0 … s−1 (a Range would lose the dim)
    mask = tree_mask != 0  # [b, s, s]
    parent = torch.where(mask & (idx[None, :] < idx[:, None]), idx + 1, 0).amax(-1) - 1  # [b, s]
    picked = choice.gather(1, parent.clamp(min=0))  # the token chosen at each row's parent
    # (bool Where and bool reductions are written as And/Or and integer sums: ONNX Runtime
    # has no kernels for them)
    ok = ((parent < 0) & (idx == 0)) | ((parent >= 0) & (input_ids == picked))
    ok = ok & (position_ids >= 0)
    bad = (mask & ~ok[:, None, :]).to(torch.int64).sum(-1)  # [b, s]: ancestors-or-self not ok
    on_path = bad == 0
    accepted = (on_path.to(torch.int64).sum(-1) - 1).clamp(min=0)  # [b]
    start = position_ids[:, :1]  # [b, 1]: the root's position
    depth = position_ids - start  # [b, s]
    at = (on_path[:, :, None] & (depth[:, :, None] == idx)).to(torch.int64)  # [b, node, depth]
    path = torch.where(at.sum(1) > 0, (at * idx[None, :, None]).sum(1), idx)  # [b, s]
    beyond = idx > accepted[:, None]
    slots = torch.where(on_path, position_ids, torch.where(beyond, start + idx, ctx_len - 1))
    slots = torch.where(position_ids < 0, ctx_len - 1, slots)
    return path, slots, accepted


def attention_kinds(rotary, layers, layer_kinds, ctx_len: int, max_rows: int | None):
    """(RoPE tables by module name, AttentionKind by kind name) of the layers' attention kinds,
    in name order. A kind's table is its own where the model keeps one per kind (Gemma 4's
    `{kind}_inv_freq`), else the shared one; the first layer's kind's table is "rope", another
    kind's own table "rope_{kind}". Its head shape is its first layer's, its ring sized by
    max_rows (attention.ring_size)."""
    first = {}
    for layer, kind in zip(layers, layer_kinds, strict=True):
        if layer.mixer_name == "self_attn":
            first.setdefault(kind.attention, (layer.self_attn, kind))
    lead = next(iter(first))
    ropes, out = {}, {}
    for name in sorted(first):
        attn, kind = first[name]
        own = hasattr(rotary, f"{name}_inv_freq")
        table = f"rope_{name}" if own and name != lead else "rope"
        if table not in ropes:
            ropes[table] = RopeTable.from_rope(Rope.from_hf(rotary, name if own else None), ctx_len)
        ring = ring_size(kind.window, max_rows, ctx_len)
        out[name] = AttentionKind(kind.window, table, attn.n_heads, attn.n_kv_heads, ring)
    return dict(sorted(ropes.items(), key=lambda item: item[0] != "rope")), out


def _config_path(cfg) -> Path:
    """Where a loaded model's config came from (for messages)."""
    return Path(getattr(cfg, "name_or_path", "") or "<model>") / "config.json"


def _check_taps(cfg, fc_weight: torch.Tensor, target_layer_ids) -> None:
    """The draft's taps: distinct layers of the model, and an fc of matching shape."""
    n_layers = cfg.num_hidden_layers
    ids = list(target_layer_ids)
    if not ids or any(not 0 <= j < n_layers for j in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids {ids} must be distinct layer ids in [0, {n_layers})")
    expected = (cfg.hidden_size, len(ids) * cfg.hidden_size)
    if tuple(fc_weight.shape) != expected:
        raise ValueError(f"fc weight shape {tuple(fc_weight.shape)} != {expected}")
