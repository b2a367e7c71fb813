"""Summarise: pure statistics of the benchmark (no clocks, no I/O, no models).

Conventions (docs/DESIGN.md, "The algorithm"):
- An acceptance length is the number of tokens one step commits (accepted proposals + 1), so
  1 … B; τ is its mean. Draft position j (1 … B−1) is accepted when the length is > j.
- Speedup = target-only time per output token / DFlash time per output token, prefill excluded.
- Bound: a step costs one verify and one draft call and commits τ tokens where the target alone
  pays one decode call per token, so speedup ≤ τ · T_decode / (T_verify + T_draft) with the
  mean call times of the same runs (means, not medians: the speedup is a ratio of totals).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from scipy import stats as sps


def spread(xs: Iterable[float]) -> dict:
    """Median with min, max, quartiles and count."""
    a = np.asarray(list(xs), np.float64)
    if a.size == 0:
        raise ValueError("no values")
    p25, p50, p75 = np.percentile(a, [25, 50, 75])
    return {
        "median": float(p50),
        "min": float(a.min()),
        "max": float(a.max()),
        "p25": float(p25),
        "p75": float(p75),
        "n": int(a.size),
    }


def tau(lengths: Sequence[int]) -> float:
    """Mean acceptance length per step (0.0 without steps)."""
    return float(np.mean(lengths)) if len(lengths) else 0.0


def acceptance_histogram(lengths: Sequence[int], block_size: int) -> list[int]:
    """Steps that committed 1, 2, …, B tokens (index k holds length k + 1)."""
    a = np.asarray(lengths, np.int64)
    if a.size and (a.min() < 1 or a.max() > block_size):
        raise ValueError(f"acceptance lengths must be in 1 … {block_size}")
    return np.bincount(a - 1, minlength=block_size).tolist() if a.size else [0] * block_size


def position_acceptance(lengths: Sequence[int], block_size: int) -> list[float]:
    """P(length > j) for draft positions j = 1 … B−1: non-increasing, summing to τ − 1."""
    hist = np.asarray(acceptance_histogram(lengths, block_size), np.float64)
    if hist.sum() == 0:
        return [0.0] * (block_size - 1)
    return (hist[::-1].cumsum()[::-1][1:] / hist.sum()).tolist()


def bound(tau_: float, t_decode: float, t_verify: float, t_draft: float) -> float:
    """τ · T_decode / (T_verify + T_draft)."""
    if t_verify + t_draft <= 0:
        raise ValueError("T_verify + T_draft must be > 0")
    return tau_ * t_decode / (t_verify + t_draft)


def loop_costs(baseline: list, dflash: list) -> dict:
    """Mean costs of the two loops over the same timed runs (records with .stats and
    .call_times): per-call means and, with the host work, per target-only token and per DFlash
    step. `pooled` is τ · token / step: exactly the ratio of the two loops' total decode times."""

    def total(recs, kind):
        return sum(sum(r.call_times.get(kind, ())) for r in recs)

    tokens = sum(len(r.call_times.get("decode", ())) for r in baseline)
    steps = sum(r.stats["steps"] for r in dflash)
    if not tokens or not steps:
        raise ValueError("no decode calls or no DFlash steps")
    lengths = [n for r in dflash for n in r.acceptance_lengths]
    out = {
        "decode_s": total(baseline, "decode") / tokens,
        "verify_s": total(dflash, "verify") / steps,
        "draft_s": total(dflash, "draft") / steps,  # per step: the last step drafts nothing
        "token_s": sum(r.stats["decode_s"] for r in baseline) / tokens,
        "step_s": sum(r.stats["decode_s"] for r in dflash) / steps,
        "tau": tau(lengths),
    }
    out["host_per_token_s"] = out["token_s"] - out["decode_s"]
    out["host_per_step_s"] = out["step_s"] - out["verify_s"] - out["draft_s"]
    out["bound"] = bound(out["tau"], out["decode_s"], out["verify_s"], out["draft_s"])
    out["pooled"] = out["tau"] * out["token_s"] / out["step_s"]
    out["fraction_of_bound"] = out["pooled"] / out["bound"]
    out["break_even_tau"] = (out["verify_s"] + out["draft_s"]) / out["decode_s"]
    return out


