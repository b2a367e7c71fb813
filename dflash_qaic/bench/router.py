"""`dflash-bench --router`: what vllm-router costs a request, time to first token through the
router minus straight to the replica, at the same load.

    dflash-bench --router artifacts/default-cb8 --requests 200 --clients 1,4

One replica (`dflash-serve ARTIFACTS --threads 1`) behind vllm-router, started as
dflash-serve-replicas starts them (serve/replicas.py). With c clients (each count in --clients),
each sends its share of the streamed completions, alternating replica and router, so both
paths see the same load; TTFT is the time from sending a request to its first token's chunk, at
the client. Also the round trip of `GET /v1/models` (no engine work: the proxy alone). Prints
the medians (ms) of each path, the router's cost (the median of paired differences: each routed
request against the direct one beside it from the same client) and the router process's CPU
time per routed call (a completion or a /v1/models, its idle CPU rate measured first and taken
off), which a busy machine does not inflate; --json writes every sample. The router's cost per
request does not depend on how many replicas it fronts (it picks one per request).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from dflash_qaic.commands import doc_parser

PROMPTS = ["def fibonacci(n):", "class Stack:\n", "import numpy as np\n", "# sort a list\n"]


def _ttft(client, model: str, prompt: str, max_tokens: int) -> float:
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    t = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t
    return first


def _round_trip(client) -> float:
    t = time.perf_counter()
    client.get("/v1/models").raise_for_status()
    return time.perf_counter() - t


def measure(direct: str, routed: str, model: str, requests: int, c: int, max_tokens: int):
    """Per client, its requests in order: [(path, ttft_s, models_s), ...] (path "direct" or
    "router", alternating)."""
    import httpx

    out: list[list[tuple[str, float, float]]] = [[] for _ in range(c)]
    go = threading.Barrier(c)

    def client(j: int) -> None:
        kw = dict(timeout=120, trust_env=False)
        with httpx.Client(base_url=direct, **kw) as d, httpx.Client(base_url=routed, **kw) as r:
            clients = {"direct": d, "router": r}
            go.wait()
            for i in range(requests // c):
                path = ("direct", "router")[(i + j) % 2]  # alternate, half the clients each way
                t = _ttft(clients[path], model, PROMPTS[i % len(PROMPTS)], max_tokens)
                out[j].append((path, t, _round_trip(clients[path])))

    threads = [threading.Thread(target=client, args=(j,)) for j in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(samples: list[list[tuple[str, float, float]]]) -> dict:
    """Medians (ms) per path, and the median of the paired differences router − direct (each
    router request against the direct one next to it from the same client: load drifts
    cancel)."""
    res = {}
    for k, kind in ((1, "ttft"), (2, "models")):
        by = {"direct": [], "router": []}
        diffs = []
        for seq in samples:
            for s in seq:
                by[s[0]].append(s[k])
            for a, b in zip(seq[0::2], seq[1::2]):
                (d, r) = (a, b) if a[0] == "direct" else (b, a)
                diffs.append(r[k] - d[k])
        res[kind] = {
            "direct_ms": 1e3 * statistics.median(by["direct"]),
            "router_ms": 1e3 * statistics.median(by["router"]),
            "cost_ms": 1e3 * statistics.median(diffs),
            "n": len(by["direct"]),
        }
    return res


def main(argv: list[str] | None = None) -> int:
    p = doc_parser("dflash-bench --router", __doc__)
    p.add_argument(
        "--requests", type=int, default=200, help="requests per client count, both paths"
    )
    p.add_argument("--clients", default="1,4", help="comma-separated client counts")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per request")
    p.add_argument("--warmup", type=int, default=8, help="requests per path first, discarded")
    p.add_argument(
        "--idle", type=float, default=10.0, help="seconds the router's idle CPU is measured"
    )
    p.add_argument("--serve-args", default="--threads 1", help="dflash-serve flags, one string")
    p.add_argument("--json", default=None, help="also write every sample to this file")
    a = p.parse_args(argv)
    levels = [int(x) for x in a.clients.split(",")]
    if min([a.requests, a.max_tokens, *levels]) < 1 or a.warmup < 0:
        p.error("--requests, --max-tokens and --clients must be ≥ 1, --warmup ≥ 0")
    import shlex

    from dflash_qaic.serve.replicas import Replicas

    model = "bench"
    args = [*shlex.split(a.serve_args), "--served-model-name", model, "--disable-log-requests"]
    load = os.getloadavg()
    rows, raw = [], {}
    with Replicas(a.artifacts, [[0]], serve_args=args, log_level="warning") as reps:
        direct, routed = reps.replicas[0].url, reps.url
        if a.warmup:
            measure(direct, routed, model, 2 * a.warmup, 1, a.max_tokens)
        pid = reps.router.proc.pid
        cpu, t = cpu_seconds(pid), time.perf_counter()
        time.sleep(a.idle)  # the router's own background work (health checks, monitors)
        idle_rate = (cpu_seconds(pid) - cpu) / (time.perf_counter() - t)
        for c in levels:
            cpu, t = cpu_seconds(pid), time.perf_counter()
            samples = measure(direct, routed, model, a.requests, c, a.max_tokens)
            cpu = cpu_seconds(pid) - cpu - idle_rate * (time.perf_counter() - t)
            raw[c] = samples
            s = summary(samples)
            s["router_cpu_ms"] = 1e3 * cpu / (2 * s["ttft"]["n"])  # per routed call
            rows.append((c, s))
    load_after = os.getloadavg()
    print(f"vllm-router cost per request, {a.artifacts} ({a.max_tokens} tokens, medians in ms)")
    print(f"load average {load[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"router idle CPU {1e3 * idle_rate:.2f} ms/s (taken off the CPU per call)")
    print("| clients | n per path | TTFT direct | TTFT router | router cost (paired) "
          "| /v1/models direct | /v1/models router | cost (paired) | router CPU per call |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c, s in rows:
        t, m = s["ttft"], s["models"]
        print(
            f"| {c} | {t['n']} | {t['direct_ms']:.2f} | {t['router_ms']:.2f} | "
            f"{t['cost_ms']:+.2f} | {m['direct_ms']:.2f} | {m['router_ms']:.2f} | "
            f"{m['cost_ms']:+.2f} | {s['router_cpu_ms']:.3f} |"
        )
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "load": [load, load_after],
                    "idle_cpu_s_per_s": idle_rate,
                    "rows": rows,
                    "samples": raw,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
