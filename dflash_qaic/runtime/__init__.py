"""The host runtime: load an artifacts directory on a backend and generate.

import dflash_qaic
pipe = dflash_qaic.load("artifacts/", backend="ort")   # "ort" | "qaic" | "auto"
res = pipe.generate(prompt_ids, max_new_tokens=64)
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash_qaic.manifest import ArtifactsError, read_manifest
from dflash_qaic.runtime.backends import (
    BackendError,
    OrtProgram,
    QaicProgram,
    StrictStandinSession,
    qaic_available,
    qaic_session_factory,
)
from dflash_qaic.runtime.pipeline import GenerationError, GenerationResult, Pipeline

BACKENDS = ("ort", "qaic", "auto", "qaic-standin")

__all__ = [
    "ArtifactsError",
    "BackendError",
    "GenerationError",
    "GenerationResult",
    "Pipeline",
    "load",
]


def _symbols(m: dict) -> dict:
    return {"batch_size": int(m["batch_size"]), "ctx_len": int(m["ctx_len"])}


def _qpc_path(d: Path, prog: dict, name: str) -> Path:
    qpcs = [q for q in prog.get("qpc") or [] if q.get("status") != "skipped"]
    if not qpcs:
        raise BackendError(
            f"the {name} program of {d} has no compiled QPC (compilation was skipped: no "
            "qaic-compile on the exporting host). Run the commands in "
            f"{d}/{name}/qpc-*/compile.cmd on an AI100 host, or re-export there"
        )
    if len(qpcs) > 1:
        raise BackendError(
            f"the {name} program of {d} is split over {len(qpcs)} QPCs (disaggregated "
            "profile); this runtime runs one QPC per program: export with another profile"
        )
    return d / qpcs[0]["qpc"]


def load(
    artifacts_dir: str | os.PathLike,
    backend: str = "ort",
    *,
    threads: int | None = None,
    tokenizer: bool = True,
) -> Pipeline:
    """Load an artifacts directory written by `dflash-export`.

    backend: "ort" (ONNX Runtime, any machine), "qaic" (AI100 via QEfficient/qaicrt), "auto"
        (qaic when its runtime and compiled QPCs are present, else ort), or "qaic-standin"
        (the AI100 buffer logic over ONNX Runtime, for tests without a card).
    threads: ONNX Runtime intra-op threads (None: ONNX Runtime's default).
    """
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS[:3])}")
    d = Path(artifacts_dir)
    m = read_manifest(d)
    if backend == "auto":
        compiled = all(
            any(q.get("status") != "skipped" for q in m[p].get("qpc") or [])
            for p in ("target", "draft")
        )
        backend = "qaic" if compiled and qaic_available() else "ort"

    programs = {}
    for name in ("target", "draft"):
        prog = m[name]
        onnx_path = d / prog["onnx"]
        if backend == "ort":
            programs[name] = OrtProgram(
                onnx_path, prog["inputs"], prog["outputs"], _symbols(m), threads
            )
        elif backend == "qaic-standin":
            session = StrictStandinSession(
                onnx_path, prog["inputs"], prog["outputs"], prog["specializations"]
            )
            programs[name] = QaicProgram(
                session, prog["inputs"], prog["outputs"], prog["specializations"]
            )
        else:
            factory = qaic_session_factory()
            qpc = _qpc_path(d, prog, name)
            devices = (prog.get("qpc") or [{}])[0].get("device_ids")
            session = factory(str(qpc), device_ids=devices)
            programs[name] = QaicProgram(
                session, prog["inputs"], prog["outputs"], prog["specializations"]
            )

    tok = None
    if tokenizer and m.get("tokenizer"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(d / m["tokenizer"], local_files_only=True)
    return Pipeline(m, programs["target"], programs["draft"], tok, backend=backend)
