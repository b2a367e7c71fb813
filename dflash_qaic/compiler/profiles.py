"""Compile profiles: how the two programs are compiled for Cloud AI 100.

A profile is one YAML file in `qpc_configs/` (`qpc_configs/<name>.yaml`), chosen with
`dflash-export --qpc-config FILE`. It says nothing about the model (dims, block size, context
length come from the export recipe); it says how the compiler should place and quantise the
programs. Schema (every key is optional unless marked *required*)::

    name: ai100_fp16              # str; default: the file's stem
    description: "..."            # str; default ""
    hw_version: ai100             # ai100 | ai200 (-aic-hw-version=...); default ai100.
                                  # `aic_hw_version` (QEfficient's name) is the same key.
    cores_per_device: 16          # NSP cores one device (SoC) offers, 1..16; default 16.
                                  # Used to check the core budget of every device.
    kv_dtype: float16             # *required*: float16 | bfloat16 | mxint8 (KV cache precision,
                                  # sent to the compiler through custom_io.yaml); bfloat16 on
                                  # ai200 only (as QEfficient allows it)
    mxfp6_matmul: false           # bool; MXFP6 weights for MatMuls (-mxfp6-matmul); default false
    convert_to_fp16: true         # bool; fp32 ONNX compiled as fp16 (-convert-to-fp16); default true
    specializations_format: named # named (current SDKs) | flat (older SDKs); default named
    compiler: qaic-compile        # qaic-compile | qaic-exec (older SDKs: qaic-exec -compile-only)
    compile_timeout_s: 10800      # seconds one compiler run may take before it is killed (with
                                  # its children); default 3 hours
    target:                       # *required*: the target program (prefill, verify, decode)
      num_cores: 12               # *required*: int, 1..cores_per_device (per device when sliced)
      device_ids: [0]             # list of distinct ints >= 0; where the runtime loads the QPC.
                                  # Default [0], or [0..N-1] with tensor_slicing: N.
      mos: null                   # int >= 1 -> -mos=<n>; null omits the flag
      aic_enable_depth_first: false   # bool -> -aic-enable-depth-first
      extra_flags: []             # list of extra compiler flags, each starting with '-'; flags
                                  # that other keys control are refused
      tensor_slicing: null        # int >= 1: slice the program over this many devices
                                  # (> 1 emits an mdp partition config, -mdp-load-partition-config)
    draft:                        # *required*: the draft program; same keys as `target:`
      num_cores: 4
      device_ids: [0]

Validation is strict: an unknown key raises `ProfileError` naming the file, the key (dotted:
`target.num_corse`) and the allowed keys; a bad value names the key and what is allowed; two
QPCs that would share a device must fit in `cores_per_device` together (both QPCs of an export
stay loaded at once). `device_ids` do not change the binary (they are where the runtime loads
it), so they are not part of the QPC cache key; everything else is.

Each program compiles to one QPC serving all its specializations. The keys `disaggregate` and
`prefill` under `target:` (a separate target prefill QPC, in earlier versions) are refused with
their own message: handing each request's KV cache from a prefill QPC to the verify/decode QPC
would move it off the card and back through the host, and with continuous batching the prefill
already runs at batch 1 on the target's QPC, between the other sequences' steps (docs/DESIGN.md,
Disaggregated prefill).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dflash_qaic import contract

HW_VERSIONS = ("ai100", "ai200")
BF16_HW_VERSIONS = ("ai200",)  # QEfficient allows bfloat16 only on AI 200
HW_VERSION_ALIAS = "aic_hw_version"  # QEfficient's name for hw_version
KV_DTYPES = ("float16", "bfloat16", "mxint8")
SPECIALIZATION_FORMATS = ("named", "flat")
COMPILERS = ("qaic-compile", "qaic-exec")
PROGRAMS = contract.ROLE_NAMES  # a section per program role
MAX_CORES_PER_DEVICE = 16  # an AI 100 SoC has up to 16 NSP cores
DEFAULT_COMPILE_TIMEOUT_S = 3 * 3600  # an 8B target compiles in well under an hour
MAX_DEVICES = 64

#: where the shipped profiles live: package data (the repository's `qpc_configs/` links here)
PROFILE_DIR = Path(__file__).resolve().parents[1] / "qpc_configs"
DEFAULT_PROFILE = "ai100_fp16"

# Flags that profile keys (or the compile step itself) control; `extra_flags` may not repeat them.
_MANAGED_FLAGS = {
    "-aic-hw": "hw_version",
    "-aic-hw-version": "hw_version",
    "-compile-only": "compiler",
    "-m": "(the ONNX path)",
    "-retained-state": "(always on)",
    "-convert-to-fp16": "convert_to_fp16",
    "-mxfp6-matmul": "mxfp6_matmul",
    "-aic-num-cores": "num_cores",
    "-mos": "mos",
    "-aic-enable-depth-first": "aic_enable_depth_first",
    "-mdp-load-partition-config": "tensor_slicing",
    "-network-specialization-config": "(written by the compile step)",
    "-custom-IO-list-file": "kv_dtype",
    "-aic-binary-dir": "(the QPC cache)",
}

_TOP_KEYS = (
    "name",
    "description",
    "hw_version",
    HW_VERSION_ALIAS,
    "cores_per_device",
    "kv_dtype",
    "mxfp6_matmul",
    "convert_to_fp16",
    "specializations_format",
    "compiler",
    "compile_timeout_s",
    "target",
    "draft",
)
_PROGRAM_KEYS = (
    "num_cores",
    "device_ids",
    "mos",
    "aic_enable_depth_first",
    "extra_flags",
    "tensor_slicing",
)
#: target keys of the removed disaggregated prefill (refused with their own message)
_REMOVED_TARGET_KEYS = ("disaggregate", "prefill")


class ProfileError(ValueError):
    """A compile profile that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class ProgramProfile:
    """How one QPC is compiled and placed."""

    num_cores: int
    device_ids: tuple[int, ...] = (0,)
    mos: int | None = None
    aic_enable_depth_first: bool = False
    extra_flags: tuple[str, ...] = ()
    tensor_slicing: int | None = None

    @property
    def num_devices(self) -> int:
        return self.tensor_slicing or 1

    @property
    def uses_mdp(self) -> bool:
        """True when the program is sliced over several devices (mdp partition config)."""
        return self.num_devices > 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_cores": self.num_cores,
            "device_ids": list(self.device_ids),
            "mos": self.mos,
            "aic_enable_depth_first": self.aic_enable_depth_first,
            "extra_flags": list(self.extra_flags),
            "tensor_slicing": self.tensor_slicing,
        }


