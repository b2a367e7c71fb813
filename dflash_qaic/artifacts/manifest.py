"""`manifest.json`: the typed record of an artifacts directory (docs/DESIGN.md, Artifacts).

The exporter writes it last; a directory without a complete, valid manifest is not an artifact.
`Manifest.from_json` validates every value (a malformed one is an `ArtifactsError` naming the
field, never a traceback), and `read_manifest` also checks that every path stays inside the
artifacts directory and that every file it names has its recorded size and sha256
(`check_files`: "fast" takes the sha256 of a file checked before from the cache of checked
files, see artifacts/files.py; "full" hashes every file again). Paths are relative, so the
directory can be moved.

Program records carry the contract's own I/O object (`contract.TargetIO` / `contract.DraftIO`);
the JSON form also lists the expanded inputs and outputs for readers of the raw file, and
`from_json` checks that they agree with the contract.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dflash_qaic import contract
from dflash_qaic.artifacts.files import (
    CHECK_MODES,
    ArtifactsError,
    inside,
    plain,
    sha256_file,
    write_json_atomic,
)
from dflash_qaic.artifacts.files import check_files as check_files_of

FORMAT = "dflash-qaic-artifacts"
#: 3: the shape plan as typed fields; 4: the plan stored once (no per-program specializations,
#: derived from it on read; no per-program copies of its sizes; no QPC `part`). Version 3 still
#: reads; earlier versions are refused: re-export.
VERSION = 4
READS = (3, 4)
NAME = "manifest.json"
INT64_MAX = 2**63 - 1


__all__ = ["ArtifactsError", "Manifest", "ProgramRecord", "FileRecord", "QpcRecord", "inside"]


# ---------------------------------------------------------------------------------------------
# validation of JSON values


class _Check:
    """Typed reads of a JSON object; every failure names the field."""

    def __init__(self, source: str, data: Any, where: str = ""):
        self.source, self.where = source, where
        if not isinstance(data, dict):
            self.fail(where or "the manifest", f"must be a JSON object, got {_kind(data)}")
        self.data = data

    def fail(self, key: str, msg: str):
        raise ArtifactsError(f"{self.source}: `{key}` {msg}; re-run dflash-export")

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def get(self, name: str, default: Any = ...) -> Any:
        if name not in self.data:
            if default is ...:
                self.fail(self.key(name), "is missing")
            return default
        return self.data[name]

    def int(self, name: str, lo: int = 0, hi: int = INT64_MAX, default: Any = ...) -> Any:
        v = self.get(name, default)
        if v is None and default is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            self.fail(self.key(name), f"must be an integer in [{lo}, {hi}], got {v!r}")
        return v

    def bool(self, name: str, default: Any = ...) -> bool:
        v = self.get(name, default)
        if not isinstance(v, bool):
            self.fail(self.key(name), f"must be true or false, got {v!r}")
        return v

    def str(self, name: str, default: Any = ..., optional: bool = False) -> Any:
        v = self.get(name, default)
        if v is None and optional:
            return None
        if not isinstance(v, str) or not v:
            self.fail(self.key(name), f"must be a non-empty string, got {v!r}")
        return v

    def relpath(self, name: str, default: Any = ..., optional: bool = False) -> Any:
        """A plain relative path (no `..`, not absolute): it must name something inside."""
        v = self.str(name, default, optional)
        if v is not None and not plain(v):
            self.fail(
                self.key(name),
                f"{v!r} is not a plain relative path inside the artifacts directory; refusing it",
            )
        return v

    def ints(self, name: str, lo: int = 0, hi: int = INT64_MAX, default: Any = ...) -> tuple:
        v = self.get(name, default)
        ok = isinstance(v, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in v
        )
        if not ok:
            self.fail(self.key(name), f"must be a list of integers in [{lo}, {hi}], got {v!r}")
        return tuple(v)

    def obj(self, name: str, default: Any = ...) -> Any:
        v = self.get(name, default)
        if v is None and default is None:
            return None
        if not isinstance(v, dict):
            self.fail(self.key(name), f"must be a JSON object, got {_kind(v)}")
        return v

    def list(self, name: str, default: Any = ...) -> list:
        v = self.get(name, default)
        if not isinstance(v, list):
            self.fail(self.key(name), f"must be a list, got {_kind(v)}")
        return v

    def sub(self, value: Any, name: str) -> _Check:
        return _Check(self.source, value, self.key(name))


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


# ---------------------------------------------------------------------------------------------
# the typed manifest


@dataclass(frozen=True)
class FileRecord:
    """One file the manifest names: path relative to the artifacts directory, size, sha256."""

    path: str
    size: int
    sha256: str

    @classmethod
    def of(cls, root: Path, rel: str) -> FileRecord:
        f = root / rel
        return cls(rel, f.stat().st_size, sha256_file(f))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, c: _Check) -> FileRecord:
        digest = c.str("sha256")
        if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
            c.fail(c.key("sha256"), f"must be 64 lowercase hex digits, got {digest!r}")
        return cls(c.relpath("path"), c.int("size"), digest)


@dataclass(frozen=True)
class QpcRecord:
    """A program's QPC, as the compile step built (or would build) it: the specializations it
    serves, where it is (paths relative to the artifacts directory), how it is built
    (compiler/qpc.py: `CompileResult` carries the same fields)."""

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
    def ready(self) -> bool:
        return self.status != "skipped"

    @classmethod
    def of(cls, result) -> QpcRecord:
        """The record of a `compile.qpc.CompileResult`."""
        return cls(**{f.name: getattr(result, f.name) for f in fields(cls)})

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["specializations"], d["device_ids"] = list(self.specializations), list(self.device_ids)
        return d

    @classmethod
    def from_json(cls, c: _Check) -> QpcRecord:
        names = c.list("specializations")
        if not all(isinstance(n, str) for n in names):
            c.fail(c.key("specializations"), f"must be a list of names, got {names!r}")
        status = c.str("status")
        if status not in ("built", "cached", "skipped"):
            c.fail(c.key("status"), f"must be built, cached or skipped, got {status!r}")
        return cls(
            specializations=tuple(names),
            key=c.str("key"),
            dir=c.relpath("dir"),
            qpc=c.relpath("qpc"),
            command=c.str("command"),
            num_cores=c.int("num_cores", 1, 1024),
            device_ids=c.ints("device_ids", 0, 1 << 16),
            tensor_slicing=c.int("tensor_slicing", 1, 1024, default=None),
            status=status,
        )


def _qpc(c: _Check, kind: str) -> QpcRecord | None:
    """The program's one QPC, if compiled (the JSON form is a list of at most one)."""
    qpcs = c.list("qpc", [])
    if len(qpcs) > 1:  # the removed disaggregated profile: a separate prefill QPC
        raise ArtifactsError(
            f"{c.source}: the {kind} program is split over {len(qpcs)} QPCs: these artifacts "
            "come from an older version compiled with a disaggregated profile, which is no "
            "longer supported; re-export them (dflash-export, with a profile from qpc_configs/)"
        )
    return QpcRecord.from_json(c.sub(qpcs[0], "qpc[]")) if qpcs else None


