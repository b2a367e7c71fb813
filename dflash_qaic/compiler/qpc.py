"""The compiler step: specializations.json, custom_io.yaml, the compiler command line, the QPC cache.

For one program (target or draft) `compile_program` writes, under the program's directory::

    <program_dir>/qpc-<key>/specializations.json   the specializations this QPC serves
    <program_dir>/qpc-<key>/custom_io.yaml         KV cache precision of every past_* in/out
    <program_dir>/qpc-<key>/mdp.json               only when the program is tensor-sliced
    <program_dir>/qpc-<key>/compile.cmd            the exact command line (shell-quoted)
    <program_dir>/qpc-<key>/qpc/programqpc.bin     the binary; its presence marks a finished QPC

`<key>` is the first 16 hex digits of a sha256 over everything that affects the binary: the
ONNX bytes (and every external-data file it references), the specializations.json and
custom_io.yaml texts, the mdp config, the command-line flags (paths normalised, so moving the
artifacts directory keeps the key) and the compiler's path. `device_ids` are not in it: they
say where the runtime loads a QPC, not how it is built.

Paths in `compile.cmd` (and in the manifest) are relative to the artifacts directory (`root`,
by default the program directory's parent), so a directory exported elsewhere can be copied to
an AI100 host and compiled there: `cd ARTIFACTS && sh target/qpc-<key>/compile.cmd`.

The compiler runs in its own process (one per QPC: back-to-back compiles in one process have
segfaulted) and its own process group, with the artifacts directory as working directory. It
writes into a staging directory `qpc-<key>/.build-*/qpc`, and only a run that exits 0 *and*
wrote a plausible `programqpc.bin` (a regular file of at least MIN_QPC_BYTES) is renamed to
`qpc-<key>/qpc`; so a directory that looks finished always is. A run that exceeds the timeout
(profile `compile_timeout_s`), or is interrupted (Ctrl-C; SIGTERM once the CLI turns it into an
exception), is killed with its whole process group and its staging folder removed; if this
process itself is killed, the kernel sends the compiler SIGKILL (PR_SET_PDEATHSIG). Its stdout
and stderr are kept in `qpc-<key>/compile.{stdout,stderr}.log`. The command that runs is
`compile.cmd` with one difference: `-aic-binary-dir` names the staging directory instead of
`qpc-<key>/qpc`. Running `compile.cmd` by hand on an AI100 host writes `qpc-<key>/qpc`
directly, which the cache then accepts.

Without a compiler the step still writes everything but the binary and returns a result with
`skipped=True`, the places it looked, and the commands to run on an AI100 host.

Each program compiles to one QPC serving all its specializations.

Continuous batching (programs exported with `full_batch_size` N) changes only the inputs: every
specialization binds `full_batch_size` (the cache rows, one value in all of them), Prefill and
DraftPrefill run at `batch_size` 1 and the others at N; `custom_io.yaml` still lists the `past_*`
caches only (`batch_index` is an ordinary int64 input). The command line is the same: QEfficient
compiles its continuous-batching models with no extra flag either (QEfficient
`transformers/models/modeling_auto.py`, `QEFFAutoModelForCausalLM.compile`: the same
`_compile` options, `full_batch_size` only in `build_prefill_specialization` /
`build_decode_specialization`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_qaic import contract, state
from dflash_qaic.compiler.profiles import (
    KV_DTYPES,
    SPECIALIZATION_FORMATS,
    CompileProfile,
    ProgramProfile,
)

try:  # POSIX only; AI100 hosts are Linux
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

COMPILER_ENV = "QAIC_COMPILER"
#: where the AI100 Apps/Platform SDK installs its compilers (tests may point this elsewhere)
SDK_EXEC_DIR = Path("/opt/qti-aic/exec")

SPECIALIZATIONS_FILE = "specializations.json"
CUSTOM_IO_FILE = "custom_io.yaml"
MDP_FILE = "mdp.json"
COMMAND_FILE = "compile.cmd"
STDOUT_LOG = "compile.stdout.log"
STDERR_LOG = "compile.stderr.log"
QPC_SUBDIR = "qpc"
QPC_MARKER = "programqpc.bin"
#: a programqpc.bin smaller than this is not a compiled program (real ones are megabytes)
MIN_QPC_BYTES = 64
_LOCK_FILE = ".compile.lock"
_STAGING_PREFIX = ".build-"
_CACHE_VERSION = "dflash-qaic/qpc-cache/1"

# Placeholders that stand for the paths when the command line is hashed.
_ONNX_PLACEHOLDER = "{onnx}"
_DIR_PLACEHOLDER = "{qpc_dir}"

log = logging.getLogger(__name__)


class CompileError(RuntimeError):
    """The compiler could not be run, failed, or produced no programqpc.bin."""

    def __init__(
        self,
        message: str,
        *,
        command: Sequence[str] | None = None,
        returncode: int | None = None,
        stderr_tail: str = "",
    ) -> None:
        super().__init__(message)
        self.command = list(command) if command is not None else None
        self.returncode = returncode
        self.stderr_tail = stderr_tail


# ----------------------------------------------------------------------------------------------
# the compiler's input files


def _check_specs(specs: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, int]]]:
    if not specs:
        raise ValueError("at least one specialization is required")
    out = []
    for spec in specs:
        name = spec.get("name") if isinstance(spec, Mapping) else None
        symbols = spec.get("symbols") if isinstance(spec, Mapping) else None
        if not isinstance(name, str) or not isinstance(symbols, Mapping) or not symbols:
            raise ValueError(
                f"a specialization must be {{'name': str, 'symbols': {{symbol: int}}}}, got {spec!r}"
            )
        values = {}
        for sym, val in symbols.items():
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(
                    f"specialization {name!r}: {sym} must be a positive int, got {val!r}"
                )
            values[str(sym)] = val
        out.append((name, values))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"specialization names must be unique, got {names}")
    # The caches are one retained buffer of full_batch_size rows: every specialization of a
    # continuous-batching program binds it, to the same value.
    rows = {n: sym.get(contract.FULL_BATCH) for n, sym in out}
    if any(v is not None for v in rows.values()) and len(set(rows.values())) != 1:
        raise ValueError(
            f"every specialization must bind {contract.FULL_BATCH} to the same value (the "
            f"cache rows), got {rows}"
        )
    return out


def specializations_json(specs: Sequence[Mapping[str, Any]], fmt: str = "named") -> dict:
    """The `specializations.json` object for named specializations (as `contract` makes them).

    `named`: `{"specializations": [{"name": "Prefill", "symbols": {"batch_size": "1", ...}}]}`;
    `flat` (older SDKs): `{"specializations": [{"batch_size": "1", ...}]}`, same order.
    Symbol values are strings, in the order the specialization gives them.
    """
    if fmt not in SPECIALIZATION_FORMATS:
        raise ValueError(f"fmt must be one of {SPECIALIZATION_FORMATS}, got {fmt!r}")
    items: list[dict] = []
    for name, symbols in _check_specs(specs):
        strs = {k: str(v) for k, v in symbols.items()}
        items.append({"name": name, "symbols": strs} if fmt == "named" else strs)
    return {"specializations": items}


def specializations_text(specs: Sequence[Mapping[str, Any]], fmt: str = "named") -> str:
    """`specializations_json` rendered as the file's text: one specialization per line."""
    items = specializations_json(specs, fmt)["specializations"]
    body = ",\n".join("    " + json.dumps(item) for item in items)
    return '{\n  "specializations": [\n' + body + "\n  ]\n}\n"


