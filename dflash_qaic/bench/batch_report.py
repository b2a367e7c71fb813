"""Render the continuous-batching benchmark (batch.py): results.json, report.md (prose in
batch_report.md.tmpl, the summary screen first) and report.png."""

from __future__ import annotations

from pathlib import Path
from string import Template

from dflash_qaic.bench import report, upstream
from dflash_qaic.bench.report import chunks, machine_md, ms, sp, x_

SCHEMA = "dflash-bench-batch/1"
TEMPLATE = Path(__file__).with_name("batch_report.md.tmpl")
MODES = ("dflash", "baseline")
LABEL = {"dflash": "DFlash", "baseline": "target alone"}

tps = lambda x: sp(x, "{:.1f}".format)  # noqa: E731
ratio = lambda x: "—" if x is None else sp(x, x_)  # noqa: E731
bound = lambda b: "—" if b is None else x_(b)  # noqa: E731
policy_name = lambda p: "None (all waiting prompts)" if p is None else str(p)  # noqa: E731


def problems(res: dict) -> list[str]:
    """Requests whose tokens differ from their solo run."""
    return res["equality"]["problems"]


def equality_text(e: dict) -> str:
    ok = "" if e["passed"] else " — TOKENS DIFFER"
    return f"requests equal to their solo run: {e['equal']}/{e['total']}{ok}"


def _latency(x: dict) -> str:
    """TTFT p50/p95, TPOT p50/p95 in ms."""
    t, p = x["ttft_s"], x["tpot_s"]
    return f"{ms(t['p50'])}/{ms(t['p95'])} {ms(p['p50'])}/{ms(p['p95'])}"


def _budget(x: dict) -> str:
    """Where a batch's wall time went: kind calls×ms share, then the host's share."""
    return " · ".join(
        f"{k} {v['share']:.0%}"
        if k == "host"
        else f"{k} {v['calls_per_batch']:.0f}×{ms(v['call_s'])} {v['share']:.0%}"
        for k, v in _ordered(x["budget"])
    )


def _ordered(budget: dict) -> list:
    return sorted(budget.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else 99)


ORDER = ("prefill", "draft_prefill", "verify", "draft", "decode", "host")


def summary_screen(res: dict) -> str:
    """One screen: equality, throughput per concurrency, latency, the admission policies and
    where a batch's wall time goes at every concurrency."""
    a, c, m, pts = res["artifacts"], res["config"], res["machine"], res["points"]
    out = [
        f"dflash-bench --concurrency {a['path']} ({a['backend']}, block {a['block_size']}, "
        f"ctx_len {a['ctx_len']}, full_batch_size {a['full_batch_size']})",
        f"T = {c['temperature']:g} · {c['repeats']} rounds × {c['max_new_tokens']} tokens per "
        f"request · {m.get('ort_threads', m['threads']) or 'default'} threads · load average {m['load_start'][0]:.2f} → "
        f"{m['load_end'][0]:.2f}",
        equality_text(res["equality"]),
        f"{'c':>3}  {'DFlash tokens/s':<24}{'target tokens/s':<24}{'DFlash÷target':<22}"
        f"{'(bound)':<9}{'(steps)':<9}{'vs c=1 DFlash, target':<24}τ",
    ]
    for p in pts:
        d, b, r = p["modes"]["dflash"], p["modes"]["baseline"], p["ratios"]
        v = r["vs_c1"]
        vs = "—" if v["dflash"] is None else f"{v['dflash']['median']:.2f}×, "
        vs += "" if v["baseline"] is None else f"{v['baseline']['median']:.2f}×"
        out.append(
            f"{p['concurrency']:>3}  {tps(d['tokens_per_s']):<24}{tps(b['tokens_per_s']):<24}"
            f"{ratio(r['dflash_vs_target']):<22}{bound(r['bound']):<9}"
            f"{bound(r.get('steps')):<9}{vs:<24}{d['tau']:.2f}"
        )
    out.append("per request, ms: TTFT p50/p95 TPOT p50/p95 — DFlash | target alone")
    out += [
        f"{p['concurrency']:>3}  {_latency(p['modes']['dflash'])} | "
        f"{_latency(p['modes']['baseline'])}"
        for p in pts
    ]
    pol = res["policy"]
    out.append(
        f"admission at c={pol['concurrency']} (prefill_chunks_per_step): TTFT p50/p95 "
        "TPOT p50/p95 ms — DFlash | target alone"
    )
    for x in pol["policies"]:
        name = str(x["prefill_chunks_per_step"]) + (" (default)" if x["default"] else "")
        d, b = x["modes"]["dflash"], x["modes"]["baseline"]
        out.append(f"  {name:<12} {_latency(d)} | {_latency(b)}")
    out += upstream.summary_lines(res)  # --peers vllm
    out.append("a batch's wall time: calls × ms per call, share")
    out += [
        f"{p['concurrency']:>3}  {LABEL[m]}: {_budget(p['modes'][m])}" for p in pts for m in MODES
    ]
    return "\n".join(out)