def cost_split(long: dict, short: dict | None, sampled: dict | None, ctx: tuple, weights: dict):
    """Split each call's mean cost at the long context into weights (bytes ÷ bandwidth), cache
    (the part linear in ctx_len, from a short and a long ctx_len), sampler (T > 0 minus T = 0 of
    the same specialization) and fixed overhead (the rest). `long`, `short`, `sampled`: mean
    seconds per call kind; `ctx` = (long ctx_len, short ctx_len); `weights`: seconds per kind."""
    L, S = ctx
    out = {}
    for kind, t in long.items():
        cache = (t - short[kind]) * L / (L - S) if short and kind in short else None
        sampler = sampled[kind] - t if sampled and kind in sampled and kind != "draft" else None
        w = weights.get(kind, 0.0)
        out[kind] = {
            "greedy_s": t,
            "sampled_s": t + (sampler or 0.0),
            "weights_s": w,
            "cache_s": cache,
            "sampler_s": sampler,
            "fixed_s": t - w - (cache or 0.0),
        }
    return out


def token_distribution_check(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    min_expected: float = 5.0,
    permutations: int = 2000,
    seed: int = 0,
) -> dict:
    """Do two samplers draw the same tokens? A sanity check on pooled token histograms.

    Each side's tokens are pooled into one histogram; tokens whose expected count is below
    `min_expected` are merged into one bin; scipy's χ² test of the 2 × K table gives the
    asymptotic p-value, which assumes independent tokens (tokens of one run are not, so it runs
    small). The permutation p-value swaps the two runs of random pairs (exchangeable when both
    sample one distribution) and needs no independence. A large p-value proves nothing: the
    proof of losslessness is the exact-distribution test (tests/test_sampling.py)."""
    if not pairs:
        raise ValueError("no pairs")
    vocab = np.unique(np.concatenate([np.asarray([*a, *b], np.int64) for a, b in pairs]))
    A = np.stack([np.bincount(np.searchsorted(vocab, a), minlength=vocab.size) for a, _ in pairs])
    Bm = np.stack([np.bincount(np.searchsorted(vocab, b), minlength=vocab.size) for _, b in pairs])
    na, nb = int(A.sum()), int(Bm.sum())
    pooled = (A + Bm).sum(axis=0)
    big = pooled * min(na, nb) / (na + nb) >= min_expected

    def binned(M):  # (..., V) -> (..., K): the big tokens, then one bin of the rare ones
        rare = M[..., ~big].sum(axis=-1, keepdims=True)
        return np.concatenate([M[..., big], rare] if (~big).any() else [M[..., big]], axis=-1)

    Ab, Bb = binned(A).astype(np.float64), binned(Bm).astype(np.float64)
    out = {
        "tokens": [na, nb],
        "pairs": len(pairs),
        "distinct_tokens": int(vocab.size),
        "bins": int(Ab.shape[1]),
        "total_variation": 0.5 * float(np.abs(A.sum(0) / na - Bm.sum(0) / nb).sum()),
        "chi2": 0.0,
        "df": 0,
        "p_asymptotic": 1.0,
        "p_permutation": 1.0,
        "permutations": permutations,
    }
    if Ab.shape[1] < 2:
        return out
    res = sps.chi2_contingency(np.stack([Ab.sum(0), Bb.sum(0)]), correction=False)
    out.update(chi2=float(res.statistic), df=int(res.dof), p_asymptotic=float(res.pvalue))
    if permutations:
        signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(permutations, len(pairs)))
        half = (Ab + Bb).sum(0) / 2
        delta = signs @ ((Ab - Bb) / 2)  # (permutations, K)
        hits = (_chi2_rows(half + delta, half - delta) >= res.statistic * (1 - 1e-12)).sum()
        out["p_permutation"] = float((1 + hits) / (1 + permutations))
    else:
        out["p_permutation"] = None
    return out


def _chi2_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson χ² of the 2 × K tables [a_i; b_i], one per row i (vectorised)."""
    col = a + b
    ea = a.sum(-1, keepdims=True) * col / col.sum(-1, keepdims=True)
    eb = col - ea
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(col > 0, (a - ea) ** 2 / ea + (b - eb) ** 2 / eb, 0.0)
    return t.sum(-1)
