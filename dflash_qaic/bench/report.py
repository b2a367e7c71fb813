"""Render: results.json, report.md (prose in report.md.tmpl, one short function per section, the
summary screen first) and report.png."""

from __future__ import annotations

import json
import math
from pathlib import Path
from string import Template

SCHEMA = "dflash-bench/2"
TEMPLATE = Path(__file__).with_name("report.md.tmpl")
PARTS = ("weights_s", "cache_s", "sampler_s", "fixed_s")
STATE = "state_s"  # a hybrid target's recurrent state: after the cache part, where present
COLORS = {**{k: f"C{i + 3}" for i, k in enumerate(PARTS)}, STATE: f"C{len(PARTS) + 3}"}
PEER_LABELS = {
    "reference_dflash": "reference `dflash_generate` (PyTorch eager), DFlash",
    "reference_target": "reference `dflash_generate`, block_size=1 (its target-only loop)",
    "hf_generate": "Hugging Face `generate`, target alone",
}


# formatting (milliseconds, a ratio, bytes, a section's temperature); the measured sections
ms = lambda s: "—" if s is None else f"{s * 1e3:.2f}"  # noqa: E731
x_ = lambda v: f"{v:.2f}×"  # noqa: E731
mb = lambda n: f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.2f} kB"  # noqa: E731
temp = lambda s: f"T = {s['temperature']:g}"  # noqa: E731
measured = lambda res: [s for s in res["temperatures"] if s["status"] == "measured"]  # noqa: E731


def parts(calls: dict) -> tuple[str, ...]:
    """The profile's parts: PARTS, with the state part after the cache when a call has one."""
    if not any(STATE in c for c in calls.values()):
        return PARTS
    return (*PARTS[:2], STATE, *PARTS[2:])


def sp(x: dict, f=lambda v: f"{v:.2f}") -> str:
    """median [min–max]"""
    return f"{f(x['median'])} [{f(x['min'])}–{f(x['max'])}]"


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def problems(res: dict) -> list[str]:
    """Where DFlash's tokens differ from the target's at T = 0 (the lossless check), the
    --compare draft's too."""
    out = [p for s in measured(res) if s["temperature"] == 0 for p in s["problems"]]
    if c := res.get("compare"):
        path = c["artifacts"]["path"]
        out += [f"{path}: {p}" for s in measured(c) if s["temperature"] == 0 for p in s["problems"]]
    return out


def draft_summary(a: dict, sections: list[dict]) -> dict:
    """One draft's row of the side-by-side comparison (results' "drafts"): its form, artifacts,
    block and source, and per temperature τ, speedup and check (or why it was skipped)."""
    keep = ("tau", "speedup", "check", "problems")
    per = [
        {"temperature": s["temperature"], "status": s["status"]}
        | ({k: s[k] for k in keep} if s["status"] == "measured" else {"note": s.get("note")})
        for s in sections
    ]
    return {
        "form": a.get("draft_form"),
        "path": a["path"],
        "block_size": a["block_size"],
        "draft": a["sources"]["draft"],
        "temperatures": per,
    }


def draft_label(d: dict) -> str:
    """A draft by its form and artifacts directory, e.g. "DFlash-2 (artifacts/default-dflash2)"."""
    return f"{d['form'] or 'draft'} ({d['path']})"


def _side(s: dict) -> tuple[str, str, str]:
    """(τ, speedup, check) of one draft at one temperature."""
    if s["status"] != "measured":
        return "—", "—", f"skipped: {s['note']}"
    return f"{s['tau']:.2f}", sp(s["speedup"], x_), check_text(s)


def check_text(s: dict) -> str:
    c = s["check"]
    if c["kind"] == "lossless":
        return "tokens identical" if c["passed"] else f"TOKENS DIFFER ({len(s['problems'])})"
    return f"histograms p = {c['p_permutation']:.2f}"