_TARGET_IO = ("n_layers", "n_kv_heads", "head_dim", "hidden_size", "vocab_size")
#: what an exporter says of a program that the manifest stores once, at the top (the shape plan,
#: the mask id and layer ids): not kept in the program's record
PLAN_COPIES = {"batch_size", "ctx_len", "prefill_seq_len", "comp_ctx_lengths", "verify_lengths"}
PLAN_COPIES |= {"mask_token_id", "target_layer_ids", "specializations", "tree_budgets"}


def _int_tuple(c: _Check, name: str, lo: int, hi: int) -> tuple[int, ...]:
    """An optional list of integers in [lo, hi] (absent: empty)."""
    v = c.get(name, [])
    if not isinstance(v, list | tuple) or any(
        isinstance(n, bool) or not isinstance(n, int) or not lo <= n <= hi for n in v
    ):
        c.fail(c.key(name), f"must be a list of integers in [{lo}, {hi}], got {v!r}")
    return tuple(v)


@dataclass(frozen=True)
class ProgramRecord:
    """An exported program, as the manifest records it: its contract I/O object, files,
    specializations (stored as the manifest's shape plan, derived from it on read) and QPC."""

    io: contract.TargetIO | contract.DraftIO
    onnx: str
    external_data: str | None
    specializations: tuple[dict, ...]
    onnx_bytes: int
    sampling_candidates: int | None = None  # target with sampling: the largest top_k it takes
    qpc: QpcRecord | None = None  # None: not compiled (--no-compile)
    compiler: str | None = None
    check: dict = field(default_factory=dict)  # the graph check's report (free-form)
    facts: dict = field(default_factory=dict)  # other exporter facts (free-form, informative)
    role: str = ""  # its role (contract.ROLES); "" from an I/O object alone: by its class

    @property
    def kind(self) -> str:
        """The program's role (contract.ROLES)."""
        if self.role:
            return self.role
        return contract.TARGET if isinstance(self.io, contract.TargetIO) else contract.DRAFT

    @property
    def state(self) -> list:
        """The program's retained state, layer by layer (state.py specs)."""
        return self.io.state

    @property
    def files(self) -> list[str]:
        return [self.onnx] + ([self.external_data] if self.external_data else [])

    def to_json(self) -> dict:
        spec = lambda s: {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}  # noqa: E731
        io = asdict(self.io)
        rings = io.pop("ring_slots", ())  # a draft with ring caches only (b16: absent)
        q_top_k = io.pop("q_top_k", 0)  # a DFlash-2 draft exported for sampling only
        top_k = io.pop("top_k", 0)  # a draft exported with --draft-top-k only
        pair_k = io.pop("pair_k", 0)  # a DFlash-2 draft exported with --draft-top-k only
        draft_q = io.pop("draft_q", ())  # a target verifying with a DFlash-2 draft's q only
        bitmask = io.pop("token_bitmask", False)  # a target exported for structured output only
        rule = io.pop("verify_rule", contract.CHAIN)  # a target exported with block verify only
        layer_kv = io.pop("layer_kv", ())  # a target whose layers' caches differ (Gemma 4) only
        logprobs = io.pop("logprobs", 0), io.pop("logprobs_mode", contract.RAW_LOGPROBS)
        extended = io.pop("extended_sampling", False)  # a program exported with it only
        return {
            **self.facts,
            **io,
            **({"ring_slots": list(rings)} if rings else {}),
            **({"q_top_k": q_top_k} if q_top_k else {}),
            **({"top_k": top_k} if top_k else {}),
            **({"pair_k": pair_k} if pair_k else {}),
            **({"draft_q": list(draft_q)} if draft_q else {}),
            **({"token_bitmask": True} if bitmask else {}),
            **({"verify_rule": rule} if rule != contract.CHAIN else {}),
            **({"layer_kv": list(layer_kv)} if layer_kv else {}),
            **(dict(zip(("logprobs", "logprobs_mode"), logprobs)) if logprobs[0] else {}),
            **({"extended_sampling": True} if extended else {}),
            "onnx": self.onnx,
            "external_data": self.external_data,
            "onnx_bytes": self.onnx_bytes,
            "inputs": [spec(s) for s in self.io.inputs],
            "outputs": [spec(s) for s in self.io.outputs],
            "state": [s.to_json() for s in self.io.state],
            "sampling_candidates": self.sampling_candidates,
            "qpc": [self.qpc.to_json()] if self.qpc else [],
            "compiler": self.compiler,
            "check": self.check,
        }

    @classmethod
    def from_facts(cls, kind: str, facts: dict, root: Path) -> ProgramRecord:
        """The program an exporter describes (`export.onnx_export.program_facts`), its paths
        made relative to the artifacts directory `root`."""
        facts = dict(facts)
        facts["onnx"] = str(Path(facts.pop("path")).relative_to(root))
        data = facts.pop("external_data")
        facts["external_data"] = str(Path(data).relative_to(root)) if data else None
        return cls.from_json(_Check(f"the exported {kind} program", facts), kind)

    @classmethod
    def from_json(cls, c: _Check, kind: str) -> ProgramRecord:
        dims = {k: c.int(k, 1, 1 << 24) for k in _TARGET_IO}
        cb = c.bool("continuous_batching")
        window = c.bool("comp_ctx")
        if contract.ROLES[kind].io is contract.TargetIO:
            io = contract.TargetIO(
                **dims,
                emit_logits=c.bool("emit_logits"),
                sampling=c.bool("sampling"),
                continuous_batching=cb,
                comp_ctx=window,
                linear_layers=_int_tuple(c, "linear_layers", 0, dims["n_layers"] - 1),
                state_dims=_int_tuple(c, "state_dims", 1, 1 << 24),
                draft_q=c.ints("draft_q", 1, 1 << 24, default=[]),
                token_bitmask=c.bool("token_bitmask", False),
                verify_rule=c.get("verify_rule", contract.CHAIN),
                layer_kv=_int_tuple(c, "layer_kv", 1, 1 << 24),
                ring_slots=_int_tuple(c, "ring_slots", 0, 1 << 22),
                logprobs=c.int("logprobs", 0, contract.MAX_LOGPROBS, default=0),
                logprobs_mode=c.get("logprobs_mode", contract.RAW_LOGPROBS),
                extended_sampling=c.bool("extended_sampling", False),
                latent_dims=_int_tuple(c, "latent_dims", 1, 1 << 24),
            )
            if io.logprobs_mode not in contract.LOGPROBS_MODES:
                c.fail(c.key("logprobs_mode"), f"must be one of {list(contract.LOGPROBS_MODES)}")
            if io.verify_rule not in contract.VERIFY_RULES:
                c.fail(c.key("verify_rule"), f"must be one of {list(contract.VERIFY_RULES)}")
            if io.layer_kv and len(io.layer_kv) != 2 * io.n_layers:
                c.fail(c.key("layer_kv"), "must list 2 dims per layer")
            if io.hybrid and len(io.state_dims) != 5:
                c.fail(c.key("state_dims"), "must list 5 dims for a hybrid target")
        else:
            io = contract.DraftIO(
                **dims,
                emit_logits=c.bool("emit_logits"),
                block_size=c.int("block_size", 2, 4096),
                continuous_batching=cb,
                comp_ctx=window,
                confidence=c.bool("confidence"),
                ring_slots=c.ints("ring_slots", 0, 1 << 22, default=[]),
                q_top_k=c.int("q_top_k", 0, 1 << 24, default=0),
                top_k=c.int("top_k", 0, contract.MAX_DRAFT_TOP_K, default=0),
                pair_k=c.int("pair_k", 0, contract.MAX_DRAFT_TOP_K, default=0),
                extended_sampling=c.bool("extended_sampling", False),
            )
        for which, specs in (("inputs", io.inputs), ("outputs", io.outputs)):
            want = [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs]
            if c.get(which, want) != want:
                c.fail(c.key(which), "do not match the I/O contract of this dflash-qaic version")
        state = [s.to_json() for s in io.state]  # absent before the state specs
        if c.get("state", state) != state:
            c.fail(c.key("state"), "does not match the state specs of this dflash-qaic version")
        known = (
            {f.name for f in fields(cls)}
            | set(dims)
            | {"emit_logits", "sampling", "block_size", "continuous_batching", "comp_ctx"}
        )
        known |= {"linear_layers", "state_dims", "draft_q", "token_bitmask", "verify_rule"}
        known |= {"confidence", "ring_slots", "q_top_k", "top_k", "inputs", "outputs", "qpc"}
        known |= {"pair_k", "state", "logprobs", "logprobs_mode", "extended_sampling"}
        known |= {"latent_dims"}
        known |= PLAN_COPIES
        return cls(
            io=io,
            onnx=c.relpath("onnx"),
            external_data=c.relpath("external_data", None, optional=True),
            # absent (version 4): the manifest derives them from its plan (Manifest.from_json)
            specializations=tuple(_specs(c)) if "specializations" in c.data else None,
            onnx_bytes=c.int("onnx_bytes", 1),
            sampling_candidates=c.int("sampling_candidates", 1, 1 << 24, default=None),
            qpc=_qpc(c, kind),
            compiler=c.str("compiler", None, optional=True),
            check=c.obj("check", {}),
            facts={k: v for k, v in c.data.items() if k not in known},
            role=kind,
        )


