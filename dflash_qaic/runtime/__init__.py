"""The host runtime: load an artifacts directory on a backend and generate.

import dflash_qaic
pipe = dflash_qaic.load("artifacts/", backend="ort")   # "ort" | "qaic" | "auto"
res = pipe.generate(prompt_ids, max_new_tokens=64)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dflash_qaic.manifest import (
    VERIFY_MODES,
    ArtifactsError,
    Manifest,
    Program,
    inside,
    read_manifest,
)
from dflash_qaic.runtime import devices
from dflash_qaic.runtime.backends import (
    BackendError,
    OrtProgram,
    QaicProgram,
    StrictStandinSession,
    qaic_available,
    qaic_session_factory,
)
from dflash_qaic.runtime.devices import profile_placement
from dflash_qaic.runtime.pipeline import GenerationError, GenerationResult, Pipeline

BACKENDS = ("ort", "qaic", "auto", "qaic-standin")
#: single-sequence programs up to this size run on one ONNX Runtime thread by default: their
#: ops are so small that waking a second thread per op costs more than it saves (default pair:
#: verify 2.7 -> 2.0 ms, decode 1.1 -> 0.7 ms with 1 thread instead of 2); with continuous
#: batching the calls have N times the rows and the cores pay off again
SMALL_PROGRAMS_BYTES = 64 << 20

__all__ = [
    "ArtifactsError",
    "Manifest",
    "BackendError",
    "GenerationError",
    "GenerationResult",
    "Pipeline",
    "load",
]


def _qpc_path(d: Path, prog: Program, name: str) -> Path:
    if len(prog.qpcs) > 1:  # a separate prefill QPC: see docs/DESIGN.md, Disaggregated prefill
        raise ArtifactsError(
            f"the {name} program of {d} is split over {len(prog.qpcs)} QPCs "
            f"({', '.join(q.part for q in prog.qpcs)}): these artifacts come from an older "
            "version compiled with a disaggregated profile, which is no longer supported; "
            "re-export them (dflash-export, with a profile from qpc_configs/)"
        )
    if not prog.qpcs or not prog.qpcs[0].ready:
        raise BackendError(
            f"the {name} program of {d} has no compiled QPC (compilation was skipped: no "
            "qaic-compile on the exporting host). Run the commands in "
            f"{d}/{name}/qpc-*/compile.cmd from {d} on an AI100 host, or re-export there"
        )
    return inside(d, prog.qpcs[0].qpc, f"{name}.qpc")


def _io(prog: Program) -> tuple[list[dict], list[dict]]:
    """The program's inputs and outputs as the backends take them (from the contract object)."""

    def spec(s):
        return {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}

    return [spec(s) for s in prog.io.inputs], [spec(s) for s in prog.io.outputs]


def _check_args(backend, threads, tokenizer, verify) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS[:3])}")
    max_threads = 4 * (os.cpu_count() or 1)
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= max_threads
    ):
        raise BackendError(
            f"threads must be None or an integer in [1, {max_threads}] (4 per core), got {threads!r}"
        )
    if not isinstance(tokenizer, bool):
        raise BackendError(f"tokenizer must be True or False, got {tokenizer!r}")
    if verify not in VERIFY_MODES:
        raise BackendError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _hub_id_hint(given, d: Path) -> None:
    """A Hugging Face model id given where an artifacts directory belongs: say how to make one.
    ("org/name" with no `org` directory here; under an existing directory it is a path.)"""
    if (
        d.exists()
        or d.parent.exists()
        or not isinstance(given, str)
        or not _HUB_ID.fullmatch(given)
    ):
        return
    name = given.split("/")[1]
    out = f"artifacts/{name.lower()}"
    raise ArtifactsError(
        f"there is no artifacts directory {given!r}, and it looks like a Hugging Face model id: "
        "dflash_qaic.load runs the programs dflash-export writes. Export the model with its "
        f"DFlash draft first, e.g. `dflash-export --target {given} --draft "
        f"z-lab/{name}-DFlash-b16 --out {out}` (the draft: a DFlash draft trained for this "
        f"target), then `dflash_qaic.load({out!r})`"
    )


