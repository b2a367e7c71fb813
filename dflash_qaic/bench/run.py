"""Measurement: prompts, the alternating baseline/DFlash runs, the peers, memory bandwidth, the
weight bytes a decode step reads, and the cost profile of real shapes.

Everything here returns plain dicts of raw measurements; `stats.py` reduces them and
`report.py` writes them out.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_qaic import contract
from dflash_qaic.bench import stats

Progress = Callable[[str], None]


class BenchError(ValueError):
    """Bad benchmark input: says what is wrong and how to fix it."""


# ---------------------------------------------------------------------------- prompts


@dataclass
class Prompt:
    name: str
    ids: list[int]
    text: str | None = None
    original_len: int | None = None  # set when the prompt was cut to fit ctx_len

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "prompt_tokens": len(self.ids),
            "truncated_from": self.original_len,
            "text": self.text,
        }


def max_prompt_len(manifest: dict, max_new_tokens: int) -> int:
    """Longest prompt with room for max_new_tokens and a last verify block (DFlash)."""
    B = int(manifest["block_size"])
    return contract.max_positions(int(manifest["ctx_len"])) - max_new_tokens - B


def _fit(p: Prompt, limit: int) -> Prompt:
    if len(p.ids) > limit:
        # keep the tail: the text the model continues from
        p.original_len, p.ids = len(p.ids), p.ids[-limit:]
    return p


def read_prompt_file(path: str | os.PathLike) -> list[dict]:
    """`.jsonl`: one object per line with "prompt" (text) or "prompt_ids" (ids), optional
    "name" / "source"; anything else: one text prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"prompts file {path} does not exist")
    out = []
    lines = path.read_text().splitlines()
    if path.suffix == ".jsonl":
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchError(f"{path}:{n} is not JSON ({e})") from e
            if not isinstance(obj, dict) or not ("prompt" in obj or "prompt_ids" in obj):
                raise BenchError(f'{path}:{n}: expected an object with "prompt" or "prompt_ids"')
            name = str(obj.get("name") or obj.get("source") or f"{path.name}:{n}")
            out.append({"name": name, "prompt": obj.get("prompt"), "ids": obj.get("prompt_ids")})
    else:
        for n, line in enumerate(lines, 1):
            if line.strip():
                out.append({"name": f"{path.name}:{n}", "prompt": line, "ids": None})
    if not out:
        raise BenchError(f"prompts file {path} holds no prompts")
    return out


def _encode(entries: list[dict], tokenizer, vocab: int) -> list[Prompt]:
    prompts = []
    for e in entries:
        if e["ids"] is not None:
            ids = [int(t) for t in e["ids"]]
            text = e["prompt"]
        else:
            if tokenizer is None:
                raise BenchError(
                    f"prompt {e['name']} is text, but these artifacts have no tokenizer: give "
                    '"prompt_ids" in a .jsonl prompts file'
                )
            text = e["prompt"]
            ids = list(tokenizer(text)["input_ids"])
        bad = [t for t in ids if not 0 <= t < vocab]
        if not ids or bad:
            raise BenchError(f"prompt {e['name']}: empty or ids {bad[:5]} outside 0 … {vocab - 1}")
        prompts.append(Prompt(e["name"], ids, text))
    return prompts


def is_default_pair(manifest: dict) -> bool:
    """Are these artifacts exported from the package's own pair (dflash_qaic.assets)?"""
    try:
        from dflash_qaic import assets
        from dflash_qaic.checkpoints import file_digest

        target_dir, _ = assets.default_pair()
        src = (manifest.get("sources") or {}).get("target") or {}
        if not Path(target_dir, "config.json").is_file():
            return False
        if src.get("path") and Path(src["path"]).resolve() == Path(target_dir).resolve():
            return True
        return bool(src.get("sha256")) and src["sha256"] == file_digest(target_dir)
    except Exception:  # no assets, or unreadable: not the default pair
        return False


def random_prompts(manifest: dict, n: int, limit: int, seed: int = 0) -> list[Prompt]:
    """Deterministic random-id prompts of varied length (mask and EOS ids excluded)."""
    rng = np.random.default_rng(seed)
    vocab = int(manifest["vocab_size"])
    banned = {int(manifest["mask_token_id"]), *map(int, manifest.get("eos_token_ids") or [])}
    allowed = np.array([t for t in range(vocab) if t not in banned], np.int64)
    chunk = int(manifest["prefill_seq_len"])
    hi = max(2, min(limit, 2 * chunk))
    lengths = np.linspace(max(1, min(8, hi)), hi, n).round().astype(int)
    return [
        Prompt(f"random-{i}", [int(t) for t in rng.choice(allowed, size=int(L))])
        for i, L in enumerate(lengths)
    ]