@dataclass(frozen=True)
class CompileProfile:
    """A validated compile profile (see the module docstring for the YAML schema)."""

    name: str
    kv_dtype: str
    target: ProgramProfile
    draft: ProgramProfile
    description: str = ""
    hw_version: str = "ai100"
    cores_per_device: int = MAX_CORES_PER_DEVICE
    mxfp6_matmul: bool = False
    convert_to_fp16: bool = True
    specializations_format: str = "named"
    compiler: str = "qaic-compile"
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    source: str = field(default="<profile>", compare=False)

    def program(self, program: str) -> ProgramProfile:
        """The section of `program` (a role of PROGRAMS)."""
        if program not in PROGRAMS:
            raise ValueError(f"program must be one of {PROGRAMS}, got {program!r}")
        return getattr(self, program)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the manifest (round-trips through `profile_from_dict`)."""
        return {
            "name": self.name,
            "description": self.description,
            "hw_version": self.hw_version,
            "cores_per_device": self.cores_per_device,
            "kv_dtype": self.kv_dtype,
            "mxfp6_matmul": self.mxfp6_matmul,
            "convert_to_fp16": self.convert_to_fp16,
            "specializations_format": self.specializations_format,
            "compiler": self.compiler,
            "compile_timeout_s": self.compile_timeout_s,
            "target": self.target.to_dict(),
            "draft": self.draft.to_dict(),
        }


# ----------------------------------------------------------------------------------------------
# loading


def _unique_key_loader():
    """A yaml SafeLoader that refuses a key given twice in one mapping (YAML would keep the
    last). yaml is imported here: reading a manifest needs none of it."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep: bool = False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    UniqueKeyLoader.add_constructor(
        yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping
    )
    return yaml, UniqueKeyLoader