def summary_screen(res: dict) -> str:
    """One screen: per temperature speedup, τ, tokens/s, bound, check; then where time goes."""
    a, c, m, secs = res["artifacts"], res["config"], res["machine"], measured(res)
    out = [
        f"dflash-bench {a['path']} ({a['backend']}, block {a['block_size']}, ctx_len "
        f"{a['ctx_len']}) · {c['num_prompts']} prompts × {c['repeats']} rounds × "
        f"{c['max_new_tokens']} tokens · {threads(m)} · load average "
        f"{m['load_start'][0]:.2f} → {m['load_end'][0]:.2f}"
    ]
    rows = {
        "": temp,
        "speedup (decode)": lambda s: sp(s["speedup"], x_),
        "τ": lambda s: f"{s['tau']:.2f}",
        "steps drafted": lambda s: (  # the step policy's choices (--spec-policy)
            f"{s['drafted_share']:.0%}" if s.get("drafted_share") is not None else "—"
        ),
        "verify rows per step": lambda s: (
            f"{s['loop']['verify_rows']:.1f}" if s["loop"].get("verify_rows") else "—"
        ),
        "tokens/s DFlash": lambda s: f"{s['modes']['dflash']['tokens_per_s']['median']:.1f}",
        "tokens/s target alone": lambda s: (
            f"{s['modes']['baseline']['tokens_per_s']['median']:.1f}"
        ),
        "bound (measured share)": lambda s: (
            f"{x_(s['loop']['bound'])} ({s['loop']['fraction_of_bound']:.0%})"
        ),
        "check": check_text,
    }
    out += [f"{k:<24}" + "".join(f"{f(s):<26}" for s in secs) for k, f in rows.items()]
    if drafts := res.get("drafts"):  # --compare: per draft and temperature τ, speedup, check
        grid = [["drafts side by side", *(temp(s) for s in drafts[0]["temperatures"])]]
        for d in drafts:
            cells = [_side(s) for s in d["temperatures"]]
            grid.append([draft_label(d), *(f"τ {t} · {x.split()[0]} · {c}" for t, x, c in cells)])
        widths = [max(len(r[i]) for r in grid) + 2 for i in range(len(grid[0]))]
        out += ["".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip() for r in grid]
    out += _trees_grid(res)
    for L in (s["loop"] for s in secs if s["temperature"] == 0):
        out.append(
            f"a DFlash step (T = 0): verify {ms(L['verify_s'])}"
            + (f" ({L['verify_rows']:.1f} rows)" if L.get("verify_rows") else "")
            + f" + draft {ms(L['draft_s'])} + host "
            f"{ms(L['host_per_step_s'])} = {ms(L['step_s'])} ms for {L['tau']:.2f} tokens; "
            f"a target-only token {ms(L['token_s'])} ms"
        )
    pe = res["peers"]
    if "systems" in pe:
        ref = pe["systems"]["reference_dflash"]["tokens_per_s"]
        greedy = next(s for s in secs if s["temperature"] == 0)
        ours = greedy["modes"]["dflash"]["tokens_per_s"]["median"]
        out.append(
            f"reference dflash_generate {ref:.1f} tokens/s: ours {ours / ref:.2f}× it (its own "
            f"speedup {x_(pe['reference_speedup'])}); HF generate "
            f"{pe['systems']['hf_generate']['tokens_per_s']:.1f} tokens/s"
        )
    p = res["profile"]
    if "calls" not in p:
        return "\n".join([*out, f"cost profile: {p['skipped']}"])
    keys = parts(p["calls"])
    names = " + ".join(k[:-2] for k in keys)
    out.append(f"one call at ctx_len {p['ctx_len']}, ms: total = {names}")
    for kind, c in p["calls"].items():
        terms = " + ".join(ms(c[k]) for k in keys)
        out.append(f"  {kind:<7}{ms(c['sampled_s']):>7} = {terms}")
    return "\n".join(out)


def budget_label(budget) -> str:
    return "auto" if budget is None else ("chain" if budget == 0 else str(budget))


def _tree_cells(t: dict) -> list[str]:
    return [f"τ {a} · {x.split()[0]} · {c}" for a, x, c in map(_side, t["temperatures"])]