def select_prompts(
    manifest: dict,
    tokenizer,
    max_new_tokens: int,
    prompts_file: str | None,
    num_prompts: int | None,
) -> tuple[list[Prompt], str]:
    """The prompts and a sentence saying where they come from."""
    limit = max_prompt_len(manifest, max_new_tokens)
    if limit < 1:
        raise BenchError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in ctx_len "
            f"{manifest['ctx_len']} (block {manifest['block_size']}): use fewer new tokens"
        )
    vocab = int(manifest["vocab_size"])
    if prompts_file is not None:
        prompts = _encode(read_prompt_file(prompts_file), tokenizer, vocab)
        source = f"prompts file {prompts_file}"
    elif is_default_pair(manifest) and tokenizer is not None:
        from dflash_qaic import assets

        path = Path(assets.__file__).parent / "prompts" / "heldout.jsonl"
        if path.is_file():  # named by their "source" (stdlib file:line)
            entries = read_prompt_file(path)
        else:
            texts = assets.heldout_prompts()
            entries = [
                {"name": f"heldout-{i}", "prompt": t, "ids": None} for i, t in enumerate(texts)
            ]
        prompts = _encode(entries, tokenizer, vocab)
        source = (
            "the default pair's held-out prompts (dflash_qaic/assets/prompts/heldout.jsonl: "
            "stdlib files neither model trained on)"
        )
    else:
        prompts = random_prompts(manifest, num_prompts or 4, limit)
        source = "deterministic random token ids (numpy default_rng(0)); not the default pair"
    if num_prompts is not None:
        prompts = prompts[:num_prompts]
    return [_fit(p, limit) for p in prompts], source


# ---------------------------------------------------------------------------- our runtime


@dataclass
class RunRecord:
    """One generation: the fields the report needs (not the whole GenerationResult)."""

    tokens: list[int]
    acceptance_lengths: list[int]
    stats: dict
    stop_reason: str
    call_times: dict[str, list[float]] = field(repr=False)
    bytes_per_step: float = 0.0

    @classmethod
    def of(cls, res) -> RunRecord:
        return cls(
            list(res.tokens),
            list(res.acceptance_lengths),
            dict(res.stats),
            res.stop_reason,
            {k: list(v) for k, v in res.call_times.items()},
            float(res.stats.get("bytes_per_step", 0.0)),
        )


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


MODE_IDS = {"baseline": 0, "dflash": 1}


def sample_seed(seed: int, temperature: float, prompt_index: int, round_: int, mode: str) -> int:
    """The seed of one sampled run: a hash (numpy SeedSequence) of --seed, the temperature (in
    millionths), the prompt index, the round (warm-up rounds first) and the mode. Baseline and
    DFlash get different seeds, so the two runs of a pair are independent draws."""
    key = [int(seed), round(float(temperature) * 1e6), prompt_index, round_, MODE_IDS[mode]]
    return int(np.random.SeedSequence(key).generate_state(1, np.uint32)[0])


