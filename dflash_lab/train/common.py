"""Pieces both trainers share: determinism, the learning-rate schedule, atomic checkpoints."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path

import torch


@contextlib.contextmanager
def torch_settings(seed: int, threads: int):
    """Within: a fixed thread count (CPU reductions split by thread, so results depend on it), the
    global seed, deterministic kernels preferred. The caller's settings are restored on exit."""
    prev = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_rng_state(),
    )
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(prev[0])
        torch.use_deterministic_algorithms(prev[1], warn_only=prev[2])
        torch.set_rng_state(prev[3])


def step_generator(seed: int, step: int) -> torch.Generator:
    """The data RNG of one step: a function of (seed, step) only, so a resumed run draws exactly
    what an uninterrupted run draws."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine decay to `min_ratio · peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def atomic_save(obj, path: str | Path) -> None:
    """torch.save to a temporary name in the same directory, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_safetensors_atomic(state: dict[str, torch.Tensor], path: str | Path) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


THREADS_HELP = (
    "torch threads (default 1: on a small shared CPU, per-op thread synchronisation costs more "
    "than it saves for these small matrices; results depend on the thread count)"
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Log:
    """Appends one JSON object per line to `path` (kept across resumes)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, **row) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"time": round(time.time(), 2), **row}) + "\n")


def load_state(path: Path):
    """A training-state file (checkpoint, sequence cache) as tensors and plain containers only
    (`weights_only`): a planted file cannot run code, it is refused with a clear error."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise SystemExit(
            f"--resume: {path} is not training state this trainer wrote (it is damaged or holds "
            f"more than tensors and plain data, and is not unpickled: {str(e).splitlines()[0]}); "
            "delete it, or train into a new --out"
        ) from e


def load_checkpoint(path: Path, expect: dict) -> dict:
    """The checkpoint at `path`, after checking that it was made with the same settings."""
    ckpt = load_state(path)
    saved = ckpt.get("settings", {})
    diff = {k: (saved.get(k), v) for k, v in expect.items() if saved.get(k) != v}
    if diff:
        lines = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise SystemExit(f"--resume: {path} was made with other settings ({lines})")
    return ckpt


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (β 0.9 / 0.95) with weight decay on matrices only (not norms or biases)."""
    params = list(model.parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def resume(ckpt_path: Path, settings: dict, model, key: str, opt) -> tuple[int, list, float]:
    """Restore model, optimizer and RNG from a checkpoint; returns (step, history, elapsed)."""
    import sys

    ckpt = load_checkpoint(ckpt_path, settings)
    model.load_state_dict(ckpt[key])
    opt.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"])
    print(f"resumed from {ckpt_path} at step {ckpt['step']}", file=sys.stderr)
    return ckpt["step"], ckpt["history"], ckpt["elapsed"]
