"""Measure: prompts, the alternating target-only / DFlash runs, the cost profile, the machine.

Only the public runtime API is used (`dflash_qaic.load`, `generate`, `generate_baseline`,
`res.stats`, `res.call_times`); manifest values are read in `facts` only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dflash_qaic import contract
from dflash_qaic.bench import stats

KINDS = ("decode", "verify", "draft")


class BenchError(ValueError):
    """Bad benchmark input: says what is wrong and how to fix it."""


class Prompt(NamedTuple):
    name: str
    ids: list[int]


def facts(pipe, artifacts) -> dict:
    """Everything the benchmark reads from the manifest, in one place (a typed manifest is read
    through its JSON form)."""
    m = pipe.manifest.to_json() if hasattr(pipe.manifest, "to_json") else pipe.manifest
    src, d = m.get("sources") or {}, Path(artifacts)
    out = {
        **{k: m[k] for k in ("block_size", "ctx_len", "prefill_seq_len", "hidden_size")},
        **{k: m[k] for k in ("vocab_size", "mask_token_id")},
        "path": str(d),
        "prefill_lengths": list(pipe.artifacts.plan.prefill_lengths),
        "full_batch_size": m.get("full_batch_size"),  # None: no continuous batching
        "eos": list(m.get("eos_token_ids") or []),
        "sampling": bool(pipe.can_sample),
        **{
            p: {"onnx": str(d / m[p]["onnx"]), "n_layers": m[p]["n_layers"]}
            for p in pipe.artifacts.roles
        },
        "sources": {k: (src.get(k) or {}).get("path") for k in ("target", "draft")},
        "target_sha256": (src.get("target") or {}).get("sha256"),
        "draft_form": draft_form(m, (src.get("draft") or {}).get("path")),
    }
    out["target"]["state_bytes"] = state_bytes(m["target"])  # 0: a dense target
    return out


def state_bytes(target: dict) -> int:
    """Bytes of one sequence's recurrent state: a hybrid target's `past_state.{i}` and
    `past_conv.{i}` inputs (the manifest's target I/O, JSON form) bound to one row. Every target
    call reads them whole and writes them back whole, whatever its length and position."""
    names = {
        f(i) for i in range(target["n_layers"]) for f in (contract.past_state, contract.past_conv)
    }
    one_row = {contract.BATCH: 1, contract.FULL_BATCH: 1}
    return sum(
        math.prod(contract.TensorSpec(s["name"], s["dtype"], tuple(s["shape"])).bind(**one_row))
        * np.dtype(s["dtype"]).itemsize
        for s in target["inputs"]
        if s["name"] in names
    )


def draft_form(m: dict, source: str | None) -> str | None:
    """ "DFlash-2" or "DFlash": from the source draft's config when it is still there, else from
    the manifest (a DFlash-2 draft exported for sampling returns q); None when unknown."""
    from dflash_qaic import checkpoints as ck

    if source:
        try:
            return "DFlash-2" if ck.read_draft_config(source).dflash2 else "DFlash"
        except (OSError, ck.CheckpointError):
            pass
    return "DFlash-2" if m["draft"].get("q_top_k") else None


def same_target(artifacts, other) -> dict:
    """The manifest of `other`, after checking it was exported from the same target checkpoint
    as `artifacts` (the sha256 of its config and weights; the target programs themselves differ
    when a draft returns q). BenchError otherwise."""
    from dflash_qaic.artifacts.manifest import load_json

    if Path(other).resolve() == Path(artifacts).resolve():
        raise BenchError(f"--compare {other} is the benchmarked directory: give another draft's")
    a, b = load_json(artifacts), load_json(other)
    target = lambda m: (m.get("sources") or {}).get("target") or {}  # noqa: E731
    digest = {}
    for d, m in ((artifacts, a), (other, b)):
        digest[d] = target(m).get("sha256")
        if not digest[d]:
            raise BenchError(
                f"{d}/manifest.json records no target checkpoint digest: re-export it with "
                "this version of dflash-export to compare drafts"
            )
    if digest[artifacts] != digest[other]:
        raise BenchError(
            f"--compare {other} was exported from another target ({target(b).get('path')}, "
            f"sha256 {digest[other][:12]}…) than {artifacts} ({target(a).get('path')}, sha256 "
            f"{digest[artifacts][:12]}…): drafts compare only against the same target; export "
            "the other draft with the same --target"
        )
    return b


def is_default_target(f: dict) -> bool:
    """Were these artifacts exported from the built-in pair's target? By its path, or by its
    checkpoint digest (the same pair in another checkout or install of the package)."""
    from dflash_qaic import assets
    from dflash_qaic import checkpoints as ck

    own = assets.default_pair()[0]
    if f["sources"]["target"] and Path(f["sources"]["target"]).resolve() == own:
        return True
    return bool(f.get("target_sha256")) and f["target_sha256"] == ck.file_digest(own)


def read_prompt_file(path, tokenizer, vocab: int) -> list[Prompt]:
    """`.jsonl`: objects with "prompt" (text) or "prompt_ids", optional "name"/"source";
    other files: one text prompt per non-empty line."""
    path = Path(path)
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except OSError as e:
        raise BenchError(f"cannot read the prompts file {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise BenchError(
            f"prompts file {path} is not UTF-8 (byte {e.start}): save it as UTF-8"
        ) from e
    out = []
    for n, line in ((n, x) for n, x in enumerate(lines, 1) if x.strip()):
        obj, where = {"prompt": line}, f"{path.name}:{n}"
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchError(f"{where} is not JSON ({e})") from e
        if not isinstance(obj, dict) or not ({"prompt", "prompt_ids"} & set(obj)):
            raise BenchError(f'{where}: expected an object with "prompt" or "prompt_ids"')
        ids = obj.get("prompt_ids")
        if ids is None and (tokenizer is None or not isinstance(obj["prompt"], str)):
            raise BenchError(f'{where}: text needs the artifacts\' tokenizer; give "prompt_ids"')
        ids = tokenizer(obj["prompt"])["input_ids"] if ids is None else ids
        if (
            not ids
            or not isinstance(ids, list)
            or any(type(t) is not int or not 0 <= t < vocab for t in ids)
        ):
            raise BenchError(
                f"{where}: ids must be a non-empty list of integers in 0 … {vocab - 1}"
            )
        out.append(Prompt(str(obj.get("name") or obj.get("source") or where), ids))
    if not out:
        raise BenchError(f"prompts file {path} holds no prompts")
    return out


def prompt_room(ctx_len: int, block_size: int, max_new: int) -> int:
    """The longest prompt that leaves room for max_new tokens + a block; BenchError if none."""
    limit = contract.max_positions(ctx_len) - max_new - block_size
    if limit < 1:
        raise BenchError(
            f"--max-new-tokens {max_new} leaves no room for a prompt in ctx_len {ctx_len}"
        )
    return limit


def select_prompts(f: dict, tokenizer, max_new: int, path: str | None, n: int):
    """(prompts, where they come from), each cut to leave room for max_new tokens + a block."""
    from dflash_qaic import assets

    limit = prompt_room(f["ctx_len"], f["block_size"], max_new)
    default = is_default_target(f)
    if path is not None:
        prompts, source = read_prompt_file(path, tokenizer, f["vocab_size"]), path
    elif default and tokenizer is not None:
        prompts = read_prompt_file(
            assets.ROOT / "prompts" / "heldout.jsonl", tokenizer, f["vocab_size"]
        )
        source = "the default pair's held-out prompts (stdlib files neither model trained on)"
    else:
        rng = np.random.default_rng(0)
        allowed = np.setdiff1d(np.arange(f["vocab_size"]), [f["mask_token_id"], *f["eos"]])
        lengths = np.linspace(8, max(8, min(limit, 2 * f["prefill_seq_len"])), n).astype(int)
        prompts = [
            Prompt(f"random-{i}", rng.choice(allowed, k).tolist()) for i, k in enumerate(lengths)
        ]
        source = "random token ids (numpy default_rng(0))"
    return [Prompt(p.name, p.ids[-limit:]) for p in prompts[:n]], source


def sample_seed(seed: int, temperature: float, prompt: int, round_: int, mode: str) -> int:
    """The seed of one sampled run: a hash of all it depends on (baseline and DFlash differ)."""
    key = [seed, round(temperature * 1e6), prompt, round_, mode == "dflash"]
    return int(np.random.SeedSequence(key).generate_state(1)[0])


def run_pairs(pipe, prompts, max_new, repeats, warmup, temperature, top_k, top_p, seed, log):
    """For every round and prompt, target alone and DFlash back to back, the order alternating.
    Returns (runs[prompt][round] = {"baseline": result, "dflash": result}, problems)."""
    kw = dict(max_new_tokens=max_new, stop_token_ids=[], temperature=temperature)
    if temperature > 0:
        kw.update(top_k=top_k, top_p=top_p)
    runs: list[list[dict]] = [[] for _ in prompts]
    problems: list[str] = []
    t0 = time.perf_counter()
    for r in range(warmup + repeats):
        for i, p in enumerate(prompts):
            pair = {}
            for mode in ("baseline", "dflash")[:: 1 if (r + i) % 2 == 0 else -1]:
                kw["seed"] = sample_seed(seed, temperature, i, r, mode) if temperature > 0 else None
                pair[mode] = (pipe.generate if mode == "dflash" else pipe.generate_baseline)(
                    p.ids, **kw
                )
            b, d = pair["baseline"].tokens, pair["dflash"].tokens
            if temperature == 0 and b != d:
                at = next((k for k, (x, y) in enumerate(zip(b, d)) if x != y), min(len(b), len(d)))
                problems.append(f"{p.name}, round {r}: DFlash tokens differ from index {at}")
            if len(b) != max_new or len(d) != max_new:
                problems.append(f"{p.name}, round {r}: {len(b)} / {len(d)} tokens, not {max_new}")
            runs[i] += [pair] if r >= warmup else []
        stage = f"round {r - warmup + 1}/{repeats}" if r >= warmup else "warm-up"
        log(f"  T={temperature:g} {stage}: {time.perf_counter() - t0:.0f} s")
    return runs, problems


def copy_bandwidth(nbytes: int = 256 << 20, reps: int = 7) -> float:
    """Bytes per second a numpy copy moves (read + write), median of `reps` copies."""
    src, dst, times = np.ones(nbytes // 8), np.empty(nbytes // 8), []
    for _ in range(reps + 1):  # the first copy touches every page
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return 2 * src.nbytes / float(np.median(times[1:]))


def weight_bytes(onnx_path) -> int:
    """Initializer bytes a call reads in full: all but tables read only through Gather (an
    embedding reads one row per token)."""
    import onnx

    g = onnx.load(str(onnx_path), load_external_data=False).graph
    others = {x for n in g.node if n.op_type != "Gather" for x in n.input}
    gathered = {n.input[0] for n in g.node if n.op_type == "Gather"} - others
    size = lambda t: math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return sum(size(t) for t in g.initializer if t.name not in gathered)


def machine(threads: int) -> dict:
    from importlib.metadata import distributions

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next(
        (x.split(":", 1)[1].strip() for x in info.splitlines() if "model name" in x),
        platform.machine(),
    )
    caches = Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")
    llc = max(
        (int(s.read_text()[:-2]) << {"K": 10, "M": 20}.get(s.read_text()[-2], 0) for s in caches),
        default=None,
    )
    pkgs = {"dflash-qaic", "onnxruntime", "numpy", "torch", "transformers", "dflash", "scipy"}
    return {
        "cpu": cpu,
        "cpus": len(os.sched_getaffinity(0)),
        "threads": threads,
        "llc_bytes": llc,
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "platform": f"{platform.platform()}, Python {platform.python_version()}",
        "versions": {d.name: d.version for d in distributions() if d.name in pkgs},
    }


def _call_times(pipe, ids, tokens, temperature) -> dict:
    """Seconds of each call, by kind, in one target-only and one DFlash run (verify calls of
    the whole block: the profile is of each call at its full size; every step drafts, so each
    kind is called whatever the step policy would choose)."""
    kw = dict(max_new_tokens=tokens, stop_token_ids=[], temperature=temperature, seed=0)
    chosen = pipe.configure(verify_lengths=[pipe.B], spec_policy="always")
    try:
        runs = (pipe.generate_baseline(ids, **kw), pipe.generate(ids, **kw))
    finally:
        pipe.configure(chosen)
    return {k: [t for r in runs for t in r.call_times.get(k, ())] for k in KINDS}


def _short_pipe(f: dict, ctx_len: int, chunk: int, out: str, threads: int):
    """The same pair exported again at a short ctx_len and prefill chunk (the only use of the
    export API here)."""
    from transformers.utils import logging as hf_logging

    import dflash_qaic
    from dflash_qaic.artifacts.build import ExportOptions, build_artifacts

    hf_logging.disable_progress_bar()

    keep = {k: f[k] for k in ("block_size", "sampling")}
    opts = ExportOptions(
        **keep, prefill_seq_len=chunk, ctx_len=ctx_len, compile=False, fp16_check=False
    )
    out = Path(out, "short")  # a directory of the exporter's own making
    quiet = logging.getLogger("dflash_qaic.exporter")  # its progress is not the benchmark's
    level, quiet.level = quiet.level, logging.WARNING
    try:
        build_artifacts(*f["sources"].values(), out, opts)
    finally:
        quiet.setLevel(level)
    return dflash_qaic.load(out, "ort", threads=threads, tokenizer=False)


def state_seconds(f: dict, copy_Bps: float) -> dict | None:
    """Seconds per call kind to read and write one sequence's recurrent state at the copy
    bandwidth (which counts read + write bytes): target calls only; None for a dense target."""
    n = f["target"].get("state_bytes", 0)
    return {k: 2 * n / copy_Bps for k in KINDS if k != "draft"} if n else None


def cost_profile(
    pipe, f: dict, ids, threads, weights_s: dict, state_s=None, rounds=3, tokens=48, log=print
):
    """Each call's median cost at the artifacts' ctx_len split into weights, cache, state (a
    hybrid target's, `state_seconds`), sampler and fixed overhead (`stats.cost_split`). The
    cache part compares with the same pair exported at a short ctx_len: it needs the source
    checkpoints and ONNX Runtime."""
    L, B = f["ctx_len"], f["block_size"]
    C = contract.prefill_lengths(f["prefill_seq_len"], B)[0]  # the prompt is one shortest chunk
    S, ids, note = 2 * C + 4 * B, ids[: C - B], None
    tokens = min(tokens, S - C - 2 * B)  # room at the short ctx_len
    if pipe.backend != "ort":
        note = "the cache part is measured on ONNX Runtime only"
    elif L <= 2 * S:
        note = f"no cache part: ctx_len {L} is too short to compare with a shorter one"
    elif not all(p and Path(p, "config.json").is_file() for p in f["sources"].values()):
        note = "no cache part: the source checkpoints (to export a short ctx_len) are gone"
    acc: dict[str, list[dict]] = {"long": [], "short": [], "sampled": []}  # rounds interleaved
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        log(f"cost profile at ctx_len {L}" + ("" if note else f" and {S} (exported again)"))
        short = None if note else _short_pipe(f, S, C, tmp, threads)
        for r in range(rounds + 1):  # the first round warms up
            got = {"long": _call_times(pipe, ids, tokens, 0.0)}
            if short:
                got["short"] = _call_times(short, ids, tokens, 0.0)
            if f["sampling"]:
                got["sampled"] = _call_times(pipe, ids, tokens, 1.0)
            for k, v in got.items():
                acc[k] += [v] if r else []
        del short
    # the median call of each kind over all timed rounds: robust to other work on the machine
    med = {
        k: {c: float(np.median(sum((x[c] for x in v), []))) for c in KINDS} if v else None
        for k, v in acc.items()
    }
    split = stats.cost_split(med["long"], med["short"], med["sampled"], (L, S), weights_s, state_s)
    return {"ctx_len": L, "short_ctx_len": med["short"] and S, "note": note, "calls": split}