def run_pipeline(
    pipe,
    prompts: list[Prompt],
    max_new_tokens: int,
    repeats: int,
    warmup: int,
    progress: Progress = print,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> dict:
    """Alternate target-only decoding and DFlash over every prompt, `warmup` discarded rounds
    then `repeats` timed rounds; the order within a (round, prompt) pair alternates, so slow
    drift hits both alike. Returns {"runs": [[{baseline, dflash}] per repeat] per prompt,
    "failures": [...], "seconds": s}.

    At temperature 0 every pair must give identical tokens (the lossless check) and DFlash the
    same tokens in every round. At temperature > 0 each run samples with its own seed
    (`sample_seed`), so tokens differ between the two modes and between rounds; only the token
    count is checked here (the distributions are compared in the report)."""
    sampled = temperature > 0
    kw = dict(max_new_tokens=max_new_tokens, stop_token_ids=[])
    if sampled:
        kw.update(temperature=temperature, top_k=top_k, top_p=top_p)
    runs: list[list[dict]] = [[] for _ in prompts]
    failures: list[dict] = []
    t0 = time.perf_counter()
    tag = f"T={temperature:g} " if sampled else ""
    for r in range(warmup + repeats):
        timed = r >= warmup
        label = f"repeat {r - warmup + 1}/{repeats}" if timed else f"warm-up {r + 1}/{warmup}"
        for i, p in enumerate(prompts):
            order = ("baseline", "dflash") if (r + i) % 2 == 0 else ("dflash", "baseline")
            pair = {}
            for mode in order:
                if sampled:
                    kw["seed"] = sample_seed(seed, temperature, i, r, mode)
                if mode == "baseline":
                    pair[mode] = RunRecord.of(pipe.generate_baseline(p.ids, **kw))
                else:
                    pair[mode] = RunRecord.of(pipe.generate(p.ids, **kw))
            b, d = pair["baseline"], pair["dflash"]
            problems = []
            if not sampled and d.tokens != b.tokens:
                problems.append(
                    f"DFlash tokens differ from the target alone at index "
                    f"{first_difference(d.tokens, b.tokens)}"
                )
            for mode, rec in pair.items():
                if len(rec.tokens) != max_new_tokens:
                    problems.append(
                        f"{mode} produced {len(rec.tokens)} tokens, not {max_new_tokens} "
                        f"(stop: {rec.stop_reason})"
                    )
            if not sampled and timed and runs[i] and runs[i][0]["dflash"].tokens != d.tokens:
                problems.append("DFlash output changed between repeats (non-deterministic)")
            for msg in problems:
                failures.append({"prompt": p.name, "round": r, "problem": msg})
            if timed:
                runs[i].append(pair)
        progress(
            f"  {tag}{label}: {len(prompts)} prompts, {time.perf_counter() - t0:.0f} s elapsed"
            + (
                f", {len(failures)} {'PROBLEMS' if sampled else 'LOSSLESS FAILURES'}"
                if failures
                else ""
            )
        )
    return {"runs": runs, "failures": failures, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------- machine limits


def copy_bandwidth(nbytes: int = 256 << 20, reps: int = 9) -> dict:
    """numpy copy of a buffer far larger than the caches; bytes moved = read + write."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page before timing
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    s = stats.spread(times)
    return {
        "buffer_bytes": int(src.nbytes),
        "copy_s": s,
        "read_plus_write_Bps": 2 * src.nbytes / s["median"],
        "read_plus_write_Bps_best": 2 * src.nbytes / s["min"],
    }


def onnx_weight_bytes(onnx_path: str | os.PathLike) -> dict:
    """Initializer bytes of an ONNX program, split into tables only read through Gather (an
    embedding: one row per token is read) and weights every call reads in full."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    g = model.graph
    consumers: dict[str, list[tuple[str, int]]] = {}
    for node in g.node:
        for k, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, k))
    read = gathered = 0
    gathered_rows = 0
    for t in g.initializer:
        n = math.prod(t.dims) if t.dims else 1
        nb = n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        uses = consumers.get(t.name, [])
        if uses and all(op == "Gather" and k == 0 for op, k in uses) and len(t.dims) == 2:
            gathered += nb
            gathered_rows += nb // max(int(t.dims[0]), 1)  # bytes of one row
        else:
            read += nb
    return {"read_bytes": read, "gather_table_bytes": gathered, "gather_row_bytes": gathered_rows}


def kv_bytes(facts: dict, ctx_len: int) -> int:
    """Bytes of one program's KV cache (fp32), which the static-cache attention reads in full."""
    return (
        2 * int(facts["n_layers"]) * int(facts["n_kv_heads"]) * ctx_len * int(facts["head_dim"]) * 4
    )


