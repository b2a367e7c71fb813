"""`dflash-bench --long-context`: prefill time, peak memory, and the cost of a draft, a verify
and a decode call against the position in the context.

    dflash-bench --long-context artifacts/qwen3-0.6b-swa --prompt-len 8000 --positions 1000,8000

A random prompt of --prompt-len tokens is generated (prefill time, peak RSS); then each call is
timed at every position (median of --repeats, after one warm-up): a call at position p reads
what a sequence at p reads (its attention window) and writes positions ≥ p of cache row 0.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dflash_qaic import contract


def _feeds(io, sym: dict, pos: np.ndarray, window: np.ndarray | None, hidden: int) -> dict:
    """Every non-cache input of `io` for one call at positions `pos` [b, seq] (row 0 active,
    the others inactive): greedy, block ids 0, features of unit scale."""
    b, seq = pos.shape
    out = {}
    for spec in io.inputs:
        if spec.name.startswith(("past_key.", "past_value.")):
            continue
        shape = spec.bind(**sym)
        if spec.name == contract.POSITION_IDS:
            out[spec.name] = pos
        elif spec.name == contract.POSITION_IDS_TARGET:
            out[spec.name] = np.where(pos < 0, pos, pos - seq)  # committed rows before it
        elif spec.name == contract.BATCH_INDEX:
            out[spec.name] = np.where(np.arange(b) == 0, 0, contract.INACTIVE_ROW)[:, None]
        elif spec.name == contract.COMP_CTX_LENGTHS:
            out[spec.name] = window
        elif spec.name == contract.TARGET_HIDDEN:
            out[spec.name] = np.random.default_rng(0).standard_normal((b, seq, hidden), "f4")
        elif spec.name in (contract.TOP_P, contract.TOKEN_BITMASK):  # top-p off, all allowed
            out[spec.name] = np.full(shape, 1 if spec.name == contract.TOP_P else -1, spec.dtype)
        else:  # ids, temperature 0, top_k 0, uniforms
            out[spec.name] = np.zeros(shape, np.dtype(spec.dtype))
    return out


def call_cost(pipe, kind: str, p: int, repeats: int) -> float:
    """Median seconds of one `kind` call ("draft", "verify", "decode") at position p."""
    m = pipe.artifacts
    prog, io = (pipe.draft, m.draft.io) if kind == "draft" else (pipe.target, m.target.io)
    seq = 1 if kind == "decode" else pipe.B
    rows = m.full_batch_size or m.batch_size
    pos = np.full((rows, seq), contract.PAD_POSITION, np.int64)
    pos[0] = np.arange(p, p + seq)
    windows = list(m.comp_ctx_lengths or [m.ctx_len])
    window = np.arange(contract.window_for(windows, p + (0 if kind == "draft" else seq)))
    sym = {contract.BATCH: rows, contract.SEQ: seq, contract.SAMPLE: 1, contract.CCL: len(window)}
    feeds = _feeds(io, sym, pos, window if m.comp_ctx_lengths else None, m.hidden_size)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        prog.run(feeds)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def run(artifacts, prompt_len, positions, new_tokens=16, repeats=3, threads=None) -> dict:
    import dflash_qaic

    pipe = dflash_qaic.load(artifacts, threads=threads, tokenizer=False, check_files="none")
    m = pipe.artifacts
    if prompt_len + new_tokens + pipe.B >= m.ctx_len or max(positions) + pipe.B >= m.ctx_len:
        raise SystemExit(f"dflash-bench: prompt and positions must stay below ctx_len {m.ctx_len}")
    ids = np.random.default_rng(0).integers(0, m.vocab_size, prompt_len).tolist()
    t = time.perf_counter()
    res = pipe.generate(ids, max_new_tokens=new_tokens, stop_token_ids=[])
    gen_s = time.perf_counter() - t
    kinds = ("draft", "verify", "decode")
    costs = {p: {k: call_cost(pipe, k, p, repeats) for k in kinds} for p in positions}
    return {
        "artifacts": str(artifacts),
        "ctx_len": m.ctx_len,
        "ring_slots": list(m.draft.io.ring_slots),
        "prompt_len": prompt_len,
        "prefill_s": res.stats["prefill_s"],
        "generate_s": gen_s,
        "tau": res.stats.get("tau"),
        "peak_rss_gb": peak_rss_gb(),
        "cost_s": {str(p): c for p, c in costs.items()},
    }


def render(r: dict) -> str:
    lines = [
        f"long context: {r['artifacts']} (ctx {r['ctx_len']}, draft rings {r['ring_slots']})",
        f"prompt {r['prompt_len']} tokens: prefill {r['prefill_s']:.2f} s, "
        f"peak RSS {r['peak_rss_gb']:.2f} GB, τ {r['tau'] or 0:.2f}",
        "| position | draft ms | verify ms | decode ms |",
        "|---:|---:|---:|---:|",
    ]
    for p, c in r["cost_s"].items():
        lines.append(f"| {p} | " + " | ".join(f"{1e3 * c[k]:.1f}" for k in c) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-bench --long-context", description=__doc__)
    p.add_argument("artifacts")
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--positions", default="1000,2000,4000,8000", help="comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the result to this file")
    a = p.parse_args(argv)
    positions = [int(x) for x in a.positions.split(",")]
    if min([a.prompt_len, a.max_new_tokens, a.repeats, *positions]) < 1:
        p.error("--prompt-len, --max-new-tokens, --repeats and --positions must be ≥ 1")
    r = run(a.artifacts, a.prompt_len, positions, a.max_new_tokens, a.repeats, a.threads)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2))
    print(render(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
