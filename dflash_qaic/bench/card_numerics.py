"""`dflash-bench ARTIFACTS --card-numerics`: τ and tokens under the compile profile's numerics.

    dflash-bench artifacts/default --card-numerics                       # the export's profile
    dflash-bench artifacts/default --card-numerics --card-profile ai100_mxfp6_mxint8
    dflash-export --out artifacts/default --check-card-numerics ai100_mxfp6_mxint8

Runs the exported programs twice: as exported (fp32, ONNX Runtime) and as the card would compute
them under a compile profile (`exporter/card_numerics.py`: MatMul weights in MXFP6 E2M3, K/V
stored in MXINT8, fp16 elsewhere), on the same prompts, greedy, each step verifying the whole
block (as the card's chain does). It reports:

- τ (tokens committed per step) of DFlash in fp32 and under card numerics, and the two mixed
  runs (card target + fp32 draft, fp32 target + card draft), which say which side moved τ: the
  target's tokens (a different path to draft for) or the draft's proposals;
- the agreement of greedy tokens with the fp32 run, for the target alone and for DFlash: the
  first position where they differ, per prompt;
- losslessness against the card-numerics target (not the fp32 one): DFlash's greedy tokens under
  card numerics equal the card-numerics target's own, prompt by prompt;
- at T = 1, a χ² check that DFlash samples the card-numerics target's distribution: pooled tokens
  of DFlash and of the target alone, both under card numerics, over independent seeds
  (`bench/stats.token_distribution_check`: asymptotic and permutation p-values).

Writes OUT/card_numerics.json and OUT/summary.txt (OUT: --out, default bench/card-numerics) and
prints the summary; `dflash-bench --project ai100 --tau-from OUT/card_numerics.json` projects
with its τ. Exits 1 when DFlash under card numerics commits other tokens than the card-numerics
target alone, 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

from dflash_qaic.commands import doc_parser

KIND = "card numerics"  # results' "kind": what the projection's --tau-from recognises
SIDES = ("fp32", "card")


class CardNumericsRunError(ValueError):
    """Bad input to the evaluation: the message names it and the fix."""


def profile_for(manifest: dict, name: str | None = None):
    """The compile profile to model: `name`, else the one the export names (manifest options:
    qpc_config with its mxfp6_matmul / mxint8_kv_cache overrides)."""
    from dflash_qaic.compiler.profiles import CompileOverrides, ProfileError, load_profile

    opts = manifest.get("options") or {}
    try:
        if name:
            return load_profile(name)
        profile = load_profile(opts.get("qpc_config") or "ai100_fp16")
        over = CompileOverrides(
            mxfp6_matmul=opts.get("mxfp6_matmul"), mxint8_kv_cache=opts.get("mxint8_kv_cache")
        )
        return over.apply(profile)
    except ProfileError as e:
        raise CardNumericsRunError(str(e)) from e


def pipelines(artifacts: Path, numerics, threads: int | None = None) -> dict:
    """(target side, draft side) -> Pipeline over the same export: "fp32" programs on ONNX Runtime,
    "card" programs under `numerics`; each verifies whole blocks every step."""
    import dflash_qaic
    from dflash_qaic.exporter.card_numerics import card_programs
    from dflash_qaic.runtime.pipeline import Pipeline

    fp32 = dflash_qaic.load(artifacts, threads=threads)
    card = card_programs(artifacts, fp32.manifest, numerics)
    progs = {"fp32": (fp32.target, fp32.draft), "card": (card["target"], card["draft"])}
    out = {}
    for t in SIDES:
        for d in SIDES:
            pipe = fp32 if t == d == "fp32" else Pipeline(fp32.artifacts, progs[t][0], progs[d][1])
            tree = {"tree_budget": 0} if pipe.plan.tree_budgets else {}
            pipe.configure(verify_lengths=(pipe.B,), **tree)
            out[t, d] = pipe
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy(pipes: dict, prompts, max_new: int, log) -> dict:
    """Every prompt through the target alone (fp32, card) and DFlash (the four side pairs)."""
    kw = dict(max_new_tokens=max_new, stop_token_ids=[])
    rows = []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        row = {"prompt": p.name}
        for side in SIDES:
            row[f"target_{side}"] = pipes[side, side].generate_baseline(p.ids, **kw).tokens
        for t, d in pipes:
            res = pipes[t, d].generate(p.ids, **kw)
            row[f"dflash_{t}_{d}"] = res.tokens
            row[f"lengths_{t}_{d}"] = res.acceptance_lengths
        rows.append(row)
        log(f"card numerics: prompt {i + 1}/{len(prompts)} ({time.perf_counter() - t0:.1f} s)")
    return summarize_greedy(rows)


def summarize_greedy(rows: list[dict]) -> dict:
    """τ per side pair, first divergences and losslessness from the per-prompt runs."""
    tau = {
        f"{t}_{d}": float(np.mean([n for r in rows for n in r[f"lengths_{t}_{d}"]]))
        for t in SIDES
        for d in SIDES
    }
    per_prompt = [
        {
            "prompt": r["prompt"],
            "target_divergence": first_divergence(r["target_card"], r["target_fp32"]),
            "dflash_divergence": first_divergence(r["dflash_card_card"], r["dflash_fp32_fp32"]),
            "lossless_card": r["dflash_card_card"] == r["target_card"],
            "lossless_fp32": r["dflash_fp32_fp32"] == r["target_fp32"],
            "tau_fp32": float(np.mean(r["lengths_fp32_fp32"])),
            "tau_card": float(np.mean(r["lengths_card_card"])),
        }
        for r in rows
    ]

    def agreement(key: str) -> dict:
        divs = [p[key] for p in per_prompt]
        n = len(rows[0]["target_fp32"]) if rows else 0
        return {
            "identical_prompts": sum(d is None for d in divs),
            "prompts": len(divs),
            "first_divergence": divs,
            "mean_agreeing_prefix": float(np.mean([n if d is None else d for d in divs])),
        }

    return {
        "tau": tau,
        "tau_fp32": tau["fp32_fp32"],
        "tau_card": tau["card_card"],
        "moved_by_target": tau["card_fp32"] - tau["fp32_fp32"],
        "moved_by_draft": tau["card_card"] - tau["card_fp32"],
        "target_agreement": agreement("target_divergence"),
        "dflash_agreement": agreement("dflash_divergence"),
        "lossless_card": all(p["lossless_card"] for p in per_prompt),
        "lossless_fp32": all(p["lossless_fp32"] for p in per_prompt),
        "per_prompt": per_prompt,
    }


def head_logits(model) -> str | None:
    """The target's logits: the input of its greedy ArgMax over the head MatMul's output."""
    made_by = {o: n.op_type for n in model.graph.node for o in n.output}
    for n in model.graph.node:
        if n.op_type == "ArgMax" and made_by.get(n.input[0]) == "MatMul":
            return n.input[0]
    return None


def record(pipe, ids: list[int], max_new: int, dflash: bool):
    """(tokens, {position: [(rows of the call, the target's logits there)]}) of one greedy run
    of `pipe` (its target a card-numerics program) alone or with DFlash, in call order."""
    from dflash_qaic import contract

    target = pipe.target
    name = head_logits(target.session.model)
    if name is None:
        raise CardNumericsRunError("the target program has no greedy ArgMax over its head")
    calls, run = [], target.run

    def recording(feeds):
        out = run(feeds)
        # copies: the runtime refills its feed buffers in place, call after call
        calls.append((np.array(feeds[contract.POSITION_IDS]), np.array(target.session.kept[name])))
        return out

    target.session.keep, target.run = {name}, recording
    try:
        go = pipe.generate if dflash else pipe.generate_baseline
        tokens = go(ids, max_new_tokens=max_new, stop_token_ids=[]).tokens
    finally:
        target.session.keep = set()
        del target.run
    at: dict[int, list] = {}
    for pos, logits in calls:
        for r, j in zip(*np.nonzero(pos >= 0)):
            at.setdefault(int(pos[r, j]), []).append((pos.shape[1], logits[r, j]))
    return tokens, at


def margin_at(n: int, base, dfl, alone_calls, dflash_calls) -> dict | None:
    """Where DFlash's tokens `dfl` leave the target alone's `base` (prompt of n tokens), each
    run's choice there with its runner-up and their logit gap, from the last call that computed
    the position (`record`: a Verify row after a rejected proposal comes earlier, in another
    context); None when they agree."""
    d = first_divergence(base, dfl)
    if d is None or d >= min(len(base), len(dfl)):
        return None
    P = n + d - 1  # the position whose logits choose token d

    def choice(calls) -> dict:
        rows, logits = calls[P][-1]
        top = np.argsort(logits)[::-1][:2]
        gap = float(logits[top[0]] - logits[top[1]])
        return {"rows": rows, "choice": int(top[0]), "runner_up": int(top[1]), "gap": gap}

    return {"token": d, "position": P, "alone": choice(alone_calls), "dflash": choice(dflash_calls)}


def margins(pipe, prompts, rows: list[dict], max_new: int, log) -> list[dict]:
    """For every prompt DFlash is not lossless on (under card numerics), the two choices at
    the divergence and their top-2 logit gaps (`margin_at`): an fp16 near-tie between call
    shapes shows as two small gaps of opposite sign."""
    out = []
    for p, r in zip(prompts, rows):
        if r["lossless_card"]:
            continue
        base, alone = record(pipe, p.ids, max_new, dflash=False)
        dfl, spec = record(pipe, p.ids, max_new, dflash=True)
        m = margin_at(len(p.ids), base, dfl, alone, spec)
        out.append({"prompt": p.name, **(m or {})})
        log(f"card numerics: the divergence on {p.name} measured")
    return out


def sampled(pipe, prompts, seeds: int, tokens: int, log) -> dict:
    """T = 1: DFlash and the target alone (both under card numerics), `seeds` independent runs
    per prompt of `tokens` tokens each; the χ² check of their pooled tokens."""
    from dflash_qaic.bench import stats
    from dflash_qaic.bench.run import sample_seed

    if not pipe.can_sample:
        return {"ran": False, "reason": "the artifacts were exported without sampling"}
    kw = dict(max_new_tokens=tokens, stop_token_ids=[], temperature=1.0)
    pairs = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        for s in range(seeds):
            base = pipe.generate_baseline(p.ids, seed=sample_seed(s, 1.0, i, 0, "baseline"), **kw)
            spec = pipe.generate(p.ids, seed=sample_seed(s, 1.0, i, 0, "dflash"), **kw)
            pairs.append((base.tokens, spec.tokens))
    log(f"card numerics: T = 1, {len(pairs)} pairs ({time.perf_counter() - t0:.1f} s)")
    check = stats.token_distribution_check(pairs)
    return {"ran": True, "temperature": 1.0, "tokens_per_run": tokens, **check}


def evaluate(
    artifacts,
    profile=None,
    *,
    prompts_path=None,
    num_prompts: int = 12,
    max_new: int = 128,
    chi2_prompts: int = 2,
    chi2_seeds: int = 100,
    chi2_tokens: int = 8,
    threads: int | None = None,
    log=lambda msg: None,
) -> dict:
    """The whole evaluation of an export (see the module docstring); profile: a compile
    profile's name (None: the export's own)."""
    from dflash_qaic.bench.run import facts, select_prompts
    from dflash_qaic.exporter.card_numerics import CardNumerics, CardNumericsError

    if chi2_seeds > 0 and importlib.util.find_spec("scipy") is None:
        raise CardNumericsRunError(
            "the T = 1 χ² check needs scipy: pip install 'dflash-qaic[bench]' (or skip it)"
        )
    artifacts = Path(artifacts)
    manifest = json.loads((artifacts / "manifest.json").read_text(encoding="utf-8"))
    prof = profile_for(manifest, profile)
    try:
        numerics = CardNumerics.from_profile(prof)
    except CardNumericsError as e:
        raise CardNumericsRunError(str(e)) from e
    pipes = pipelines(artifacts, numerics, threads)
    fp32 = pipes["fp32", "fp32"]
    prompts, source = select_prompts(
        facts(fp32, artifacts), fp32.tokenizer, max_new, prompts_path, num_prompts
    )
    log(f"card numerics: {numerics.describe()}; {len(prompts)} prompts ({source})")
    out = {
        "kind": KIND,
        "artifacts": str(artifacts),
        "profile": prof.name,
        "numerics": numerics.describe(),
        "weights_format": numerics.weights,
        "kv_format": numerics.kv,
        "prompts": {"source": source, "count": len(prompts), "max_new_tokens": max_new},
        "verify": f"whole block ({fp32.B}) every step",
    }
    out["greedy"] = g = greedy(pipes, prompts, max_new, log)
    g["margins"] = margins(pipes["card", "card"], prompts, g["per_prompt"], max_new, log)
    if chi2_seeds > 0:
        card = pipes["card", "card"]
        out["sampled"] = sampled(card, prompts[:chi2_prompts], chi2_seeds, chi2_tokens, log)
    return out


def summary(r: dict) -> str:
    g = r["greedy"]
    ta, da = g["target_agreement"], g["dflash_agreement"]
    n = r["prompts"]["max_new_tokens"]

    def divs(a):
        return ", ".join("=" if d is None else str(d) for d in a["first_divergence"])

    lines = [
        f"CARD NUMERICS ({r['numerics']}); {r['prompts']['count']} prompts × {n} tokens, "
        f"greedy, {r['verify']}",
        f"  τ fp32 {g['tau_fp32']:.2f}  →  card {g['tau_card']:.2f}  "
        f"(Δ {g['tau_card'] - g['tau_fp32']:+.2f}: target side {g['moved_by_target']:+.2f}, "
        f"draft side {g['moved_by_draft']:+.2f})",
        "  τ by (target, draft) numerics: "
        + ", ".join(f"{k.replace('_', '+')} {v:.2f}" for k, v in g["tau"].items()),
        f"  target alone vs fp32: {ta['identical_prompts']}/{ta['prompts']} prompts identical; "
        f"first divergence per prompt (= none): {divs(ta)}",
        f"  DFlash vs fp32 DFlash: {da['identical_prompts']}/{da['prompts']} identical; "
        f"first divergence: {divs(da)}",
        f"  lossless against the card-numerics target: {'yes' if g['lossless_card'] else 'NO'}"
        f" (fp32: {'yes' if g['lossless_fp32'] else 'NO'})",
    ]
    for m in g.get("margins", []):
        if "token" not in m:
            continue
        a, d = m["alone"], m["dflash"]
        lines.append(
            f"  {m['prompt']}: DFlash leaves the target alone at token {m['token']} (position "
            f"{m['position']}): alone ({a['rows']}-row call) {a['choice']} over "
            f"{a['runner_up']} by {a['gap']:.4g}, DFlash ({d['rows']}-row call) {d['choice']} "
            f"over {d['runner_up']} by {d['gap']:.4g}"
        )
    s = r.get("sampled")
    if s and s.get("ran"):
        lines.append(
            f"  T = 1, DFlash vs the card-numerics target alone: χ² {s['chi2']:.1f}, df "
            f"{s['df']}, p {s['p_asymptotic']:.3g} (permutation p {s['p_permutation']:.3g}), "
            f"{s['pairs']} run pairs × {s['tokens_per_run']} tokens"
        )
    elif s:
        lines.append(f"  T = 1: not run ({s['reason']})")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the command line


def parser() -> argparse.ArgumentParser:
    p = doc_parser("dflash-bench ARTIFACTS --card-numerics", __doc__)
    p.add_argument("--card-profile", help="compile profile to model (default: the export's)")
    p.add_argument("--prompts", help="prompts file (default: as dflash-bench)")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chi2-prompts", type=int, default=2, help="prompts of the T = 1 check")
    p.add_argument("--chi2-seeds", type=int, default=100, help="runs per prompt (0: skip)")
    p.add_argument("--chi2-tokens", type=int, default=8, help="tokens per T = 1 run")
    p.add_argument("--threads", type=int, help="ONNX Runtime threads of the fp32 programs")
    p.add_argument("--out", default="bench/card-numerics", help="output directory")
    p.add_argument("--debug", action="store_true", help="tracebacks on errors")
    return p


def write(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    from dflash_qaic.bench.run import BenchError
    from dflash_qaic.runtime import ArtifactsError

    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = evaluate(
            args.artifacts,
            args.card_profile,
            prompts_path=args.prompts,
            num_prompts=args.num_prompts,
            max_new=args.max_new_tokens,
            chi2_prompts=args.chi2_prompts,
            chi2_seeds=args.chi2_seeds,
            chi2_tokens=args.chi2_tokens,
            threads=args.threads,
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
    except (CardNumericsRunError, BenchError, ArtifactsError, FileNotFoundError) as e:
        if args.debug:
            raise
        print(f"dflash-bench --card-numerics: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    write(result, out / "card_numerics.json")
    text = summary(result)
    (out / "summary.txt").write_text(text, encoding="utf-8")
    print(text, end="")
    print(f"wrote {out}/card_numerics.json, summary.txt")
    return 0 if result["greedy"]["lossless_card"] else 1