def machine_info(threads: int | None) -> dict:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "memory_bytes": mem,
        "last_level_cache_bytes": last_level_cache_bytes(),
        "ort_threads": threads if threads else "onnxruntime default",
        "load_average_start": load_average(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions(),
    }


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest cache level (Linux sysfs), None when unknown."""
    best = (0, None)
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((d / "level").read_text())
            size = (d / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        try:
            nbytes = int(size.rstrip("KMG")) * mult
        except ValueError:
            continue
        if level > best[0]:
            best = (level, nbytes)
    return best[1]


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine competes with the timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in (
        "dflash-qaic",
        "onnxruntime",
        "onnx",
        "numpy",
        "torch",
        "transformers",
        "dflash",
        "matplotlib",
    ):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


# ---------------------------------------------------------------------------- peers


class _TimingStreamer:
    """A transformers streamer that stamps the arrival of each generated token."""

    def __init__(self):
        self.stamps: list[float] = []
        self.calls = 0

    def put(self, value):
        self.calls += 1
        if self.calls > 1:  # the first put is the prompt
            self.stamps.append(time.perf_counter())

    def end(self):
        pass


def _quiet_transformers() -> None:
    """No per-load progress bars from transformers in the benchmark's log."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def _peer_skip(manifest: dict) -> str | None:
    src = manifest.get("sources") or {}
    for who in ("target", "draft"):
        p = (src.get(who) or {}).get("path")
        if not p or not Path(p, "config.json").is_file():
            return (
                f"skipped: the source {who} checkpoint ({p}) is gone; the peers run the "
                "PyTorch checkpoints the artifacts were exported from"
            )
    try:
        from dflash_qaic.checkpoints import file_digest

        for who in ("target", "draft"):
            s = src[who]
            if s.get("sha256") and file_digest(s["path"]) != s["sha256"]:
                return f"skipped: the source {who} checkpoint at {s['path']} changed since export"
    except OSError as e:
        return f"skipped: cannot read the source checkpoints ({e})"
    try:
        import dflash.model  # noqa: F401
    except ImportError:
        return "skipped: the reference package `dflash` is not installed"
    return None


def run_peers(
    manifest: dict,
    prompts: list[Prompt],
    max_new_tokens: int,
    repeats: int,
    warmup: int,
    threads: int | None,
    ours: list[list[int]],
    progress: Progress = print,
) -> dict:
    """The reference `dflash_generate` (PyTorch eager, CPU) with the artifacts' block size and
    with block_size=1 (its own target-only baseline), and Hugging Face greedy `generate` of
    the target alone; same prompts, same token budget, alternating order; `warmup` passes of
    each over the first prompt, then `repeats` timed rounds over all prompts.
    `ours` holds our output tokens per prompt, to check the peers agree token for token."""
    skip = _peer_skip(manifest)
    if skip:
        return {"skipped": skip}
    import torch
    from dflash import model as ref

    from dflash_qaic.checkpoints import load_target_model

    ref._cuda_time = time.perf_counter  # the reference syncs CUDA; on CPU the wall clock
    _quiet_transformers()
    if threads:
        torch.set_num_threads(threads)
    src = manifest["sources"]
    target = load_target_model(src["target"]["path"])
    draft = ref.DFlashDraftModel.from_pretrained(src["draft"]["path"], dtype=torch.float32).eval()
    B = int(manifest["block_size"])
    eos = list(manifest.get("eos_token_ids") or [])
    pad = eos[0] if eos else 0
    names = ("reference_dflash", "reference_target", "hf_generate")
    runs = {n: [[] for _ in prompts] for n in names}
    t0 = time.perf_counter()

    def ref_run(ids, block_size):
        out = ref.dflash_generate(
            draft, target, ids, max_new_tokens, None, block_size=block_size, return_stats=True
        )
        toks = out.output_ids[0, ids.shape[1] :].tolist()
        return {
            "tokens": toks,
            "acceptance_lengths": [int(a) for a in out.acceptance_lengths],
            "ttft_s": float(out.time_to_first_token),
            "tpot_s": float(out.time_per_output_token),
        }

    def hf_run(ids):
        streamer = _TimingStreamer()
        t = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=pad,
                streamer=streamer,
            )
        t_end = time.perf_counter()
        s = streamer.stamps
        n = len(s)
        return {
            "tokens": out[0, ids.shape[1] :].tolist(),
            "ttft_s": s[0] - t,
            # the reference's convention: decode time (after the first token) / all new tokens
            "tpot_s": (t_end - s[0]) / n,
        }

    def one(n, ids):
        if n == "reference_dflash":
            return ref_run(ids, B)
        if n == "reference_target":
            return ref_run(ids, 1)
        return hf_run(ids)

    # Warm-up: each system on the first prompt (PyTorch's first calls allocate and dispatch
    # slowly); then the timed rounds over all prompts, the order alternating.
    for _ in range(warmup):
        for n in names:
            one(n, torch.tensor([prompts[0].ids], dtype=torch.long))
    for r in range(repeats):
        for i, p in enumerate(prompts):
            ids = torch.tensor([p.ids], dtype=torch.long)
            for n in names if (r + i) % 2 == 0 else names[::-1]:
                runs[n][i].append(one(n, ids))
        progress(f"  peers round {r + 1}/{repeats}: {time.perf_counter() - t0:.0f} s")

    out = {"torch_threads": torch.get_num_threads(), "seconds": time.perf_counter() - t0}
    for n in names:
        per_prompt = []
        for i, recs in enumerate(runs[n]):
            per_prompt.append(
                {
                    "prompt": prompts[i].name,
                    "tpot_s": [x["tpot_s"] for x in recs],
                    "ttft_s": [x["ttft_s"] for x in recs],
                    "tokens_match_ours": all(x["tokens"] == ours[i] for x in recs),
                    "first_difference": first_difference(recs[0]["tokens"], ours[i]),
                    "acceptance_lengths": recs[0].get("acceptance_lengths"),
                }
            )
        out[n] = per_prompt
    return out


