"""`dflash-bench --response-format FILE`: DFlash under a structured-output constraint against the
target alone under the same constraint, on the same programs (docs/DESIGN.md, Structured output).

    dflash-bench ARTIFACTS --response-format person.json [--prompts FILE] [--num-prompts 12]

FILE holds a response format (`{"type": "json_schema", "json_schema": {"schema": …}}`, `{"type":
"regex", "regex": …}`, … as `generate(..., response_format=...)` takes it) or a bare JSON
schema. Each round runs every prompt three ways, back to back, the order rotating: the target
alone, DFlash filling the tokens the grammar forces, DFlash without filling. Reported: τ of both
DFlash runs, speedup over the target alone (TPOT ratio, prefill excluded), forced and cut
proposals per step, the host's CPU time per step in the grammar (matcher, masks, filling), and
whether every greedy run equals the target alone token for token. Exits 1 when one does not.
The artifacts must be exported with --structured-output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from dflash_qaic.commands import doc_parser
from dflash_qaic.runtime.grammar import KINDS


def read_format(path: str) -> dict:
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"dflash-bench: error: --response-format {path}: {e}") from None
    kind = obj.get("type") if isinstance(obj, dict) else None
    if kind in KINDS and (len(obj) > 1 or kind in ("json_object", "text")):
        return obj  # a response format; anything else is a JSON schema
    return {"type": "json_schema", "json_schema": {"name": Path(path).stem, "schema": obj}}


def parser() -> argparse.ArgumentParser:
    p = doc_parser("dflash-bench", __doc__)
    p.add_argument("--response-format", required=True, metavar="FILE")
    p.add_argument("--prompts", default=None, help="prompts file (as dflash-bench's --prompts)")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default="bench/structured", help="writes results.json there")
    return p


def run(pipe, prompts, spec: dict, max_new: int, repeats: int, warmup: int, temperature: float):
    """Every round: each prompt three ways (target alone, DFlash filling, DFlash not filling)."""
    modes = ("baseline", "fill", "nofill")
    runs = {m: [] for m in modes}
    problems = []
    for r in range(warmup + repeats):
        for i, p in enumerate(prompts):
            out = {}
            order = modes[(r + i) % 3 :] + modes[: (r + i) % 3]
            for mode in order:
                kw = dict(max_new_tokens=max_new, response_format=spec, temperature=temperature)
                if temperature > 0:
                    kw["seed"] = 1000 * r + i
                if mode == "baseline":
                    out[mode] = pipe.generate_baseline(p.ids, **kw)
                else:
                    pipe.configure(fill_forced_tokens=mode == "fill")
                    out[mode] = pipe.generate(p.ids, **kw)
            pipe.configure(fill_forced_tokens=True)
            if temperature == 0:
                for mode in ("fill", "nofill"):
                    if out[mode].tokens != out["baseline"].tokens:
                        problems.append(f"{p.name}, round {r}: DFlash ({mode}) differs")
            if r >= warmup:
                for mode in modes:
                    runs[mode].append(out[mode])
    return runs, problems


def summary(runs: dict) -> dict:
    def tpot(rs):
        return sum(x.stats["decode_s"] for x in rs) / max(sum(len(x.tokens) for x in rs), 1)

    def per_step(rs, key):
        steps = sum(x.stats["steps"] for x in rs)
        return sum(x.stats[key] for x in rs) / max(steps, 1)

    out = {"tpot_target_s": tpot(runs["baseline"])}
    for mode in ("fill", "nofill"):
        rs = runs[mode]
        steps = sum(x.stats["steps"] for x in rs)
        out[mode] = {
            "tau": sum(sum(x.acceptance_lengths) for x in rs) / max(steps, 1),
            "speedup": out["tpot_target_s"] / max(tpot(rs), 1e-12),
            "forced_per_step": per_step(rs, "forced_proposals"),
            "cut_per_step": per_step(rs, "cut_proposals"),
            "host_ms_per_step": 1e3 * per_step(rs, "grammar_host_s"),
            "stopped": sum(x.stop_reason == "stop_token" for x in rs),
            "runs": len(rs),
        }
    out["tau_ratio"] = out["fill"]["tau"] / max(out["nofill"]["tau"], 1e-12)
    return out


def main(argv: list[str] | None = None) -> int:
    import dflash_qaic
    from dflash_qaic.bench.run import BenchError, facts, select_prompts

    a = parser().parse_args(argv)
    spec = read_format(a.response_format)
    pipe = dflash_qaic.load(a.artifacts, threads=a.threads)
    pipe.configure(enable_prefix_caching=False)  # rounds repeat each prompt: none from a cache
    try:
        pipe.grammar(spec)  # a bad format or artifacts without the option: say so now
        prompts, source = select_prompts(
            facts(pipe, a.artifacts), pipe.tokenizer, a.max_new_tokens, a.prompts, a.num_prompts
        )
    except (BenchError, ValueError) as e:
        print(f"dflash-bench: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    runs, problems = run(pipe, prompts, spec, a.max_new_tokens, a.repeats, a.warmup, a.temperature)
    s = summary(runs)
    load = os.getloadavg()
    result = {
        "artifacts": str(a.artifacts),
        "response_format": spec,
        "prompts": source,
        "num_prompts": len(prompts),
        "repeats": a.repeats,
        "temperature": a.temperature,
        "load_average": load,
        "seconds": time.perf_counter() - t0,
        "lossless": not problems,
        "problems": problems,
        **s,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    f, n = s["fill"], s["nofill"]
    print(f"structured output: {a.response_format}, {len(prompts)} prompts x {a.repeats} rounds")
    print(f"  lossless (every greedy run = the target alone): {'yes' if not problems else 'NO'}")
    print(f"  tau: filling {f['tau']:.2f}, not filling {n['tau']:.2f} ({s['tau_ratio']:.2f}x)")
    print(f"  speedup over the target alone: {f['speedup']:.2f}x (not filling {n['speedup']:.2f}x)")
    print(
        f"  per step: {f['forced_per_step']:.2f} forced, {f['cut_per_step']:.2f} cut proposals; "
        f"grammar host CPU {f['host_ms_per_step']:.3f} ms (not filling "
        f"{n['host_ms_per_step']:.3f} ms)"
    )
    print(f"  ended by the grammar's stop: {f['stopped']}/{f['runs']} runs")
    print(f"  load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; results: {out}/results.json")
    for p in problems:
        print("  problem:", p)
    return 1 if problems else 0
