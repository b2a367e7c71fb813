"""Pure statistics of the benchmark: no clocks, no I/O, no models.

Conventions (REFERENCE.md §3):
- An acceptance length is the number of tokens one step commits: accepted proposals + 1
  (the target's correction or bonus), so 1 … B. The first generated token comes from prefill
  and belongs to no step. τ is the mean acceptance length per step.
- Draft position j (1 … B−1) of a step is accepted when the step's acceptance length is > j.
- Speedup = baseline time per output token / DFlash time per output token.
- Bound: speedup ≤ τ · T_decode / (T_verify + T_draft [+ T_host]): a step costs one verify and
  one draft call and yields τ tokens, where target-only decoding pays T_decode per token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


def _values(xs: Iterable[float]) -> np.ndarray:
    a = np.asarray(list(xs), dtype=np.float64)
    if a.size == 0:
        raise ValueError("no values")
    return a


def median(xs: Iterable[float]) -> float:
    return float(np.median(_values(xs)))


def spread(xs: Iterable[float]) -> dict:
    """Median with min, max and the interquartile range (numpy's linear percentiles)."""
    a = _values(xs)
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
    """Mean acceptance length per step (0.0 when there were no steps)."""
    return float(np.mean(lengths)) if len(lengths) else 0.0


def acceptance_histogram(lengths: Iterable[int], block_size: int) -> list[int]:
    """Counts of steps that committed 1, 2, …, B tokens (index k holds length k + 1)."""
    counts = [0] * block_size
    for n in lengths:
        if not 1 <= n <= block_size:
            raise ValueError(f"acceptance length {n} is outside 1 … {block_size}")
        counts[n - 1] += 1
    return counts


def position_acceptance(lengths: Sequence[int], block_size: int) -> list[float]:
    """Fraction of steps whose draft position j was accepted, for j = 1 … B−1 (index j − 1).

    A step of acceptance length n accepted positions 1 … n−1, so this is P(length > j); it is
    non-increasing in j, and its sum is τ − 1.
    """
    hist = acceptance_histogram(lengths, block_size)
    steps = sum(hist)
    if steps == 0:
        return [0.0] * (block_size - 1)
    return [sum(hist[j:]) / steps for j in range(1, block_size)]


def speedup_bound(
    tau_: float, t_decode: float, t_verify: float, t_draft: float, t_host: float = 0.0
) -> float:
    """τ · T_decode / (T_verify + T_draft + T_host): the speedup a loop with these per-call
    costs reaches at mean acceptance τ (with t_host = 0: nothing but the two calls per step)."""
    denom = t_verify + t_draft + t_host
    if denom <= 0:
        raise ValueError("T_verify + T_draft + T_host must be > 0")
    return tau_ * t_decode / denom


def fraction_of_bound(measured: float, bound: float) -> float:
    """The measured speedup as a fraction of the bound (1.0: the loop loses nothing)."""
    return measured / bound if bound > 0 else math.nan


def speedup(baseline_tpot: float, dflash_tpot: float) -> float:
    return baseline_tpot / dflash_tpot


def predicted_speedups(
    t_decode: float,
    t_verify: float,
    t_draft: float,
    t_host: float = 0.0,
    taus: Iterable[float] = (),
) -> list[dict]:
    """Rows {tau, bound, with_host} of predicted speedup for each τ."""
    return [
        {
            "tau": float(t),
            "bound": speedup_bound(t, t_decode, t_verify, t_draft),
            "with_host": speedup_bound(t, t_decode, t_verify, t_draft, t_host),
        }
        for t in taus
    ]


def break_even_tau(t_decode: float, t_verify: float, t_draft: float, t_host: float = 0.0) -> float:
    """The τ at which DFlash only matches target-only decoding (bound = 1)."""
    return (t_verify + t_draft + t_host) / t_decode


def bandwidth(nbytes: float, seconds: float) -> float:
    """Bytes per second."""
    return nbytes / seconds if seconds > 0 else math.inf


# ---------------------------------------------------------------------------- traffic model


def traffic_per_step(
    hidden_size: int,
    vocab_size: int,
    block_size: int,
    *,
    id_bytes: int = 8,
    feature_bytes: int = 4,
    context_rows: float | None = None,
    logits_bytes: int = 4,
) -> dict:
    """Bytes crossing the host per DFlash step (one verify call + one draft call), batch 1.

    Ours: the draft takes the block's B ids and B positions, the committed feature rows
    (`context_rows` of them, with their positions) and returns B−1 token ids; the target's
    verify takes B ids and B positions and returns B token ids and B×H features.
    `context_rows` None = B, the padded context chunk this runtime sends; the minimum is the
    τ rows a step commits.
    The comparison design (QEfficient #995) is the same loop except that the draft returns
    full fp32 logits for all B block rows (the argmax runs on the host) instead of B−1 ids.
    """
    B, H = block_size, hidden_size
    R = B if context_rows is None else context_rows
    draft_in = B * id_bytes + B * id_bytes + R * H * feature_bytes + R * id_bytes
    draft_out = (B - 1) * id_bytes
    verify_in = B * id_bytes + B * id_bytes
    verify_out = B * id_bytes + B * H * feature_bytes
    ours = draft_in + draft_out + verify_in + verify_out
    logits_out = B * vocab_size * logits_bytes
    logits_design = ours - draft_out + logits_out
    return {
        "hidden_size": H,
        "vocab_size": vocab_size,
        "block_size": B,
        "context_rows": R,
        "draft_in": draft_in,
        "draft_out": draft_out,
        "verify_in": verify_in,
        "verify_out": verify_out,
        "ours": ours,
        "logits_draft_out": logits_out,
        "logits_design": logits_design,
        "ratio": logits_design / ours,
    }


def _io_bytes(specs: list[dict], symbols: dict) -> dict[str, int]:
    """Bytes of each non-retained input or output with the symbols bound."""
    out = {}
    for s in specs:
        if s["name"].startswith("past_"):
            continue  # retained state: stays where the program runs
        n = 1
        for d in s["shape"]:
            n *= int(symbols[d]) if isinstance(d, str) else int(d)
        out[s["name"]] = n * np.dtype(s["dtype"]).itemsize
    return out


# The host I/O `traffic_per_step` models; anything else a program takes (e.g. sampling inputs)
# is listed as extra.
_MODELED = {
    "verify_in": {"input_ids", "position_ids"},
    "verify_out": {"next_tokens", "hidden_states"},
    "draft_in": {"target_hidden", "position_ids_target", "input_ids", "position_ids"},
    "draft_out": {"draft_tokens"},
}


def traffic_from_manifest(manifest: dict) -> dict:
    """Per-call host bytes of one verify call and one draft call, from the manifest's I/O
    specs (non-retained inputs and outputs, seq_len = B, the shapes the runtime binds).
    `extra` lists I/O the traffic model does not describe, with its bytes per call."""
    B = int(manifest["block_size"])
    sym = {"batch_size": int(manifest["batch_size"]), "seq_len": B, "ctx_len": manifest["ctx_len"]}
    sym["sample_len"] = 1  # the greedy Verify specialization samples one row
    t, d = manifest["target"], manifest["draft"]
    io = {
        "verify_in": _io_bytes(t["inputs"], sym),
        "verify_out": _io_bytes(t["outputs"], sym),
        "draft_in": _io_bytes(d["inputs"], sym),
        "draft_out": _io_bytes(d["outputs"], sym),
    }
    out: dict = {k: sum(v.values()) for k, v in io.items()}
    out["extra"] = {
        f"{k}:{name}": nb
        for k, v in io.items()
        for name, nb in v.items()
        if name not in _MODELED[k]
    }
    one = {**sym, "seq_len": 1}
    out["decode_in"] = sum(_io_bytes(t["inputs"], one).values())
    out["decode_out"] = sum(_io_bytes(t["outputs"], one).values())
    out["verify"] = out["verify_in"] + out["verify_out"]
    out["draft"] = out["draft_in"] + out["draft_out"]
    out["decode"] = out["decode_in"] + out["decode_out"]
    out["step"] = out["verify"] + out["draft"]
    return out


# Published shapes of the real recipes (Hugging Face config.json of Qwen/Qwen3-4B, Qwen3-8B and
# the z-lab b16 drafts), for the traffic model.
REAL_RECIPES = {
    "Qwen3-4B + DFlash-b16": {"hidden_size": 2560, "vocab_size": 151936, "block_size": 16},
    "Qwen3-8B + DFlash-b16": {"hidden_size": 4096, "vocab_size": 151936, "block_size": 16},
}


# ---------------------------------------------------------------------------- sampling (T > 0)


def chi2_sf(x: float, df: int) -> float:
    """P(χ²_df ≥ x): the regularized upper incomplete gamma Q(df/2, x/2) (series below
    a + 1, Lentz's continued fraction above; Numerical Recipes §6.2). No scipy at run time."""
    if df <= 0:
        raise ValueError("df must be ≥ 1")
    if not x > 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    log_pre = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1.0:  # series for the lower function P
        ap, term = a, 1.0 / a
        total = term
        for _ in range(100_000):
            ap += 1.0
            term *= z / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_pre))
    tiny = 1e-300
    b = z + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return min(1.0, math.exp(log_pre) * h)


