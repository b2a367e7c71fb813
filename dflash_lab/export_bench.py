"""Benchmark of export itself: random pairs at the published shapes, in the published on-disk
form (bf16, the target sharded with an index, tied head; a 5-layer b16 draft), exported each
in a child process so its peak RSS is its own.

    python -m dflash_lab.export_bench [--presets qwen3-0.6b qwen3-4b] [--ctx-len 4096]
                                       [--verify-tokens 4] [--work DIR] [--keep] [--out FILE.md]

Per pair it reports: bytes of programs written, peak RSS of the export and its ratio to those
bytes, seconds, and seconds ÷ (bytes ÷ this disk's measured write speed), i.e. how many times
slower than just writing the bytes; the seconds of a re-run that reuses the artifacts; with
`--verify-tokens N`, whether N greedy tokens through ONNX Runtime equal Hugging Face's (run one
after the other, each in its own process: a multi-GB fp32 model is in RAM once at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = [9707, 11, 847, 829, 374, 264, 1273, 13, 576, 3974, 13876, 38835, 34208, 916]


def disk_write_speed(directory: Path, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a sequential write of `nbytes` (fsync'ed) into `directory`."""
    block = os.urandom(64 << 20)
    path = Path(directory) / ".write-speed.tmp"
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t
    path.unlink()
    return max(1, nbytes // len(block)) * len(block) / seconds


def _child(mode: str, **kw) -> dict:
    """Run `mode` in a fresh interpreter; its last stdout line is a JSON result."""
    cmd = [sys.executable, "-m", "dflash_lab.export_bench", "--child", json.dumps([mode, kw])]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench child {mode} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def _child_main(mode: str, kw: dict) -> dict:
    import torch  # noqa: F401  (imports are not the export's work: time what follows)

    import dflash_qaic.exporter.cli  # noqa: F401

    t = time.perf_counter()
    if mode == "export":
        from dflash_qaic.exporter.cli import main

        rc = main(kw["argv"] + ["--quiet"])
        if rc != 0:
            raise SystemExit(f"dflash-export exited with {rc}")
        out = {"rc": rc}
    elif mode == "ort":
        import dflash_qaic

        pipe = dflash_qaic.load(kw["artifacts"], backend="ort")
        res = pipe.generate(kw["prompt"], max_new_tokens=kw["n"], stop_token_ids=[])
        out = {"tokens": list(res.tokens)}
    elif mode == "ort-target":
        out = {"tokens": _ort_target_greedy(kw["artifacts"], kw["prompt"], kw["n"])}
    elif mode == "hf":
        import torch

        from dflash_qaic import checkpoints as ck

        model = ck.load_target_model(kw["target"])
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([kw["prompt"]]), max_new_tokens=kw["n"], do_sample=False
            )
        out = {"tokens": ids[0, len(kw["prompt"]) :].tolist()}
    else:
        raise ValueError(mode)
    out["seconds"] = time.perf_counter() - t
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _ort_target_greedy(artifacts: str, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from the target program alone in ONNX Runtime (prefill, then decode
    calls), without weight prepacking: for a program too big to run next to its draft. DFlash
    is lossless, so these are the tokens the full pipeline commits."""
    import numpy as np
    import onnxruntime as ort

    from dflash_qaic import contract
    from dflash_qaic.artifacts.manifest import read_manifest

    m = read_manifest(artifacts)
    io = m.target.io  # the contract object (typed manifest)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    path = str(Path(artifacts) / m["target"]["onnx"])
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    kv = {s.name: np.zeros(s.bind(batch_size=1, ctx_len=m["ctx_len"]), np.float32) for s in io.kv}
    ids, pos, tokens = list(prompt), list(range(len(prompt))), []
    names = [o.name for o in sess.get_outputs()]
    for _ in range(n):
        s = len(ids)
        feed = {contract.INPUT_IDS: np.array([ids]), contract.POSITION_IDS: np.array([pos])}
        if io.comp_ctx:  # every slot: this check is about tokens, not cost
            feed[contract.COMP_CTX_LENGTHS] = np.arange(m.ctx_len, dtype=np.int64)
        if io.sampling:
            feed[contract.TEMPERATURE] = np.zeros(1, np.float32)
            feed[contract.TOP_K] = np.zeros(1, np.int64)
            feed[contract.TOP_P] = np.ones(1, np.float32)
            feed[contract.RANDOM_U] = np.zeros((1, s, contract.N_RANDOM), np.float32)
        out = dict(zip(names, sess.run(None, {**feed, **kv})))
        kv = {k: out[contract.retained(k)] for k in kv}
        tokens.append(int(out[contract.NEXT_TOKENS][0, -1]))
        ids, pos = [tokens[-1]], [pos[-1] + 1]
    return tokens


def _bytes_written(out: Path) -> int:
    return sum(f.stat().st_size for p in ("target", "draft") for f in (out / p).glob("*.onnx*"))


def bench_pair(preset: str, work: Path, ctx_len: int, write_speed: float, verify: int, **kw):
    """Make (or reuse) the random pair of `preset`, export it, re-run it, optionally verify."""
    from dflash_lab.tiny import make_tiny_pair

    pair_dir = work / preset
    t_make = time.perf_counter()
    if not (pair_dir / ".complete").is_file():
        shutil.rmtree(pair_dir, ignore_errors=True)
        make_tiny_pair(pair_dir, preset=preset)
        (pair_dir / ".complete").touch()
    t_make = time.perf_counter() - t_make
    out = work / f"{preset}-artifacts"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["--target", str(pair_dir / "target"), "--draft", str(pair_dir / "draft")]
    argv += ["--out", str(out), "--no-compile", "--ctx-len", str(ctx_len)]
    if not kw.get("fp16_check", True):
        argv.append("--no-fp16-check")
    load = os.getloadavg()[0]
    res = _child("export", argv=argv)
    written = _bytes_written(out)
    again = _child("export", argv=argv)
    row = {
        "preset": preset,
        "ctx_len": ctx_len,
        "load_avg_1min": round(load, 2),
        "make_pair_seconds": round(t_make, 1),
        "bytes_written": written,
        "peak_rss_bytes": res["peak_rss_bytes"],
        "rss_ratio": res["peak_rss_bytes"] / written,
        "seconds": res["seconds"],
        "write_floor_seconds": written / write_speed,
        "seconds_ratio": res["seconds"] / (written / write_speed),
        "reuse_seconds": again["seconds"],
    }
    if verify:
        vocab = json.loads((pair_dir / "target" / "config.json").read_text())["vocab_size"]
        prompt = [t % vocab for t in PROMPT]
        mode = "ort-target" if kw.get("target_only") else "ort"
        ort_tokens = _child(mode, artifacts=str(out), n=verify, prompt=prompt)["tokens"]
        hf_tokens = _child("hf", target=str(pair_dir / "target"), n=verify, prompt=prompt)["tokens"]
        row.update(ort_tokens=ort_tokens, hf_tokens=hf_tokens, greedy_equal=ort_tokens == hf_tokens)
        row["greedy_checked_with"] = "target program" if kw.get("target_only") else "pipeline"
    if not kw.get("keep"):
        shutil.rmtree(out, ignore_errors=True)
    return row


def run_export_bench(
    presets=("qwen3-0.6b",),
    work_dir: str | os.PathLike | None = None,
    *,
    ctx_len: int = 4096,
    verify_tokens: int = 0,
    keep: bool = False,
    fp16_check: bool = True,
    target_only: bool = False,
    progress=print,
) -> dict:
    """Export benchmark over `presets` (names of `dflash_lab.tiny.PRESETS`); returns
    {"write_speed_bytes_per_s", "rows": [one dict per preset]}. Pairs are kept in `work_dir`
    (a temp dir when None) for re-runs; artifacts are removed unless `keep`."""
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="dflash-bench-export-"))
    work.mkdir(parents=True, exist_ok=True)
    speed = disk_write_speed(work)
    progress(f"disk write speed: {speed / 1e6:.0f} MB/s ({work})")
    rows = []
    for preset in presets:
        progress(f"{preset}: making the pair (if needed) and exporting at ctx {ctx_len}")
        row = bench_pair(
            preset,
            work,
            ctx_len,
            speed,
            verify_tokens,
            keep=keep,
            fp16_check=fp16_check,
            target_only=target_only,
        )
        progress(render_markdown({"write_speed_bytes_per_s": speed, "rows": [row]}))
        rows.append(row)
    return {"write_speed_bytes_per_s": speed, "work_dir": str(work), "rows": rows}


def render_markdown(result: dict) -> str:
    head = (
        "| pair | ctx | programs written | peak RSS | RSS ÷ written | export s | "
        "s ÷ write floor | re-run s | greedy ORT = HF | load |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in result["rows"]:
        eq = {True: "yes", False: "NO"}.get(r.get("greedy_equal"), "not run")
        lines.append(
            f"| {r['preset']} | {r['ctx_len']} | {r['bytes_written'] / 1e9:.2f} GB | "
            f"{r['peak_rss_bytes'] / 1e9:.2f} GB | {r['rss_ratio']:.2f}x | {r['seconds']:.1f} | "
            f"{r['seconds_ratio']:.1f}x | {r['reuse_seconds']:.2f} | {eq} | {r['load_avg_1min']} |"
        )
    speed = result["write_speed_bytes_per_s"] / 1e6
    lines.append(f"\nDisk write speed {speed:.0f} MB/s (write floor = bytes ÷ that speed).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["qwen3-0.6b"])
    p.add_argument("--ctx-len", type=int, default=4096)
    p.add_argument("--verify-tokens", type=int, default=0)
    p.add_argument("--work", help="where the random pairs are kept (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the exported artifacts")
    p.add_argument("--no-fp16-check", action="store_true")
    p.add_argument(
        "--target-only",
        action="store_true",
        help="verify tokens with the target program alone (a multi-GB pair on a small host)",
    )
    p.add_argument("--out", help="also write the markdown report here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        mode, kw = json.loads(a.child)
        print(json.dumps(_child_main(mode, kw)))
        return
    res = run_export_bench(
        a.presets,
        a.work,
        ctx_len=a.ctx_len,
        verify_tokens=a.verify_tokens,
        keep=a.keep,
        fp16_check=not a.no_fp16_check,
        target_only=a.target_only,
    )
    md = render_markdown(res)
    print(md)
    if a.out:
        Path(a.out).write_text(md + "\n")
        Path(a.out).with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
