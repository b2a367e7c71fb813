"""Shared fixtures: tiny pairs written once per session in the real on-disk formats."""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from dflash_lab.tiny import make_tiny_pair

# the cache of checked artifact files (dflash_qaic/artifacts/files.py): one per test run, not the user's
os.environ.setdefault("DFLASH_QAIC_CACHE_DIR", tempfile.mkdtemp(prefix="dflash-qaic-cache-"))


def _key(kw: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in sorted(kw.items())).replace(" ", "")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """tiny_pair(family="qwen3", **TinySpec fields) -> (target_dir, draft_dir), cached."""
    cache: dict[str, tuple] = {}

    def make(**kw):
        k = _key(kw)
        if k not in cache:
            cache[k] = make_tiny_pair(tmp_path_factory.mktemp("pair"), **kw)
        return cache[k]

    return make


@pytest.fixture(scope="session")
def planned_chunks():
    """planned_chunks(n, lengths) -> the prefill call lengths of an n-token prompt, call by call
    (contract.plan_prefill, as the engine applies it)."""
    from dflash_qaic import contract

    def plan(n: int, lengths: list[int]) -> list[int]:
        out = []
        while n > 0:
            out.append(contract.plan_prefill(n, lengths))
            n -= out[-1]
        return out

    return plan


@pytest.fixture(scope="session", autouse=True)
def _reference_on_cpu():
    """dflash 0.1.0 times with torch.cuda.synchronize; on a CPU machine use the wall clock."""
    import dflash.model as ref

    ref._cuda_time = time.perf_counter


@pytest.fixture(scope="session")
def default_artifacts(tmp_path_factory):
    """The built-in default pair exported once per session (`dflash-export --out DIR`)."""
    from dflash_qaic.export.cli import main

    out = tmp_path_factory.mktemp("default-pair")
    assert main(["--out", str(out), "--no-compile", "--quiet"]) == 0
    return out


@pytest.fixture(scope="session")
def cb_artifacts(tmp_path_factory):
    """The built-in default pair exported once per session with --full-batch-size 4 (prefill
    chunk 64, ctx 1024) and --structured-output: the serving tests' continuous-batching
    artifacts (a row without a grammar runs exactly as without the option)."""
    import dflash_qaic
    from dflash_qaic.export.cli import load_recipe

    r = load_recipe("default")
    out = tmp_path_factory.mktemp("default-pair-cb")
    dflash_qaic.export(
        r["target"],
        r["draft"],
        out,
        full_batch_size=4,
        compile=False,
        prefill_seq_len=64,
        ctx_len=1024,
        structured_output=True,
    )
    return out