def _trees_grid(res: dict) -> list[str]:
    """--tree-budgets: per draft and budget, τ · speedup · check at each temperature."""
    trees = res.get("trees")
    if not trees:
        return []
    grid = [["tree budgets", "", *(temp(s) for s in trees[0]["temperatures"])]]
    grid += [[t["draft"], budget_label(t["budget"]), *_tree_cells(t)] for t in trees]
    widths = [max(len(r[i]) for r in grid) + 2 for i in range(len(grid[0]))]
    return ["".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip() for r in grid]


def trees_md(res: dict) -> str:
    """The --tree-budgets section ("" without it)."""
    trees = res.get("trees")
    if not trees:
        return ""
    head = ["draft", "tree budget"]
    for s in trees[0]["temperatures"]:
        head += [f"{temp(s)} τ", f"{temp(s)} speedup", f"{temp(s)} verify rows", f"{temp(s)} check"]
    rows = []
    for t in trees:
        cells = []
        for s in t["temperatures"]:
            tau, x, check = _side(s)
            rows_ = s.get("loop", {}).get("verify_rows")
            cells += [tau, x, f"{rows_:.1f}" if rows_ else "—", check]
        rows.append([t["draft"], budget_label(t["budget"]), *cells])
    return (
        f"## Tree verification\n\n{table(head, rows)}\n\nDFlash on the tree programs at each "
        "budget (chain: the same program verifying chains; auto: the size picked per step from "
        "the trees' expected tokens and the measured call costs), each run against the target "
        "alone of its own round (docs/DESIGN.md, Tree verification).\n"
    )


def speed_md(res: dict) -> str:
    rows = []
    for s in measured(res):
        for mode, label in (("baseline", "target alone"), ("dflash", "DFlash")):
            x = s["modes"][mode]
            tps, host = sp(x["tokens_per_s"], "{:.1f}".format), sp(x["host_share"], "{:.0%}".format)
            rows.append([temp(s), label, sp(x["ttft_s"], ms), sp(x["tpot_s"], ms), tps, host])
            rows[-1].append(mb(x["bytes_per_step"]))
        rows.append([temp(s), f"**speedup {sp(s['speedup'], x_)}**", "", "", "", "", ""])
    head = ["", "", "TTFT ms", "TPOT ms", "tokens/s", "host share", "bytes / step"]
    skipped = [f"\n{temp(s)} skipped: {s['note']}." for s in res["temperatures"] if "note" in s]
    return table(head, rows) + "".join(skipped)


def acceptance_md(res: dict) -> str:
    B, rows, per = res["artifacts"]["block_size"], [], []
    for s in measured(res):
        total = sum(s["histogram"]) or 1
        rows.append([f"{temp(s)}: length = k"] + [f"{h / total:.2f}" for h in s["histogram"]])
        survival = [1.0] + s["position_acceptance"] if s["steps"] else [0.0] * B
        rows.append([f"{temp(s)}: length ≥ k"] + [f"{v:.2f}" for v in survival])
        for p in s["prompts"]:
            tpot = [ms(p["tpot_s"][m]) for m in ("baseline", "dflash")]
            per.append([temp(s), p["name"], p["prompt_tokens"], f"{p['tau']:.2f}", p["steps"]])
            per[-1] += [*tpot, sp(p["speedup"], x_)]
    head = ["", "prompt", "tokens", "τ", "steps", "target TPOT ms", "DFlash TPOT ms", "speedup"]
    hist = table(["share of steps, k =", *map(str, range(1, B + 1))], rows)
    return f"{hist}\n\nPer prompt:\n\n{table(head, per)}"


