"""Summarise: the statistics of the benchmark and the reduction of one temperature's runs to
the numbers the report shows (no clocks, no I/O, no models).

Conventions (docs/DESIGN.md, "Algorithm"):
- An acceptance length is the number of tokens one step commits (accepted proposals + 1), so
  1 … B; τ is its mean. Draft position j (1 … B−1) is accepted when the length is > j.
- Speedup = target-only time per output token / DFlash time per output token, prefill excluded.
- Bound: a step costs one verify and one draft call and commits τ tokens where the target alone
  pays one decode call per token: without host work, speedup = τ · T_decode / (T_verify +
  T_draft) with the mean call times of the same runs (means: the speedup is a ratio of totals).
- Timings per mode are per round, totals over all prompts (TPOT = decode time after the first
  token / new tokens, as the reference measures it), then median [min–max] over rounds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from scipy import stats as sps


def spread(xs: Iterable[float]) -> dict:
    """Median (also as p50) with min, max, quartiles, the 95th percentile (numpy's linear
    interpolation) and count."""
    a = np.asarray(list(xs), np.float64)
    if a.size == 0:
        raise ValueError("no values")
    q = np.percentile(a, [0, 25, 50, 75, 95, 100]).tolist()
    out = dict(zip(("min", "p25", "median", "p75", "p95", "max"), q))
    return {**out, "p50": out["median"], "n": int(a.size)}


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
    rows = [n for r in dflash for n in getattr(r, "verify_lengths", ())]  # the chosen lengths
    out = {
        "verify_rows": float(np.mean(rows)) if rows else None,
        "decode_s": total(baseline, "decode") / tokens,
        # a step's target call: its verify, or its decode where the step policy decoded; its
        # draft calls: the step's, and a decoding row's context sent when it drafts again
        "verify_s": (total(dflash, "verify") + total(dflash, "decode")) / steps,
        "draft_s": (total(dflash, "draft") + total(dflash, "draft_context")) / steps,
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


def cost_split(
    long: dict, short: dict | None, sampled: dict | None, ctx: tuple, weights: dict, state=None
):
    """Split each call's cost at the long context into weights (bytes ÷ bandwidth), cache
    (the part linear in ctx_len, from a short and a long ctx_len), state (a hybrid target's
    recurrent state and conv windows, read and written whole by every target call: bytes ÷
    bandwidth; the same at both ctx_lens, so the cache part holds only the KV caches), sampler
    (T > 0 minus T = 0 of the same specialization) and fixed overhead (the rest). `long`,
    `short`, `sampled`: seconds per call kind; `ctx` = (long ctx_len, short ctx_len);
    `weights`, `state`: seconds per kind (state None: a dense target, no state part)."""
    L, S = ctx
    out = {}
    for kind, t in long.items():
        cache = (t - short[kind]) * L / (L - S) if short and kind in short else None
        sampler = sampled[kind] - t if sampled and kind in sampled and kind != "draft" else None
        w = weights.get(kind, 0.0)
        out[kind] = dict(greedy_s=t, sampled_s=t + (sampler or 0.0), weights_s=w, cache_s=cache)
        st = {} if state is None else {"state_s": state.get(kind)}  # None: no state (the draft)
        fixed = t - w - (cache or 0.0) - (st.get("state_s") or 0.0)
        out[kind].update(**st, sampler_s=sampler, fixed_s=fixed)
    return out


def token_distribution_check(pairs, *, min_expected=5.0, permutations=2000, seed=0) -> dict:
    """Do two samplers draw the same tokens? A sanity check on pooled token histograms.

    `pairs`: (tokens of run A, tokens of run B) per (prompt, round), independent seeds. Each
    side's tokens are pooled into one histogram; tokens whose expected count is below
    `min_expected` are merged into one bin; scipy's χ² test of the 2 × K table gives the
    asymptotic p-value, which assumes independent tokens (tokens of one run are not, so it runs
    small). The permutation p-value swaps the two runs of random pairs (exchangeable when both
    sample one distribution) and needs no independence. A large p-value proves nothing: the
    proof of losslessness is the exact-distribution test (tests/test_sampling.py)."""
    if not pairs:
        raise ValueError("no pairs")
    vocab = np.unique([t for a, b in pairs for t in (*a, *b)])
    count = lambda run: np.bincount(np.searchsorted(vocab, run), minlength=vocab.size)  # noqa: E731
    A, Bm = np.array([count(a) for a, _ in pairs]), np.array([count(b) for _, b in pairs])
    na, nb = int(A.sum()), int(Bm.sum())
    big = (A + Bm).sum(0) * min(na, nb) / (na + nb) >= min_expected
    rare = ~big

    def binned(M):  # the big tokens, then one bin of the rare ones
        return np.column_stack([M[:, big]] + ([M[:, rare].sum(1)] if rare.any() else []))

    Ab, Bb = binned(A), binned(Bm)
    out = {"tokens": [na, nb], "pairs": len(pairs), "distinct_tokens": int(vocab.size)}
    out.update(bins=int(Ab.shape[1]), chi2=0.0, df=0, p_asymptotic=1.0, p_permutation=1.0)
    out["total_variation"] = 0.5 * float(np.abs(A.sum(0) / na - Bm.sum(0) / nb).sum())
    if Ab.shape[1] < 2:
        return out

    res = sps.chi2_contingency(np.stack([Ab.sum(0), Bb.sum(0)]), correction=False)
    out.update(chi2=float(res.statistic), df=int(res.dof), p_asymptotic=float(res.pvalue))
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(permutations, len(pairs)))
    n = (Ab + Bb).sum(0)
    a = n / 2 + signs @ ((Ab - Bb) / 2)  # side A's counts with each pair kept or swapped
    e = a.sum(-1, keepdims=True) * n / n.sum()  # its expected counts (side B's: n − e)
    hits = (((a - e) ** 2 * (1 / e + 1 / (n - e))).sum(-1) >= res.statistic * (1 - 1e-12)).sum()
    out["p_permutation"] = float((1 + hits) / (1 + permutations)) if permutations else None
    return out


MODES = ("baseline", "dflash")


def _per_round(runs, mode, num: str, den: str) -> list[float]:
    return [
        sum(per[r][mode].stats[num] for per in runs) / sum(per[r][mode].stats[den] for per in runs)
        for r in range(len(runs[0]))
    ]


def _mode(runs, mode) -> dict:
    recs = [pair[mode] for per in runs for pair in per]
    steps = sum(x.stats["steps"] for x in recs)
    return {
        "tpot_s": spread(_per_round(runs, mode, "decode_s", "new_tokens")),
        "tokens_per_s": spread(_per_round(runs, mode, "new_tokens", "decode_s")),
        "ttft_s": spread(x.stats["ttft_s"] for x in recs),
        "host_share": spread(_per_round(runs, mode, "host_s", "decode_s")),
        "bytes_per_step": sum(x.stats["bytes_per_step"] * x.stats["steps"] for x in recs) / steps,
    }


def _ratio(runs, key) -> dict:
    """Per round: target-only over DFlash totals of `key(stats)` over all prompts."""

    def total(r, mode):
        return sum(key(per[r][mode].stats) for per in runs)

    return spread(total(r, "baseline") / total(r, "dflash") for r in range(len(runs[0])))


def _prompt(p, pairs) -> dict:
    lengths = [n for x in pairs for n in x["dflash"].acceptance_lengths]
    ratios = [x["baseline"].stats["tpot_s"] / x["dflash"].stats["tpot_s"] for x in pairs]
    return {
        "name": p.name,
        "prompt_tokens": len(p.ids),
        "tau": tau(lengths),
        "steps": len(lengths),
        "speedup": spread(ratios),
        "tpot_s": {m: float(np.median([x[m].stats["tpot_s"] for x in pairs])) for m in MODES},
    }


def section(temperature: float, runs, problems: list[str], prompts, B: int, seed: int) -> dict:
    """Everything measured at one temperature: speed per mode, speedup, τ, acceptance, the loop
    costs and bound, per prompt, and the check (T = 0: tokens identical; T > 0: histograms)."""
    base = [pair["baseline"] for per in runs for pair in per]
    dfl = [pair["dflash"] for per in runs for pair in per]
    lengths = [n for r in dfl for n in r.acceptance_lengths]
    out = {
        "temperature": temperature,
        "status": "measured",
        "rounds": len(runs[0]),
        "prompts": [_prompt(p, pairs) for p, pairs in zip(prompts, runs)],
        "tau": tau(lengths),
        "steps": len(lengths),
        "histogram": acceptance_histogram(lengths, B),
        "position_acceptance": position_acceptance(lengths, B),
        "speedup": _ratio(runs, lambda s: s["decode_s"]),  # same tokens: the ratio of TPOTs
        "speedup_end_to_end": _ratio(runs, lambda s: s["prefill_s"] + s["decode_s"]),
        "modes": {m: _mode(runs, m) for m in MODES},
        "loop": loop_costs(base, dfl),
        "problems": problems,
    }
    if temperature == 0:
        out["check"] = {"kind": "lossless", "passed": not problems, "pairs": len(base)}
    else:
        pairs = [(b.tokens, d.tokens) for b, d in zip(base, dfl)]
        out["check"] = {"kind": "histograms", **token_distribution_check(pairs, seed=seed)}
    return out


# ---------------------------------------------------------------- continuous batching (batch.py)


def batch_point(batches: Sequence[dict]) -> dict:
    """One (concurrency, mode) over its rounds. `batches`: per round {"wall_s": seconds of the
    whole batch, "results": one record per request (.stats, .acceptance_lengths), optionally
    "budget": {kind: {"calls", "s"}} of the batch's program calls}.
    Aggregate tokens/s = all requests' new tokens ÷ the batch's wall time (prefill included),
    per round; TTFT and TPOT pool every request of every round; τ pools every step."""
    if not batches or not all(b["results"] for b in batches):
        raise ValueError("no batches")
    rounds = [sum(r.stats["new_tokens"] for r in b["results"]) / b["wall_s"] for b in batches]
    recs = [r for b in batches for r in b["results"]]
    lengths = [n for r in recs for n in r.acceptance_lengths]
    return {
        "budget": wall_budget(batches),
        "rounds_tokens_per_s": rounds,
        "tokens_per_s": spread(rounds),
        "ttft_s": spread(r.stats["ttft_s"] for r in recs),
        "tpot_s": spread(r.stats["tpot_s"] for r in recs),
        "tau": tau(lengths),
        "requests": len(recs),
        "new_tokens": sum(r.stats["new_tokens"] for r in recs),
    }


def round_ratios(num: Sequence[float], den: Sequence[float]) -> dict:
    """Round-by-round num[r] / den[r] (measured in the same round), as a spread."""
    if len(num) != len(den) or not num:
        raise ValueError("ratios need the same, non-zero number of rounds on both sides")
    return spread(a / b for a, b in zip(num, den))


def wall_budget(batches: Sequence[dict]) -> dict:
    """Where the batches' wall time went: per call kind, calls per batch, seconds per call and
    share of the wall time; "host" is the rest (the host loop, Python, waiting)."""
    walls = sum(b["wall_s"] for b in batches)
    kinds = sorted({k for b in batches for k in b.get("budget", {})})
    out = {}
    for k in kinds:
        calls = sum(b["budget"].get(k, {}).get("calls", 0) for b in batches)
        secs = sum(b["budget"].get(k, {}).get("s", 0.0) for b in batches)
        out[k] = {
            "calls_per_batch": calls / len(batches),
            "call_s": secs / calls if calls else 0.0,
            "share": secs / walls,
        }
    if out:
        out["host"] = {
            "calls_per_batch": 0,
            "call_s": None,
            "share": 1 - sum(x["share"] for x in out.values()),
        }
    return out