def custom_io(io: contract.TargetIO | contract.DraftIO, kv_dtype: str) -> list[dict[str, str]]:
    """The custom IO entries: every retained input the program's state specs declare, then its
    `_RetainedState` output, each at its spec's on-card precision (state.py: the profile's KV
    dtype; a recurrent state, rewritten whole by every call, stays fp16 under MXINT8, where
    re-rounding the whole state each step would compound)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    precision = state.card_dtypes(io.state, kv_dtype)
    outputs = {o.name for o in io.outputs}
    missing = [contract.retained(n) for n in precision if contract.retained(n) not in outputs]
    if missing:
        raise ValueError(f"the I/O contract has no retained output for {missing}")
    pairs = [*precision.items(), *((contract.retained(n), p) for n, p in precision.items())]
    return [{"IOName": n, "Precision": p} for n, p in pairs]


def custom_io_yaml(io: contract.TargetIO | contract.DraftIO, kv_dtype: str) -> str:
    """`custom_io.yaml`: a YAML list of `{IOName: <name>, Precision: <kv_dtype>}`."""
    return "".join(
        f"- IOName: {e['IOName']}\n  Precision: {e['Precision']}\n" for e in custom_io(io, kv_dtype)
    )


def mdp_partition_config(num_devices: int, num_cores: int) -> dict:
    """Multi-device partition config: one partition over devices 0..N-1 (logical ids; the
    runtime maps them to the profile's device_ids), `num_cores` on each, p2p connected."""
    if num_devices < 2 or num_cores < 1:
        raise ValueError(
            f"need num_devices >= 2 and num_cores >= 1, got {num_devices}, {num_cores}"
        )
    devices = list(range(num_devices))
    return {
        "connections": [{"devices": devices, "type": "p2p"}],
        "partitions": [
            {
                "name": "Partition0",
                "devices": [{"deviceId": d, "numCores": num_cores} for d in devices],
            }
        ],
    }


def mdp_text(num_devices: int, num_cores: int) -> str:
    """`mdp_partition_config` rendered as the file's text, one device per line."""
    cfg = mdp_partition_config(num_devices, num_cores)
    (part,) = cfg["partitions"]
    devices = ",\n".join("        " + json.dumps(d) for d in part["devices"])
    return (
        "{\n"
        f'  "connections": {json.dumps(cfg["connections"])},\n'
        '  "partitions": [\n'
        "    {\n"
        f'      "name": {json.dumps(part["name"])},\n'
        '      "devices": [\n'
        f"{devices}\n"
        "      ]\n"
        "    }\n"
        "  ]\n"
        "}\n"
    )


# ----------------------------------------------------------------------------------------------
# the command line


def compile_command(
    compiler_path: str | os.PathLike[str],
    onnx_path: str | os.PathLike[str],
    qpc_dir: str | os.PathLike[str],
    program_profile: ProgramProfile,
    profile: CompileProfile,
    *,
    binary_dir: str | os.PathLike[str] | None = None,
) -> list[str]:
    """The compiler's argv for one QPC whose input files live in `qpc_dir`.

    `<compiler> -aic-hw [-compile-only] -aic-hw-version=ai100 -m=<onnx> -retained-state
    [-convert-to-fp16] [-mxfp6-matmul] -aic-num-cores=<N> [-mos=<n>] [-aic-enable-depth-first]
    [-mdp-load-partition-config=<dir>/mdp.json] [extra flags...]
    -network-specialization-config=<dir>/specializations.json
    -custom-IO-list-file=<dir>/custom_io.yaml -aic-binary-dir=<dir>/qpc`
    (`-compile-only` for the older `qaic-exec`). `binary_dir` overrides `<dir>/qpc`.
    """
    d = os.fspath(qpc_dir)
    argv = [os.fspath(compiler_path), "-aic-hw"]
    if profile.compiler == "qaic-exec":
        argv.append("-compile-only")
    argv += [
        f"-aic-hw-version={profile.hw_version}",
        f"-m={os.fspath(onnx_path)}",
        "-retained-state",
    ]
    if profile.convert_to_fp16:
        argv.append("-convert-to-fp16")
    if profile.mxfp6_matmul:
        argv.append("-mxfp6-matmul")
    argv.append(f"-aic-num-cores={program_profile.num_cores}")
    if program_profile.mos is not None:
        argv.append(f"-mos={program_profile.mos}")
    if program_profile.aic_enable_depth_first:
        argv.append("-aic-enable-depth-first")
    if program_profile.uses_mdp:
        argv.append(f"-mdp-load-partition-config={os.path.join(d, MDP_FILE)}")
    argv += list(program_profile.extra_flags)
    out = os.fspath(binary_dir) if binary_dir is not None else os.path.join(d, QPC_SUBDIR)
    argv += [
        f"-network-specialization-config={os.path.join(d, SPECIALIZATIONS_FILE)}",
        f"-custom-IO-list-file={os.path.join(d, CUSTOM_IO_FILE)}",
        f"-aic-binary-dir={out}",
    ]
    return argv


def default_compiler_path(kind: str = "qaic-compile") -> Path:
    """Where the SDK installs compiler `kind` (qaic-compile, or qaic-exec on older SDKs)."""
    return SDK_EXEC_DIR / kind


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def compiler_search(kind: str = "qaic-compile") -> tuple[Path | None, list[str]]:
    """Find the compiler: `$QAIC_COMPILER` (a path to an executable), else the SDK's
    `/opt/qti-aic/exec/<kind>`, else `<kind>` on PATH. Returns (path or None, where it looked).

    A `$QAIC_COMPILER` that is set but not an executable file is an error, not a fallback.
    """
    looked: list[str] = []
    env = os.environ.get(COMPILER_ENV)
    if env:
        looked.append(f"${COMPILER_ENV}={env}")
        path = Path(env).expanduser().absolute()
        if not _is_executable(path):
            raise CompileError(f"${COMPILER_ENV}={env} is not an executable file")
        return path, looked
    looked.append(f"${COMPILER_ENV} (not set)")
    default = default_compiler_path(kind)
    looked.append(str(default))
    if _is_executable(default):
        return default, looked
    looked.append(f"{kind} on PATH")
    which = shutil.which(kind)
    if which:
        return Path(which).absolute(), looked
    return None, looked


# ----------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class CompileResult:
    """What `compile_program` did for one program: its one QPC (serving every specialization),
    where it is (paths relative to the artifacts directory `root`) and how it is (or would be)
    built. The manifest records these fields as its QPC record (artifacts/manifest.py)."""

    program: str
    root: Path
    compiler: Path | None
    looked_in: tuple[str, ...]
    specializations: tuple[str, ...]  # names, in specializations.json order
    key: str  # 16 hex digits
    dir: str  # <program>/qpc-<key>
    qpc: str  # <program>/qpc-<key>/qpc, the directory the runtime loads
    command: str  # compile.cmd's command line (shell-quoted)
    num_cores: int
    device_ids: tuple[int, ...]
    tensor_slicing: int | None
    status: str  # "built" | "cached" | "skipped"

    @property
    def cached(self) -> bool:
        """The QPC came from the cache; the compiler did not run."""
        return self.status == "cached"

    @property
    def skipped(self) -> bool:
        """No compiler was found and the QPC is missing."""
        return self.status == "skipped"

    @property
    def ready(self) -> bool:
        return plausible_qpc(self.root / self.qpc)

    @property
    def qpc_dir(self) -> Path:
        """`qpc-<key>`."""
        return self.root / self.dir

    @property
    def qpc_path(self) -> Path:
        """`qpc-<key>/qpc`, the directory the runtime loads."""
        return self.root / self.qpc

    @property
    def argv(self) -> list[str]:
        """compile.cmd's command line as an argv."""
        return shlex.split(self.command)

    def summary(self) -> str:
        """One readable paragraph: where the QPC is, or what to run to build it."""
        if self.skipped:
            return (
                f"{self.program}: no AI100 compiler found (looked in: {', '.join(self.looked_in)}); "
                f"compiler inputs written. On an AI100 host, in the artifacts directory, run:\n"
                f"  {self.command}"
            )
        return f"{self.program}: {self.status} {self.qpc}"


# ----------------------------------------------------------------------------------------------
# hashing


def onnx_files(onnx_path: str | os.PathLike[str]) -> list[Path]:
    """The ONNX file and every external-data file it references, in a stable order.

    A file that does not parse as ONNX (e.g. a test's placeholder) counts as one opaque file.
    """
    path = Path(onnx_path)
    files = [path]
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return files
    locations = set()
    for tensor in _all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    locations.add(entry.value)
    for loc in sorted(locations):
        ext = path.parent / loc
        if not ext.is_file():
            raise CompileError(f"{path}: external data file {loc!r} is missing ({ext})")
        files.append(ext)
    return files


def _all_tensors(model: Any) -> Iterator[Any]:
    def graph_tensors(graph: Any) -> Iterator[Any]:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            yield from node_tensors(node)

    def node_tensors(node: Any) -> Iterator[Any]:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from graph_tensors(attr.g)
            for g in attr.graphs:
                yield from graph_tensors(g)

    yield from graph_tensors(model.graph)
    for fn in model.functions:
        for node in fn.node:
            yield from node_tensors(node)


def _onnx_digest(onnx_path: Path) -> list[list[str]]:
    files = onnx_files(onnx_path)
    # The main file is hashed under a fixed name: renaming it does not change the binary.
    names = ["<onnx>"] + [os.path.relpath(f, onnx_path.parent) for f in files[1:]]
    return [[n, _sha256(f)] for n, f in zip(names, files)]


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _cache_key(
    compiler: Path, argv: list[str], texts: Mapping[str, str], onnx_digest: list[list[str]]
) -> str:
    blob = json.dumps(
        {
            "version": _CACHE_VERSION,
            "compiler": str(compiler),
            "argv": argv,
            "files": dict(sorted(texts.items())),
            "onnx": onnx_digest,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# compile


def _write_text(path: Path, text: str) -> None:
    """Write atomically, and not at all when the file already holds `text`."""
    try:
        if path.read_text(encoding="utf-8") == text:
            return
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(qpc_dir: Path) -> Iterator[None]:
    """Serialise builds of one QPC across processes (a second process then finds it cached)."""
    with open(qpc_dir / _LOCK_FILE, "a+") as fh:
        if fcntl is not None:
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh, fcntl.LOCK_UN)


def plausible_qpc(qpc_path: Path) -> bool:
    """A finished QPC: `programqpc.bin` is a regular file (not a symlink) of MIN_QPC_BYTES+."""
    marker = qpc_path / QPC_MARKER
    return not marker.is_symlink() and marker.is_file() and marker.stat().st_size >= MIN_QPC_BYTES


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _tail(path: Path, max_lines: int = 40, max_bytes: int = 16384) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", errors="replace").rstrip().splitlines()
    return "\n".join(lines[-max_lines:])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """In the child before exec: SIGKILL it when the exporting process dies (even by kill -9)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_compiler(
    argv: list[str], shown: list[str], cwd: Path, log_dir: Path, timeout: float | None
) -> int:
    """Run `argv` in its own process (and process group), logs to `log_dir`; errors quote
    `shown` (the compile.cmd form of the command)."""
    for log in (STDOUT_LOG, STDERR_LOG):  # a new file: never write through a hard link
        (log_dir / log).unlink(missing_ok=True)
    with open(log_dir / STDOUT_LOG, "wb") as out, open(log_dir / STDERR_LOG, "wb") as err:
        try:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise CompileError(
                f"cannot run the compiler: {exc}\ncommand: {shlex.join(shown)}", command=shown
            ) from exc
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise CompileError(
                f"the compiler did not finish within {timeout} s and was stopped\n"
                f"command: {shlex.join(shown)}",
                command=shown,
            ) from None
        except BaseException:
            _kill_group(proc)
            raise


@dataclass(frozen=True)
class _Job:
    """One compiler run: the QPC directory, compile.cmd's argv and the artifacts root."""

    program: str
    specs: list[Mapping[str, Any]]
    program_profile: ProgramProfile
    qpc_dir: Path
    argv: list[str]
    onnx: Path
    compiler: Path
    root: Path


def _rel(path: Path, root: Path) -> str:
    """`path` relative to the artifacts root when inside it (compile.cmd is run from there)."""
    return os.path.relpath(path, root) if path.is_relative_to(root) else str(path)


def _build(job: _Job, profile: CompileProfile, timeout: float) -> str:
    """Build one QPC under the lock; returns "built" or "cached"."""
    qpc_dir, argv = job.qpc_dir, job.argv
    final = qpc_dir / QPC_SUBDIR
    with _locked(qpc_dir):
        if plausible_qpc(final):
            return "cached"
        if final.exists() or final.is_symlink():
            log.info(
                "%s: discarding a half-finished %s (no plausible %s)",
                job.program,
                final,
                QPC_MARKER,
            )
            _remove(final)
        for stale in qpc_dir.glob(_STAGING_PREFIX + "*"):
            _remove(stale)
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=qpc_dir))
        try:
            out_dir = staging / QPC_SUBDIR
            run_argv = compile_command(
                job.compiler,
                _rel(job.onnx, job.root),
                _rel(qpc_dir, job.root),
                job.program_profile,
                profile,
                binary_dir=_rel(out_dir, job.root),
            )
            names = "+".join(s["name"] for s in job.specs)
            log.info("%s: compiling %s → %s", job.program, names, _rel(final, job.root))
            rc = _run_compiler(run_argv, argv, job.root, qpc_dir, timeout)
            if rc != 0 or not plausible_qpc(out_dir):
                what = (
                    f"exited with status {rc}"
                    if rc != 0
                    else f"exited 0 but wrote no plausible {QPC_MARKER} (missing or under "
                    f"{MIN_QPC_BYTES} bytes)"
                )
                tail = _tail(qpc_dir / STDERR_LOG)
                raise CompileError(
                    f"the AI100 compiler {what} for {job.program}\n"
                    f"command: {shlex.join(argv)}\n(run in {job.root})\n"
                    f"stderr (last lines; full log {qpc_dir / STDERR_LOG}):\n{tail or '(empty)'}",
                    command=argv,
                    returncode=rc,
                    stderr_tail=tail,
                )
            os.rename(out_dir, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return "built"


def _check_program(program: str, io, onnx_path) -> Path:
    if program not in contract.ROLES:
        raise ValueError(f"program must be one of {list(contract.ROLES)}, got {program!r}")
    expected = contract.ROLES[program].io
    if not isinstance(io, expected):
        raise TypeError(f"program {program!r} needs a {expected.__name__}, got {type(io).__name__}")
    onnx = Path(onnx_path).absolute()
    if not onnx.is_file():
        raise FileNotFoundError(f"no ONNX file at {onnx}")
    return onnx


def compile_program(
    onnx_path: str | os.PathLike[str],
    program_dir: str | os.PathLike[str],
    io: contract.TargetIO | contract.DraftIO,
    specs: Sequence[Mapping[str, Any]],
    profile: CompileProfile,
    program: str,
    *,
    timeout: float | None = None,
    root: str | os.PathLike[str] | None = None,
) -> CompileResult:
    """Compile one program (a role of contract.ROLES: `"target"`, `"draft"`) into `program_dir/qpc-<key>/qpc`.

    `specs` are named specializations (`contract.target_specializations` /
    `draft_specializations`). Reuses a finished QPC (`status="cached"`), rebuilds a
    half-finished one, and without a compiler writes the inputs and returns `skipped=True`.
    Raises `CompileError` when the compiler fails (its stderr tail and the command included).
    Logs each step (the `dflash_qaic.compiler.qpc` logger); `timeout` bounds each compiler run in seconds
    (default: the profile's `compile_timeout_s`). `root` is the artifacts directory the paths
    of compile.cmd are relative to (default: `program_dir`'s parent).
    """
    onnx = _check_program(program, io, onnx_path)
    pdir = Path(program_dir).absolute()
    pdir.mkdir(parents=True, exist_ok=True)
    base = Path(root).absolute() if root is not None else pdir.parent
    limit = timeout if timeout is not None else profile.compile_timeout_s

    found, looked_in = compiler_search(profile.compiler)
    compiler = found if found is not None else default_compiler_path(profile.compiler)
    pp = profile.program(program)
    texts = {
        SPECIALIZATIONS_FILE: specializations_text(specs, profile.specializations_format),
        CUSTOM_IO_FILE: custom_io_yaml(io, profile.kv_dtype),
    }
    if pp.uses_mdp:
        texts[MDP_FILE] = mdp_text(pp.num_devices, pp.num_cores)
    normalised = compile_command(compiler, _ONNX_PLACEHOLDER, _DIR_PLACEHOLDER, pp, profile)
    key = _cache_key(compiler, normalised, texts, _onnx_digest(onnx))
    qpc_dir = pdir / f"qpc-{key}"
    qpc_dir.mkdir(exist_ok=True)
    argv = compile_command(compiler, _rel(onnx, base), _rel(qpc_dir, base), pp, profile)
    for name, text in texts.items():
        _write_text(qpc_dir / name, text)
    _write_text(qpc_dir / COMMAND_FILE, shlex.join(argv) + "\n")

    if plausible_qpc(qpc_dir / QPC_SUBDIR):
        status = "cached"
        log.info("%s: using cached %s", program, _rel(qpc_dir / QPC_SUBDIR, base))
    elif found is None:
        status = "skipped"
        log.info(
            "%s: no AI100 compiler (looked in %s); wrote %s",
            program,
            ", ".join(looked_in),
            _rel(qpc_dir / COMMAND_FILE, base),
        )
    else:
        job = _Job(program, list(specs), pp, qpc_dir, argv, onnx, compiler, base)
        status = _build(job, profile, limit)
    return CompileResult(
        program=program,
        root=base,
        compiler=found,
        looked_in=tuple(looked_in),
        specializations=tuple(str(s["name"]) for s in specs),
        key=key,
        dir=_rel(qpc_dir, base),
        qpc=_rel(qpc_dir / QPC_SUBDIR, base),
        command=shlex.join(argv),
        num_cores=pp.num_cores,
        device_ids=pp.device_ids,
        tensor_slicing=pp.tensor_slicing,
        status=status,
    )