def available_profiles() -> list[str]:
    """Names of the profiles shipped in `qpc_configs/`."""
    if not PROFILE_DIR.is_dir():
        return []
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def find_profile(name_or_path: str | os.PathLike[str]) -> Path:
    """Resolve a profile argument: an existing file, or a name looked up in `qpc_configs/`
    (the current directory's first, then the repository's)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.suffix == "" and len(path.parts) == 1:
        for base in (Path.cwd() / "qpc_configs", PROFILE_DIR):
            candidate = base / f"{path.name}.yaml"
            if candidate.is_file():
                return candidate
    known = ", ".join(available_profiles()) or "none"
    raise ProfileError(f"{name_or_path}: no such compile profile (shipped profiles: {known})")


def load_profile(name_or_path: str | os.PathLike[str] = DEFAULT_PROFILE) -> CompileProfile:
    """Load and validate a compile profile from a YAML file or a shipped profile's name."""
    path = find_profile(name_or_path)
    source = str(path)
    yaml, loader = _unique_key_loader()
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{source}: not valid YAML: {exc}") from exc
    except OSError as exc:
        raise ProfileError(f"{source}: cannot read: {exc}") from exc
    return profile_from_dict(data, source=source, default_name=path.stem)


def profile_from_dict(
    data: Any, *, source: str = "<profile>", default_name: str | None = None
) -> CompileProfile:
    """Validate plain data (as parsed from YAML) into a `CompileProfile`.

    `source` names the origin in error messages; `default_name` is used when `name` is absent.
    """
    v = _Validator(source)
    top = v.mapping(data, "", _TOP_KEYS)
    for key in ("kv_dtype", *PROGRAMS):
        v.require(top, key, "")

    name = top.get("name", default_name)
    if name is None:
        raise ProfileError(f"{source}: missing required key 'name'")
    name = v.string(name, "name", nonempty=True)
    cores_per_device = v.integer(
        top.get("cores_per_device", MAX_CORES_PER_DEVICE),
        "cores_per_device",
        minimum=1,
        maximum=MAX_CORES_PER_DEVICE,
    )

    _refuse_disaggregated(top["target"], source)
    target = v.program(
        v.mapping(top["target"], "target", _PROGRAM_KEYS), "target", cores_per_device
    )
    draft = v.program(v.mapping(top["draft"], "draft", _PROGRAM_KEYS), "draft", cores_per_device)

    profile = CompileProfile(
        name=name,
        description=v.string(top.get("description", ""), "description"),
        hw_version=_hw_version(v, top),
        cores_per_device=cores_per_device,
        kv_dtype=v.choice(top["kv_dtype"], "kv_dtype", KV_DTYPES),
        mxfp6_matmul=v.boolean(top.get("mxfp6_matmul", False), "mxfp6_matmul"),
        convert_to_fp16=v.boolean(top.get("convert_to_fp16", True), "convert_to_fp16"),
        specializations_format=v.choice(
            top.get("specializations_format", "named"),
            "specializations_format",
            SPECIALIZATION_FORMATS,
        ),
        compiler=v.choice(top.get("compiler", "qaic-compile"), "compiler", COMPILERS),
        compile_timeout_s=v.seconds(
            top.get("compile_timeout_s", DEFAULT_COMPILE_TIMEOUT_S), "compile_timeout_s"
        ),
        target=target,
        draft=draft,
        source=source,
    )
    _check_core_budget(profile)
    _check_bf16(profile)
    return profile


def _hw_version(v: _Validator, top: Mapping[str, Any]) -> str:
    """hw_version, or QEfficient's aic_hw_version (not both)."""
    if "hw_version" in top and HW_VERSION_ALIAS in top:
        raise v.fail(HW_VERSION_ALIAS, "is hw_version under QEfficient's name: give one of them")
    key = HW_VERSION_ALIAS if HW_VERSION_ALIAS in top else "hw_version"
    return v.choice(top.get(key, "ai100"), key, HW_VERSIONS)


def _check_bf16(profile: CompileProfile) -> None:
    if profile.kv_dtype == "bfloat16" and profile.hw_version not in BF16_HW_VERSIONS:
        raise ProfileError(
            f"{profile.source}: key 'kv_dtype': bfloat16 needs hw_version "
            f"{' or '.join(BF16_HW_VERSIONS)} (QEfficient allows bf16 only on AI 200; "
            f"{profile.hw_version} computes fp16): set kv_dtype: float16 or mxint8, or "
            "hw_version: ai200 for an AI 200 card"
        )