def _specs(c: _Check) -> list[dict]:
    out = []
    for s in c.list("specializations"):
        sc = c.sub(s, "specializations[]")
        name, kind = sc.str("name"), sc.str("kind")
        sym = sc.obj("symbols")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sym.values()):
            sc.fail(sc.key("symbols"), f"must map symbols to integers >= 1, got {sym!r}")
        out.append({"name": name, "kind": kind, "symbols": dict(sym)})
    return out


@dataclass(frozen=True)
class Manifest:
    """Everything the runtime needs from an artifacts directory (docs/DESIGN.md, Artifacts)."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    prefill_seq_len: int
    ctx_len: int
    batch_size: int
    vocab_size: int
    hidden_size: int
    # the programs by role (contract.ROLES, in its order): today "target" and "draft"
    programs: dict[str, ProgramRecord]
    # the shape plan's lists (contract.ShapePlan; the other plan fields are the ones above)
    prefill_lengths: tuple[int, ...]
    verify_lengths: tuple[int, ...]
    draft_prefill_rows: tuple[int, ...]
    full_batch_size: int | None = None  # continuous batching: cache rows of both programs
    comp_ctx_lengths: tuple[int, ...] | None = None  # attention windows (contract.py), ascending
    tree_budgets: tuple[int, ...] = ()  # a tree program's tree verify rows (contract.ShapePlan)
    files: tuple[FileRecord, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: str | None = None  # relative directory holding the target's tokenizer files
    input_hash: str = ""  # the reuse key: every input and option that changes the programs
    options: dict = field(default_factory=dict)
    qpc_config: str | None = None
    compile_skipped: dict | None = None  # {"looked_in": [...], "commands": [...]}
    sources: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)

    @property
    def plan(self) -> contract.ShapePlan:
        """The shape plan both programs were exported for (contract.ShapePlan), from the
        manifest's typed fields."""
        return contract.ShapePlan(
            block_size=self.block_size,
            prefill_seq_len=self.prefill_seq_len,
            ctx_len=self.ctx_len,
            prefill_lengths=self.prefill_lengths,
            verify_lengths=self.verify_lengths,
            draft_prefill_rows=self.draft_prefill_rows,
            windows=self.comp_ctx_lengths,
            full_batch_size=self.full_batch_size,
            sampling=self.target.io.sampling,
            batch_size=self.batch_size,
            tree_budgets=self.tree_budgets,
        )

    @property
    def target(self) -> ProgramRecord:
        return self.programs[contract.TARGET]

    @property
    def draft(self) -> ProgramRecord:
        return self.programs[contract.DRAFT]

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.programs)

    @property
    def specialization_count(self) -> dict[str, int]:
        """Specializations per program (each one is compiled: fewer compile faster)."""
        return {role: len(p.specializations) for role, p in self.programs.items()}

    def program(self, name: str) -> ProgramRecord:
        if name not in self.programs:
            raise ValueError(f"program must be one of {list(self.programs)}, got {name!r}")
        return self.programs[name]

    def with_programs(self, change) -> Manifest:
        """The manifest with `change(record)` in place of every program record."""
        return replace(self, programs={r: change(p) for r, p in self.programs.items()})

    @property
    def compiled(self) -> bool:
        return all(p.qpc is not None and p.qpc.ready for p in self.programs.values())

    def named_files(self) -> list[str]:
        """Every file the manifest must record: the programs' files and their QPC binaries."""
        out = [f for p in self.programs.values() for f in p.files]
        for p in self.programs.values():
            if p.qpc is not None and p.qpc.ready:
                out.append(f"{p.qpc.qpc}/programqpc.bin")
        return out

    def __getitem__(self, key: str):
        """The JSON form's value (for readers that still take the raw dict; prefer attributes)."""
        return self.to_json()[key]

    def get(self, key: str, default=None):
        return self.to_json().get(key, default)

    def replace(self, **changes) -> Manifest:
        return replace(self, **changes)

    def to_json(self) -> dict:
        d = {"format": FORMAT, "version": VERSION}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "programs":  # each role at the top level, as before; and their list
                d.update({role: p.to_json() for role, p in v.items()})
                v = list(v)
            elif f.name == "files":
                v = [r.to_json() for r in v]
            elif isinstance(v, tuple):
                v = list(v)
            d[f.name] = v
        d["specialization_count"] = self.specialization_count
        return d

    @classmethod
    def from_json(cls, data: Any, source: str = NAME, complete: bool = True) -> Manifest:
        """Validate plain JSON data; `complete=False` skips the check that every named file
        has a record (for a manifest still being built)."""
        c = _Check(source, data)
        if c.get("format", None) != FORMAT:
            raise ArtifactsError(
                f"{source} is not a dflash-qaic manifest (format {data.get('format')!r})"
            )
        version = c.get("version", None)
        if version not in READS:
            older = (
                isinstance(version, int) and not isinstance(version, bool) and version < READS[0]
            )
            raise ArtifactsError(
                f"{source} has manifest version {version!r}, "
                + ("written by an earlier dflash-qaic; " if older else "")
                + f"this dflash-qaic reads versions {READS[0]} to {VERSION}: re-export the "
                "artifacts with this "
                "version's `dflash-export` (the same command line writes the new form)"
            )
        vocab = c.int("vocab_size", 1, 1 << 24)
        m = cls(
            block_size=c.int("block_size", 2, 4096),
            mask_token_id=c.int("mask_token_id", 0, vocab - 1),
            target_layer_ids=c.ints("target_layer_ids", 0, 4096),
            prefill_seq_len=c.int("prefill_seq_len", 1, 1 << 20),
            ctx_len=c.int("ctx_len", 4, 1 << 22),
            batch_size=c.int("batch_size", 1, 4096),
            full_batch_size=c.int("full_batch_size", 1, 4096, default=None),
            comp_ctx_lengths=_windows(c),
            vocab_size=vocab,
            hidden_size=c.int("hidden_size", 1, 1 << 20),
            programs={r: ProgramRecord.from_json(c.sub(c.obj(r), r), r) for r in _roles(c)},
            prefill_lengths=c.ints("prefill_lengths", 1, 1 << 20),
            verify_lengths=c.ints("verify_lengths", 1, 4096),
            draft_prefill_rows=c.ints("draft_prefill_rows", 1, 1 << 22),
            tree_budgets=c.ints("tree_budgets", 2, contract.MAX_TREE_BUDGET, default=[]),
            files=tuple(FileRecord.from_json(c.sub(f, "files[]")) for f in c.list("files")),
            eos_token_ids=c.ints("eos_token_ids", 0, INT64_MAX, default=[]),
            tokenizer=c.relpath("tokenizer", None, optional=True),
            input_hash=c.str("input_hash", ""),
            options=c.obj("options", {}),
            qpc_config=c.str("qpc_config", None, optional=True),
            compile_skipped=c.obj("compile_skipped", None),
            sources=c.obj("sources", {}),
            versions=c.obj("versions", {}),
        )
        m = _with_specializations(m, c)
        _consistent(m, c, complete)
        return m