# ---------------------------------------------------------------------------- cost profile

# Published Hugging Face configs (Qwen/Qwen3-*) and the z-lab b16 draft recipe (5 layers,
# 5 target-layer taps, block 16). The 0.6B and 1.7B drafts assume the same recipe.
SHAPES = {
    "qwen3-0.6b": dict(H=1024, L=28, heads=16, kv=8, hd=128, inter=3072, tied=True),
    "qwen3-1.7b": dict(H=2048, L=28, heads=16, kv=8, hd=128, inter=6144, tied=True),
    "qwen3-4b": dict(H=2560, L=36, heads=32, kv=8, hd=128, inter=9728, tied=True),
    "qwen3-8b": dict(H=4096, L=36, heads=32, kv=8, hd=128, inter=12288, tied=False),
}
QWEN3_VOCAB = 151936
DRAFT_LAYERS, TAPS, PROFILE_BLOCK = 5, 5, 16
# Target layers built by default: enough to be that shape, few enough for ~12 GB of RAM.
DEFAULT_PROFILE_LAYERS = {"qwen3-0.6b": 8, "qwen3-1.7b": 4, "qwen3-4b": 2, "qwen3-8b": 1}


def parse_shape(spec: str) -> dict:
    """`name[:target_layers[:draft_layers]]`, e.g. `qwen3-0.6b`, `qwen3-0.6b:28`, `qwen3-4b:2:1`."""
    parts = spec.strip().lower().split(":")
    name = parts[0]
    if name not in SHAPES:
        raise BenchError(f"unknown profile shape {name!r}: known {', '.join(SHAPES)}")
    full = SHAPES[name]
    try:
        L = int(parts[1]) if len(parts) > 1 and parts[1] else DEFAULT_PROFILE_LAYERS[name]
        Ld = int(parts[2]) if len(parts) > 2 and parts[2] else DRAFT_LAYERS
    except ValueError as e:
        raise BenchError(f"profile shape {spec!r}: layer counts must be integers") from e
    if not (1 <= L <= full["L"] and 1 <= Ld <= DRAFT_LAYERS):
        raise BenchError(
            f"profile shape {spec!r}: target layers must be 1 … {full['L']}, draft layers "
            f"1 … {DRAFT_LAYERS}"
        )
    return {"name": name, "spec": spec, "target_layers": L, "draft_layers": Ld, **full}


def tap_ids(n_layers: int, taps: int = TAPS) -> list[int]:
    """Distinct target-layer ids: the published rule when it gives distinct ids, else spread."""
    from dflash_qaic.checkpoints import default_target_layer_ids

    ids = default_target_layer_ids(n_layers, taps)
    if len(set(ids)) == taps and all(0 <= i < n_layers for i in ids):
        return ids
    k = min(taps, n_layers)
    return sorted({round(x) for x in np.linspace(0, n_layers - 1, k)})


def layer_bytes(s: dict) -> int:
    """fp32 bytes of one decoder layer (attention, MLP, norms) of shape `s`."""
    H, q, kv, inter = s["H"], s["heads"] * s["hd"], s["kv"] * s["hd"], s["inter"]
    return 4 * (H * q + 2 * H * kv + q * H + 3 * H * inter + 2 * s["hd"] + 2 * H)


