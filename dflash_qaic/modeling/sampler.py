"""The target program's on-device sampler: the lossless speculative-sampling choice per row.

See docs/DESIGN.md, Sampling. Used by `modeling.target.ExportTarget`; every function works on
[b, s, V] logits and is traced into the target graph. One acceptance function per verification
rule (dflash_qaic/contract.py): `sample_chain`, `sample_block`, `sample_tree` (`ACCEPTANCE`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_qaic import contract

# Precision (the compiler runs this in fp16). The math works on unnormalised weights
# w = exp((logit - max) / T) <= 1 (the most likely token has w = 1), never on normalised
# probabilities, and every comparison is made against sums computed in the same graph:
#   accept   u1 * sum(w) < w[d]                                   (p(d) = w[d] / sum(w))
#   sample   first index where cumsum(w') > u2 * sum(w')          (w' = w with d removed)
# so fp16 rounding of the sums moves a threshold but never sends the search off the end, and
# the search returns a token of positive weight even when a runtime rounds two uses of one
# value differently (ONNX Runtime's fp16 run does: it computes some ops in fp32 and drops
# casts), see `_first_above`.
# Sums and cumulative sums are hierarchical: the vocabulary is a tree of `levels` levels with
# `branch` ≈ V^(1/levels) <= 64 children per node (3 levels of 54 for V = 152k), and the inverse
# CDF descends it, choosing a child on the cumulative sum of its siblings' totals. A token then
# competes for fp16 resolution only with ~64 siblings per level. (A single running sum over V in
# fp16 drops every token whose weight is below ~2^-12 of the running total: most of a long
# tail.) Remaining caveat for large vocabularies in fp16: a node whose total is below ~2^-12 of
# its siblings' running sum is still rounded away, at most ~branch · 2^-12 ≈ 1.3% of the mass per
# level in the worst case; a numpy simulation of fp16 cumulative sums over V = 152k puts the
# total-variation error at ≈ 0.5–1% for 3 levels (vs ≈ 2–8% for 2 levels and ≈ 30–60% for one
# running sum). Weights below fp16's subnormal floor (~6e-8 of the top token's) are zero, and
# sum(w) overflows fp16 only for a near-uniform distribution over more than 65504 tokens.
# Keeping these nodes in fp32 (a node-precision override in the compiler) removes all of it.
# `random_u` itself arrives in fp16 on the device: p(d) and the inverse CDF are quantised to
# 2^-11 ≈ 5e-4.

# Largest uniform the sampler uses: 1 - 2**-11, exact in fp32 and fp16 (fp16 rounds a uniform
# just below 1 up to 1.0, which would make "u * mass < mass" false).
U_MAX = 1.0 - 2.0**-11
MAX_BRANCH = 64  # children per node of the vocabulary tree
# Most likely tokens the top-k / top-p thresholds are read from (QEfficient's on-device sampler
# bounds its candidates the same way, max_top_k_ids = 512): a TopK of 512 costs a small
# fraction of a sort of the vocabulary (≈ 1 ms vs ≈ 60 ms per row for V = 152k in ONNX Runtime).
SAMPLING_CANDIDATES = 512


INT32_MIN = -(2**31)


def token_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The tokens a grammar allows, from its bitmask int32 [b, s, ceil(V/32)] (bit i % 32 of
    word i // 32, xgrammar's layout) -> bool [b, s, V] (docs/DESIGN.md, Structured output).

    Integer arithmetic only (opset 17 has no bitwise And on int32): bit 31 is the word's sign;
    bits 0 … 30 are read from the word with its sign bit cleared (w − INT32_MIN ≥ 0 for a
    negative w, no overflow) as (w // 2^k) mod 2."""
    v = torch.arange(vocab)
    words = bitmask.index_select(-1, v // 32)  # [b, s, V]
    k = v % 32
    sign = k == 31
    low = torch.where(words < 0, words - INT32_MIN, words)  # bits 0 … 30, >= 0
    pow2 = torch.where(sign, 1, torch.pow(2, k)).to(torch.int32)
    bit = torch.remainder(torch.div(low, pow2, rounding_mode="floor"), 2) == 1
    return (sign & (words < 0)) | (~sign & bit)  # And / Or: ONNX Runtime has no bool Where


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Disallowed logits lowered to `floor` = min(logits) − 1 per row, below every allowed one
    (finite and small: safe in fp16, unlike −inf or −65504, which the fp16 check would flag);
    returns (masked logits, floor [b, s, 1]). The argmax of the masked logits is an allowed
    token, and `sampling_weights` gives every logit at or below the floor weight 0, exactly."""
    floor = logits.amin(-1, keepdim=True) - 1.0
    return torch.where(allowed, logits, floor), floor


def vocab_tree(vocab: int) -> tuple[int, int]:
    """(levels, branch): at least 2 levels, branch = ceil(V^(1/levels)) <= MAX_BRANCH."""
    levels = max(2, math.ceil(math.log(max(vocab, 2)) / math.log(MAX_BRANCH)))
    branch = max(2, math.ceil(vocab ** (1.0 / levels)))
    while branch**levels < vocab:  # float rounding of the root
        branch += 1
    return levels, branch


def _tree(x: torch.Tensor, vocab: int) -> torch.Tensor:
    """[b, s, V] -> [b, s, branch, …, branch] (levels axes, the root's children first), zero
    padded at the end (static Concat and Reshape, so every shape stays inferable)."""
    levels, branch = vocab_tree(vocab)
    if branch**levels > vocab:
        pad = branch**levels - vocab
        while pad > 0:  # a slice of x is at most V long
            n = min(pad, vocab)
            x = torch.cat([x, x[..., :n] * 0], dim=-1)
            pad -= n
    return x.view(x.shape[0], x.shape[1], *([branch] * levels))


def _untree(x: torch.Tensor, vocab: int) -> torch.Tensor:
    """Inverse of `_tree`: [b, s, branch, …] -> [b, s, V]."""
    return x.view(x.shape[0], x.shape[1], -1)[..., :vocab]


def _node_sums(x: torch.Tensor, vocab: int) -> list[torch.Tensor]:
    """Totals per tree level, leaves first: sums[0] = the leaves [b, s, n, …, n], sums[k] =
    totals of the level-k nodes [b, s, n, …] (levels - k axes). A total is the last entry of
    the cumulative sum of its children, the same op the descent uses."""
    sums = [_tree(x, vocab)]
    for _ in range(vocab_tree(vocab)[0] - 1):
        sums.append(sums[-1].cumsum(-1)[..., -1])
    return sums


def _exclusive(c: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum from an inclusive one (the same values, shifted by one)."""
    return torch.cat([c[..., :1] * 0, c[..., :-1]], dim=-1)


def _first_above(c: torch.Tensor, t: torch.Tensor, positive: torch.Tensor, n: int) -> torch.Tensor:
    """Index of the first entry of the cumulative sum c [b, s, n] that exceeds t [b, s] >= 0.

    That entry has a positive increment, so a zero-weight entry is never chosen. If rounding
    left no entry above t, the last entry of positive weight (`positive` [b, s, n] bool) is
    taken. Nothing here assumes that two uses of one value see the same rounding (a runtime
    may keep one consumer's copy in fp32 and round another's to fp16): the answer always has
    positive weight.
    """
    above = c > t[..., None]
    first = above.to(torch.int32).argmax(-1)
    idx = torch.arange(n, device=c.device)
    last = torch.where(positive, idx, 0).amax(-1)
    return torch.where(above[..., -1], first, last)


def _select(x: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
    """x [b, s, n, …] at the child marked by onehot [b, s, n] -> [b, s, …] (a sum of one term
    and zeros: exact in any precision)."""
    for _ in range(x.dim() - 3):
        onehot = onehot[..., None]
    return torch.where(onehot, x, 0.0).sum(2)


def inverse_cdf(x: torch.Tensor, u: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A token drawn from the unnormalised weights x [b, s, V] >= 0 by the uniform u [b, s]:
    the first token whose cumulative weight exceeds u · sum(x), found by descending the
    vocabulary tree. Returns (token [b, s] int64, sum(x) [b, s]); with sum(x) = 0, token 0."""
    levels, n = vocab_tree(vocab)
    sums = _node_sums(x, vocab)  # leaves first
    c = sums[-1].cumsum(-1)  # [b, s, n]: the root's children
    mass = c[..., -1]
    rest = u * mass  # >= 0
    token = None
    for level in range(levels - 1, -1, -1):
        nodes = sums[level]  # [b, s, n]: children of the node chosen so far
        if level < levels - 1:
            c = nodes.cumsum(-1)
        j = _first_above(c, rest, nodes > 0, n)  # [b, s]
        onehot = torch.arange(n, device=x.device) == j[..., None]  # [b, s, n]
        rest = (rest - torch.where(onehot, _exclusive(c), 0.0).sum(-1)).clamp(min=0.0)
        token = j if token is None else token * n + j
        sums = [_select(s, onehot) for s in sums[:level]] + sums[level:]
    return token, mass


def _tree_total(x: torch.Tensor, vocab: int) -> torch.Tensor:
    """sum(x) over the vocabulary [b, s], level by level."""
    return _node_sums(x, vocab)[-1].cumsum(-1)[..., -1]


def sampling_weights(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    vocab: int,
    candidates: int = SAMPLING_CANDIDATES,
    floor: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unnormalised target distribution after temperature, min-p, top-k and top-p.

    logits [b, s, V]; temperature, top_k, top_p [b] (top_k 0 = off, top_p >= 1 = off; a
    temperature of 0 is treated as 1 here, the caller takes the argmax for it).
    Returns w [b, s, V] >= 0 with p = w / sum(w) and w = 1 at the most likely token.
    Like Hugging Face's warpers, top-k keeps every token tied with the k-th, and top-p keeps the
    smallest head of the (top-k filtered) distribution whose mass reaches top_p.

    The thresholds come from the `candidates` most likely tokens (one TopK, not a sort of the
    vocabulary): top-k is exact for k <= candidates (a larger k counts as `candidates`; the
    runtime refuses one), top-p is exact whenever its head fits in the candidates, and a row
    whose head would not (top-k off, the candidates' mass below top_p) keeps the whole
    distribution, i.e. gains at most 1 - top_p of mass. With V <= candidates all is exact.
    Sampling itself always runs over the whole vocabulary.
    floor [b, s, 1] (structured output, `mask_logits`): logits at or below it get weight 0, so
    top-k, top-p and the sample see only the allowed tokens.
    min_p [b] (extended sampling, vLLM's): tokens whose probability is below min_p times the
    most likely one's (w < min_p) weigh nothing, before top-k and top-p.
    """
    n = min(candidates, vocab)
    t = torch.where(temperature > 0, temperature, 1.0)[:, None, None]  # [b, 1, 1]
    srt = logits.topk(n, dim=-1).values  # [b, s, n], descending
    top = srt[..., :1]  # [b, s, 1]
    rank = torch.arange(n, device=logits.device)
    k = top_k[:, None, None]  # [b, 1, 1]
    k_on = k > 0
    keep_k = (rank < k) | ~k_on  # [b, 1, n]
    e = torch.where(keep_k, torch.exp((srt - top) / t), 0.0)  # [b, s, n] sorted weights
    w_all = torch.exp((logits - top) / t)  # [b, s, V]
    if floor is not None:  # the grammar's disallowed tokens weigh nothing
        e = torch.where(srt > floor, e, 0.0)
        w_all = torch.where(logits > floor, w_all, 0.0)
    if min_p is not None:  # w = p / p_max
        mp = min_p[:, None, None]
        e, w_all = torch.where(e >= mp, e, 0.0), torch.where(w_all >= mp, w_all, 0.0)
    # top-p's reference mass: the top-k head, or the whole vocabulary when top-k is off
    head = _tree_total(e, n)[..., None]  # [b, s, 1]
    mass = torch.where(k_on, head, _tree_total(w_all, vocab)[..., None])
    # mass ahead of each sorted candidate: the exclusive prefix of its siblings, per tree level
    sums = _node_sums(e, n)
    before = _exclusive(sums[0].cumsum(-1))
    for level in range(1, len(sums)):
        ahead = _exclusive(sums[level].cumsum(-1))
        for _ in range(level):
            ahead = ahead[..., None]
        before = before + ahead
    p = top_p[:, None, None]
    keep = keep_k & ((_untree(before, n) < p * mass) | (p >= 1.0))  # a prefix of the order
    # no filter at all, or a top-p head longer than the candidates: keep the whole vocabulary
    keep_all = ~k_on & ((p >= 1.0) | (head < p * mass))  # [b, s, 1]
    # the top token is always kept (the clamp covers a top_p that fp16 rounds to 0)
    n_keep = keep.sum(-1, keepdim=True).clamp(min=1)  # [b, s, 1]
    threshold = srt.gather(-1, n_keep - 1)  # smallest kept logit
    return torch.where((logits >= threshold) | keep_all, w_all, 0.0)


@dataclass
class _Verify:
    """What every rule's acceptance starts from (`_verify_rows`): greedy [b, s], the sampling
    rows 0 … n−1 [n], their weights w [b, n, V], uniforms u [b, n, 2], proposals [b, n], has
    (a proposal) [b, n], w(d) [b, n] and sum(w) [b, n]."""

    greedy: torch.Tensor
    rows: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    u_accept: torch.Tensor
    u_sample: torch.Tensor
    proposal: torch.Tensor
    has: torch.Tensor
    w_d: torch.Tensor
    total: torch.Tensor


def _verify_rows(
    logits, input_ids, position_ids, temperature, top_k, top_p, random_u, vocab, candidates,
    floor, proposals: bool = True, min_p=None,
) -> _Verify:  # fmt: skip
    """The sampling rows' distributions and proposals (see `sample_chain`); proposals False:
    no row has one (a tree's nodes are only checked against their parent's draw)."""
    greedy = logits.argmax(dim=-1)  # [b, s]
    rows = _leading_rows(random_u)  # [n]: 0 … n−1
    head = logits.index_select(1, rows)  # [b, n, V]: the rows that sample
    head_floor = floor.index_select(1, rows) if floor is not None else None
    w = sampling_weights(head, temperature, top_k, top_p, vocab, candidates, head_floor, min_p)
    u = random_u.clamp(0.0, U_MAX)
    u_accept, u_sample = u[..., 0], u[..., 1]  # [b, n]
    # proposal of row j: the next row's input token, if that row exists and is not padding
    proposal = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1).index_select(1, rows)
    next_pos = torch.cat([position_ids[:, 1:], position_ids[:, :1] * 0 - 1], dim=1)
    has = next_pos.index_select(1, rows) >= 0  # [b, n]
    if not proposals:
        has = torch.zeros_like(has)
    w_d = torch.where(has, w.gather(-1, proposal[..., None])[..., 0], 0.0)  # [b, n]
    total = _tree_total(w, vocab)  # [b, n]
    return _Verify(greedy, rows, w, u, u_accept, u_sample, proposal, has, w_d, total)


def sample_chain(
    logits, input_ids, position_ids, temperature, top_k, top_p, random_u, vocab: int,
    candidates: int = SAMPLING_CANDIDATES, q_ids=None, q_probs=None, floor=None, min_p=None,
) -> torch.Tensor:  # fmt: skip
    """The chain rule's acceptance (contract.CHAIN): the token committed at every row under
    the lossless rule (docs/DESIGN.md, Sampling) -> [b, s].

    logits [b, s, V]; input_ids, position_ids [b, s]; temperature, top_k, top_p [b];
    random_u [b, n, 2] uniforms in [0, 1) for the first n <= s rows (n = `sample_len`).
    Row j's proposal d is input_ids[j + 1] when row j + 1 exists and is not padding. With a
    proposal: d if u1 < p(d), else a sample (by u2) from p with d removed and renormalised, so a
    rejected row never returns d. Without one: a sample from p. Rows with temperature 0, and
    every row j >= n, return the argmax of the logits, exactly: only the first n rows pay for
    the sampler (a greedy verify binds n = 1, see `contract.target_specializations`).
    p is `sampling_weights` (see there for `candidates` and `min_p`).

    q_ids, q_probs [b, m, k] (a DFlash-2 draft's sampled path, docs/DESIGN.md, DFlash-2
    drafts): the draft's distribution q over k candidates for the proposal of row j < m
    (rows from m on have none). Then the rule is q-aware: d if u1 < p(d) / q(d), else a sample
    from norm(max(p − q, 0)) (p itself if that is empty). None: q is one-hot at d (the rule
    above; the graph is exactly the one without q).

    floor [b, s, 1] (structured output): logits already masked by `mask_logits`; p is then the
    target's distribution restricted to the grammar's tokens, and a disallowed proposal has
    p(d) = 0 (always rejected).
    """
    v = _verify_rows(
        logits, input_ids, position_ids, temperature, top_k, top_p, random_u, vocab, candidates,
        floor, min_p=min_p,
    )  # fmt: skip
    if q_ids is not None:
        return _q_aware(
            v.greedy, v.rows, v.w, v.w_d, v.total, v.proposal, v.has, v.u, temperature, q_ids,
            q_probs,
        )  # fmt: skip
    return _token_rule(v, temperature, vocab)


def sample_tree(
    logits, input_ids, position_ids, temperature, top_k, top_p, random_u, vocab: int,
    candidates: int = SAMPLING_CANDIDATES, floor: torch.Tensor | None = None, min_p=None,
) -> torch.Tensor:  # fmt: skip
    """The tree rule's acceptance (contract.TREE): no row has a proposal, every sampling
    row draws from p (a node's children are only checked against its draw; docs/DESIGN.md,
    Tree verification; `accept_path` then picks the path). Arguments as `sample_chain`'s."""
    v = _verify_rows(
        logits, input_ids, position_ids, temperature, top_k, top_p, random_u, vocab, candidates,
        floor, proposals=False, min_p=min_p,
    )  # fmt: skip
    return _token_rule(v, temperature, vocab)


def sample_block(
    logits, input_ids, position_ids, temperature, top_k, top_p, random_u, vocab: int,
    candidates: int = SAMPLING_CANDIDATES, q_ids=None, q_probs=None, floor=None, min_p=None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The block rule's acceptance (contract.BLOCK; `_block`, docs/DESIGN.md, Block
    verification): (tokens [b, s], accepted [b]): a row commits its first accepted + 1 tokens.
    Arguments as `sample_chain`'s."""
    v = _verify_rows(
        logits, input_ids, position_ids, temperature, top_k, top_p, random_u, vocab, candidates,
        floor, min_p=min_p,
    )  # fmt: skip
    q = _q_vocab(v.w, v.rows, v.proposal, q_ids, q_probs) if q_ids is not None else None
    chosen, tau = _block(v.w, v.w_d, v.total, v.proposal, v.has, v.u, q, v.rows)
    hot = temperature > 0
    chosen = torch.where(hot[:, None], chosen, v.greedy.index_select(1, v.rows))
    accepted = torch.where(hot, tau, _leading_equal(v.greedy, input_ids, position_ids))
    return v.greedy.scatter(1, v.rows + chosen * 0, chosen), accepted


def _token_rule(v: _Verify, temperature, vocab: int) -> torch.Tensor:
    """Token by token: keep the proposal d with probability p(d), else sample p without d."""
    hit = (torch.arange(vocab, device=v.w.device) == v.proposal[..., None]) & v.has[..., None]
    # a sample from p with d removed (from p itself where there is no proposal)
    sampled, mass = inverse_cdf(torch.where(hit, 0.0, v.w), v.u_sample, vocab)
    # an empty residual (all of p on d) can only mean d: accept it
    accept = v.has & ((v.u_accept * v.total < v.w_d) | (mass <= 0))
    chosen = torch.where(accept, v.proposal, sampled)  # [b, n]
    chosen = torch.where(temperature[:, None] == 0, v.greedy.index_select(1, v.rows), chosen)
    # rows 0 … n−1 get their choice, the rest keep the argmax
    return v.greedy.scatter(1, v.rows + chosen * 0, chosen)  # [b, s]


# the chain rule under its older name (the lossless speculative-sampling choice per row)
sample_next_tokens = sample_chain
# each rule's in-graph acceptance, by `contract.VerifyRule.acceptance`
ACCEPTANCE = {f.__name__: f for f in (sample_chain, sample_block, sample_tree)}


def _leading_rows(random_u: torch.Tensor) -> torch.Tensor:
    """[b, n, 2] -> the row indices 0 … n−1 [n], int64. Written as a cumulative sum of ones
    shaped like random_u's rows (not arange / Slice up to a shape value), so every shape
    stays inferable from the specialization by ONNX shape inference. Exact in fp16 up to
    n = 2048."""
    ones = random_u[0, :, 0] * 0 + 1  # [n]
    return (ones.cumsum(0) - 1).long()


def _q_vocab(w, rows, proposal, q_ids, q_probs) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's q at the verify rows 0 … n−1: (q over the vocabulary [b, n, V], q(d) [b, n]),
    spread from its k candidates by k compares (no scatter: k is small); rows past the draft's
    m rows have none (zeros)."""
    b, n, V = w.shape
    # q rows aligned with the verify rows 0 … n−1; rows past the draft's have no proposal
    pad = torch.cat([q_probs, q_probs[:, :1] * 0], dim=1)  # [b, m + 1, k]: a zero row
    ids = torch.cat([q_ids, q_ids[:, :1]], dim=1)
    last = ids.shape[1] - 1
    at = rows.clamp(max=last)  # rows ≥ m read the zero row
    qp = pad.index_select(1, at).to(w.dtype)  # [b, n, k]
    qi = ids.index_select(1, at)  # [b, n, k]
    q_d = (qp * (qi == proposal[..., None])).sum(-1)  # [b, n]
    vocab = torch.arange(V, device=w.device)
    q_v = w * 0
    for j in range(qi.shape[-1]):
        q_v = q_v + torch.where(vocab == qi[..., j : j + 1], qp[..., j : j + 1], 0.0)
    return q_v, q_d


def _q_aware(greedy, rows, w, w_d, total, proposal, has, u, temperature, q_ids, q_probs):
    """`sample_next_tokens` with the draft's q (see there). In weight units (p = w / total):
    accept iff u1 · q(d) · total < w(d); the residual is max(w − total · q, 0) over the
    vocabulary."""
    V = w.shape[-1]
    q_v, q_d = _q_vocab(w, rows, proposal, q_ids, q_probs)
    residual = torch.where(has[..., None], (w - total[..., None] * q_v).clamp(min=0.0), w)
    left = _tree_total(residual, V)  # [b, n]
    residual = torch.where((left > 0)[..., None], residual, w)  # empty: p itself
    sampled, _ = inverse_cdf(residual, u[..., 1], V)
    accept = has & (u[..., 0] * q_d * total < w_d)
    chosen = torch.where(accept, proposal, sampled)  # [b, n]
    chosen = torch.where(temperature[:, None] == 0, greedy.index_select(1, rows), chosen)
    return greedy.scatter(1, rows + chosen * 0, chosen)  # [b, s]


def _leading_equal(greedy: torch.Tensor, input_ids, position_ids) -> torch.Tensor:
    """[b]: the leading proposals equal to the argmax (the host's chain rule, for greedy rows):
    the first row j whose argmax differs from row j + 1's input or whose next row is padding."""
    same = (greedy[:, :-1] == input_ids[:, 1:]) & (position_ids[:, 1:] >= 0)  # [b, s − 1]
    stop = torch.cat([~same, greedy[:, :1] >= 0], dim=1)  # a last column that always stops
    return stop.to(torch.int32).argmax(-1).long()


def _block(w, w_d, total, proposal, has, u, q, rows):
    """Block verification (Sun et al. 2024; docs/DESIGN.md, Block verification) of the rows
    0 … n−1 that sample (`rows`, every row of a sampled verify). Row j's proposal d_j (the next
    row's input) came from the draft's q_j (q None: one-hot at d_j, a greedy draft); γ = the
    row's proposals. In probability units, with p_j = w_j / total_j:
      π_0 = 1, π_{i+1} = min(π_i · p_i(d_i) / q_i(d_i), 1)
      R_i = Σ_x max(π_i p_i(x) − q_i(x), 0);  h_i = R_i / (R_i + 1 − π_i) (i < γ), h_γ = π_γ
      τ = the largest i in 1 … γ with η_i < h_i (0 if none): the row keeps d_0 … d_{τ−1}, then
      draws its token from p_γ (τ = γ) or from norm(max(π_τ p_τ − q_τ, 0)) (τ < γ).
    The output is distributed as the target's own sampling, and the expected accepted count is
    never below the token-wise rule's. η_i is row i's first uniform, the draw row τ's second.
    π is the clamped running product in closed form, log π_i = S_i − max_{m ≤ i} S_m with S the
    exclusive cumulative sum of log(p/q) (no loop over rows: n is a specialization's symbol).
    Returns (chosen [b, n], τ [b])."""
    b, n, V = w.shape
    if q is None:  # a greedy draft: q is one-hot at the proposal
        q_v = ((torch.arange(V, device=w.device) == proposal[..., None]) & has[..., None]).to(
            w.dtype
        )
        q_d = has.to(w.dtype)
    else:
        q_v, q_d = q
    # log(p(d) / q(d)) in weight units, fp16-safe: each term within ±(17 + log V), and a
    # proposal the target rules out (p(d) = 0) gets −60 (π then ≤ e^−60: 0 in fp16)
    tiny = 2.0**-24  # fp16's smallest subnormal
    log_r = torch.log(w_d.clamp(min=tiny)) - torch.log(total.clamp(min=tiny))
    log_r = log_r - torch.log(q_d.clamp(min=tiny))
    log_r = torch.where(has, torch.where(w_d > 0, log_r, -60.0), 0.0)  # [b, n]
    S = _exclusive(log_r.cumsum(-1))  # [b, n]: S_0 = 0
    upto = rows[None, :] <= rows[:, None]  # [n, n]: m ≤ i
    running = torch.where(upto, S[:, None, :], 0.0).amax(-1)  # max over m ≤ i (S_0 = 0 among them)
    pi = torch.exp(S - running)  # [b, n], ≤ 1
    gamma = has.long().sum(-1, keepdim=True)  # [b, 1]: the row's proposals (a prefix of rows)
    end = rows == gamma  # [b, n]: the row after the last proposal
    residual = (pi[..., None] * w - total[..., None] * q_v).clamp(min=0.0)  # [b, n, V]
    left = _tree_total(residual, V)  # R_i · total_i
    rest = (1.0 - pi) * total
    h = torch.where(left + rest > 0, left / (left + rest).clamp(min=tiny), 0.0)
    h = torch.where(end, pi, torch.where(rows < gamma, h, 0.0))  # [b, n]
    # η_i < h_i for 1 ≤ i ≤ γ (strict, so h = 0 never stops: a prompt row's uniforms are 0)
    stop = (u[..., 0] < h) & (rows >= 1) & (rows <= gamma)
    tau = torch.where(stop, rows, 0).amax(-1)  # [b]
    dist = torch.where((end | (left <= 0))[..., None], w, residual)  # empty residual: p itself
    sampled, _ = inverse_cdf(dist, u[..., 1], V)  # [b, n]
    chosen = torch.where(rows < tau[:, None], proposal, sampled)  # d_0 … d_{τ−1}, then the draw
    return chosen, tau


def log_softmax(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """log p over the vocabulary [b, s, V], its normaliser summed over the vocabulary tree (fp16:
    see the comments at the top; exp(l − max) ≤ 1, so no term overflows)."""
    top = logits.amax(-1, keepdim=True)  # [b, s, 1]
    return logits - (top + torch.log(_tree_total(torch.exp(logits - top), vocab))[..., None])


def logprob_outputs(raw, out: dict, x: dict, k: int, mode: str) -> dict:
    """The logprob outputs (contract.logprob_specs) of the raw logits [b, s, V], or (mode
    processed_logprobs) of the ones the choice was made from (out[LOGITS]: the grammar's mask
    applied) divided by the row's temperature (0 counting as 1): log p of the choice and of
    the scored token (x[LOGPROB_IDS]) [b, s], and the top k (ids, log p) [b, s, k], most likely
    first. A few floats per row; the [b, s, V] log-probabilities stay in the graph."""
    logits = raw
    if mode == contract.PROCESSED_LOGPROBS:
        logits = out[contract.LOGITS]
        t = x.get(contract.TEMPERATURE)
        if t is not None:
            logits = logits / torch.where(t > 0, t, 1.0)[:, None, None]
    lp = log_softmax(logits, logits.shape[-1])
    top = lp.topk(k, dim=-1)  # [b, s, k]
    scored = x[contract.LOGPROB_IDS].clamp(min=0)
    return {
        contract.TOKEN_LOGPROBS: lp.gather(-1, out[contract.NEXT_TOKENS][..., None])[..., 0],
        contract.SCORED_LOGPROBS: lp.gather(-1, scored[..., None])[..., 0],
        contract.TOP_LOGPROB_IDS: top.indices,
        contract.TOP_LOGPROBS: top.values,
    }