def _roles(c: _Check) -> list[str]:
    """The manifest's program roles (absent: the target and the draft, every manifest before
    the list); each a declared role (contract.ROLES), the target and draft among them."""
    roles = c.get("programs", list(contract.ROLE_NAMES[:2]))
    if (
        not isinstance(roles, list)
        or any(r not in contract.ROLES for r in roles)
        or len(set(roles)) != len(roles)
        or not {contract.TARGET, contract.DRAFT} <= set(roles)
    ):
        c.fail("programs", f"must list distinct roles of {list(contract.ROLES)}, got {roles!r}")
    return sorted(roles, key=contract.ROLE_NAMES.index)


def _windows(c: _Check) -> tuple[int, ...] | None:
    if c.get("comp_ctx_lengths", None) is None:
        return None
    w = c.ints("comp_ctx_lengths", 1, 1 << 22)
    if not w or list(w) != sorted(set(w)) or w[-1] != c.get("ctx_len", None):
        c.fail("comp_ctx_lengths", f"must ascend and end at ctx_len, got {list(w)}")
    return w


def _with_specializations(m: Manifest, c: _Check) -> Manifest:
    """The programs' specializations, derived from the shape plan; a manifest that lists them
    (version 3) must list exactly these."""
    try:
        m.plan.check()
    except ValueError as e:
        c.fail("prefill_lengths/verify_lengths/draft_prefill_rows", str(e))
    programs = {}
    for role, prog in m.programs.items():
        want = contract.ROLES[role].specializations(m.plan)
        if prog.specializations is not None and list(prog.specializations) != want:
            c.fail(f"{role}.specializations", f"must be {want} for the shape plan")
        programs[role] = replace(prog, specializations=tuple(want))
    return replace(m, programs=programs)