def _chi2_homogeneity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two-sample χ² over the last axis (bins): Σ (obs − exp)² / exp over both rows, with
    exp = row total × pooled column share. Works on stacked rows (…, K)."""
    na = a.sum(axis=-1, keepdims=True)
    nb = b.sum(axis=-1, keepdims=True)
    col = a + b
    n = na + nb
    ea, eb = na * col / n, nb * col / n
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(col > 0, (a - ea) ** 2 / ea + (b - eb) ** 2 / eb, 0.0)
    return t.sum(axis=-1)


def token_distribution_check(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    min_expected: float = 5.0,
    permutations: int = 2000,
    seed: int = 0,
) -> dict:
    """Do two samplers draw the same tokens? A sanity check on pooled token histograms.

    `pairs`: (tokens of run A, tokens of run B) per (prompt, round): the same prompt, independent
    seeds. Tokens are pooled per side into one histogram over the vocabulary; tokens whose
    expected count would fall below `min_expected` on either side are merged into one bin; the
    two-sample (homogeneity) χ² of the 2 × K table has K − 1 degrees of freedom.

    The asymptotic p-value treats every token as an independent draw, which the tokens of one
    run are not (each depends on the ones before), so it runs small. The permutation p-value
    does not need that: under "same distribution" the two runs of a pair are exchangeable, so
    swapping them (a fair coin per pair) gives the statistic's null distribution, whatever the
    dependence inside a run. A small p-value says "look closer", a large one proves nothing:
    the proof that the sampler is lossless is the exact-distribution test (tests/test_sampling.py).
    """
    if not pairs:
        raise ValueError("no pairs")
    vocab = sorted({int(t) for a, b in pairs for t in (*a, *b)})
    index = {t: k for k, t in enumerate(vocab)}
    A = np.zeros((len(pairs), len(vocab)), np.float64)
    Bm = np.zeros_like(A)
    for i, (a, b) in enumerate(pairs):
        np.add.at(A[i], [index[int(t)] for t in a], 1.0)
        np.add.at(Bm[i], [index[int(t)] for t in b], 1.0)
    a_tot, b_tot = A.sum(axis=0), Bm.sum(axis=0)
    na, nb = float(a_tot.sum()), float(b_tot.sum())
    if na == 0 or nb == 0:
        raise ValueError("a side has no tokens")
    tv = 0.5 * float(np.abs(a_tot / na - b_tot / nb).sum())
    # bins: tokens with enough pooled mass for the χ² approximation, the rest merged into one
    pooled = a_tot + b_tot
    big = pooled * min(na, nb) / (na + nb) >= min_expected
    rare = ~big

    def binned(M: np.ndarray) -> np.ndarray:
        cols = [M[..., big]]
        if rare.any():
            cols.append(M[..., rare].sum(axis=-1, keepdims=True))
        return np.concatenate(cols, axis=-1)

    Ab, Bb = binned(A), binned(Bm)
    K = Ab.shape[1]
    out = {
        "tokens": [int(na), int(nb)],
        "pairs": len(pairs),
        "distinct_tokens": len(vocab),
        "bins": K,
        "merged_tokens": int(rare.sum()),
        "min_expected": min_expected,
        "total_variation": tv,
        "permutations": 0,
    }
    if K < 2:
        return {**out, "chi2": 0.0, "df": 0, "p_asymptotic": 1.0, "p_permutation": 1.0}
    sa, sb = Ab.sum(axis=0), Bb.sum(axis=0)
    chi2 = float(_chi2_homogeneity(sa, sb))
    out.update(chi2=chi2, df=K - 1, p_asymptotic=chi2_sf(chi2, K - 1))
    if permutations > 0:
        rng = np.random.default_rng(seed)
        half_sum, half_diff = (Ab + Bb) / 2.0, (Ab - Bb) / 2.0
        total = half_sum.sum(axis=0)
        hits, done = 0, 0
        while done < permutations:  # in chunks: (chunk × pairs) @ (pairs × K)
            m = min(500, permutations - done)
            signs = rng.choice(np.array([-1.0, 1.0]), size=(m, len(pairs)))
            pa = total + signs @ half_diff
            pb = total - signs @ half_diff
            hits += int((_chi2_homogeneity(pa, pb) >= chi2 * (1 - 1e-12)).sum())
            done += m
        out.update(permutations=permutations, p_permutation=(1 + hits) / (1 + permutations))
    else:
        out["p_permutation"] = None
    return out