def drafts_md(res: dict) -> str:
    """The --compare section: both drafts' τ, speedup and check side by side, then the compared
    draft's speed table ("" without --compare)."""
    if "drafts" not in res:
        return trees_md(res)
    drafts, c = res["drafts"], res["compare"]
    head = ["draft", "block"]
    for s in drafts[0]["temperatures"]:
        head += [f"{temp(s)} τ", f"{temp(s)} speedup", f"{temp(s)} check"]
    rows = [
        [draft_label(d), d["block_size"], *(x for s in d["temperatures"] for x in _side(s))]
        for d in drafts
    ]
    other = {**res, "artifacts": c["artifacts"], "temperatures": c["temperatures"]}
    return (
        f"## Drafts side by side\n\n{table(head, rows)}\n\nThe same target, prompts, "
        "temperatures, rounds and seeds; the compared artifacts ran after the benchmarked ones "
        "in this process, and every DFlash run is against the target alone of its own round "
        "(a speedup is a ratio within one draft's runs). The sections after this one are of "
        f"`{res['artifacts']['path']}` only (no cost profile or peers for the compared draft). "
        f"`{c['artifacts']['path']}`, speed:\n\n{speed_md(other)}\n{trees_md(res)}"
    )


def bound_md(res: dict) -> str:
    rows = []
    for s in measured(res):
        L = s["loop"]
        rows.append([temp(s), f"{L['tau']:.2f}"] + [ms(L[k]) for k in BOUND_TERMS])
        rows[-1] += [x_(L["bound"]), x_(L["pooled"]), f"{L['fraction_of_bound']:.0%}"]
        rows[-1].append(f"{L['break_even_tau']:.2f}")
    head = ["", "τ", "T_decode ms", "T_verify ms", "T_draft / step ms", "host / token ms"]
    head += ["host / step ms", "bound", "pooled", "share of bound", "break-even τ"]
    return table(head, rows)


BOUND_TERMS = ("decode_s", "verify_s", "draft_s", "host_per_token_s", "host_per_step_s")


def profile_md(res: dict) -> str:
    p = res["profile"]
    if "calls" not in p:
        return f"Not measured: {p['skipped']}."
    rows, keys = [], parts(p["calls"])
    for kind, c in p["calls"].items():
        t = c["sampled_s"]
        cells = ["—" if c[k] is None else f"{ms(c[k])} ({c[k] / t:.0%})" for k in keys]
        rows.append([kind, ms(c["greedy_s"]), ms(t), *cells])
    note = f"\n\n{p['note']}." if p.get("note") else ""
    head = ["call", "T = 0 ms", "T = 1 ms", *(k[:-2] for k in keys)]
    if STATE in keys:
        n = res["artifacts"]["target"]["state_bytes"]
        note += (
            f"\n\nA hybrid target: state = its Gated DeltaNet layers' recurrent state and conv "
            f"windows ({mb(n)} a sequence), which every target call reads and writes whole "
            f"whatever its position: 2 × {mb(n)} ÷ the copy bandwidth below. It is the same at "
            "both ctx_lens, so the cache part is the full-attention layers' KV cache alone."
        )
    return table(head, rows) + note


def bandwidth_md(res: dict) -> str:
    """Weight bytes a decode call reads ÷ its mean time, against a numpy copy's bandwidth."""
    b, w, llc = res["bandwidth"], res["bandwidth"]["weight_bytes"], res["machine"]["llc_bytes"]
    out = (
        f"A numpy copy moves {b['copy_Bps'] / 1e9:.2f} GB/s (read + write). A decode call reads "
        f"{mb(w['target'])} of target weights, a draft call {mb(w['draft'])}"
    )
    for s in (s for s in measured(res) if s["temperature"] == 0):
        Bps = w["target"] / s["loop"]["decode_s"]
        out += f"; decode reads them at {Bps / 1e9:.2f} GB/s, {Bps / b['copy_Bps']:.1%} of a copy"
    if llc and w["target"] + w["draft"] < llc:
        out += (
            f". Both programs' weights fit in the last-level cache ({mb(llc)}): this "
            "pair is bound by per-call and per-operator overhead, not by memory bandwidth"
        )
    if n := res["artifacts"]["target"].get("state_bytes"):  # a hybrid target
        out += f". Every target call also reads and writes {mb(n)} of recurrent state"
    return out + "."


