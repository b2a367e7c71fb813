"""The host runtime: load an artifacts directory on a backend and generate.

import dflash_qaic
pipe = dflash_qaic.load("artifacts/", backend="ort")   # "ort" | "qaic" | "auto"
res = pipe.generate(prompt_ids, max_new_tokens=64)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dflash_qaic.artifacts.manifest import (
    ArtifactsError,
    Manifest,
    ProgramRecord,
    inside,
    read_manifest,
)
from dflash_qaic.runtime import devices, options
from dflash_qaic.runtime.backends import (
    BackendError,
    Capabilities,
    OrtProgram,
    QaicProgram,
    StrictStandinSession,
    qaic_available,
    qaic_session_factory,
)
from dflash_qaic.runtime.devices import profile_placement
from dflash_qaic.runtime.options import LoadOptions
from dflash_qaic.runtime.pipeline import GenerationError, GenerationResult, Pipeline

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


def _qpc_path(d: Path, prog: ProgramRecord, name: str) -> Path:
    if prog.qpc is None or not prog.qpc.ready:
        raise BackendError(
            f"the {name} program of {d} has no compiled QPC (compilation was skipped: no "
            "qaic-compile on the exporting host). Run the commands in "
            f"{d}/{name}/qpc-*/compile.cmd from {d} on an AI100 host, or re-export there"
        )
    return inside(d, prog.qpc.qpc, f"{name}.qpc")


def _io(prog: ProgramRecord) -> tuple[list[dict], list[dict]]:
    """The program's inputs and outputs as the backends take them (from the contract object)."""

    def spec(s):
        return {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}

    return [spec(s) for s in prog.io.inputs], [spec(s) for s in prog.io.outputs]


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


def _programs(d: Path, m: Manifest, backend: str, threads, placement) -> dict:
    """Every program on `backend` (role → the runtime's program object, runtime/backends.py),
    each with its state specs and capabilities."""
    symbols = {"batch_size": m.batch_size, "ctx_len": m.ctx_len}
    if m.full_batch_size is not None:  # continuous batching: the caches have this many rows
        symbols["full_batch_size"] = m.full_batch_size
    programs = {}
    for name, prog in m.programs.items():
        inputs, outputs = _io(prog)
        specs = [dict(s) for s in prog.specializations]
        onnx_path = inside(d, prog.onnx, f"{name}.onnx")
        declared = {"state": prog.state, "capabilities": Capabilities.of(name, prog.io)}
        if backend == "ort":
            programs[name] = OrtProgram(onnx_path, inputs, outputs, symbols, threads, **declared)
        elif backend == "qaic-standin":
            session = StrictStandinSession(onnx_path, inputs, outputs, specs, prog.state)
            programs[name] = QaicProgram(session, inputs, outputs, specs, **declared)
        else:
            factory = qaic_session_factory()
            qpc = _qpc_path(d, prog, name)
            session = factory(str(qpc), device_ids=list(getattr(placement, name)))
            programs[name] = QaicProgram(session, inputs, outputs, specs, **declared)
    return programs


_D = LoadOptions()


def load(
    artifacts_dir: str | os.PathLike,
    backend: str = _D.backend,
    *,
    threads: int | None = _D.threads,
    tokenizer: bool = _D.tokenizer,
    check_files: str = _D.check_files,
    device_ids=_D.device_ids,
    verify: str | None = None,
) -> Pipeline:
    """Load an artifacts directory written by `dflash-export`.

    artifacts_dir: the directory holding manifest.json. The options (runtime/options.py, the
    table the commands' flags come from too):
    {options}
    device_ids, further: a list, e.g. [4] or [4, 5], is the replica's device group;
        {"target": [...], "draft": [...]} names each program's own (the two may share a device
        only where the profile has them share one). Distinct ints ≥ 0; on "qaic" they must
        exist on the host (dflash_qaic/runtime/devices.py).
    verify: the old name of check_files (a DeprecationWarning).

    Raises ArtifactsError for a missing, incomplete, damaged or untrusted directory (every
    manifest path must stay inside it), BackendError for a backend that cannot run here.
    """
    if verify is not None:
        options.deprecated("load(verify=...)", "load(check_files=...)")
        check_files = verify
    LoadOptions(  # checks every value
        backend=backend,
        threads=threads,
        tokenizer=tokenizer,
        check_files=check_files,
        device_ids=device_ids,
    )
    d = Path(artifacts_dir)
    _hub_id_hint(artifacts_dir, d)
    m = read_manifest(d, check_files=check_files)
    if backend == "auto":
        backend = "qaic" if m.compiled and qaic_available() else "ort"
    placement = None if device_ids is None else devices.place(device_ids, profile_placement(m))
    if backend == "qaic":
        devices.check_generation(m, devices.host_generation())  # QPCs for this card's kind
        if placement is None:
            placement = profile_placement(m)
        else:
            devices.check_present(placement, devices.host_devices())

    small = sum(p.onnx_bytes for p in m.programs.values()) <= SMALL_PROGRAMS_BYTES
    if threads is None and small and m.full_batch_size is None:
        threads = 1
    programs = _programs(d, m, backend, threads, placement)
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


load.__doc__ = load.__doc__.replace("    {options}", options.docs())
