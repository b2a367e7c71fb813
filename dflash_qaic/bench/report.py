"""Reduce the raw measurements to `results.json`, and render `report.md` and `report.png`.

Every number in the report is computed here from the run's measurements (or, for the traffic
model of the real recipes, from their published shapes); nothing is typed in by hand. Timings
are medians over the timed repetitions with their spread: [min–max] over repetitions, or the
interquartile range (IQR) over pooled per-call samples.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from dflash_qaic.bench import stats
from dflash_qaic.manifest import write_json_atomic

SCHEMA = "dflash-bench/1"
MODES = ("baseline", "dflash")
PEER_LABELS = {
    "reference_dflash": "reference `dflash_generate` (PyTorch eager), DFlash",
    "reference_target": "reference `dflash_generate`, block_size=1 (its target-only loop)",
    "hf_generate": "Hugging Face `generate`, target alone, greedy",
}


# ---------------------------------------------------------------------------- reduction


def _pooled(runs: list[list[dict]], mode: str, kind: str) -> list[float]:
    return [t for per in runs for pair in per for t in pair[mode].call_times.get(kind, ())]


def _mode_summary(runs: list[list[dict]], mode: str) -> dict:
    """Aggregate of one mode: per repetition, totals over all prompts; then medians + spread."""
    reps = len(runs[0])
    tpot, tps, host = [], [], []
    for r in range(reps):
        recs = [per[r][mode] for per in runs]
        dec = sum(x.stats["decode_s"] for x in recs)
        n = sum(x.stats["new_tokens"] for x in recs)
        tpot.append(dec / n)
        tps.append(n / dec)
        host.append(sum(x.stats["host_s"] for x in recs) / dec)
    all_recs = [pair[mode] for per in runs for pair in per]
    steps = sum(x.stats["steps"] for x in all_recs)
    moved = sum(x.stats["bytes_per_step"] * x.stats["steps"] for x in all_recs)
    return {
        "tpot_s": stats.spread(tpot),
        "tokens_per_s": stats.spread(tps),
        "ttft_s": stats.spread([x.stats["ttft_s"] for x in all_recs]),
        "prefill_s": stats.spread([x.stats["prefill_s"] for x in all_recs]),
        "host_share": stats.spread(host),
        "bytes_per_step": moved / max(steps, 1),
    }


def _prompt_summary(p, pairs: list[dict], B: int, sampled: bool = False) -> dict:
    """One prompt's numbers. Acceptance lengths: at T = 0 every round commits the same steps, so
    one round's; at T > 0 each round samples anew, so all timed rounds' steps, pooled."""
    d0 = pairs[0]["dflash"]
    if sampled:
        lengths = [n for x in pairs for n in x["dflash"].acceptance_lengths]
    else:
        lengths = d0.acceptance_lengths
    out = {
        **p.to_dict(),
        "new_tokens": len(d0.tokens),
        "rounds": len(pairs),
        "steps": len(lengths),
        "tau": stats.tau(lengths),
        "acceptance_lengths": lengths,
        "acceptance_histogram": stats.acceptance_histogram(lengths, B),
        "position_acceptance": stats.position_acceptance(lengths, B),
        "speedup": stats.spread(
            [
                stats.speedup(x["baseline"].stats["tpot_s"], x["dflash"].stats["tpot_s"])
                for x in pairs
            ]
        ),
    }
    for mode in MODES:
        recs = [x[mode] for x in pairs]
        out[mode] = {
            "tpot_s": stats.spread([x.stats["tpot_s"] for x in recs]),
            "tokens_per_s": stats.spread([x.stats["tokens_per_s"] for x in recs]),
            "ttft_s": stats.spread([x.stats["ttft_s"] for x in recs]),
            "host_share": stats.spread([x.stats["host_s"] / x.stats["decode_s"] for x in recs]),
            "bytes_per_step": recs[0].stats["bytes_per_step"],
        }
    return out


def _bound(runs, tau_: float, speedup_med: float, B: int) -> dict:
    dec = _pooled(runs, "baseline", "decode")
    ver = _pooled(runs, "dflash", "verify")
    dra = _pooled(runs, "dflash", "draft")
    per_call = {
        "decode": stats.spread(dec),
        "verify": stats.spread(ver),
        "draft": stats.spread(dra),
        "prefill": stats.spread(_pooled(runs, "dflash", "prefill")),
    }
    if _pooled(runs, "dflash", "draft_prefill"):
        per_call["draft_prefill"] = stats.spread(_pooled(runs, "dflash", "draft_prefill"))
    Td, Tv, Tdr = (per_call[k]["median"] for k in ("decode", "verify", "draft"))
    bound = stats.speedup_bound(tau_, Td, Tv, Tdr)

    # Where the loop loses time: the same identity with means, then with the host time.
    recs_d = [pair["dflash"] for per in runs for pair in per]
    recs_b = [pair["baseline"] for per in runs for pair in per]
    steps_d = sum(x.stats["steps"] for x in recs_d)
    steps_b = sum(x.stats["steps"] for x in recs_b)
    step_s = sum(x.stats["decode_s"] for x in recs_d) / steps_d
    verify_per_step = sum(ver) / steps_d
    draft_per_step = sum(dra) / steps_d  # the last step of a run makes no draft call
    token_s = sum(x.stats["decode_s"] for x in recs_b) / steps_b
    decode_mean = sum(dec) / len(dec)
    bound_means = stats.speedup_bound(tau_, decode_mean, verify_per_step, draft_per_step)
    pooled = tau_ * token_s / step_s
    return {
        "per_call_s": per_call,
        "tau": tau_,
        "bound": bound,
        "measured": speedup_med,
        "fraction_of_bound": stats.fraction_of_bound(speedup_med, bound),
        "break_even_tau": stats.break_even_tau(Td, Tv, Tdr),
        "decomposition": {
            "dflash_step_s": step_s,
            "verify_per_step_s": verify_per_step,
            "draft_per_step_s": draft_per_step,
            "host_per_step_s": step_s - verify_per_step - draft_per_step,
            "baseline_token_s": token_s,
            "decode_call_mean_s": decode_mean,
            "host_per_token_s": token_s - decode_mean,
            "bound_medians": bound,
            "bound_means": bound_means,
            "with_host_pooled": pooled,
        },
        "curve": [
            {"tau": t, "bound": stats.speedup_bound(t, Td, Tv, Tdr)}
            for t in [1 + i * (B - 1) / 60 for i in range(61)]
        ],
    }


def _bandwidth(manifest, weights: dict, copy_bw: list[dict], per_call: dict, ctx_len: int):
    from dflash_qaic.bench.run import kv_bytes

    Td = per_call["decode"]["median"]
    read = weights["target"]["read_bytes"] + weights["target"]["gather_row_bytes"]
    kv = kv_bytes(manifest["target"], ctx_len)
    copy = stats.median(c["read_plus_write_Bps"] for c in copy_bw)
    achieved = stats.bandwidth(read, Td)
    calls = {}
    for kind, prog in (("decode", "target"), ("verify", "target"), ("draft", "draft")):
        w = weights[prog]["read_bytes"]
        t = per_call[kind]["median"]
        calls[kind] = {"weight_bytes": w, "median_s": t, "weight_Bps": stats.bandwidth(w, t)}
    return {
        "target_weight_bytes_read_per_decode": read,
        "target_onnx_bytes": manifest["target"].get("onnx_bytes"),
        "target_embedding_table_bytes": weights["target"]["gather_table_bytes"],
        "target_kv_cache_bytes": kv,
        "t_decode_s": Td,
        "achieved_weight_Bps": achieved,
        "achieved_weight_plus_kv_Bps": stats.bandwidth(read + kv, Td),
        "copy": copy_bw,
        "copy_read_plus_write_Bps": copy,
        "fraction_of_copy": achieved / copy,
        "per_kind": calls,
    }


def _peers(peers: dict, ours_summary: dict, prompts_summary: list[dict]) -> dict:
    if "skipped" in peers:
        return peers
    out = {"torch_threads": peers["torch_threads"], "seconds": peers["seconds"], "systems": {}}
    reps = len(peers["reference_dflash"][0]["tpot_s"])
    for name in PEER_LABELS:
        per = peers[name]
        tpot_r = [sum(p["tpot_s"][r] for p in per) / len(per) for r in range(reps)]
        out["systems"][name] = {
            "label": PEER_LABELS[name],
            "tpot_s": stats.spread(tpot_r),
            "tokens_per_s": stats.spread([1 / t for t in tpot_r]),
            "ttft_s": stats.spread([t for p in per for t in p["ttft_s"]]),
            "tokens_match_ours": sum(p["tokens_match_ours"] for p in per),
            "prompts": len(per),
            "per_prompt": per,
        }
    ref_d, ref_t = peers["reference_dflash"], peers["reference_target"]
    sp = [
        sum(p["tpot_s"][r] for p in ref_t) / sum(p["tpot_s"][r] for p in ref_d) for r in range(reps)
    ]
    lengths = [x for p in ref_d for x in p["acceptance_lengths"]]
    same = sum(
        p["acceptance_lengths"] == q["acceptance_lengths"] for p, q in zip(ref_d, prompts_summary)
    )
    out["reference_speedup"] = stats.spread(sp)
    out["reference_tau"] = stats.tau(lengths)
    out["reference_acceptance_equal_ours"] = same
    return out


def _traffic(manifest: dict, runs, tau_: float) -> dict:
    B, H, V = (int(manifest[k]) for k in ("block_size", "hidden_size", "vocab_size"))
    rows = {}
    for name, shape in stats.REAL_RECIPES.items():
        rows[name] = stats.traffic_per_step(**shape)
    rows["this pair"] = stats.traffic_per_step(H, V, B)
    rows["this pair, minimal (τ context rows)"] = stats.traffic_per_step(H, V, B, context_rows=tau_)
    m = stats.traffic_from_manifest(manifest)
    # The runtime counts every byte it feeds and fetches; predict the same total from the
    # manifest's I/O shapes and the call counts.
    recs = [pair["dflash"] for per in runs for pair in per]
    measured = sum(x.stats["bytes_per_step"] * x.stats["steps"] for x in recs)
    predicted = sum(
        m["verify"] * len(x.call_times.get("verify", ()))
        + m["draft"] * len(x.call_times.get("draft", ()))
        for x in recs
    )
    extra = sum(m["extra"].values())
    rows["this pair, as exported (manifest I/O)"] = {
        **rows["this pair"],
        "ours": m["step"],
        "logits_design": m["step"] - m["draft_out"] + rows["this pair"]["logits_draft_out"],
        "ratio": (m["step"] - m["draft_out"] + rows["this pair"]["logits_draft_out"]) / m["step"],
        "extra_bytes": extra,
    }
    return {
        "recipes": rows,
        "manifest_per_call": m,
        "measured_bytes": measured,
        "predicted_bytes": predicted,
        "model_matches_measurement": measured == predicted,
    }


def _temperature_section(meas: dict, prompts, B: int) -> dict:
    """Everything measured at one temperature: aggregate, acceptance, per prompt, the bound,
    and the check (T = 0: lossless token equality; T > 0: the token-distribution sanity check)."""
    T = float(meas["temperature"])
    head = {
        "temperature": T,
        "top_k": meas.get("top_k", 0),
        "top_p": meas.get("top_p", 1.0),
        "seed": meas.get("seed"),
    }
    if "skipped" in meas:
        return {**head, "status": "skipped", "note": meas["skipped"]}
    sampled = T > 0
    runs = meas["runs"]
    used = prompts[: len(runs)]
    per_prompt = [_prompt_summary(p, pairs, B, sampled) for p, pairs in zip(used, runs)]
    lengths = [n for p in per_prompt for n in p["acceptance_lengths"]]
    tau_ = stats.tau(lengths)
    reps = len(runs[0])
    summ = {m: _mode_summary(runs, m) for m in MODES}

    def _tpot(r: int, mode: str) -> float:
        return sum(per[r][mode].stats["decode_s"] for per in runs) / sum(
            per[r][mode].stats["new_tokens"] for per in runs
        )

    speedup = stats.spread(
        [stats.speedup(_tpot(r, "baseline"), _tpot(r, "dflash")) for r in range(reps)]
    )

    def _e2e(rec) -> float:  # the whole generate call: prefill (with the draft's) + decode
        return rec.stats["prefill_s"] + rec.stats["decode_s"]

    speedup_e2e = stats.spread(
        [
            sum(_e2e(per[r]["baseline"]) for per in runs)
            / sum(_e2e(per[r]["dflash"]) for per in runs)
            for r in range(reps)
        ]
    )
    failures = meas["failures"]
    out = {
        **head,
        "status": "measured",
        "num_prompts": len(runs),
        "repeats": reps,
        "warmup": meas.get("warmup"),
        "reduced": meas.get("reduced"),
        "aggregate": {
            "tau": tau_,
            "tau_mean_of_prompts": sum(p["tau"] for p in per_prompt) / len(per_prompt),
            "steps": len(lengths),
            "speedup": speedup,
            "speedup_end_to_end": speedup_e2e,
            **summ,
        },
        "acceptance": {
            "block_size": B,
            "histogram": stats.acceptance_histogram(lengths, B),
            "position_acceptance": stats.position_acceptance(lengths, B),
        },
        "prompts": per_prompt,
        "bound": _bound(runs, tau_, speedup["median"], B),
        "measure_seconds": meas["seconds"],
    }
    if sampled:
        pairs = [(x["baseline"].tokens, x["dflash"].tokens) for per in runs for x in per]
        out["distribution_check"] = stats.token_distribution_check(
            pairs, seed=int(head["seed"] or 0)
        )
        out["problems"] = failures
    else:
        out["lossless"] = {
            "checked": True,
            "passed": not failures,
            "pairs_checked": len(runs) * (reps + (meas.get("warmup") or 0)),
            "failures": failures,
        }
    return out


def primary_section(sections: list[dict]) -> dict:
    """The section the top-level keys describe: T = 0 when measured, else the first measured."""
    measured = [s for s in sections if s["status"] == "measured"]
    if not measured:
        raise ValueError("no temperature was measured")
    return next((s for s in measured if s["temperature"] == 0), measured[0])


def build_results(
    *,
    manifest: dict,
    artifacts: str,
    backend: str,
    config: dict,
    machine: dict,
    prompts,
    prompts_source: str,
    measurements: list[dict],
    weights: dict,
    copy_bw: list[dict],
    peers: dict,
    profiles: list[dict],
    command: str,
    seconds: float,
    started: str,
) -> dict:
    """`measurements`: one per temperature, in the order given: the `run_pipeline` dict plus
    temperature, top_k, top_p, seed, warmup (and `reduced`: a note when fewer prompts or rounds
    ran than at T = 0), or {temperature, skipped: note}. The top-level aggregate, acceptance,
    prompts and bound describe the T = 0 section (else the first measured one), as before
    temperatures existed; `temperatures` holds every section."""
    B = int(manifest["block_size"])
    sections = [_temperature_section(meas, prompts, B) for meas in measurements]
    prim = primary_section(sections)
    prim_meas = measurements[sections.index(prim)]
    greedy = next(
        (s for s in sections if s["status"] == "measured" and s["temperature"] == 0), None
    )
    lossless = (
        greedy["lossless"]
        if greedy
        else {
            "checked": False,
            "passed": None,
            "pairs_checked": 0,
            "failures": [],
            "note": "T = 0 was not among the temperatures: no token-equality check ran",
        }
    )
    t = manifest["target"]
    d = manifest["draft"]
    return {
        "schema": SCHEMA,
        "command": command,
        "started": started,
        "seconds": seconds,
        "artifacts": {
            "path": artifacts,
            "backend": backend,
            "block_size": B,
            "ctx_len": manifest["ctx_len"],
            "prefill_seq_len": manifest["prefill_seq_len"],
            "hidden_size": manifest["hidden_size"],
            "vocab_size": manifest["vocab_size"],
            "target_layer_ids": manifest.get("target_layer_ids"),
            "target": {k: t.get(k) for k in ("n_layers", "n_kv_heads", "head_dim", "onnx_bytes")},
            "draft": {k: d.get(k) for k in ("n_layers", "n_kv_heads", "head_dim", "onnx_bytes")},
            "sources": manifest.get("sources"),
            "input_hash": manifest.get("input_hash"),
        },
        "config": {**config, "prompts_source": prompts_source, "num_prompts": len(prompts)},
        "machine": machine,
        "lossless": lossless,
        "primary_temperature": prim["temperature"],
        "aggregate": prim["aggregate"],
        "acceptance": prim["acceptance"],
        "prompts": prim["prompts"],
        "bound": prim["bound"],
        "temperatures": sections,
        "bandwidth": _bandwidth(
            manifest, weights, copy_bw, prim["bound"]["per_call_s"], int(manifest["ctx_len"])
        ),
        "peers": _peers(peers, prim["aggregate"], greedy["prompts"] if greedy else []),
        "traffic": _traffic(manifest, prim_meas["runs"], prim["aggregate"]["tau"]),
        "profiles": profiles,
        "measure_seconds": sum(s.get("measure_seconds", 0.0) for s in sections),
    }


# ---------------------------------------------------------------------------- formatting


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def _sp(x: dict, f=_ms, unit: str = "") -> str:
    """median [min–max]"""
    if x["n"] == 1:
        return f"{f(x['median'])}{unit}"
    return f"{f(x['median'])}{unit} [{f(x['min'])}–{f(x['max'])}]"


def _iqr(x: dict, f=_ms) -> str:
    return f"{f(x['median'])} (IQR {f(x['p25'])}–{f(x['p75'])}, n={x['n']})"


def _x(v: float) -> str:
    return f"{v:.2f}×"


def _pct(v: float) -> str:
    return f"{v * 100:.1f}%"


def _bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def _gbs(v: float) -> str:
    return f"{v / 1e9:.2f} GB/s"


def _table(head: list[str], rows: list[list]) -> str:
    lines = [
        "| " + " | ".join(str(h) for h in head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(res: dict) -> str:
    a, art, cfg = res["aggregate"], res["artifacts"], res["config"]
    B = art["block_size"]
    out: list[str] = ["# dflash-bench report", ""]
    ll = res["lossless"]
    if ll.get("checked") is False:
        out.append(f"**Lossless check: not run** ({ll['note']}).")
    elif ll["passed"]:
        out.append(
            f"**Lossless check (T = 0): passed.** DFlash produced exactly the target-alone tokens "
            f"in all {ll['pairs_checked']} (prompt, round) pairs, {cfg['max_new_tokens']} tokens "
            "each."
        )
    else:
        out += [
            f"## ⚠ LOSSLESS CHECK FAILED ({len(ll['failures'])} problems)",
            "",
            "DFlash output is NOT the target's greedy output; the speed numbers below are void.",
            "",
            _table(
                ["prompt", "round", "problem"],
                [[f["prompt"], f["round"], f["problem"]] for f in ll["failures"][:20]],
            ),
        ]
    out += _contention_md(res["machine"])
    out += [
        "",
        f"- command: `{res['command']}`",
        f"- started {res['started']}, took {res['seconds']:.0f} s",
        f"- artifacts: `{art['path']}` on backend `{art['backend']}`: block {B}, ctx_len "
        f"{art['ctx_len']}, prefill chunk {art['prefill_seq_len']}, H {art['hidden_size']}, "
        f"vocab {art['vocab_size']}, target {art['target']['n_layers']} layers "
        f"({_bytes(art['target']['onnx_bytes'])} ONNX), draft {art['draft']['n_layers']} layers "
        f"({_bytes(art['draft']['onnx_bytes'])} ONNX)",
        f"- prompts: {cfg['num_prompts']} from {cfg['prompts_source']}",
        f"- method: in one process on one `load()` of the programs, for {cfg['warmup']} "
        f"discarded warm-up round(s) then {cfg['repeats']} timed round(s), every prompt runs "
        "target-only decoding (the decode specialization of the same target program) and DFlash "
        "back to back, the order alternating; `stop_token_ids=[]`, so every run makes exactly "
        f"{cfg['max_new_tokens']} tokens. Time per output token (TPOT) = decode time after the "
        "first token / new tokens (the reference's convention). Speedup = baseline TPOT / "
        "DFlash TPOT, per round, over all prompts; reported as median [min–max] over rounds.",
        *_sampling_method_md(res),
        "",
        *_temperatures_md(res),
        f"## Aggregate ({_temp(res.get('primary_temperature', 0.0))})",
        "",
    ]
    rows = []
    for mode, label in (("baseline", "target alone"), ("dflash", "DFlash")):
        s = a[mode]
        rows.append(
            [
                label,
                _sp(s["ttft_s"]),
                _sp(s["tpot_s"]),
                _sp(s["tokens_per_s"], lambda v: f"{v:.1f}"),
                _sp(s["host_share"], _pct),
                _bytes(s["bytes_per_step"]),
            ]
        )
    out += [
        _table(
            ["", "TTFT ms", "TPOT ms", "tokens/s", "host time share", "host bytes / step"], rows
        ),
        "",
        f"**Speedup {_sp(a['speedup'], _x)}** at mean acceptance length **τ = {a['tau']:.2f}** "
        f"over {a['steps']} steps (mean of per-prompt τ {a['tau_mean_of_prompts']:.2f}; block "
        f"{B}, so τ ≤ {B}). DFlash TTFT counts the target's prefill; its prefill including the "
        f"draft's context prefill is {_sp(a['dflash']['prefill_s'])} ms. End to end (whole "
        f"`generate` calls, prefill included): speedup {_sp(a['speedup_end_to_end'], _x)}.",
        "",
        f"## Per prompt ({_temp(res.get('primary_temperature', 0.0))})",
        "",
    ]
    rows = [
        [
            p["name"],
            p["prompt_tokens"]
            if p["truncated_from"] is None
            else f"{p['prompt_tokens']} (cut from {p['truncated_from']})",
            f"{p['tau']:.2f}",
            p["steps"],
            _sp(p["baseline"]["tpot_s"]),
            _sp(p["dflash"]["tpot_s"]),
            _sp(p["speedup"], _x),
        ]
        for p in res["prompts"]
    ]
    out += [
        _table(
            ["prompt", "tokens", "τ", "steps", "baseline TPOT ms", "DFlash TPOT ms", "speedup"],
            rows,
        ),
        "",
        f"## Acceptance ({_temp(res.get('primary_temperature', 0.0))})",
        "",
        "Tokens committed per step (accepted proposals + 1); the last step of a run is capped by "
        "the token budget, as the reference counts it.",
        "",
    ]
    hist = res["acceptance"]["histogram"]
    total = sum(hist) or 1
    out += [
        _table(
            ["length", *range(1, B + 1)],
            [["steps", *hist], ["share", *(f"{h / total:.2f}" for h in hist)]],
        ),
        "",
        "Per-position acceptance: the fraction of steps whose draft position j was accepted "
        "(its sum is τ − 1).",
        "",
        _table(
            ["j", *range(1, B)],
            [["accepted", *(f"{f:.2f}" for f in res["acceptance"]["position_acceptance"])]],
        ),
        "",
    ]
    bd = res["bound"]
    pc = bd["per_call_s"]
    dc = bd["decomposition"]
    out += [
        f"## The bound and where the loop loses time ({_temp(res.get('primary_temperature', 0.0))})",
        "",
        "Per-call wall times, pooled over all timed runs (median, IQR, number of calls):",
        "",
        _table(
            ["call", "ms"],
            [[k, _iqr(v)] for k, v in pc.items()],
        ),
        "",
        f"Bound τ·T_decode / (T_verify + T_draft) = {a['tau']:.2f} × {_ms(pc['decode']['median'])} / "
        f"({_ms(pc['verify']['median'])} + {_ms(pc['draft']['median'])}) = **{_x(bd['bound'])}**; "
        f"measured {_x(bd['measured'])} = **{_pct(bd['fraction_of_bound'])} of the bound**. "
        f"Break-even τ (bound = 1): {bd['break_even_tau']:.2f}."
        + (
            " Above 100%: the measured speedup comes from total times (means), the bound from "
            "median call times, and these call-time distributions are skewed (see the IQRs and "
            "the bound from mean call times below)."
            if bd["fraction_of_bound"] > 1
            else ""
        ),
        "",
        _table(
            ["per DFlash step", "ms", "per target-only token", "ms"],
            [
                [
                    "verify (mean)",
                    _ms(dc["verify_per_step_s"]),
                    "decode call (mean)",
                    _ms(dc["decode_call_mean_s"]),
                ],
                [
                    "draft (mean per step)",
                    _ms(dc["draft_per_step_s"]),
                    "host (rest of the loop)",
                    _ms(dc["host_per_token_s"]),
                ],
                ["host (rest of the loop)", _ms(dc["host_per_step_s"]), "", ""],
                ["total", _ms(dc["dflash_step_s"]), "total", _ms(dc["baseline_token_s"])],
            ],
        ),
        "",
        _table(
            ["speedup", "value"],
            [
                ["bound from median call times", _x(dc["bound_medians"])],
                ["bound from mean call times", _x(dc["bound_means"])],
                ["with each loop's host time (pooled over runs)", _x(dc["with_host_pooled"])],
                ["measured (median over rounds)", _x(bd["measured"])],
            ],
        ),
        "",
    ]
    for sec in res.get("temperatures", []):
        if sec["status"] == "measured" and sec["temperature"] > 0:
            out += _sampled_md(sec, B, cfg)
    bw = res["bandwidth"]
    rows = [
        [
            k,
            _bytes(v["weight_bytes"]),
            _ms(v["median_s"]),
            _gbs(v["weight_Bps"]),
        ]
        for k, v in bw["per_kind"].items()
    ]
    out += [
        "## The machine's limit: memory bandwidth",
        "",
        f"A target-only decode step reads {_bytes(bw['target_weight_bytes_read_per_decode'])} of "
        f"weights (the ONNX initializers, less the embedding table of "
        f"{_bytes(bw['target_embedding_table_bytes'])} of which one row is read; the ONNX file is "
        f"{_bytes(bw['target_onnx_bytes'])}) in a median {_ms(bw['t_decode_s'])} ms: "
        f"**{_gbs(bw['achieved_weight_Bps'])}** of weights "
        f"({_gbs(bw['achieved_weight_plus_kv_Bps'])} counting the {_bytes(bw['target_kv_cache_bytes'])} "
        "static KV cache the attention reads in full). A numpy copy in the same process moves "
        f"**{_gbs(bw['copy_read_plus_write_Bps'])}** (read + write, median of the runs before and "
        f"after the measurement): decoding reaches {_pct(bw['fraction_of_copy'])} of it.",
        "",
        _table(["call", "weight bytes", "median ms", "weight bytes / s"], rows),
        "",
    ]
    llc = res["machine"].get("last_level_cache_bytes")
    if llc and bw["target_weight_bytes_read_per_decode"] + bw["target_kv_cache_bytes"] < llc:
        out += [
            f"The target's weights and KV cache ({_bytes(bw['target_weight_bytes_read_per_decode'] + bw['target_kv_cache_bytes'])}) "
            f"fit in this CPU's last-level cache ({_bytes(llc)}): decoding this pair is bound by "
            "per-call and per-operator overheads, not by memory bandwidth, so the fraction above "
            "is low by construction. The cost profile (`--profile-shapes`) measures real shapes.",
            "",
        ]
    if art["backend"] != "ort":
        out += [
            f"(Backend `{art['backend']}`: the programs run on the card, so the host copy "
            "bandwidth is not their limit; the rows above are for reference.)",
            "",
        ]
    out += [
        "## Peers on the same machine (T = 0 only)",
        "",
        "The peers run greedy decoding only; they are compared with our T = 0 runs.",
        "",
    ]
    pe = res["peers"]
    if "skipped" in pe:
        out += [f"Peers {pe['skipped']}.", ""]
    else:
        rows = [
            [
                "ours (ONNX Runtime), DFlash",
                _sp(a["dflash"]["ttft_s"]),
                _sp(a["dflash"]["tpot_s"]),
                _sp(a["dflash"]["tokens_per_s"], lambda v: f"{v:.1f}"),
                "—",
            ],
            [
                "ours (ONNX Runtime), target alone",
                _sp(a["baseline"]["ttft_s"]),
                _sp(a["baseline"]["tpot_s"]),
                _sp(a["baseline"]["tokens_per_s"], lambda v: f"{v:.1f}"),
                "—",
            ],
        ]
        for s in pe["systems"].values():
            rows.append(
                [
                    s["label"],
                    _sp(s["ttft_s"]),
                    _sp(s["tpot_s"]),
                    _sp(s["tokens_per_s"], lambda v: f"{v:.1f}"),
                    f"{s['tokens_match_ours']}/{s['prompts']}",
                ]
            )
        out += [
            _table(["system", "TTFT ms", "TPOT ms", "tokens/s", "same tokens as ours"], rows),
            "",
            f"Reference DFlash speedup over its own target-only loop: "
            f"{_sp(pe['reference_speedup'], _x)} at τ {pe['reference_tau']:.2f} (ours "
            f"{_sp(a['speedup'], _x)} at τ {a['tau']:.2f}); its acceptance lengths equal ours on "
            f"{pe['reference_acceptance_equal_ours']}/{cfg['num_prompts']} prompts. PyTorch "
            f"threads: {pe['torch_threads']}. The peers run the source checkpoints in fp32 after "
            f"ours, in the same process: {cfg['warmup']} warm-up pass(es) of each over the first "
            f"prompt, then {cfg['peer_repeats']} timed round(s) over all prompts, the order "
            "alternating; TPOT as the reference defines it (decode time after the first token / "
            "new tokens; for `generate`, from the first streamed token to the end).",
            "",
        ]
    tr = res["traffic"]
    rows = [
        [
            name,
            r["hidden_size"],
            r["block_size"],
            _bytes(r["ours"]),
            _bytes(r["logits_draft_out"]),
            _bytes(r["logits_design"]),
            f"{r['ratio']:.0f}×",
        ]
        for name, r in tr["recipes"].items()
    ]
    out += [
        "## Host traffic per step",
        "",
        "Ours: the draft takes B ids, B positions and the context feature rows (B rows as this "
        "runtime sends them, padded; τ at minimum) and returns B−1 ids; verify takes B ids and B "
        "positions and returns B ids and B×H fp32 features. The comparison design (QEfficient "
        "#995) returns fp32 logits for all B draft rows instead of B−1 ids.",
        "",
        _table(
            [
                "recipe",
                "H",
                "B",
                "ours / step",
                "fp32 draft logits",
                "logits design / step",
                "ratio",
            ],
            rows,
        ),
        "",
        *(
            [
                "I/O the model above leaves out, per step in these artifacts: "
                + ", ".join(f"`{k}` {v} B" for k, v in tr["manifest_per_call"]["extra"].items())
                + " (counted in the “as exported” row).",
                "",
            ]
            if tr["manifest_per_call"]["extra"]
            else []
        ),
        f"Check against the runtime's own byte count: the manifest's I/O shapes predict "
        f"{tr['predicted_bytes']:,} bytes for all DFlash calls of the timed runs, the runtime "
        f"counted {round(tr['measured_bytes']):,} "
        f"({'equal' if tr['model_matches_measurement'] else 'DIFFERENT'}).",
        "",
    ]
    if res["profiles"]:
        out += _profiles_md(res["profiles"])
    out += _machine_md(res["machine"], res["command"])
    out += ["![report](report.png)", ""]
    return "\n".join(out)


def _temp(t: float) -> str:
    return f"T = {t:g}"


def _sampling_method_md(res: dict) -> list[str]:
    secs = res.get("temperatures") or []
    if not any(sec["temperature"] > 0 for sec in secs):
        return []
    cfg = res["config"]
    return [
        f"- temperatures: {', '.join(format(sec['temperature'], 'g') for sec in secs)}; at T > 0 "
        f"top_k {cfg.get('top_k', 0)} (0 = off), top_p {cfg.get('top_p', 1.0):g} (1 = off). "
        "Each sampled run has its own seed, a hash of "
        f"--seed {cfg.get('seed', 0)}, T, the prompt index, the round and the mode (baseline and "
        "DFlash differ), so the runs are reproducible and the two runs of a pair independent. "
        "Sampling is lossless (the same output distribution as the target's own sampling), not "
        "token-identical: randomness is consumed differently, so at T > 0 there is no token "
        "equality to check; a distribution sanity check replaces it.",
    ]


def _temperatures_md(res: dict) -> list[str]:
    """The summary table: one row per temperature."""
    secs = res.get("temperatures") or []
    if len(secs) < 2 and not any(sec["status"] == "skipped" for sec in secs):
        return []
    rows, notes = [], []
    for sec in secs:
        if sec["status"] == "skipped":
            rows.append([_temp(sec["temperature"]), "skipped", *["—"] * 8])
            notes.append(f"**{_temp(sec['temperature'])} skipped:** {sec['note']}")
            continue
        a, bd = sec["aggregate"], sec["bound"]
        if sec["temperature"] == 0:
            ll = sec["lossless"]
            check = "tokens identical" if ll["passed"] else f"FAILED ({len(ll['failures'])})"
        else:
            dc = sec["distribution_check"]
            p = dc["p_permutation"] if dc["p_permutation"] is not None else dc["p_asymptotic"]
            check = f"token histograms p = {p:.2f}"
        rows.append(
            [
                _temp(sec["temperature"]),
                f"{sec['num_prompts']} × {sec['repeats']}",
                f"{a['tau']:.2f}",
                _sp(a["baseline"]["tpot_s"]),
                _sp(a["dflash"]["tpot_s"]),
                _sp(a["baseline"]["tokens_per_s"], lambda v: f"{v:.1f}"),
                _sp(a["dflash"]["tokens_per_s"], lambda v: f"{v:.1f}"),
                f"**{_sp(a['speedup'], _x)}**",
                f"{_x(bd['bound'])} ({_pct(bd['fraction_of_bound'])})",
                check,
            ]
        )
        if sec.get("reduced"):
            notes.append(f"**{_temp(sec['temperature'])}:** {sec['reduced']}")
    out = [
        "## Speedup by temperature",
        "",
        _table(
            [
                "",
                "prompts × rounds",
                "τ",
                "baseline TPOT ms",
                "DFlash TPOT ms",
                "baseline tokens/s",
                "DFlash tokens/s",
                "speedup",
                "bound (measured share)",
                "check",
            ],
            rows,
        ),
        "",
        "Speedup and timings: median [min–max] over rounds. Bound τ·T_decode / (T_verify + "
        "T_draft) from that temperature's median call times, with the measured speedup as a share "
        "of it. The check: at T = 0, DFlash tokens equal the target's; at T > 0, the permutation "
        "p-value of the two-sample χ² on pooled token histograms (a sanity check, see below).",
        "",
    ]
    for n in notes:
        out += [n, ""]
    return out


def _sampled_md(sec: dict, B: int, cfg: dict) -> list[str]:
    """Details of one sampled temperature: acceptance, per prompt, the distribution check."""
    T = _temp(sec["temperature"])
    a, acc, dc = sec["aggregate"], sec["acceptance"], sec["distribution_check"]
    hist = acc["histogram"]
    total = sum(hist) or 1
    out = [
        f"## Sampling at {T} (top_k {sec['top_k']}, top_p {sec['top_p']:g})",
        "",
        f"{sec['num_prompts']} prompts × {sec['warmup']} warm-up + {sec['repeats']} timed "
        f"round(s), {cfg['max_new_tokens']} tokens per run. **Speedup {_sp(a['speedup'], _x)}** "
        f"at **τ = {a['tau']:.2f}** over {a['steps']} steps (pooled over all timed rounds: each "
        f"round samples anew); end to end {_sp(a['speedup_end_to_end'], _x)}. Bound "
        f"{_x(sec['bound']['bound'])}, measured {_pct(sec['bound']['fraction_of_bound'])} of it.",
        "",
        _table(
            ["length", *range(1, B + 1)],
            [["steps", *hist], ["share", *(f"{h / total:.2f}" for h in hist)]],
        ),
        "",
        _table(
            ["j", *range(1, B)],
            [["accepted", *(f"{f:.2f}" for f in acc["position_acceptance"])]],
        ),
        "",
        _table(
            ["prompt", "τ", "steps (all rounds)", "baseline TPOT ms", "DFlash TPOT ms", "speedup"],
            [
                [
                    p["name"],
                    f"{p['tau']:.2f}",
                    p["steps"],
                    _sp(p["baseline"]["tpot_s"]),
                    _sp(p["dflash"]["tpot_s"]),
                    _sp(p["speedup"], _x),
                ]
                for p in sec["prompts"]
            ],
        ),
        "",
        f"### Same distribution? A sanity check at {T}, not a proof",
        "",
        "No token equality holds at T > 0, so instead: pool the tokens of all timed runs of each "
        "mode into one histogram and compare the two with a two-sample χ² test (tokens whose "
        f"expected count is below {dc['min_expected']:g} merged into one bin). Tokens within a "
        "run depend on each other, so the asymptotic χ² p-value (which assumes independent "
        "tokens) runs small; the permutation p-value swaps the baseline and DFlash runs of random "
        "pairs (exchangeable when both sample the same distribution) and needs no independence. "
        "A small p-value says look closer; a large one proves nothing. The proof that DFlash "
        "sampling is lossless is the exact-distribution test, `tests/test_sampling.py`.",
        "",
        _table(
            [
                "tokens (baseline, DFlash)",
                "distinct",
                "bins",
                "χ²",
                "df",
                "p (asymptotic)",
                "p (permutation)",
                "total variation",
            ],
            [
                [
                    f"{dc['tokens'][0]}, {dc['tokens'][1]}",
                    dc["distinct_tokens"],
                    dc["bins"],
                    f"{dc['chi2']:.1f}",
                    dc["df"],
                    f"{dc['p_asymptotic']:.3g}",
                    "—"
                    if dc["p_permutation"] is None
                    else f"{dc['p_permutation']:.3g} ({dc['permutations']} swaps)",
                    f"{dc['total_variation']:.3f}",
                ]
            ],
        ),
        "",
    ]
    if sec["problems"]:
        out += [
            f"**{len(sec['problems'])} problems at {T}:**",
            "",
            _table(
                ["prompt", "round", "problem"],
                [[f["prompt"], f["round"], f["problem"]] for f in sec["problems"][:20]],
            ),
            "",
        ]
    return out


def _contention_md(mi: dict) -> list[str]:
    """Say so when other work was running: it competes with the timings."""
    start = mi.get("load_average_start")
    cpus = mi.get("usable_cpus") or 1
    if not start or start[0] < 0.5 * cpus:
        return []
    return [
        "",
        f"**Note: the machine was busy.** The 1-minute load average was {start[0]:.1f} on "
        f"{cpus} CPUs before the benchmark started; other processes competed with every timing "
        "below (baseline and DFlash alike, as they alternate), so absolute times are inflated and "
        "noisier than on an idle machine.",
    ]


def _profiles_md(profiles: list[dict]) -> list[str]:
    out = [
        "## Cost profile of real shapes (random weights, this backend)",
        "",
        "Random-weight programs of published Qwen3 shapes (vocab 151936, block 16, 5 target-layer "
        "taps, a 5-layer draft as in the b16 recipe), exported without compilation and timed per "
        "call through the runtime (medians over all calls of a kind after a warm-up round). "
        "Predicted speedup at τ = τ·T_decode / (T_verify + T_draft [+ host time per step]). "
        "When built with fewer layers than the real model, the full-depth estimate adds, for each "
        "missing layer, the per-layer kernel time ONNX Runtime's node profiler measured for that "
        "kind of call (an estimate, not a measurement).",
        "",
    ]
    for p in profiles:
        s, b = p["shape"], p["built"]
        pc = p["per_call_s"]
        f = p["full_depth"]
        head = ["call", "ms (median, IQR)", "weight bytes read"]
        if f:
            head += ["ms per layer (profiler)", f"ms at full depth ({f['target_layers']} layers)"]
        rows = []
        for kind, prog, label in (
            ("decode", "target", "decode"),
            ("verify", "target", "verify (B=16)"),
            ("draft", "draft", "draft"),
        ):
            row = [label, _iqr(pc[kind]), _bytes(p["weight_bytes"][prog]["read_bytes"])]
            if f:
                row += [_ms(f["layer_s"][kind]), _ms(f["per_call_s"][kind])]
            rows.append(row)
        out += [
            f"### {p['spec']}: H {s['H']}, {b['target_layers']}/{s['L']} target layers, "
            f"{b['draft_layers']} draft layers, ctx_len {p['ctx_len']}",
            "",
            _table(head, rows),
            "",
            f"Host time per step {_ms(p['host_per_step_s'])} ms; break-even τ as built "
            f"{p['break_even_tau']:.2f}"
            + (f", at full depth {f['break_even_tau']:.2f}" if f else "")
            + f"; build {p['build_s']:.0f} s."
            + (f" {p['full_depth_missing']}." if p.get("full_depth_missing") else ""),
            "",
        ]
        head = ["τ", *(f"{r['tau']:.0f}" for r in p["predicted"])]
        rows = [
            ["as built: bound", *(f"{r['bound']:.2f}" for r in p["predicted"])],
            ["as built: with host", *(f"{r['with_host']:.2f}" for r in p["predicted"])],
        ]
        if f:
            rows += [
                [
                    f"full depth ({f['target_layers']} layers), estimated: with host",
                    *(f"{r['with_host']:.2f}" for r in f["predicted"]),
                ]
            ]
        out += [_table(head, rows), ""]
    return out


# ---------------------------------------------------------------------------- PNG


_COLORS = ("#4c72b0", "#55a868", "#8172b2", "#937860", "#da8bc3", "#8c8c8c")
_MARKERS = ("o", "s", "^", "v", "P", "X")


def render_png(res: dict, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    B = res["acceptance"]["block_size"]
    secs = [s for s in res.get("temperatures") or [] if s["status"] == "measured"]
    if not secs:  # results without per-temperature sections: the top level alone
        secs = [
            {
                "temperature": res.get("primary_temperature", 0.0),
                "aggregate": res["aggregate"],
                "acceptance": res["acceptance"],
                "prompts": res["prompts"],
            }
        ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(secs)
    for k, sec in enumerate(secs):
        hist = sec["acceptance"]["histogram"]
        total = sum(hist) or 1
        ax1.bar(
            [L - 0.4 + width * (k + 0.5) for L in range(1, B + 1)],
            [h / total for h in hist],
            width=width,
            color=_COLORS[k % len(_COLORS)],
            label=f"{_temp(sec['temperature'])}: τ = {sec['aggregate']['tau']:.2f}, "
            f"{sum(hist)} steps",
        )
    ax1.set_xlabel("tokens committed per step (acceptance length)")
    ax1.set_ylabel("share of steps")
    ax1.set_title("Acceptance histogram")
    ax1.set_xticks(range(1, B + 1))
    ax1.legend(fontsize=8)

    curve = res["bound"]["curve"]
    ax2.plot(
        [c["tau"] for c in curve],
        [c["bound"] for c in curve],
        color="#dd8452",
        label=f"bound τ·T_decode/(T_verify+T_draft) "
        f"({_temp(res.get('primary_temperature', 0.0))} call times)",
    )
    ax2.axhline(1.0, color="grey", lw=0.8, ls=":")
    for k, sec in enumerate(secs):
        color, marker = _COLORS[k % len(_COLORS)], _MARKERS[k % len(_MARKERS)]
        ps = sec["prompts"]
        ax2.errorbar(
            [p["tau"] for p in ps],
            [p["speedup"]["median"] for p in ps],
            yerr=[
                [p["speedup"]["median"] - p["speedup"]["min"] for p in ps],
                [p["speedup"]["max"] - p["speedup"]["median"] for p in ps],
            ],
            fmt=marker,
            color=color,
            ms=4,
            alpha=0.8,
            label=f"{_temp(sec['temperature'])}, per prompt",
        )
        ag = sec["aggregate"]
        ax2.plot(
            [ag["tau"]],
            [ag["speedup"]["median"]],
            "D",
            color=color,
            mec="#c44e52",
            mew=2,
            ms=9,
            zorder=5,
            label=f"{_temp(sec['temperature'])}, all prompts",
        )
    for p in res["profiles"]:
        pr = p["full_depth"]["predicted"] if p["full_depth"] else p["predicted"]
        ax2.plot(
            [r["tau"] for r in pr],
            [r["with_host"] for r in pr],
            ls="--",
            lw=1,
            label=f"{p['spec']} predicted{' (full depth, estimated)' if p['full_depth'] else ''}",
        )
    ax2.set_xlabel("mean acceptance length τ")
    ax2.set_ylabel("speedup over target-only decoding")
    ax2.set_title("Speedup against τ")
    ax2.set_xlim(0.8, B + 0.2)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- output


def _clean(obj):
    """JSON-safe: NaN and infinities become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_outputs(res: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "report.md", "png": out / "report.png"}
    write_json_atomic(paths["json"], _clean(res))
    md = render_markdown(res)
    _atomic_write(paths["md"], lambda p: Path(p).write_text(md))
    _atomic_write(paths["png"], lambda p: render_png(res, p))
    return paths