def peers_md(res: dict) -> str:
    pe = res["peers"]
    if "systems" not in pe:
        return f"Not run: {pe['skipped']}."
    rows = [
        [PEER_LABELS[n], ms(s["ttft_s"]), ms(s["tpot_s"]), f"{s['tokens_per_s']:.1f}"]
        + [f"{s['same_tokens']}/{pe['prompts']}"]
        for n, s in pe["systems"].items()
    ]
    head = ["system", "TTFT ms", "TPOT ms", "tokens/s", "same tokens as ours"]
    return (
        f"{table(head, rows)}\n\nThe reference gains {x_(pe['reference_speedup'])} over its own "
        f"target-only loop at τ {pe['reference_tau']:.2f} (draft: "
        f"`{pe.get('reference_draft', 'DFlashDraftModel')}`). PyTorch threads: "
        f"{pe['torch_threads']}. Medians over the timed rounds."
    )


def distribution_md(res: dict) -> str:
    rows = []
    for s in measured(res):
        c = s["check"]
        if c["kind"] == "histograms":
            rows.append([temp(s), "{}, {}".format(*c["tokens"]), c["distinct_tokens"], c["bins"]])
            rows[-1] += [f"{c['chi2']:.1f}", c["df"], f"{c['p_asymptotic']:.3g}"]
            rows[-1] += [f"{c['p_permutation']:.3f}", f"{c['total_variation']:.3f}"]
    head = ["", "tokens (target, DFlash)", "distinct", "bins", "χ²", "df", "p (asymptotic)"]
    return table([*head, "p (permutation)", "total variation"], rows) if rows else "Not run."


def threads(m: dict) -> str:
    """ONNX Runtime's and PyTorch's threads (ours default to 1 for small programs)."""
    ort = m.get("ort_threads", m["threads"])
    return f"{ort or 'default'} ONNX Runtime thread(s), {m['threads']} PyTorch"


def machine_md(res: dict) -> str:
    m = res["machine"]
    vers = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    return (
        f"- {m['cpu']}; {m['cpus']} usable CPUs; {threads(m)}"
        f"\n- load average (1, 5, 15 min): {m['load_start']} at start, {m['load_end']} "
        f"at end\n- {m['platform']}\n- {vers}"
    )


def render_markdown(res: dict) -> str:
    """The template filled in: the run's settings, then one section function per section."""
    a, c = res["artifacts"], res["config"]
    sections = (speed_md, drafts_md, acceptance_md, bound_md, profile_md, bandwidth_md, peers_md)
    # the settings first: a section of the same name (`peers`: the --peers flag) replaces it
    fields = dict(c) | {f.__name__[:-3]: f(res) for f in (*sections, distribution_md, machine_md)}
    return Template(TEMPLATE.read_text(encoding="utf-8")).substitute(
        fields,
        **run_fields(res, summary_screen(res)),
        artifacts=f"`{a['path']}` on `{a['backend']}`: block {a['block_size']}, ctx_len "
        f"{a['ctx_len']}, prefill chunks {chunks(a)}, H {a['hidden_size']}, vocab "
        f"{a['vocab_size']}, target {a['target']['n_layers']} layers, draft "
        f"{a['draft']['n_layers']}",
        e2e=", ".join(f"{temp(s)} {sp(s['speedup_end_to_end'], x_)}" for s in measured(res)),
        ctx_len=a["ctx_len"],
    )


BUSY = (
    "\n**The machine was busy** (load average ≥ 1 before the run): other processes competed "
    "with every timing. Ratios come from alternating runs in one process, but are noisier.\n"
)


def chunks(artifacts: dict) -> str:
    """The prefill lengths, e.g. "64, 256" (results from before them: the chunk)."""
    return ", ".join(map(str, artifacts.get("prefill_lengths") or [artifacts["prefill_seq_len"]]))


