"""The I/O contract of the two programs: names, symbols, shapes and dtypes.

This is the one place that defines what the target and draft ONNX programs take and return.
The exporters name their graph inputs/outputs from here; the runtime binds buffers from here;
the compiler step derives `specializations.json` and `custom_io.yaml` from here. Nothing else
spells an I/O name.

Shapes are tuples whose entries are either ints (static) or symbol names (str) that a
specialization binds: `batch_size`, `seq_len`, `ctx_len`, (target with sampling) `sample_len`,
the number of leading rows of a call that run the sampler, and (continuous batching)
`full_batch_size`, the rows of every cache.

Continuous batching (docs/DESIGN.md, Continuous batching; QEfficient's layout): exported with a
full batch size N, both programs take `batch_index` int64 [batch_size, 1], the cache row each call
row reads and writes, and keep N cache rows. Prefill (target and draft) runs at batch 1 into the
row its `batch_index` names; verify, decode and the draft block run at batch N. An inactive row has
`batch_index` -1 and every position -1 (vllm-qaic's convention): its writes go to a padding slot
(below), which no query ever reads, and its outputs are ignored.

Greedy calls do not pay for the sampler: `random_u` is [batch, sample_len, 2], and only the first
`sample_len` rows of a call run the sampler; the rest take the argmax. The greedy Verify
specialization binds sample_len = 1, VerifySampled binds it to the block (the runtime picks one by
the shape of `random_u`); likewise Prefill (1: a greedy prompt, and every chunk of a sampled prompt
but its last) and PrefillSampled (the chunk); Decode has one row anyway. One
program, no control flow: a specialization is just another static shape to the compiler, and no
dimension is ever 0 (docs/DESIGN.md, Sampling).

KV cache slots (both programs): a cache has `ctx_len` slots indexed by absolute position. The
last slot, `ctx_len - 1`, is the *padding slot*: rows whose position is -1 write there, and no
real token is ever placed there (the runtime stops a sequence at `ctx_len - 1` positions), so
the causal/visibility masks never let any query read it. That is how "a position of -1 never
changes a slot that can later be read" holds on ONNX Runtime and on the device alike.

Ring caches (draft sliding layers, `DraftIO.ring_slots`): a sliding layer of window W < ctx_len
keeps W slots, a static axis: slots 0 … W−2 hold position mod (W − 1), the last one, W − 1, is the
ring's padding slot. A call writes a context row there when its position is −1, when it is too
old for the call's block to see (below start − (W − 1)) or at or past the block start; a query
reads a ring slot only while the position it holds (derived from the block start) is within its
window, so the padding slot, too-old and not-yet-written slots are never read (docs/DESIGN.md,
Sliding drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dflash_qaic import state
from dflash_qaic.state import (  # noqa: F401  (the buffer names, re-exported)
    BATCH,
    CTX,
    FULL_BATCH,
    RETAINED_SUFFIX,
    past_conv,
    past_key,
    past_state,
    past_value,
    retained,
)

SEQ = "seq_len"
SAMPLE = "sample_len"  # target rows per call that run the sampler (the first ones), 1 <= it <= seq
CCL = "comp_ctx_lengths"  # compute context length: cache slots a call's attention reads
SYMBOLS = (BATCH, SEQ, CTX, SAMPLE, FULL_BATCH, CCL)

# Common input names (QEfficient conventions).
INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
BATCH_INDEX = "batch_index"  # continuous batching: int64 [batch, 1], the cache row of each call row
INACTIVE_ROW = -1  # batch_index (and positions) of a row that holds no sequence
# int64 [comp_ctx_lengths]: the cache slots this call's attention reads, 0 … L-1 (QEfficient's
# compute-context-length input); L is the smallest exported length above every position in the
# call, so a call costs O(L), not O(ctx_len)
COMP_CTX_LENGTHS = "comp_ctx_lengths"
# Target sampling inputs (per row of the batch; per position for the random numbers).
TEMPERATURE = "temperature"  # float [batch]: 0 = greedy argmax, exactly
TOP_K = "top_k"  # int64 [batch]: keep the k most likely tokens; 0 = off
TOP_P = "top_p"  # float [batch]: keep the smallest head of mass >= top_p; 1 = off
RANDOM_U = "random_u"  # float [batch, sample_len, 2]: uniforms in [0, 1) from the host
N_RANDOM = 2  # per position: [..., 0] the accept test, [..., 1] the inverse-CDF sample
SAMPLING_INPUTS = (TEMPERATURE, TOP_K, TOP_P, RANDOM_U)
# Target outputs.
NEXT_TOKENS = "next_tokens"
HIDDEN_STATES = "hidden_states"
LOGITS = "logits"
# Hybrid targets (Gated DeltaNet layers): int64 [batch]: the positions of the call each row
# committed to its recurrent state, decided in the graph by the host's rule (docs/DESIGN.md,
# Hybrid targets): a prefill chunk's real rows; a verify or decode call's 1 + accepted proposals.
NUM_COMMITTED = "num_committed"
# Verification rules (docs/DESIGN.md, Seams: verifiers). A verify call's row r carries a token
# (input_ids), a position (position_ids), a parent row (whose token it follows) and a cache slot
# (where its K/V is written). CHAIN: row r's parent is row r − 1 (row 0's: the committed prefix)
# and its slot is its position, so neither needs an input; every program exported so far is a
# chain. BLOCK: the same rows, but the program decides the accepted count jointly over the
# block (Sun et al. 2024) and returns it as NUM_ACCEPTED int64 [batch].
# TREE: the rows are a tree's nodes (docs/DESIGN.md, Tree verification): row r sits at position
# start + depth (start: row 0's, the root's), sees the committed prefix (slots < start) and the
# rows TREE_MASK marks (its ancestors and itself); the program picks a token at every node
# (argmax, or a plain sample of p), accepts the path that follows those choices from the root,
# writes the path's K/V into slots start … start + accepted and returns next_tokens and
# hidden_states in path order (row d: the accepted node at depth d; past the path, row d
# itself), and NUM_ACCEPTED. A chain is the tree whose mask is lower-triangular, a prefill
# chunk too, so a tree program takes every call through the same rule.
CHAIN = "chain"
BLOCK = "block"
TREE = "tree"
VERIFY_RULES = (CHAIN, BLOCK, TREE)
NUM_ACCEPTED = "num_accepted"
TREE_MASK = "tree_mask"  # int32 [batch, seq_len, seq_len]: 1 where row r sees row c of the call
MAX_TREE_BUDGET = 128  # rows of a tree verify (TensorRT-Edge-LLM's bound)
# Draft inputs / outputs.
TARGET_HIDDEN = "target_hidden"
POSITION_IDS_TARGET = "position_ids_target"
DRAFT_TOKENS = "draft_tokens"
# float [batch, B−1]: the draft's probability of each proposal, estimated as the softmax over its
# CONFIDENCE_TOPK largest logits (an upper bound of the full softmax's; every term and the sum
# stay ≤ CONFIDENCE_TOPK, so fp16 holds it). The runtime picks the verify length from it.
DRAFT_CONFIDENCE = "draft_confidence"
# A DFlash-2 draft exported for sampling (docs/DESIGN.md, DFlash-2 drafts): it takes TEMPERATURE
# and one uniform per proposal, and returns its candidates and its distribution q over them
DRAFT_RANDOM_U = "draft_random_u"  # float [batch, B − 1]
DRAFT_Q_IDS = "draft_q_ids"  # int64 [batch, B − 1, k]
DRAFT_Q_PROBS = "draft_q_probs"  # float [batch, B − 1, k]
# A DFlash draft exported for block verification samples its proposals the same way, from the
# softmax of its DRAFT_SAMPLE_TOP_K largest logits (its q), and returns them as above
DRAFT_SAMPLE_TOP_K = 8
# A draft exported with --draft-top-k k (≤ MAX_DRAFT_TOP_K): each proposal row's k most likely
# ids and their log-probabilities under the draft's full softmax (what a tree is built from,
# B·k small values to the host, never logits)
DRAFT_TOP_IDS = "draft_top_ids"  # int64 [batch, B − 1, k]
DRAFT_TOP_LOGPROBS = "draft_top_logprobs"  # float [batch, B − 1, k], descending
# a DFlash-2 draft with --draft-top-k: its selector's log q of each of row j's first k' candidates
# after each of row j − 1's (row 0: after the anchor, the same for every i), what a tree's
# branches are ranked by (docs/DESIGN.md, Tree verification)
DRAFT_PAIR_LOGPROBS = "draft_pair_logprobs"  # float [batch, B − 1, k', k']
MAX_DRAFT_TOP_K = 8
CONFIDENCE_TOPK = 16
# Structured output (docs/DESIGN.md, Structured output): int32 [batch, seq_len, ceil(V / 32)], the
# tokens a grammar allows at each row (bit i % 32 of word i // 32 set when token i is allowed,
# xgrammar's layout); the program sets every other logit out of reach before its token choice
TOKEN_BITMASK = "token_bitmask"
# Logprobs (docs/DESIGN.md, Logprobs): a target exported with --logprobs K returns, per row, a few
# floats of its distribution, never the logits: the log-probability of its choice, of the token
# LOGPROB_IDS names (a prompt row's next prompt token, which may sit in the next chunk) and its
# K most likely tokens with theirs; of the raw logits, or of the processed ones (LOGPROBS_MODES)
LOGPROB_IDS = "logprob_ids"  # int64 [batch, seq_len]: the token each row scores
TOKEN_LOGPROBS = "token_logprobs"  # float [batch, seq_len]: log p(next_tokens)
SCORED_LOGPROBS = "scored_logprobs"  # float [batch, seq_len]: log p(logprob_ids)
TOP_LOGPROB_IDS = "top_logprob_ids"  # int64 [batch, seq_len, K], most likely first
TOP_LOGPROBS = "top_logprobs"  # float [batch, seq_len, K]
MAX_LOGPROBS = 20  # OpenAI's largest top_logprobs
RAW_LOGPROBS, PROCESSED_LOGPROBS = "raw_logprobs", "processed_logprobs"  # vLLM's names
LOGPROBS_MODES = (RAW_LOGPROBS, PROCESSED_LOGPROBS)

# Extended sampling (docs/DESIGN.md, Extended sampling): a target exported with
# --extended-sampling takes, per row, the settings and a summary of the request's history, and
# adjusts each row's logits before its choice by the tokens before it, the block's own
# proposals included: penalties, logit bias, min_tokens, bad words, min_p
REPETITION_PENALTY = "repetition_penalty"  # float [batch]: 1 = off (HF's rule, prompt + output)
PRESENCE_PENALTY = "presence_penalty"  # float [batch]: 0 = off (OpenAI's, output tokens)
FREQUENCY_PENALTY = "frequency_penalty"  # float [batch]: 0 = off
MIN_P = "min_p"  # float [batch]: 0 = off (tokens below min_p · p_max leave p)
# int64 [batch]: the first position of a generated token (the prompt's length): row inputs from
# there on are generated tokens, counted in the history of the rows after them
GENERATED_FROM = "generated_from"
OUTPUT_COUNTS = "output_token_counts"  # float [batch, V]: generated tokens before the call's
PROMPT_TOKENS = "prompt_token_bitmask"  # int32 [batch, ceil(V / 32)]: the prompt's tokens
STOP_ALLOWED_FROM = "stop_allowed_from"  # int64 [batch]: min_tokens: a stop token's first position
MIN_TOKENS_STOP_IDS = "min_tokens_stop_ids"  # int64 [batch, MAX_STOP_IDS]: -1 = none
LOGIT_BIAS_IDS = "logit_bias_ids"  # int64 [batch, MAX_LOGIT_BIAS]: (0 with bias 0 = none)
LOGIT_BIAS = "logit_bias"  # float [batch, MAX_LOGIT_BIAS]: added to those logits
# bad words: int64 [batch, MAX_BAD_WORDS, BAD_WORD_TOKENS], each word's ids right-aligned, -1
# before them; a word's last token is out of reach where the tokens before it were generated
# just before (OUTPUT_TAIL: the generated ids before the call's first row, -2 for none)
BAD_WORDS = "bad_words_ids"
OUTPUT_TAIL = "output_tail_ids"  # int64 [batch, BAD_WORD_TOKENS - 1]
MAX_STOP_IDS, MAX_LOGIT_BIAS, MAX_BAD_WORDS, BAD_WORD_TOKENS = 8, 64, 16, 4
NO_TOKEN = -2  # OUTPUT_TAIL's filler: matches no bad word's token

PAD_POSITION = -1

# Specialization names (the named form of specializations.json).
PREFILL = "Prefill"  # greedy: sample_len 1 (also a sampled prompt's chunks before its last)
PREFILL_SAMPLED = "PrefillSampled"  # sampling: sample_len = the chunk
# Both at every prefill length (`prefill_lengths`): `Prefill` is the chunk, `Prefill[n]` shorter.
PREFILLS = (PREFILL, PREFILL_SAMPLED)  # the target's prompt chunks (batch 1 in continuous batching)
VERIFY = "Verify"  # greedy: sample_len 1
VERIFY_SAMPLED = "VerifySampled"  # sampling: sample_len = block
DECODE = "Decode"
DRAFT_DECODE = "DraftDecode"
DRAFT_PREFILL = "DraftPrefill"
# Prefill chunks of context one DraftPrefill call takes (`draft_prefill_rows`).
DRAFT_PREFILL_CHUNKS = 4


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64" | "float32"
    shape: tuple[int | str, ...]

    def bind(self, **symbols: int) -> tuple[int, ...]:
        """Concrete shape with the symbols bound, e.g. spec.bind(batch_size=1, seq_len=16, ctx_len=256)."""
        return tuple(symbols[d] if isinstance(d, str) else d for d in self.shape)


# ---------------------------------------------------------------- verification rules
# One rule object per rule, asked by every side (docs/DESIGN.md, Seams: a verifier):
#   rule(name).effective(sampling)      the rule a program of that sampling is exported with
#   rule(name).inputs(io), .outputs(io) its extra program inputs / outputs (TargetIO asks it)
#   rule(name).acceptance               its in-graph acceptance (a function of modeling/sampler.py)
# A program declares the rules it supports (modeling/target.py: ExportTarget.verify_rules); the
# exporter refuses any other by name; the runtime's verifier is the one registered for the rule
# object (runtime/step.py: VERIFIERS).


@dataclass(frozen=True)
class VerifyRule:
    """One verification rule (contract.py's comment on CHAIN / BLOCK / TREE gives the rows).

    name: the rule's name in the manifest and on the command line.
    acceptance: the in-graph acceptance, a function of modeling/sampler.py by this name.
    sampled_only: the rule differs from the chain only when the program samples (a greedy
    program with it is a chain program).
    takes_tree: the program takes TREE_MASK (rows are a tree's nodes at start + depth).
    counts_accepted: the program returns NUM_ACCEPTED (the accepted count decided in the graph).
    path_order: outputs in the accepted path's order, caches written after acceptance.
    flag: the export option that asks for it (for messages).
    """

    name: str
    acceptance: str
    sampled_only: bool = False
    takes_tree: bool = False
    counts_accepted: bool = False
    path_order: bool = False
    flag: str = ""

    @property
    def describe(self) -> str:
        """The rule as a message names it: 'block verification (--verify-rule block)'."""
        return f"{self.name} verification" + (f" ({self.flag})" if self.flag else "")

    def effective(self, sampling: bool) -> VerifyRule:
        """The rule a program of this sampling is exported with: a sampled-only rule on a
        greedy program is the chain."""
        return CHAIN_RULE if self.sampled_only and not sampling else self

    def inputs(self, io) -> list[TensorSpec]:
        """The program inputs this rule adds (io: the program's contract.TargetIO)."""
        return [TensorSpec(TREE_MASK, "int32", (BATCH, SEQ, SEQ))] if self.takes_tree else []

    def outputs(self, io) -> list[TensorSpec]:
        """The program outputs this rule adds."""
        counts = self.counts_accepted and (io.sampling or not self.sampled_only)
        return [TensorSpec(NUM_ACCEPTED, "int64", (BATCH,))] if counts else []


CHAIN_RULE = VerifyRule(CHAIN, acceptance="sample_chain")
BLOCK_RULE = VerifyRule(
    BLOCK,
    acceptance="sample_block",
    sampled_only=True,
    counts_accepted=True,
    flag="--verify-rule block",
)
TREE_RULE = VerifyRule(
    TREE,
    acceptance="sample_tree",
    takes_tree=True,
    counts_accepted=True,
    path_order=True,
    flag="--tree-budgets",
)
RULES: dict[str, VerifyRule] = {r.name: r for r in (CHAIN_RULE, BLOCK_RULE, TREE_RULE)}
assert tuple(RULES) == VERIFY_RULES  # the rule names, in their order


def rule(name: str | VerifyRule) -> VerifyRule:
    """The rule of this name (a rule passes through); a clear error for any other."""
    if isinstance(name, VerifyRule):
        return name
    if name not in RULES:
        raise ValueError(f"unknown verify rule {name!r}: choose from {', '.join(RULES)}")
    return RULES[name]


def layer_states(
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    continuous_batching: bool = False,
    layer_kv: tuple[int, ...] = (),
    ring_slots: tuple[int, ...] = (),
    linear_layers: tuple[int, ...] = (),
    state_dims: tuple[int, ...] = (),
    latent_dims: tuple[int, ...] = (),
) -> list[state.StateSpec]:
    """The state spec of every layer (state.py): a Gated DeltaNet layer's (`linear_layers`,
    state_dims = v_heads, k_head_dim, v_head_dim, conv_dim, kernel - 1), a sliding layer's ring
    (`ring_slots`: per layer its slots, 0 for a ctx_len cache), else full attention; layer_kv:
    layer i's (kv heads, head dim) at [2i], [2i + 1] when layers differ (Gemma 4), else () for
    all alike; latent_dims (kv_lora_rank, rope_dim): every layer a latent (MLA) layer.
    `full_batch_size` rows with continuous batching, else one per call row."""
    rows = state.rows_symbol(continuous_batching)
    if latent_dims:
        return [state.LatentAttentionSpec(i, rows, *latent_dims) for i in range(n_layers)]
    out: list[state.StateSpec] = []
    for i in range(n_layers):
        kvh, hd = layer_kv[2 * i : 2 * i + 2] if layer_kv else (n_kv_heads, head_dim)
        ring = ring_slots[i] if ring_slots else 0
        if i in linear_layers:
            out.append(state.GatedDeltaNetSpec.of(i, rows, state_dims))
        elif ring:
            out.append(state.SlidingWindowSpec(i, rows, kvh, hd, ring))
        else:
            out.append(state.FullAttentionSpec(i, rows, kvh, hd))
    return out


def state_fields(specs: list[state.StateSpec]) -> dict:
    """The TargetIO fields that record these layer state specs (the inverse of `layer_states`):
    n_layers, the attention cache shape (n_kv_heads, head_dim: the first attention layer's;
    `layer_kv` when layers differ), `ring_slots` when a layer is a ring, a hybrid's
    `linear_layers` and `state_dims`; a latent (MLA) target's `latent_dims` (every layer latent,
    recorded as one kv head of kv_lora_rank + rope_dim values). A spec these fields cannot
    record is refused."""
    latent = [s for s in specs if isinstance(s, state.LatentAttentionSpec)]
    if (
        latent
        and len(latent) == len(specs)
        and len({(s.kv_lora_rank, s.rope_dim) for s in latent}) == 1
    ):
        r, dr = latent[0].kv_lora_rank, latent[0].rope_dim
        return dict(n_layers=len(specs), n_kv_heads=1, head_dim=r + dr, latent_dims=(r, dr))
    attn = [s for s in specs if isinstance(s, state.FullAttentionSpec | state.SlidingWindowSpec)]
    nets = [s for s in specs if isinstance(s, state.GatedDeltaNetSpec)]
    if len(attn) + len(nets) != len(specs) or not attn:
        kinds = sorted({s.kind for s in specs})
        raise ValueError(f"the target contract records attention and DeltaNet state, not {kinds}")
    shapes = [(s.kv_heads, s.head_dim) for s in attn]
    out: dict = dict(n_layers=len(specs), n_kv_heads=shapes[0][0], head_dim=shapes[0][1])
    if nets:
        n = nets[0]
        dims = (n.v_heads, n.k_head_dim, n.v_head_dim, n.conv_dim, n.conv_window)
        out.update(linear_layers=tuple(s.layer for s in nets), state_dims=dims)
    elif len(set(shapes)) > 1:
        out["layer_kv"] = tuple(d for shape in shapes for d in shape)
    rings = [s.slots if isinstance(s, state.SlidingWindowSpec) else 0 for s in attn]
    if any(rings) and not nets:
        out["ring_slots"] = tuple(rings)
    return out


def retained_specs(specs) -> list[TensorSpec]:
    """The retained inputs the state specs declare, in layer order (past_key.{i}, past_value.{i}
    interleaved as QEfficient orders them; a hybrid's past_state.{i}, past_conv.{i})."""
    return [TensorSpec(b.name, b.dtype, b.shape) for b in state.buffers_of(specs)]


def batch_index_specs(continuous_batching: bool) -> list[TensorSpec]:
    return [TensorSpec(BATCH_INDEX, "int64", (BATCH, 1))] if continuous_batching else []


def window_specs(comp_ctx: bool) -> list[TensorSpec]:
    return [TensorSpec(COMP_CTX_LENGTHS, "int64", (CCL,))] if comp_ctx else []


LONG_WINDOW = 2048  # past 16K of context, windows halve down to about this many slots


def default_comp_ctx_lengths(ctx_len: int, prefill_seq_len: int, block_size: int) -> list[int]:
    """Attention windows exported by default: ctx_len, / 2, / 4 and / 8 (up to 16K of context),
    and past that halvings down to LONG_WINDOW (40K: 2560 … 40960), those that hold at least the
    shortest prefill chunk and a block. Each window at most doubles the one below, so a call
    reads at most twice the slots it needs above the smallest window: a long prompt's cost
    follows its length, not ctx_len (docs/DESIGN.md, Sliding drafts)."""
    floor = prefill_lengths(prefill_seq_len, block_size)[0] + block_size
    smallest = max(floor, min(ctx_len >> 3, LONG_WINDOW))
    return sorted({ctx_len >> k for k in range(16) if (ctx_len >> k) >= smallest} | {ctx_len})


def windows_or_default(
    lengths: list[int] | None, ctx_len: int, prefill_seq_len: int, block_size: int
) -> list[int]:
    return (
        list(lengths) if lengths else default_comp_ctx_lengths(ctx_len, prefill_seq_len, block_size)
    )


def window_for(lengths: list[int], needed: int) -> int:
    """The smallest exported window holding `needed` slots (0 … needed-1)."""
    for n in lengths:
        if n >= needed:
            return n
    raise ValueError(f"no attention window holds {needed} slots (windows {lengths})")


def sampling_specs() -> list[TensorSpec]:
    """The target's sampling inputs (see `TargetIO`)."""
    return [
        TensorSpec(TEMPERATURE, "float32", (BATCH,)),
        TensorSpec(TOP_K, "int64", (BATCH,)),
        TensorSpec(TOP_P, "float32", (BATCH,)),
        TensorSpec(RANDOM_U, "float32", (BATCH, SAMPLE, N_RANDOM)),
    ]


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask row: 32 tokens per word."""
    return (vocab_size + 31) // 32


def q_specs(rows: int, k: int) -> list[TensorSpec]:
    """A DFlash-2 draft's q over its k candidates per proposal (DraftIO out, TargetIO in)."""
    shape = (BATCH, rows, k)
    return [TensorSpec(DRAFT_Q_IDS, "int64", shape), TensorSpec(DRAFT_Q_PROBS, "float32", shape)]


@dataclass(frozen=True)
class TargetIO:
    """I/O of the target program (prefill, verify and decode in one graph).

    With `sampling` (the default) the program also takes `temperature`, `top_k`, `top_p` per
    batch row and `random_u` for the first `sample_len` positions, and `next_tokens` at those
    positions is the token committed under the lossless rule (docs/DESIGN.md, Sampling): row j's proposal
    is the next row's input token when that row exists and is not padding; it is accepted with
    probability p(d), else the row samples from p with d removed; a row without a proposal
    samples from p. Temperature 0 and every row past `sample_len` take the plain argmax.
    Without `sampling`, `next_tokens` is always the argmax. With `continuous_batching` the
    program also takes `batch_index` and keeps `full_batch_size` cache rows.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    emit_logits: bool = False
    sampling: bool = True
    continuous_batching: bool = False
    comp_ctx: bool = False  # takes `comp_ctx_lengths` (every export since it existed does)
    # Hybrid targets: the Gated DeltaNet layers (no KV cache: a state and a conv window,
    # state.GatedDeltaNetSpec) and their state dims; the program also returns NUM_COMMITTED.
    linear_layers: tuple[int, ...] = ()
    state_dims: tuple[int, ...] = ()
    # (B − 1, k) for a DFlash-2 draft exported for sampling: the draft's q (DRAFT_Q_IDS,
    # DRAFT_Q_PROBS [batch, B − 1, k]) is an input and verification is q-aware; () as before
    draft_q: tuple[int, ...] = ()
    # structured output: the program takes TOKEN_BITMASK, applied before every row's choice
    token_bitmask: bool = False
    # how a sampled verify decides its accepted count (VERIFY_RULES; BLOCK adds NUM_ACCEPTED)
    verify_rule: str = CHAIN
    # per-layer cache shapes (kv heads, head dim of layer i at [2i], [2i + 1]) when the layers
    # differ (Gemma 4's sliding and full layers); () when every layer has n_kv_heads, head_dim
    layer_kv: tuple[int, ...] = ()
    # per layer: the slots of a sliding layer's ring cache, 0 for a ctx_len cache (empty: all
    # ctx_len); docs/DESIGN.md, Layer kinds
    ring_slots: tuple[int, ...] = ()
    # logprobs: the top K (0: no logprob outputs) and of which distribution (LOGPROBS_MODES)
    logprobs: int = 0
    logprobs_mode: str = RAW_LOGPROBS
    # the extended sampling inputs (extended_specs), applied before every row's choice
    extended_sampling: bool = False
    # a latent-attention (MLA) target: (kv_lora_rank, rope_dim) of every layer's latent cache
    # (state.LatentAttentionSpec); () for attention / DeltaNet caches
    latent_dims: tuple[int, ...] = ()

    @property
    def hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def rule(self) -> VerifyRule:
        """The program's verification rule object (`verify_rule` is its name)."""
        return rule(self.verify_rule)

    @property
    def state(self) -> list[state.StateSpec]:
        """The retained state of every layer (state.py): full attention, a sliding layer's ring,
        a Gated DeltaNet layer's state and conv window."""
        return layer_states(
            self.n_layers,
            self.n_kv_heads,
            self.head_dim,
            self.continuous_batching,
            self.layer_kv,
            self.ring_slots,
            self.linear_layers,
            self.state_dims,
            self.latent_dims,
        )

    @property
    def kv(self) -> list[TensorSpec]:
        """Every retained buffer, as the state specs declare them."""
        return retained_specs(self.state)

    @property
    def inputs(self) -> list[TensorSpec]:
        return [
            TensorSpec(INPUT_IDS, "int64", (BATCH, SEQ)),
            TensorSpec(POSITION_IDS, "int64", (BATCH, SEQ)),
            *batch_index_specs(self.continuous_batching),
            *window_specs(self.comp_ctx),
            *(sampling_specs() if self.sampling else ()),
            *(q_specs(*self.draft_q) if self.sampling and self.draft_q else ()),
            *self.bitmask,
            *(extended_specs(self.vocab_size) if self.extended_sampling else ()),
            *self.rule.inputs(self),
            *([TensorSpec(LOGPROB_IDS, "int64", (BATCH, SEQ))] if self.logprobs else ()),
            *self.kv,
        ]

    @property
    def bitmask(self) -> list[TensorSpec]:
        """TOKEN_BITMASK when the program takes it (structured output), else nothing."""
        if not self.token_bitmask:
            return []
        return [TensorSpec(TOKEN_BITMASK, "int32", (BATCH, SEQ, bitmask_words(self.vocab_size)))]

    @property
    def outputs(self) -> list[TensorSpec]:
        out = [
            TensorSpec(NEXT_TOKENS, "int64", (BATCH, SEQ)),
            TensorSpec(HIDDEN_STATES, "float32", (BATCH, SEQ, self.hidden_size)),
        ]
        if self.emit_logits:
            out.append(TensorSpec(LOGITS, "float32", (BATCH, SEQ, self.vocab_size)))
        if self.hybrid:
            out.append(TensorSpec(NUM_COMMITTED, "int64", (BATCH,)))
        out += self.rule.outputs(self)
        out += logprob_specs(self.logprobs)
        out += [TensorSpec(retained(s.name), s.dtype, s.shape) for s in self.kv]
        return out


def extended_specs(vocab_size: int) -> list[TensorSpec]:
    """The extended sampling inputs (see their names' comments)."""
    rows = [REPETITION_PENALTY, PRESENCE_PENALTY, FREQUENCY_PENALTY, MIN_P]
    return [
        *(TensorSpec(n, "float32", (BATCH,)) for n in rows),
        TensorSpec(GENERATED_FROM, "int64", (BATCH,)),
        TensorSpec(OUTPUT_COUNTS, "float32", (BATCH, vocab_size)),
        TensorSpec(PROMPT_TOKENS, "int32", (BATCH, bitmask_words(vocab_size))),
        TensorSpec(STOP_ALLOWED_FROM, "int64", (BATCH,)),
        TensorSpec(MIN_TOKENS_STOP_IDS, "int64", (BATCH, MAX_STOP_IDS)),
        TensorSpec(LOGIT_BIAS_IDS, "int64", (BATCH, MAX_LOGIT_BIAS)),
        TensorSpec(LOGIT_BIAS, "float32", (BATCH, MAX_LOGIT_BIAS)),
        TensorSpec(BAD_WORDS, "int64", (BATCH, MAX_BAD_WORDS, BAD_WORD_TOKENS)),
        TensorSpec(OUTPUT_TAIL, "int64", (BATCH, BAD_WORD_TOKENS - 1)),
    ]


def draft_extended_specs(vocab_size: int) -> list[TensorSpec]:
    """The draft's extended sampling inputs: the target's but MIN_P (a sampler setting) and the
    repetition penalty's (the draft leaves it out: modeling/penalties.py, proposal_logits).
    The host feeds both programs the same arrays."""
    skip = (MIN_P, REPETITION_PENALTY, PROMPT_TOKENS)
    return [s for s in extended_specs(vocab_size) if s.name not in skip]


def logprob_specs(k: int) -> list[TensorSpec]:
    """The logprob outputs of a target exported with --logprobs k (none for k = 0)."""
    if not k:
        return []
    return [
        TensorSpec(TOKEN_LOGPROBS, "float32", (BATCH, SEQ)),
        TensorSpec(SCORED_LOGPROBS, "float32", (BATCH, SEQ)),
        TensorSpec(TOP_LOGPROB_IDS, "int64", (BATCH, SEQ, k)),
        TensorSpec(TOP_LOGPROBS, "float32", (BATCH, SEQ, k)),
    ]


@dataclass(frozen=True)
class RowLayout:
    """Where each row of a verify call sits: its parent row (−1: the committed prefix) and its
    depth, apart from its row (docs/DESIGN.md, Seams: verifiers). Chain programs take the chain
    layout implicitly (`chain`); a tree program takes any layout as TREE_MASK (`mask`) and its
    rows' positions start + depth (a tree's rows share depths, so positions repeat)."""

    parents: tuple[int, ...]
    depths: tuple[int, ...]

    @classmethod
    def chain(cls, n: int) -> RowLayout:
        return cls(tuple(range(-1, n - 1)), tuple(range(n)))

    @property
    def is_chain(self) -> bool:
        return self == RowLayout.chain(len(self.parents))

    def positions(self, start: int) -> list[int]:
        """Row positions: start + depth (a chain: start … start + n − 1)."""
        return [start + d for d in self.depths]

    def slots(self, start: int) -> list[int]:
        """The slots a tree program writes the rows' K/V to when none is accepted past the root:
        start + row (a chain's are its positions); the accepted path's go to start + depth."""
        return [start + r for r in range(len(self.parents))]

    def mask(self) -> list[list[int]]:
        """TREE_MASK of this layout: [r][c] = 1 where row r sees row c (ancestors and itself)."""
        n = len(self.parents)
        return [[int(self.visible(r, c)) for c in range(n)] for r in range(n)]

    def visible(self, r: int, c: int) -> bool:
        """Whether row r attends to row c of the same call: c is r or one of its ancestors
        (a chain: c ≤ r, the causal mask)."""
        while r >= 0:
            if r == c:
                return True
            r = self.parents[r]
        return False


@dataclass(frozen=True)
class DraftIO:
    """I/O of the draft program. The block length B is static in the graph."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    block_size: int
    emit_logits: bool = False
    continuous_batching: bool = False
    comp_ctx: bool = False  # takes `comp_ctx_lengths`
    confidence: bool = False  # returns `draft_confidence` (every export since it existed does)
    # per layer: the ring's slots of a sliding layer, 0 for a ctx_len cache (empty: all ctx_len)
    ring_slots: tuple[int, ...] = ()
    # a DFlash-2 draft exported for sampling: its selector's top-k (0: greedy proposals only)
    q_top_k: int = 0
    # each proposal row's top-k ids and log-probabilities as outputs (0: none)
    top_k: int = 0
    # a DFlash-2 draft's pairwise log q over its first pair_k candidates (0: none)
    pair_k: int = 0
    # the target's extended sampling inputs but min_p and the repetition penalty's
    # (`draft_extended_specs`): the draft adjusts its logits as the target will before it proposes
    extended_sampling: bool = False

    @property
    def state(self) -> list[state.StateSpec]:
        """The retained state of every layer: the injected context's K/V, a ring on a sliding
        layer (state.py)."""
        return layer_states(
            self.n_layers,
            self.n_kv_heads,
            self.head_dim,
            self.continuous_batching,
            ring_slots=self.ring_slots,
        )

    @property
    def kv(self) -> list[TensorSpec]:
        return retained_specs(self.state)

    @property
    def inputs(self) -> list[TensorSpec]:
        b = self.block_size
        return [
            TensorSpec(TARGET_HIDDEN, "float32", (BATCH, SEQ, self.hidden_size)),
            TensorSpec(POSITION_IDS_TARGET, "int64", (BATCH, SEQ)),
            TensorSpec(INPUT_IDS, "int64", (BATCH, b)),
            TensorSpec(POSITION_IDS, "int64", (BATCH, b)),
            *batch_index_specs(self.continuous_batching),
            *window_specs(self.comp_ctx),
            *self.q_inputs,
            *(draft_extended_specs(self.vocab_size) if self.extended_sampling else ()),
            *self.kv,
        ]

    @property
    def q_inputs(self) -> list[TensorSpec]:
        if not self.q_top_k:
            return []
        return [
            TensorSpec(TEMPERATURE, "float32", (BATCH,)),
            TensorSpec(DRAFT_RANDOM_U, "float32", (BATCH, self.block_size - 1)),
        ]

    @property
    def q_outputs(self) -> list[TensorSpec]:
        """A DFlash-2 draft's q (also the target's inputs of the same names)."""
        return q_specs(self.block_size - 1, self.q_top_k) if self.q_top_k else []

    @property
    def outputs(self) -> list[TensorSpec]:
        out = [TensorSpec(DRAFT_TOKENS, "int64", (BATCH, self.block_size - 1))]
        if self.confidence:
            out.append(TensorSpec(DRAFT_CONFIDENCE, "float32", (BATCH, self.block_size - 1)))
        out += self.q_outputs
        if self.top_k:
            shape = (BATCH, self.block_size - 1, self.top_k)
            out += [
                TensorSpec(DRAFT_TOP_IDS, "int64", shape),
                TensorSpec(DRAFT_TOP_LOGPROBS, "float32", shape),
            ]
        if self.pair_k:
            pair = (BATCH, self.block_size - 1, self.pair_k, self.pair_k)
            out.append(TensorSpec(DRAFT_PAIR_LOGPROBS, "float32", pair))
        if self.emit_logits:
            out.append(TensorSpec(LOGITS, "float32", (BATCH, self.block_size - 1, self.vocab_size)))
        out += [TensorSpec(retained(s.name), s.dtype, s.shape) for s in self.kv]
        return out


def _batch_symbols(batch_size: int, full_batch_size: int | None, prefill: bool) -> dict:
    """batch_size (and full_batch_size) of a specialization: with continuous batching, prefill
    runs one row into one cache row and the others run every cache row."""
    if full_batch_size is None:
        return {BATCH: batch_size}
    return {BATCH: 1 if prefill else full_batch_size, FULL_BATCH: full_batch_size}


def default_verify_lengths(block_size: int) -> list[int]:
    """Verify calls of B/4, B/2 and B rows (at least 2): the runtime verifies a shorter head of
    the block when the draft is unsure of the rest and a shorter call costs less."""
    return sorted({n for n in (block_size // 4, block_size // 2, block_size) if n >= 2})


def prefill_lengths(prefill_seq_len: int, block_size: int) -> list[int]:
    """The prefill chunks' row counts: the chunk C and, when C/4 exceeds the block size, C/4 too.
    A prompt takes chunks of C while at least C tokens are left, then the fewest rows that cover
    the rest (`plan_prefill`): a 280-token prompt costs 256 + 64 rows, not 5 chunks of 64 (each
    call also pays a fixed cost), nor 2 chunks of 256. Every length exceeds the block size, so a
    prefill call never has a verify call's shape (docs/DESIGN.md, Prefill chunks)."""
    quarter = prefill_seq_len // 4
    return [quarter, prefill_seq_len] if quarter > block_size else [prefill_seq_len]


def plan_prefill(remaining: int, lengths: list[int]) -> int:
    """The row count of the next prefill call when `remaining` prompt tokens are left: the chunk
    (the longest length) while it is filled; else the length whose repeats cover the rest in
    the fewest rows, and of those the longest (fewest calls). It depends on the prompt alone,
    so a prompt is cut the same way whatever else runs (a batched request equals its solo run)."""
    if remaining >= lengths[-1]:
        return lengths[-1]
    return min(lengths, key=lambda n: (-(-remaining // n) * n, -n))


def check_prefill_lengths(lengths: list[int], prefill_seq_len: int, block_size: int) -> None:
    """Prefill lengths as a manifest may list them: ascending, ending at the chunk, the shorter
    ones above the block size (a prefill call must not take a verify call's shape)."""
    if (
        not lengths
        or lengths != sorted(set(lengths))
        or lengths[-1] != prefill_seq_len
        or any(n <= block_size for n in lengths[:-1])
    ):
        raise ValueError(
            f"prefill lengths must ascend, the shorter ones above the block size {block_size}, "
            f"and end at prefill_seq_len {prefill_seq_len}, got {lengths} (e.g. "
            f"{prefill_lengths(prefill_seq_len, block_size)}): re-export the artifacts"
        )


def check_verify_lengths(lengths: list[int] | None, block_size: int) -> list[int]:
    """The verify lengths to export (None: `default_verify_lengths`), checked: ascending, each in
    2 … B, the last one B (a step can always verify the whole block)."""
    if lengths is None:
        return default_verify_lengths(block_size)
    lengths = [int(n) for n in lengths]
    if (
        not lengths
        or lengths != sorted(set(lengths))
        or lengths[0] < 2
        or lengths[-1] != block_size
    ):
        raise ValueError(
            f"verify lengths must ascend, be at least 2 and end at the block size {block_size}, "
            f"got {lengths} (e.g. {default_verify_lengths(block_size)}; {block_size} alone "
            "always verifies the whole block)"
        )
    return lengths


def draft_prefill_rows(ctx_len: int, prefill_seq_len: int, block_size: int) -> int:
    """Context rows of the DraftPrefill specialization: up to DRAFT_PREFILL_CHUNKS prefill chunks
    (fewer when ctx_len is small), so a prompt of P tokens costs ⌈P / rows⌉ draft calls, each
    running the block once, instead of one per target chunk."""
    room = (ctx_len - block_size - 2) // prefill_seq_len
    return prefill_seq_len * max(1, min(DRAFT_PREFILL_CHUNKS, room))


def max_positions(ctx_len: int) -> int:
    """Real tokens a sequence may hold: every slot but the padding slot."""
    return ctx_len - 1


def max_prompt(ctx_len: int, rows: int) -> int:
    """The prompt-room rule, for every caller: the longest prompt that leaves room for a call of
    `rows` rows after it (DFlash: rows = B, its first verify block; the target alone: rows = 1).
    A call of `rows` rows from position `start` fits while start ≤ max_prompt(ctx_len, rows)."""
    return max_positions(ctx_len) - rows


@dataclass(frozen=True)
class ShapePlan:
    """The shapes both programs are specialized for: what the exporter compiled them for and
    what the runtime may call (docs/DESIGN.md, I/O contract). The manifest stores these fields
    (`Manifest.plan`); the specializations of both programs are derived from them
    (`target_specializations`, `draft_specializations`), and nothing parses a name back.

    prefill_lengths: the target's prompt-chunk row counts, ascending, the last one the chunk;
    verify_lengths: the verify blocks' row counts, ascending, the last one the block size;
    draft_prefill_rows: the draft's prompt-context row counts, ascending;
    tree_budgets: the rows of tree verify calls (a tree program's; () for others), ascending;
    windows: the attention windows (comp_ctx_lengths), ascending, the last one ctx_len;
    full_batch_size: continuous batching's cache rows (None: off);
    sampling: the target takes the sampling inputs (greedy calls run the sampler on one row);
    batch_size: the rows of a call without continuous batching (1)."""

    block_size: int
    prefill_seq_len: int
    ctx_len: int
    prefill_lengths: tuple[int, ...]
    verify_lengths: tuple[int, ...]
    draft_prefill_rows: tuple[int, ...]
    windows: tuple[int, ...] | None = None
    full_batch_size: int | None = None
    sampling: bool = True
    batch_size: int = 1
    tree_budgets: tuple[int, ...] = ()

    @property
    def step_lengths(self) -> tuple[int, ...]:
        """Row counts of a step's verify calls: the verify lengths and the tree budgets."""
        return tuple(sorted({*self.verify_lengths, *self.tree_budgets}))

    def sample_len(self, seq: int, greedy: bool) -> int:
        """`sample_len` of the target specialization a call of `seq` rows takes: 1 when no row
        samples (the greedy Prefill, Verify and Decode), else every row."""
        return 1 if greedy else seq

    @property
    def cache_rows(self) -> int:
        return self.full_batch_size or 1

    def longest(self) -> ShapePlan:
        """The plan cut to the longest shape of each kind at the full context (the chunk, the
        whole block, the longest draft prefill, the ctx_len window): the specializations that
        compute every value the shorter ones compute on fewer rows or slots (the fp16 check)."""
        return replace(
            self,
            prefill_lengths=self.prefill_lengths[-1:],
            verify_lengths=self.verify_lengths[-1:],
            tree_budgets=self.tree_budgets[-1:],
            draft_prefill_rows=self.draft_prefill_rows[-1:],
            windows=(self.ctx_len,) if self.windows else None,
        )

    def check(self) -> None:
        """ValueError naming the field when the plan cannot be specialized (fix: re-export)."""
        check_prefill_lengths(list(self.prefill_lengths), self.prefill_seq_len, self.block_size)
        check_verify_lengths(list(self.verify_lengths), self.block_size)
        rows = list(self.draft_prefill_rows)
        if not rows or rows != sorted(set(rows)) or rows[0] < 1 or rows[-1] >= self.ctx_len:
            raise ValueError(
                f"draft prefill rows must ascend, each in 1 … ctx_len - 1, got {rows}: "
                "re-export the artifacts"
            )
        w = list(self.windows) if self.windows is not None else None
        if w is not None and (not w or w != sorted(set(w)) or w[0] < 1 or w[-1] != self.ctx_len):
            raise ValueError(f"windows must ascend and end at ctx_len {self.ctx_len}, got {w}")
        check_tree_budgets(list(self.tree_budgets), self.ctx_len)


def check_tree_budgets(budgets: list[int], ctx_len: int) -> list[int]:
    """Tree budgets as an export takes them: distinct, ascending, each in 2 … MAX_TREE_BUDGET
    and below ctx_len − 1."""
    top = min(MAX_TREE_BUDGET, max_positions(ctx_len) - 1)
    if budgets != sorted(set(budgets)) or any(not 2 <= n <= top for n in budgets):
        raise ValueError(
            f"tree budgets must be distinct ascending row counts in 2 … {top}, got {budgets} "
            "(e.g. 16,32,64)"
        )
    return budgets


def shape_plan(
    block_size: int,
    prefill_seq_len: int,
    ctx_len: int,
    *,
    batch_size: int = 1,
    full_batch_size: int | None = None,
    windows: list[int] | None = None,
    verify_lengths: list[int] | None = None,
    sampling: bool = True,
    tree_budgets: list[int] | None = None,
) -> ShapePlan:
    """The plan an export makes from its options: the prefill lengths (`prefill_lengths`), the
    verify lengths (None: `default_verify_lengths`), the draft's prefill rows (the prefill
    lengths and `draft_prefill_rows`) and the windows as given (None: no `comp_ctx_lengths`
    input; the exporter passes `windows_or_default`)."""
    chunks = prefill_lengths(prefill_seq_len, block_size)
    rows = sorted({*chunks, draft_prefill_rows(ctx_len, prefill_seq_len, block_size)})
    return ShapePlan(
        block_size=block_size,
        prefill_seq_len=prefill_seq_len,
        ctx_len=ctx_len,
        prefill_lengths=tuple(chunks),
        verify_lengths=tuple(check_verify_lengths(verify_lengths, block_size)),
        draft_prefill_rows=tuple(rows),
        windows=tuple(windows) if windows is not None else None,
        full_batch_size=full_batch_size,
        sampling=sampling,
        batch_size=batch_size,
        tree_budgets=tuple(check_tree_budgets(list(tree_budgets or ()), ctx_len)),
    )


def _spec(plan: ShapePlan, kind: str, name: str, seq: int, sample: int | None) -> dict:
    """One specialization: its name, its kind (PREFILL, VERIFY, … : the name without the length
    and window) and its symbols."""
    prefill = kind in PREFILLS or kind == DRAFT_PREFILL
    sym = {**_batch_symbols(plan.batch_size, plan.full_batch_size, prefill), SEQ: seq}
    sym[CTX] = plan.ctx_len
    if sample is not None:
        sym[SAMPLE] = sample
    return {"name": name, "kind": kind, "symbols": sym}


def _sized(kind: str, n: int, full: int) -> str:
    return kind if n == full else f"{kind}[{n}]"


def target_specializations(plan: ShapePlan) -> list[dict]:
    """Named specializations of the target program: prefill chunk, verify block, single-token
    decode; with sampling, `sample_len` bound in each and a second prefill chunk and verify
    block that sample every row (the greedy Prefill and Verify run the sampler on one row only,
    at temperature 0 the argmax).
    Both prefill chunks exist once per prefill length n (`Prefill` at the chunk, `Prefill[n]`
    below), both verify blocks once per verify length n (`Verify` at B rows, `Verify[n]` below) and
    once per tree budget n of a tree program (a tree of n rows is a verify call of n rows).
    With `full_batch_size` N (continuous batching) prefill is at batch 1, the others at N.
    With windows, each of them once per attention window (`windowed`).
    Each is `{"name", "kind", "symbols"}`; the compiler's file takes the name and symbols."""
    C, B = plan.prefill_seq_len, plan.block_size
    greedy = 1 if plan.sampling else None
    specs = []
    for n in plan.prefill_lengths:
        specs.append(_spec(plan, PREFILL, _sized(PREFILL, n, C), n, greedy))
        if plan.sampling:
            specs.append(_spec(plan, PREFILL_SAMPLED, _sized(PREFILL_SAMPLED, n, C), n, n))
    steps = plan.step_lengths  # a tree of n rows is a verify call of n rows
    specs += [_spec(plan, VERIFY, _sized(VERIFY, n, B), n, greedy) for n in steps]
    if plan.sampling:
        specs += [_spec(plan, VERIFY_SAMPLED, _sized(VERIFY_SAMPLED, n, B), n, n) for n in steps]
    specs.append(_spec(plan, DECODE, DECODE, 1, greedy))
    return windowed(specs, plan.windows, plan.ctx_len)


def draft_specializations(plan: ShapePlan) -> list[dict]:
    """Named specializations of the draft program: context chunk = block (DraftDecode) and, for
    the prompt, one per draft prefill row count (the longest named `DraftPrefill`, the others
    `DraftPrefill[n]`; the runtime takes the smallest that holds what it hands over, so a short
    prompt never pays for the long one); with `full_batch_size` N the decode block runs at batch
    N, the prefills at batch 1; with windows, each once per attention window."""
    rows = plan.draft_prefill_rows
    specs = [_spec(plan, DRAFT_DECODE, DRAFT_DECODE, plan.block_size, None)]
    specs += [_spec(plan, DRAFT_PREFILL, _sized(DRAFT_PREFILL, n, rows[-1]), n, None) for n in rows]
    return windowed(specs, plan.windows, plan.ctx_len)


def windowed(specs: list[dict], lengths, ctx_len: int) -> list[dict]:
    """Every specialization once per attention window, smallest first; the full-context one
    keeps its plain name, the others are named `<name>@<window>`."""
    if lengths is None:
        return specs
    return [
        {
            **s,
            "name": s["name"] if n == ctx_len else f"{s['name']}@{n}",
            "symbols": {**s["symbols"], CCL: n},
        }
        for n in lengths
        for s in specs
    ]


@dataclass(frozen=True)
class Role:
    """A program an artifacts directory holds, by the part it plays: its name (the manifest's
    key and the program's directory), its I/O contract class and the specializations a shape
    plan gives it. A new role (a prefill program) is one more entry in ROLES."""

    name: str
    io: type
    specializations: object  # ShapePlan -> list[dict]

    def __str__(self) -> str:
        return self.name


TARGET, DRAFT = "target", "draft"
#: every program role, in the order the manifest and the runtime list them
ROLES: dict[str, Role] = {
    r.name: r
    for r in (
        Role(TARGET, TargetIO, target_specializations),
        Role(DRAFT, DraftIO, draft_specializations),
    )
}
ROLE_NAMES = tuple(ROLES)