@dataclass(frozen=True)
class CompileOverrides:
    """Compile options given on the command line or to `dflash_qaic.export` / `compile`, with
    QEfficient's names; each one that is not None replaces the profile's value (declared and
    checked once, in dflash_qaic/exporter/options.py).

    num_cores: the target's cores per device (the draft keeps its profile's);
    mxfp6_matmul; mxint8_kv_cache: True -> kv_dtype mxint8, False -> float16;
    num_devices: the target sliced over devices 0..N-1 (1: one device);
    mos, aic_enable_depth_first: both programs; timeout_s: seconds per compiler run.
    """

    num_cores: int | None = None
    mxfp6_matmul: bool | None = None
    mxint8_kv_cache: bool | None = None
    num_devices: int | None = None
    mos: int | None = None
    aic_enable_depth_first: bool | None = None
    timeout_s: float | None = None

    @property
    def given(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def apply(self, profile: CompileProfile) -> CompileProfile:
        """The profile with these overrides (core budget checked again); unchanged if none."""
        if not self.given:
            return profile
        target, draft = profile.target, profile.draft
        both = {}
        if self.mos is not None:
            both["mos"] = self.mos
        if self.aic_enable_depth_first is not None:
            both["aic_enable_depth_first"] = self.aic_enable_depth_first
        tchanges = dict(both)
        if self.num_cores is not None:
            tchanges["num_cores"] = self.num_cores
        if self.num_devices is not None:
            n = self.num_devices
            tchanges["tensor_slicing"] = n if n > 1 else None
            tchanges["device_ids"] = tuple(range(n))
        target = replace(target, **tchanges)
        draft = replace(draft, **both)
        top: dict[str, Any] = {}
        if self.mxfp6_matmul is not None:
            top["mxfp6_matmul"] = self.mxfp6_matmul
        if self.mxint8_kv_cache is not None:
            top["kv_dtype"] = "mxint8" if self.mxint8_kv_cache else "float16"
        if self.timeout_s is not None:
            top["compile_timeout_s"] = float(self.timeout_s)
        label = ",".join(f"{k}={v}" for k, v in self.given.items())
        out = replace(profile, target=target, draft=draft, name=f"{profile.name}+{label}", **top)
        out = replace(out, source=f"{profile.source} with {label}")
        _check_core_budget(out)
        return out


def placements(profile: CompileProfile) -> list[tuple[str, ProgramProfile]]:
    """Every QPC the profile produces, as (label, program profile): one per program role."""
    return [(role, profile.program(role)) for role in PROGRAMS]


def _refuse_disaggregated(target: Any, source: str) -> None:
    """The one error for a profile written for the removed disaggregated prefill."""
    if not isinstance(target, Mapping):
        return  # the mapping check names the problem
    found = [k for k in _REMOVED_TARGET_KEYS if k in target]
    if found:
        keys = " and ".join(f"'target.{k}'" for k in found)
        raise ProfileError(
            f"{source}: {keys}: disaggregated prefill (a separate target prefill QPC) is no "
            "longer supported, because handing each request's KV cache to the verify/decode QPC "
            "moves it off the card and back through the host; remove "
            f"{'these keys' if len(found) > 1 else 'this key'} (prefill runs on the target's "
            "QPC; see docs/DESIGN.md, Disaggregated prefill)"
        )


def _check_core_budget(profile: CompileProfile) -> None:
    used: dict[int, list[tuple[str, int]]] = {}
    for label, prog in placements(profile):
        for dev in prog.device_ids:
            used.setdefault(dev, []).append((label, prog.num_cores))
    for dev, users in sorted(used.items()):
        total = sum(c for _, c in users)
        if total > profile.cores_per_device:
            detail = " + ".join(f"{label} {c}" for label, c in users)
            raise ProfileError(
                f"{profile.source}: device {dev} is over its core budget: {detail} = {total} "
                f"cores > cores_per_device {profile.cores_per_device}; lower num_cores or use "
                f"different device_ids"
            )


class _Validator:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, message: str) -> ProfileError:
        return ProfileError(f"{self.source}: key {key!r}: {message}")

    def mapping(self, value: Any, key: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        where = f"key {key!r}" if key else "the profile"
        if value is None and not key:
            raise ProfileError(f"{self.source}: empty profile")
        if not isinstance(value, Mapping):
            raise ProfileError(f"{self.source}: {where} must be a mapping, got {_kind(value)}")
        for k in value:
            if not isinstance(k, str) or k not in allowed:
                dotted = f"{key}.{k}" if key else str(k)
                raise ProfileError(
                    f"{self.source}: unknown key {dotted!r}; allowed keys"
                    f"{' in ' + repr(key) if key else ''}: {', '.join(allowed)}"
                )
        return dict(value)

    def require(self, data: Mapping[str, Any], key: str, parent: str) -> None:
        if key not in data:
            dotted = f"{parent}.{key}" if parent else key
            raise ProfileError(f"{self.source}: missing required key {dotted!r}")

    def string(self, value: Any, key: str, *, nonempty: bool = False) -> str:
        if not isinstance(value, str) or (nonempty and not value.strip()):
            raise self.fail(
                key, f"must be a{' non-empty' if nonempty else ''} string, got {value!r}"
            )
        return value

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def integer(
        self, value: Any, key: str, *, minimum: int | None = None, maximum: int | None = None
    ) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be <= {maximum}, got {value}")
        return value

    def seconds(self, value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.fail(key, f"must be a number of seconds > 0, got {value!r}")
        if value == float("inf"):
            raise self.fail(key, "must be finite")
        return float(value)

    def choice(self, value: Any, key: str, allowed: tuple[str, ...]) -> str:
        if value not in allowed:
            raise self.fail(key, f"must be one of {', '.join(allowed)}; got {value!r}")
        return value

    def program(self, raw: Mapping[str, Any], key: str, cores_per_device: int) -> ProgramProfile:
        self.require(raw, "num_cores", key)
        num_cores = self.integer(
            raw["num_cores"], f"{key}.num_cores", minimum=1, maximum=cores_per_device
        )
        tensor_slicing = raw.get("tensor_slicing")
        if tensor_slicing is not None:
            tensor_slicing = self.integer(tensor_slicing, f"{key}.tensor_slicing", minimum=1)
        n_devices = tensor_slicing or 1
        device_ids = raw.get("device_ids", list(range(n_devices)))
        if not isinstance(device_ids, list) or not device_ids:
            raise self.fail(f"{key}.device_ids", f"must be a non-empty list, got {device_ids!r}")
        for d in device_ids:
            self.integer(d, f"{key}.device_ids", minimum=0)
        if len(set(device_ids)) != len(device_ids):
            raise self.fail(f"{key}.device_ids", f"lists a device twice: {device_ids}")
        if len(device_ids) != n_devices:
            if tensor_slicing is None:
                raise self.fail(
                    f"{key}.device_ids",
                    f"lists {len(device_ids)} devices but a program without tensor_slicing "
                    f"runs on one device; set tensor_slicing: {len(device_ids)} to slice it",
                )
            raise self.fail(
                f"{key}.device_ids",
                f"must list tensor_slicing = {tensor_slicing} devices, got {device_ids}",
            )
        mos = raw.get("mos")
        if mos is not None:
            mos = self.integer(mos, f"{key}.mos", minimum=1)
        flags = raw.get("extra_flags", [])
        if not isinstance(flags, list):
            raise self.fail(f"{key}.extra_flags", f"must be a list of strings, got {flags!r}")
        for flag in flags:
            if not isinstance(flag, str) or not flag.startswith("-") or flag != flag.strip():
                raise self.fail(
                    f"{key}.extra_flags",
                    f"each flag must be a string starting with '-' (no spaces around), "
                    f"got {flag!r}",
                )
            stem = flag.split("=", 1)[0]
            if stem in _MANAGED_FLAGS:
                raise self.fail(
                    f"{key}.extra_flags",
                    f"{flag!r} is controlled by the profile key {_MANAGED_FLAGS[stem]}, "
                    f"not by extra_flags",
                )
        return ProgramProfile(
            num_cores=num_cores,
            device_ids=tuple(device_ids),
            mos=mos,
            aic_enable_depth_first=self.boolean(
                raw.get("aic_enable_depth_first", False), f"{key}.aic_enable_depth_first"
            ),
            extra_flags=tuple(flags),
            tensor_slicing=tensor_slicing,
        )


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__