def _zero_feeds(specs: list[dict], symbols: dict) -> dict[str, np.ndarray]:
    """Inputs of one call with every symbol bound: zeros, positions 0, 1, 2, …"""
    feeds = {}
    for i in specs:
        shape = [symbols[d] if isinstance(d, str) else d for d in i["shape"]]
        a = np.zeros(shape, np.dtype(i["dtype"]))
        if "position" in i["name"]:
            a[...] = np.arange(shape[-1])
        feeds[i["name"]] = a
    return feeds


_LAYER_NODE = re.compile(r"/layers\.(\d+)/")


def layer_profile(
    onnx_path,
    inputs: list[dict],
    symbols: dict,
    seq_lens: dict[str, int],
    n_layers: int,
    threads: int | None,
    runs: int = 3,
) -> dict:
    """Per-layer kernel time of a program, from ONNX Runtime's node profiler.

    A node belongs to decoder layer i when its name holds `/layers.i/`; the cache writes
    (inlined `CtxScatter` functions, one per K and V of every layer) lose that prefix and are
    shared evenly among the layers. Returns {kind: {layer_s, other_s}} (medians over runs).
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    tmp = tempfile.mkdtemp(prefix="dflash-bench-ortprof-")
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tmp, "p")
    try:
        sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        order = []
        for kind, seq in seq_lens.items():
            feeds = _zero_feeds(inputs, {**symbols, "seq_len": seq})
            for r in range(runs + 1):  # the first run of each kind warms up
                sess.run(None, feeds)
                order.append((kind, r > 0))
        events = json.loads(Path(sess.end_profiling()).read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    windows = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    if len(windows) != len(order):
        return {}
    per: dict[str, list[tuple[float, float]]] = {k: [] for k in seq_lens}
    for (kind, timed), w in zip(order, windows):
        if not timed:
            continue
        lo, hi = w["ts"], w["ts"] + w["dur"]
        inside = [e for e in nodes if lo <= e["ts"] <= hi]
        layer = sum(e["dur"] for e in inside if _LAYER_NODE.search(e["name"]))
        scatter = sum(e["dur"] for e in inside if "CtxScatter" in e["name"])
        total = sum(e["dur"] for e in inside)
        per[kind].append(((layer + scatter) / n_layers * 1e-6, (total - layer - scatter) * 1e-6))
    return {
        k: {
            "layer_s": stats.median(x[0] for x in v),
            "other_s": stats.median(x[1] for x in v),
        }
        for k, v in per.items()
        if v
    }


def profile_shape(
    spec: str,
    threads: int | None,
    workdir: str | None = None,
    ctx_len: int = 512,
    calls: int = 16,
    repeats: int = 2,
    progress: Progress = print,
) -> dict:
    """Random-weight programs of a real shape: build, export (no compile), time per call.

    With fewer layers than the real model, the full-depth estimate adds, per missing layer,
    the per-layer kernel time ONNX Runtime's profiler measured for that kind of call.
    """
    import gc

    import dflash_qaic
    from dflash_qaic.export.artifacts import ExportOptions, build_artifacts
    from dflash_qaic.tiny import make_tiny_pair

    _quiet_transformers()
    s = parse_shape(spec)
    L, Ld = s["target_layers"], s["draft_layers"]
    B = PROFILE_BLOCK
    taps = tap_ids(L)
    built_full = L == s["L"] and Ld == DRAFT_LAYERS
    tmp = Path(tempfile.mkdtemp(prefix="dflash-bench-profile-", dir=workdir))
    t0 = time.perf_counter()
    try:
        progress(f"  {spec}: writing random checkpoints ({L} target / {Ld} draft layers)")
        tdir, ddir = make_tiny_pair(
            tmp / "pair",
            family="qwen3",
            hidden_size=s["H"],
            target_layers=L,
            draft_layers=Ld,
            num_heads=s["heads"],
            num_kv_heads=s["kv"],
            head_dim=s["hd"],
            intermediate_size=s["inter"],
            vocab_size=QWEN3_VOCAB,
            block_size=B,
            target_layer_ids=taps,
            tie_word_embeddings=s["tied"],
        )
        progress(f"  {spec}: exporting (ctx_len {ctx_len}, no compile)")
        m = build_artifacts(
            tdir,
            ddir,
            tmp / "art",
            ExportOptions(prefill_seq_len=32, ctx_len=ctx_len, compile=False, fp16_check=False),
            progress=lambda _msg: None,
        )
        shutil.rmtree(tmp / "pair", ignore_errors=True)
        t_build = time.perf_counter() - t0
        art = tmp / "art"
        wt = onnx_weight_bytes(art / m["target"]["onnx"])
        wd = onnx_weight_bytes(art / m["draft"]["onnx"])
        progress(f"  {spec}: timing ({repeats} × {calls} calls of each kind)")
        pipe = dflash_qaic.load(art, backend="ort", threads=threads, tokenizer=False)
        prompt = random_prompts(m, 1, 48, seed=1)[0].ids
        times: dict[str, list[float]] = {}
        host: list[float] = []
        for r in range(repeats + 1):  # the first round warms up
            b = pipe.generate_baseline(prompt, max_new_tokens=calls + 1, stop_token_ids=[])
            d = pipe.generate(prompt, max_new_tokens=calls + 1, stop_token_ids=[])
            if r == 0:
                continue
            for res in (b, d):
                for k, v in res.call_times.items():
                    times.setdefault(k, []).extend(v)
            steps = d.stats["steps"]
            calls_s = sum(d.call_times.get("verify", ())) + sum(d.call_times.get("draft", ()))
            host.append((d.stats["decode_s"] - calls_s) / max(steps, 1))
        del pipe, b, d
        gc.collect()
        layers = {}
        if not built_full:
            progress(f"  {spec}: per-layer kernel times (ONNX Runtime profiler)")
            sym = {"batch_size": 1, "ctx_len": ctx_len}
            layers["target"] = layer_profile(
                art / m["target"]["onnx"],
                m["target"]["inputs"],
                sym,
                {"decode": 1, "verify": B},
                L,
                threads,
            )
            layers["draft"] = layer_profile(
                art / m["draft"]["onnx"], m["draft"]["inputs"], sym, {"draft": B}, Ld, threads
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    per_call = {k: stats.spread(v) for k, v in times.items() if k in ("decode", "verify", "draft")}
    Td, Tv, Tdr = (per_call[k]["median"] for k in ("decode", "verify", "draft"))
    Th = stats.median(host)
    taus = list(range(1, B + 1))
    full = None
    if not built_full:
        lt, ld = layers.get("target", {}), layers.get("draft", {})
        if {"decode", "verify"} <= set(lt) and "draft" in ld:
            add_t, add_d = s["L"] - L, DRAFT_LAYERS - Ld
            # the fc over more taps: priced like decoder-layer weights of the same call
            fc_extra = (len(tap_ids(s["L"])) - len(taps)) * s["H"] * s["H"] * 4 / layer_bytes(s)
            f = {
                "decode": Td + (add_t + fc_extra) * lt["decode"]["layer_s"],
                "verify": Tv + (add_t + fc_extra) * lt["verify"]["layer_s"],
                "draft": Tdr + add_d * ld["draft"]["layer_s"],
            }
            full = {
                "target_layers": s["L"],
                "draft_layers": DRAFT_LAYERS,
                "layer_s": {
                    "decode": lt["decode"]["layer_s"],
                    "verify": lt["verify"]["layer_s"],
                    "draft": ld["draft"]["layer_s"],
                },
                "method": "measured time + missing layers × profiled per-layer kernel time",
                "per_call_s": f,
                "break_even_tau": stats.break_even_tau(f["decode"], f["verify"], f["draft"], Th),
                "predicted": stats.predicted_speedups(
                    f["decode"], f["verify"], f["draft"], Th, taus
                ),
            }
    return {
        "spec": spec,
        "shape": {k: s[k] for k in ("name", "H", "L", "heads", "kv", "hd", "inter", "tied")},
        "vocab_size": QWEN3_VOCAB,
        "block_size": B,
        "ctx_len": ctx_len,
        "built": {"target_layers": L, "draft_layers": Ld, "target_layer_ids": taps},
        "weight_bytes": {"target": wt, "draft": wd},
        "onnx_bytes": {"target": m["target"]["onnx_bytes"], "draft": m["draft"]["onnx_bytes"]},
        "per_call_s": per_call,
        "host_per_step_s": Th,
        "break_even_tau": stats.break_even_tau(Td, Tv, Tdr, Th),
        "predicted": stats.predicted_speedups(Td, Tv, Tdr, Th, taus),
        "full_depth": full,
        "full_depth_missing": None
        if built_full or full
        else "the ONNX Runtime profile attributed no time to decoder layers; no extrapolation",
        "build_s": t_build,
        "seconds": time.perf_counter() - t0,
    }