# ---------------------------------------------------------------------------- markdown


def equality_md(res: dict) -> str:
    e = res["equality"]
    text = equality_text(e) + "."
    more = e["problems"][:20]
    return text + ("\n\n" + "\n".join(f"- {p}" for p in more) if more else "")


def render_markdown(res: dict) -> str:
    a, c = res["artifacts"], res["config"]
    return Template(TEMPLATE.read_text(encoding="utf-8")).substitute(
        equality=equality_md(res),
        upstream=upstream.section_md(res),
        machine=machine_md(res),
        **report.run_fields(res, summary_screen(res)),
        artifacts=f"`{a['path']}` on `{a['backend']}`: full_batch_size {a['full_batch_size']}, "
        f"block {a['block_size']}, ctx_len {a['ctx_len']}, prefill chunks {chunks(a)}, "
        f"target {a['target']['n_layers']} layers, draft {a['draft']['n_layers']}",
        prompts=f"{len(c['prompts'])} from {c['prompts_source']}",
        concurrency=", ".join(map(str, c["concurrency"])),
        repeats=c["repeats"],
        warmup=c["warmup"],
        max_new_tokens=c["max_new_tokens"],
        temperature=f"{c['temperature']:g}",
        default_policy=policy_name(res["policy"]["default"]),
    )


# ---------------------------------------------------------------------------- plot


def render_png(res: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = res["points"]
    cs = [p["concurrency"] for p in pts]
    vs = upstream.ratio_rows(res)  # --peers vllm: a third panel of bars
    fig, axes = plt.subplots(1, 3 if vs else 2, figsize=(18 if vs else 12, 4.6))
    ax1, ax2 = axes[:2]
    if vs:
        upstream.bar_panel(axes[2], res)
    for k, m in enumerate(MODES):
        x = [p["modes"][m]["tokens_per_s"] for p in pts]
        med = [v["median"] for v in x]
        err = [[v["median"] - v["min"] for v in x], [v["max"] - v["median"] for v in x]]
        ax1.errorbar(cs, med, yerr=err, marker="o", color=f"C{k}", capsize=3, label=LABEL[m])
        if cs[0] == 1:  # perfect scaling from one request
            ax1.plot(cs, [med[0] * c for c in cs], ":", color=f"C{k}", lw=1)
        tp = [p["modes"][m]["tpot_s"] for p in pts]
        ax2.plot(cs, [v["p50"] * 1e3 for v in tp], "o-", color=f"C{k}", label=f"{LABEL[m]} p50")
        ax2.plot(cs, [v["p95"] * 1e3 for v in tp], "s--", color=f"C{k}", label=f"{LABEL[m]} p95")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent requests")
        ax.legend(fontsize=8)
    T = res["config"]["temperature"]
    ax1.set(ylabel="aggregate tokens/s", title=f"Aggregate throughput, T = {T:g} (dotted: c × c=1)")
    ax2.set(ylabel="ms per output token", title="Per-request TPOT")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(res: dict, out: Path) -> dict[str, Path]:
    return report.write_outputs(res, out, render_markdown, render_png)