def load(
    artifacts_dir: str | os.PathLike,
    backend: str = "ort",
    *,
    threads: int | None = None,
    tokenizer: bool = True,
    verify: str = "fast",
    device_ids=None,
) -> Pipeline:
    """Load an artifacts directory written by `dflash-export`.

    artifacts_dir: the directory holding manifest.json.
    backend: "ort" (ONNX Runtime, any machine), "qaic" (AI100 via QEfficient/qaicrt), "auto"
        (qaic when its runtime and compiled QPCs are present, else ort), or "qaic-standin"
        (the AI100 buffer logic over ONNX Runtime, for tests without a card).
    threads: ONNX Runtime intra-op threads, 1 … 4 × cores (None: 1 for single-sequence
        programs up to 64 MiB, else ONNX Runtime's default, one per core).
    tokenizer: load the tokenizer the artifacts carry (text prompts, `res.text`); False skips it.
    verify: "fast" checks every file's size and sha256, taking the sha256 of a file unchanged
        since it was last verified from the cache of verified files (dflash_qaic/files.py);
        "full" hashes every file now; "none" checks only that they exist.
    device_ids: where this replica's programs run (None: where the compile profile put them).
        A list, e.g. [4] or [4, 5], is the replica's device group: the profile's devices, in
        increasing order, renamed to these; {"target": [...], "draft": [...]} names each
        program's own (the two may share a device only where the profile has them share one).
        Distinct ints ≥ 0; on "qaic" they must exist on the host. ONNX Runtime records them
        (`pipe.device_ids`) for reports. See dflash_qaic/runtime/devices.py.

    Raises ArtifactsError for a missing, incomplete, damaged or untrusted directory (every
    manifest path must stay inside it), BackendError for a backend that cannot run here.
    """
    _check_args(backend, threads, tokenizer, verify)
    d = Path(artifacts_dir)
    _hub_id_hint(artifacts_dir, d)
    m = read_manifest(d, verify=verify)
    if backend == "auto":
        backend = "qaic" if m.compiled and qaic_available() else "ort"
    placement = None if device_ids is None else devices.place(device_ids, profile_placement(m))
    if backend == "qaic":
        if placement is None:
            placement = profile_placement(m)
        else:
            devices.check_present(placement, devices.host_devices())

    small = m.target.onnx_bytes + m.draft.onnx_bytes <= SMALL_PROGRAMS_BYTES
    if threads is None and small and m.full_batch_size is None:
        threads = 1
    symbols = {"batch_size": m.batch_size, "ctx_len": m.ctx_len}
    if m.full_batch_size is not None:  # continuous batching: the caches have this many rows
        symbols["full_batch_size"] = m.full_batch_size
    programs = {}
    for name in ("target", "draft"):
        prog = m.program(name)
        inputs, outputs = _io(prog)
        specs = [dict(s) for s in prog.specializations]
        onnx_path = inside(d, prog.onnx, f"{name}.onnx")
        if backend == "ort":
            programs[name] = OrtProgram(onnx_path, inputs, outputs, symbols, threads)
        elif backend == "qaic-standin":
            session = StrictStandinSession(onnx_path, inputs, outputs, specs)
            programs[name] = QaicProgram(session, inputs, outputs, specs)
        else:
            factory = qaic_session_factory()
            qpc = _qpc_path(d, prog, name)
            session = factory(str(qpc), device_ids=list(getattr(placement, name)))
            programs[name] = QaicProgram(session, inputs, outputs, specs)

    tok = None
    if tokenizer and m.tokenizer:
        from dflash_qaic.runtime.tokenizer import TokenizerError, load_tokenizer

        try:
            tok = load_tokenizer(inside(d, m.tokenizer))
        except TokenizerError as e:
            raise ArtifactsError(str(e)) from e
    return Pipeline(
        m,
        programs["target"],
        programs["draft"],
        tok,
        backend=backend,
        threads=threads,
        device_ids=placement,
    )