def _consistent(m: Manifest, c: _Check, complete: bool) -> None:
    """Cross-field checks: the values the runtime sizes its buffers from agree everywhere."""
    for prog in m.programs.values():
        if (prog.io.hidden_size, prog.io.vocab_size) != (m.hidden_size, m.vocab_size):
            c.fail(f"{prog.kind}.hidden_size/vocab_size", "disagree with the top-level values")
    if m.draft.io.block_size != m.block_size:
        c.fail("draft.block_size", f"is {m.draft.io.block_size}, block_size is {m.block_size}")
    if m.block_size > m.prefill_seq_len or m.ctx_len < m.prefill_seq_len + m.block_size + 2:
        c.fail("ctx_len", "is too small for prefill_seq_len and block_size")
    fbs, w = m.full_batch_size, (list(m.comp_ctx_lengths) if m.comp_ctx_lengths else None)
    for prog in m.programs.values():
        if prog.io.continuous_batching != (fbs is not None):
            c.fail(f"{prog.kind}.continuous_batching", f"disagrees with full_batch_size {fbs}")
        if prog.io.comp_ctx != (w is not None):
            c.fail(f"{prog.kind}.comp_ctx", f"disagrees with comp_ctx_lengths {w}")
    count = c.get("specialization_count", m.specialization_count)
    if count != m.specialization_count:
        c.fail("specialization_count", f"is {count}, the programs have {m.specialization_count}")
    recorded = {f.path for f in m.files}
    missing = [p for p in m.named_files() if p not in recorded]
    if missing and complete:
        c.fail("files", f"has no size and sha256 for {missing}")
    for t in m.eos_token_ids:
        if t >= m.vocab_size:
            c.fail("eos_token_ids", f"holds {t}, outside the vocabulary of {m.vocab_size}")


