"""`dflash-bench --pd`: inter-token latency of decoding streams while long prompts arrive, on
one aggregated server and on one prefill + one decode server (P/D) with the same total threads.

    dflash-bench --pd artifacts/pd-bench --threads 2 --streams 3 --long-prompts 6

Both setups run behind vllm-router, started as dflash-serve-replicas starts them
(serve/replicas.py): the aggregated one `dflash-serve --threads T`; the P/D one `--role prefill
--threads T/2` and `--role decode --threads T/2` behind the router's P/D mode. The same
workload, greedy, on each: --streams clients each send streamed completions of
--stream-tokens tokens one after the other (a short prompt each) until the last long prompt has
answered; once every stream has its first token, one more client sends --long-prompts prompts
of --long-len tokens (random ids, seeded), each after the one before has answered
(--long-tokens tokens each). The artifacts need
--full-batch-size ≥ streams + 1 and a context that holds a long prompt and its tokens.

Measured at the client: TTFT (sending to the first chunk) of the streams and of the long
prompts, and the inter-token latency of the streams (the gap between successive chunks of a
stream; a chunk is one engine step's tokens), p50 and p99, over every gap that ends while a long
prompt is in flight (the "while long prompts arrive" window) and over all gaps. The tokens of
every request must be equal between the two setups (exit 1 otherwise). --json writes every
sample. docs/BENCHMARKS.md has the figures of this machine.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import sys
import threading
import time
from pathlib import Path

from dflash_qaic.commands import doc_parser

SHORT = [[30 + 7 * i + j for j in range(24)] for i in range(8)]  # the streams' prompt ids


def _stream(client, body: dict) -> tuple[float, list[float], list[int]]:
    """One streamed completion: (sent at, chunk arrival times, token ids)."""
    t0, times, ids = time.perf_counter(), [], []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
    return t0, times, ids


def workload(url: str, a, long_ids: list[list[int]]) -> dict:
    """The mixed workload against `url`: {"streams": [[(t0, times, ids), ...] per client],
    "long": [(t0, times, ids), ...], "window": (start, end)}."""
    import httpx

    common = dict(temperature=0, ignore_eos=True, return_token_ids=True, model="bench")
    out = {"streams": [[] for _ in range(a.streams)], "long": [], "window": (0.0, 0.0)}
    first = threading.Barrier(a.streams + 1)
    errors: list[BaseException] = []

    done = threading.Event()

    def streams(i: int) -> None:
        body = dict(prompt=SHORT[i % len(SHORT)], max_tokens=a.stream_tokens, **common)
        with httpx.Client(base_url=url, timeout=600, trust_env=False) as c:
            while not done.is_set():  # until the last long prompt has answered
                try:
                    out["streams"][i].append(_stream(c, body))
                except BaseException as e:  # noqa: BLE001 (reported after the run)
                    errors.append(e)
                    first.abort()
                    return
                if len(out["streams"][i]) == 1:
                    first.wait()

    def longs() -> None:
        with httpx.Client(base_url=url, timeout=600, trust_env=False) as c:
            try:
                first.wait()
                t_start = time.perf_counter()
                for ids in long_ids:
                    body = dict(prompt=ids, max_tokens=a.long_tokens, **common)
                    out["long"].append(_stream(c, body))
                out["window"] = (t_start, time.perf_counter())
            except BaseException as e:  # noqa: BLE001 (reported after the run)
                errors.append(e)
            finally:
                done.set()

    threads = [threading.Thread(target=streams, args=(i,)) for i in range(a.streams)]
    threads.append(threading.Thread(target=longs))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors or not out["long"]:
        raise RuntimeError(f"the workload failed: {errors[:1] or 'no long prompt answered'}")
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary(run: dict) -> dict:
    """TTFT and inter-token latency p50/p99 (ms) of a workload run."""
    lo, hi = run["window"]
    reqs = [s for c in run["streams"] for s in c]
    gaps = [(b - a, b) for _, ts, _ in reqs for a, b in zip(ts, ts[1:])]
    inside = [g for g, t in gaps if lo <= t <= hi]
    ttft = [ts[0] - t0 for t0, ts, _ in reqs]
    long_ttft = [ts[0] - t0 for t0, ts, _ in run["long"]]
    return {
        "ttft_ms": (_pct(ttft, 0.5), _pct(ttft, 0.99)),
        "itl_window_ms": (_pct(inside, 0.5), _pct(inside, 0.99)),
        "itl_all_ms": (_pct([g for g, _ in gaps], 0.5), _pct([g for g, _ in gaps], 0.99)),
        "long_ttft_ms": (_pct(long_ttft, 0.5), _pct(long_ttft, 0.99)),
        "gaps_in_window": len(inside),
        "window_s": hi - lo,
    }


def same_tokens(x: dict, y: dict) -> bool:
    """Every request both runs made has the same tokens: each stream client's rounds (as many
    as both made; one client repeats one prompt) and every long prompt."""
    pairs = [(u, v) for cx, cy in zip(x["streams"], y["streams"]) for u, v in zip(cx, cy)]
    pairs += list(zip(x["long"], y["long"]))
    return len(x["long"]) == len(y["long"]) and all(u[2] == v[2] for u, v in pairs)


def run_setup(a, roles: list[str], threads: int, long_ids) -> dict:
    """Start the setup (its servers and the router), warm it, run the workload, stop it."""
    from dflash_qaic.serve.replicas import Replicas

    serve = [*shlex.split(a.serve_args), "--threads", str(threads), "--served-model-name"]
    serve += ["bench", "--disable-log-requests"]
    groups = [[i] for i in range(len(roles))]
    with Replicas(a.artifacts, groups, serve_args=serve, roles=roles, timeout=600) as reps:
        import httpx

        with httpx.Client(base_url=reps.url, timeout=600, trust_env=False) as c:
            warm = dict(model="bench", max_tokens=4, temperature=0, return_token_ids=True)
            for ids in (SHORT[0], long_ids[0]):
                _stream(c, {**warm, "prompt": ids})
        return workload(reps.url, a, long_ids)


def _row(name: str, s: dict) -> str:
    f = lambda p: f"{p[0]:.1f} / {p[1]:.1f}"  # noqa: E731
    return (
        f"| {name} | {f(s['itl_window_ms'])} | {f(s['itl_all_ms'])} | {f(s['ttft_ms'])} | "
        f"{f(s['long_ttft_ms'])} | {s['gaps_in_window']} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = doc_parser("dflash-bench --pd", __doc__)
    p.add_argument("--threads", type=int, default=2, help="total threads of each setup")
    p.add_argument("--streams", type=int, default=3, help="decoding streams (clients)")
    p.add_argument("--stream-tokens", type=int, default=128, help="tokens per stream request")
    p.add_argument("--long-prompts", type=int, default=20, help="long prompts sent")
    p.add_argument("--long-len", type=int, default=1000, help="tokens per long prompt")
    p.add_argument("--long-tokens", type=int, default=8, help="tokens per long prompt's answer")
    p.add_argument("--serve-args", default="", help="more dflash-serve flags, one string")
    p.add_argument("--seed", type=int, default=0, help="seed of the long prompts' ids")
    p.add_argument("--json", default=None, help="also write every sample to this file")
    a = p.parse_args(argv)
    counts = [a.streams, a.stream_tokens, a.long_prompts, a.long_len, a.long_tokens]
    if min(counts) < 1 or a.threads < 2 or a.threads % 2:
        p.error("counts must be ≥ 1 and --threads even (≥ 2: half to prefill, half to decode)")
    from dflash_qaic.artifacts.manifest import read_manifest

    vocab = read_manifest(Path(a.artifacts), check_files="none").vocab_size
    rng = random.Random(a.seed)
    long_ids = [[rng.randrange(vocab) for _ in range(a.long_len)] for _ in range(a.long_prompts)]
    load = os.getloadavg()
    agg = run_setup(a, ["both"], a.threads, long_ids)
    pd = run_setup(a, ["prefill", "decode"], a.threads // 2, long_ids)
    load_after = os.getloadavg()
    same = same_tokens(agg, pd)
    s_agg, s_pd = summary(agg), summary(pd)
    print(f"P/D against aggregated, {a.artifacts}: {a.streams} streams of "
          f"{a.stream_tokens}-token requests while {a.long_prompts} prompts of {a.long_len} tokens "
          f"arrive; {a.threads} threads in all; load average {load[0]:.2f} before, "
          f"{load_after[0]:.2f} after")  # fmt: skip
    print("| setup | ITL p50 / p99 while long prompts arrive (ms) | ITL p50 / p99 all (ms) | "
          "stream TTFT p50 / p99 (ms) | long-prompt TTFT p50 / p99 (ms) | gaps in window |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    print(_row(f"aggregated (--threads {a.threads})", s_agg))
    print(_row(f"1P+1D (--threads {a.threads // 2} each)", s_pd))
    ratio = s_pd["itl_window_ms"][1] / s_agg["itl_window_ms"][1]
    print(f"ITL p99 while long prompts arrive, P/D / aggregated: {ratio:.2f}; tokens equal: {same}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"load": [load, load_after], "aggregated": agg, "pd": pd}, indent=1)
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
