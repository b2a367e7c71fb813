"""`dflash-bench --serve ARTIFACTS [--clients 16] [--max-tokens 64]` (also `python -m
dflash_lab.serve_bench`): N concurrent streaming greedy clients against a real `dflash-serve`
process (`dflash_qaic/serve/process.py`).

Each prompt's single-request greedy output is computed in-process first (and the same requests
one after another give the in-process tokens/s a one-at-a-time server could reach); then one
warm-up request, and all clients at once, client i streaming held-out prompt i (cycling) over
HTTP. Reported: completed, equal to the single-request output, server errors (/metrics and HTTP),
the most requests in the server's slots at once, TTFT p50 / p95 as the clients see it (queueing
included), TPOT p50, aggregate tokens/s (first request sent to last token), the server's τ and
the load average. `ok`: all complete, all equal, no error.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def _percentile(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


async def _client(http, url, prompt, max_tokens, t0) -> dict:
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    body.update(return_token_ids=True, stream_options={"include_usage": True})
    rec = {"ids": [], "text": "", "status": None, "error": None, "t_first": None, "t_done": None}
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode("utf-8", "replace")[:300]
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec["error"] = event["error"]["message"]
                    continue
                for c in event["choices"]:
                    if c.get("token_ids") and rec["t_first"] is None:
                        rec["t_first"] = time.perf_counter() - t0
                    rec["ids"] += c.get("token_ids") or []
                    rec["text"] += c["text"]
            rec["t_done"] = time.perf_counter() - t0
    except Exception as e:  # a broken connection counts as an error, not a crash
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


async def _run_clients(url, prompts, max_tokens) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as http:
        warm = await _client(http, url, prompts[0], 8, time.perf_counter())
        if warm["error"]:
            raise RuntimeError(f"the warm-up request failed: {warm['error']}")
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(_client(http, url, p, max_tokens, t0) for p in prompts))
        return list(recs), t0


def _scrape(url) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", trust_env=False).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _server_side(before: dict, after: dict) -> dict:
    def d(name, *labels):
        key = (name, tuple(labels))
        return after.get(key, 0.0) - before.get(key, 0.0)

    errors = sum(
        v - before.get(k, 0.0) for k, v in after.items() if k[0] == "dflash:request_errors_total"
    )
    steps = d("vllm:spec_decode_num_drafts_total")
    accepted = d("vllm:spec_decode_num_accepted_tokens_total")
    return {
        "server_errors": int(errors),
        "aborted": int(d("vllm:request_success_total", ("finished_reason", "abort"))),
        "steps": int(steps),
        "tau": (accepted + steps) / steps if steps else None,  # tokens committed per step
        "max_running": int(after.get(("dflash:num_requests_running_max", ()), 0.0)),
    }


def run_serve_bench(
    artifacts,
    clients: int = 16,
    *,
    max_tokens: int = 64,
    prompts: list[str] | None = None,
    backend: str = "ort",
    threads: int | None = None,
    progress=lambda msg: print(msg, file=sys.stderr),
) -> dict:
    """Measure `clients` concurrent streaming greedy requests against a dflash-serve process."""
    import dflash_qaic
    from dflash_qaic import assets
    from dflash_qaic.serve.process import ServerProcess

    pool = prompts or assets.heldout_prompts()
    chosen = [pool[i % len(pool)] for i in range(clients)]
    progress(f"serve bench: {clients} single-request greedy references in-process")
    pipe = dflash_qaic.load(artifacts, backend=backend, threads=threads)
    full_batch_size = pipe.full_batch_size
    pipe.generate(chosen[0], 8, temperature=0)  # warm-up, as the server gets
    t = time.perf_counter()
    refs = [pipe.generate(p, max_tokens, temperature=0) for p in chosen]
    # the same requests one after another in-process: what a one-at-a-time server could reach
    serial_tps = sum(len(r.tokens) for r in refs) / (time.perf_counter() - t)
    del pipe
    args = ["--backend", backend] + (["--threads", str(threads)] if threads else [])
    load_before = os.getloadavg()
    with ServerProcess(artifacts, *args) as server:
        progress(f"serve bench: {clients} concurrent streaming clients against {server.url}")
        before = _scrape(server.url)
        recs, _ = asyncio.run(_run_clients(server.url, chosen, max_tokens))
        after = _scrape(server.url)
        code = server.stop()
    load_after = os.getloadavg()
    done = [r for r in recs if r["error"] is None and r["t_done"] is not None]
    equal = [r["ids"] == ref.tokens for r, ref in zip(recs, refs)]
    tokens = sum(len(r["ids"]) for r in done)
    wall = max((r["t_done"] for r in done), default=0.0)
    ttft = [r["t_first"] for r in done if r["t_first"] is not None]
    tpot = [(r["t_done"] - r["t_first"]) / (len(r["ids"]) - 1) for r in done if len(r["ids"]) > 1]
    server_side = _server_side(before, after)
    http_errors = sum(1 for r in recs if r["status"] != 200)
    res = {
        "clients": clients,
        "max_tokens": max_tokens,
        "backend": backend,
        "threads": threads,
        "full_batch_size": full_batch_size,
        "completed": len(done),
        "equal_greedy": int(sum(equal)),
        "http_errors": http_errors,
        **server_side,
        "server_exit_code": code,
        "tokens": tokens,
        "wall_s": wall,
        "aggregate_tokens_per_s": tokens / wall if wall > 0 else None,
        "serial_in_process_tokens_per_s": serial_tps,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p95_s": _percentile(ttft, 95),
        "tpot_p50_s": _percentile(tpot, 50),
        "loadavg_before": list(load_before),
        "loadavg_after": list(load_after),
        "errors": [r["error"] for r in recs if r["error"]][:5],
    }
    res["ok"] = (
        res["completed"] == clients
        and res["equal_greedy"] == clients
        and res["server_errors"] == 0
        and http_errors == 0
    )
    return res


def render_markdown(res: dict) -> str:
    def ms(x):
        return "–" if x is None else f"{x * 1e3:.1f} ms"

    tau = "–" if res["tau"] is None else f"{res['tau']:.2f}"
    agg = res["aggregate_tokens_per_s"]
    lines = [
        f"### Serving: {res['clients']} concurrent streaming clients ({res['backend']})",
        "",
        "| | |",
        "|---|---|",
        f"| completed | {res['completed']} / {res['clients']} |",
        f"| equal to single-request greedy | {res['equal_greedy']} / {res['clients']} |",
        f"| server errors (metrics / HTTP) | {res['server_errors']} / {res['http_errors']} |",
        f"| TTFT p50 / p95 (queueing included) | {ms(res['ttft_p50_s'])} / {ms(res['ttft_p95_s'])} |",
        f"| TPOT p50 | {ms(res['tpot_p50_s'])} |",
        f"| aggregate tokens/s | {'–' if agg is None else f'{agg:.1f}'} "
        f"({res['tokens']} tokens in {res['wall_s']:.2f} s) |",
        "| the same requests one after another, in-process | "
        f"{res['serial_in_process_tokens_per_s']:.1f} tok/s |",
        f"| requests in the server's slots at once (most) | {res['max_running']} of "
        f"{res['full_batch_size']} |",
        f"| τ measured by the server | {tau} over {res['steps']} steps |",
        f"| load average before / after | {' '.join(f'{x:.2f}' for x in res['loadavg_before'])}"
        f" / {' '.join(f'{x:.2f}' for x in res['loadavg_after'])} |",
        "",
        f"{res['max_tokens']} new tokens per request, greedy; the server runs up to "
        f"{res['full_batch_size']} requests at once (--full-batch-size; 1 without it), the "
        "others wait for a free slot.",
    ]
    if not res["ok"]:
        lines += ["", f"**FAILED**: {res['errors']}"]
    return "\n".join(lines) + "\n"


OPTIONS = [  # flag, type, default, help
    ("--clients", int, 16, "concurrent streaming clients"),
    ("--max-tokens", int, 64, "tokens per request"),
    ("--threads", int, None, "the server's ONNX Runtime threads; None: its default"),
    ("--json", str, None, "also write the result to this file"),
]


def main(argv: list[str] | None = None) -> int:
    from dflash_qaic.bench.cli import common_parser

    args = common_parser(__doc__, "artifacts directory", OPTIONS).parse_args(argv)
    if args.clients < 1 or args.max_tokens < 1:
        print("dflash-bench: error: --clients and --max-tokens must be ≥ 1", file=sys.stderr)
        return 2
    kw = dict(max_tokens=args.max_tokens, backend=args.backend, threads=args.threads)
    res = run_serve_bench(args.artifacts, args.clients, **kw)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print(render_markdown(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
