"""Summarise: the raw runs of one temperature reduced to the numbers the report shows.

Timings per mode are per round, totals over all prompts (TPOT = decode time after the first
token / new tokens, as the reference measures it), then median [min–max] over rounds.
"""

from __future__ import annotations

import numpy as np

from dflash_qaic.bench import stats

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
        "tpot_s": stats.spread(_per_round(runs, mode, "decode_s", "new_tokens")),
        "tokens_per_s": stats.spread(_per_round(runs, mode, "new_tokens", "decode_s")),
        "ttft_s": stats.spread(x.stats["ttft_s"] for x in recs),
        "host_share": stats.spread(_per_round(runs, mode, "host_s", "decode_s")),
        "bytes_per_step": sum(x.stats["bytes_per_step"] * x.stats["steps"] for x in recs) / steps,
    }


def _speedups(runs) -> tuple[dict, dict]:
    """Per round: decode-only and end-to-end (prefill included) speedup over all prompts."""
    b, d = (
        _per_round(runs, "baseline", "decode_s", "new_tokens"),
        _per_round(runs, "dflash", "decode_s", "new_tokens"),
    )

    def e2e(r, mode):
        return sum(per[r][mode].stats["prefill_s"] + per[r][mode].stats["decode_s"] for per in runs)

    rounds = range(len(runs[0]))
    return (
        stats.spread(x / y for x, y in zip(b, d)),
        stats.spread(e2e(r, "baseline") / e2e(r, "dflash") for r in rounds),
    )


def _prompt(p, pairs, B: int) -> dict:
    lengths = [n for x in pairs for n in x["dflash"].acceptance_lengths]
    return {
        "name": p.name,
        "prompt_tokens": len(p.ids),
        "tau": stats.tau(lengths),
        "steps": len(lengths),
        "speedup": stats.spread(
            x["baseline"].stats["tpot_s"] / x["dflash"].stats["tpot_s"] for x in pairs
        ),
        "tpot_s": {m: float(np.median([x[m].stats["tpot_s"] for x in pairs])) for m in MODES},
    }


def section(temperature: float, runs, problems: list[str], prompts, B: int, seed: int) -> dict:
    """Everything measured at one temperature: speed per mode, speedup, τ, acceptance, the loop
    costs and bound, per prompt, and the check (T = 0: tokens identical; T > 0: histograms)."""
    base = [pair["baseline"] for per in runs for pair in per]
    dfl = [pair["dflash"] for per in runs for pair in per]
    lengths = [n for r in dfl for n in r.acceptance_lengths]
    speedup, e2e = _speedups(runs)
    out = {
        "temperature": temperature,
        "status": "measured",
        "rounds": len(runs[0]),
        "prompts": [_prompt(p, pairs, B) for p, pairs in zip(prompts, runs)],
        "tau": stats.tau(lengths),
        "steps": len(lengths),
        "histogram": stats.acceptance_histogram(lengths, B),
        "position_acceptance": stats.position_acceptance(lengths, B),
        "speedup": speedup,
        "speedup_end_to_end": e2e,
        "modes": {m: _mode(runs, m) for m in MODES},
        "loop": stats.loop_costs(base, dfl),
        "problems": problems,
    }
    if temperature == 0:
        out["check"] = {"kind": "lossless", "passed": not problems, "pairs": len(base)}
    else:
        pairs = [(b.tokens, d.tokens) for b, d in zip(base, dfl)]
        out["check"] = {"kind": "histograms", **stats.token_distribution_check(pairs, seed=seed)}
    return out


def bandwidth(copy_Bps: float, weights: dict, loop: dict | None, llc: int | None) -> dict:
    """Weight bytes a decode call reads ÷ its mean time, against a numpy copy's bandwidth."""
    out = {"copy_Bps": copy_Bps, "weight_bytes": weights, "llc_bytes": llc}
    if loop:
        achieved = weights["target"] / loop["decode_s"]
        out.update(decode_Bps=achieved, fraction_of_copy=achieved / copy_Bps)
        out["fits_in_llc"] = bool(llc) and weights["target"] + weights["draft"] < llc
    return out