# ---------------------------------------------------------------------------------------------
# writing and reading


def write_manifest(out_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write `manifest` as `out_dir/manifest.json` (atomically, umask permissions)."""
    Manifest.from_json(manifest.to_json())  # never write what would not read back
    path = Path(out_dir) / NAME
    write_json_atomic(path, manifest.to_json())
    return path


def load_json(artifacts_dir: str | os.PathLike) -> Any:
    """The raw JSON of a manifest (ArtifactsError when the directory is not an artifact)."""
    d = Path(artifacts_dir)
    if not d.is_dir():
        raise ArtifactsError(
            f"artifacts directory {d} does not exist: create it with `dflash-export --out {d}`"
        )
    path = d / NAME
    if not path.is_file():
        raise ArtifactsError(
            f"{d} has no {NAME}: it is not a finished artifacts directory (an export that was "
            f"interrupted or failed). Re-run `dflash-export --out {d}`"
        )
    try:
        return json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ArtifactsError(f"{path} is not valid JSON ({e}); re-run dflash-export") from e


def _no_constant(name: str):
    raise ValueError(f"non-finite number {name}")


def read_manifest(artifacts_dir: str | os.PathLike, check_files: str = "fast") -> Manifest:
    """Read, validate and check the manifest of an artifacts directory and the files it names.

    check_files: "fast" (default) checks every recorded file's size and sha256, taking the
        sha256 of a file unchanged since it was last checked from the cache of checked files
        (the first load of a new directory hashes what its exporter did not); "full" hashes
        every file now; "none" checks only that the files exist.
    """
    if check_files not in CHECK_MODES:
        raise ValueError(f"check_files must be one of {CHECK_MODES}, got {check_files!r}")
    d = Path(artifacts_dir)
    m = Manifest.from_json(load_json(d), str(d / NAME))
    refuse_merged_weights(m, d)
    paths = [("tokenizer", m.tokenizer)] if m.tokenizer else []
    for p in m.programs.values():
        if p.qpc is not None:
            paths += [(f"{p.kind}.qpc", p.qpc.qpc), (f"{p.kind}.qpc", p.qpc.dir)]
    for what, rel in paths:
        inside(d, rel, what)
    check_files_of(d, m.files, check_files)
    return m


# Before 0.6.1 the streaming export could merge two small neighbouring weights of a multi-GB
# model into one (docs/DESIGN.md, Hybrid targets: "What the 32 layers found").
MERGED_WEIGHTS_FIXED_IN = (0, 6, 1)
MERGED_WEIGHTS_MIN_BYTES = 1 << 30


def refuse_merged_weights(m: Manifest, root: Path) -> None:
    """ArtifactsError for artifacts whose multi-GB programs an exporter before 0.6.1 wrote: they
    may read one weight in place of another (a Qwen3 layer's q_norm for its k_norm)."""
    made = str(m.versions.get("dflash_qaic", ""))
    try:
        version = tuple(int(x) for x in made.split(".")[:3])
    except ValueError:
        return  # a development build: nothing to compare
    big = [r.path for r in m.files if r.size >= MERGED_WEIGHTS_MIN_BYTES]
    if version < MERGED_WEIGHTS_FIXED_IN and big:
        raise ArtifactsError(
            f"{root} was exported by dflash-qaic {made}, whose streaming export could merge two "
            f"small weights of a multi-GB program into one ({big[0]}): its programs may compute "
            f"wrong tokens; re-export with this version: dflash-export --out {root} …"
        )