def _machine_md(mi: dict, command: str) -> list[str]:
    vers = ", ".join(f"{k} {v}" for k, v in mi["versions"].items() if v)
    return [
        "## Machine",
        "",
        f"- CPU: {mi['cpu']}; {mi['logical_cpus']} logical CPUs, {mi['usable_cpus']} usable; "
        f"last-level cache {_bytes(mi.get('last_level_cache_bytes') or 0)}; memory "
        f"{_bytes(mi['memory_bytes'] or 0)}",
        f"- ONNX Runtime intra-op threads: {mi['ort_threads']}",
        f"- load average (1, 5, 15 min) at start {mi.get('load_average_start')}, at end "
        f"{mi.get('load_average_end')}",
        f"- {mi['platform']}, Python {mi['python']}",
        f"- versions: {vers}",
        f"- command: `{command}`",
        "",
    ]


def render_profile_png(res: dict, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in res["profiles"]:
        pr = p["predicted"]
        (line,) = ax.plot(
            [r["tau"] for r in pr], [r["with_host"] for r in pr], label=f"{p['spec']} as built"
        )
        if p["full_depth"]:
            fd = p["full_depth"]["predicted"]
            ax.plot(
                [r["tau"] for r in fd],
                [r["with_host"] for r in fd],
                ls="--",
                color=line.get_color(),
                label=f"{p['shape']['name']} full depth (estimated)",
            )
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("mean acceptance length τ")
    ax.set_ylabel("predicted speedup")
    ax.set_title("Predicted speedup from measured per-call costs")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_profile_outputs(res: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """The cost profile alone (no artifacts given)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "report.md", "png": out / "report.png"}
    write_json_atomic(paths["json"], _clean(res))
    md = "\n".join(
        [
            "# dflash-bench cost profile",
            "",
            f"- command: `{res['command']}`",
            f"- started {res['started']}, took {res['seconds']:.0f} s",
            "",
            *_profiles_md(res["profiles"]),
            *_machine_md(res["machine"], res["command"]),
            "![report](report.png)",
            "",
        ]
    )
    _atomic_write(paths["md"], lambda p: Path(p).write_text(md))
    _atomic_write(paths["png"], lambda p: render_profile_png(res, p))
    return paths