def run_fields(res: dict, summary: str) -> dict:
    """The fields every report's template shares: its screen, the machine's load, and how, when
    and for how long it ran."""
    return dict(
        summary=summary,
        load_note=load_note(res["machine"]),
        command=res["command"],
        started=res["started"],
        seconds=f"{res['seconds']:.0f}",
    )


def load_note(machine: dict) -> str:
    """BUSY when the load before the run says others were using the machine (the load after it
    also counts the benchmark's own threads, which keep a 2-core machine near 1)."""
    return BUSY if machine["load_start"][0] >= 1 else ""


def _speed_panel(ax, s: dict, k: int, B: int) -> None:
    """Per-prompt dots, the all-prompt point, the bound and the with-host line of one T."""
    L, c, ps = s["loop"], f"C{k}", s["prompts"]
    for slope, ls, what in ((L["bound"], "-", "bound"), (L["pooled"], ":", "with host time")):
        ax.plot([0, B], [0, B * slope / L["tau"]], ls=ls, color=c, label=f"{temp(s)} {what}")
    ax.plot([p["tau"] for p in ps], [p["speedup"]["median"] for p in ps], "o", color=c, ms=4)
    ax.plot([s["tau"]], [s["speedup"]["median"]], "D", color=c, mec="k", ms=9, label=temp(s))


def bar_segments(call: dict) -> list[tuple[str, float, float]]:
    """(part, bottom, height) in ms of one call's stacked bar: the positive parts upward from 0,
    then the negative ones (a part below the noise) downward, so the bar ends at the total."""
    vals = [(k, (call[k] or 0.0) * 1e3) for k in parts({"": call})]
    out, top = [], 0.0
    for k, v in [x for x in vals if x[1] > 0] + [x for x in vals if x[1] < 0]:
        out.append((k, top, v))
        top += v
    return out


def _profile_panel(ax, p: dict) -> None:
    seen = set()
    for x, call in p["calls"].items():
        for k, bottom, h in bar_segments(call):
            label = None if k in seen else k[:-2]
            seen.add(k)
            color, hatch = COLORS[k], "//" if h < 0 else None
            ax.bar(x, h, bottom=bottom, color=color, hatch=hatch, label=label)
        ax.plot(x, call["sampled_s"] * 1e3, "k_", ms=30, label=None if seen & {"_"} else "total")
        seen.add("_")
    ax.set(ylabel="ms per call (hatched: negative parts)")
    ax.set_title(f"Cost of one call at ctx_len {p['ctx_len']}")


def render_png(res: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    B, secs = res["artifacts"]["block_size"], measured(res)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    for k, s in enumerate(secs):
        w, share = 0.8 / len(secs), [h / max(s["steps"], 1) for h in s["histogram"]]
        xs = [x - 0.4 + w * (k + 0.5) for x in range(1, B + 1)]
        ax1.bar(xs, share, w, color=f"C{k}", label=f"{temp(s)}: τ = {s['tau']:.2f}")
        _speed_panel(ax2, s, k, B)
    ax1.set(xlabel="tokens committed per step", ylabel="share of steps", title="Acceptance")
    ax2.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax2.set(xlabel="τ (dots: prompts)", ylabel="speedup", title="Speedup against τ (same runs)")
    if "calls" in res["profile"]:
        _profile_panel(ax3, res["profile"])
    else:
        ax3.set_axis_off()
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=7) if ax.get_legend_handles_labels()[0] else None
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _clean(obj):
    """JSON-safe: NaN and infinities become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    return [_clean(v) for v in obj] if isinstance(obj, list | tuple) else obj


def write_outputs(res: dict, out: Path, markdown=None, png=None) -> dict[str, Path]:
    """results.json, report.md and report.png (this report's renderers unless given others)."""
    paths = {"json": out / "results.json", "md": out / "report.md", "png": out / "report.png"}
    paths["json"].write_text(json.dumps(_clean(res), indent=1) + "\n")
    paths["md"].write_text((markdown or render_markdown)(res), encoding="utf-8")
    (png or render_png)(res, paths["png"])
    return paths
