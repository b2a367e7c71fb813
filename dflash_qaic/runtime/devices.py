"""Where one replica's programs run: `dflash_qaic.load(..., device_ids=...)`, `--device-ids`.

A compile profile's `device_ids` (recorded per QPC in the manifest) are where the export placed
the target and the draft: `[0]` and `[0]` for the shipped single-SoC profiles, `[0, 1, 2, 3]`
and `[0]` for a target sliced over four. They do not enter the binary, so one set of QPCs runs
on any devices with the same shape of placement (docs/DESIGN.md, Replicas). `device_ids` moves
it:

- a list of ints, the replica's device group: the profile's devices, in increasing order, are
  renamed to the given ones in order. `[4]` puts a target and draft that share device 0 on 4;
  `[4, 5]` puts a profile's target on [0] and draft on [1] on 4 and 5; a target sliced over
  [0, 1, 2, 3] with its draft on [0] on `[4, 5, 6, 7]` runs on 4 … 7 with its draft on 4. The
  list must name as many devices as the profile uses.
- `{"target": [...], "draft": [...]}`: each program's own devices, as many as its profile entry
  lists. The two may share a device only when the profile already has them share one (the
  profile checked that their cores fit on one device together; a split profile did not).

Ids are distinct non-negative ints. On the `qaic` backend they must exist: the devices on the
host are read from `qaic-util -q` when the AI100 tools are installed. The `qaic` backend also
reads the card's generation as QEfficient does (`host_generation`: `qaic-util -q`'s
`NSP IMAGE_VARIANT`, else the Qualcomm PCI device id `lspci` lists) and refuses QPCs compiled
for another (`-aic-hw-version` in their compile command; a QPC of one generation does not run
on the other). ONNX Runtime has no
devices: the `ort` backends take any valid ids, record them (`Pipeline.device_ids`) and report
them (dflash-serve's `/metrics`, `dflash:device_info`), so replicas are told apart the same way
on a laptop and on a card.
"""

from __future__ import annotations

import logging
import numbers
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from dflash_qaic import contract
from dflash_qaic.runtime.backends import BackendError

log = logging.getLogger(__name__)

PROGRAMS = contract.ROLE_NAMES  # a Placement field per program role
#: the AI100 Platform SDK's device query tool (`qaic-util -q` lists each device as "QID n")
QAIC_UTIL = Path("/opt/qti-aic/tools/qaic-util")
_QID = re.compile(r"^\s*QID\s+(\d+)\b", re.M)
#: the card generation: qaic-util's image variant of the first device it lists (AIC100…,
#: AIC200…), else lspci's Qualcomm PCI device ids (QEfficient's tables)
_VARIANT = re.compile(r"NSP IMAGE_VARIANT\s*:\s*(\S+)")
_PCI_DEVICE = re.compile(r"\bDevice\s+([0-9a-fA-F]+)", re.I)
PCI_GENERATIONS = {"a110": "ai200", "a100": "ai100", "a0dc": "ai100"}
EXAMPLE_PROFILE = {"ai100": "ai100_mxfp6_mxint8", "ai200": "ai200_bf16"}  # qpc_configs/
_HW_VERSION = re.compile(r"-aic-hw-version=(\w+)")


class Placement(NamedTuple("_Placement", [(role, tuple[int, ...]) for role in PROGRAMS])):
    """The devices of a replica's programs, a field per program role (target, draft)."""

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device the replica uses, in increasing order."""
        return tuple(sorted({d for ids in self for d in ids}))

    def to_json(self) -> dict:
        return {role: list(ids) for role, ids in zip(self._fields, self)}


def profile_placement(manifest) -> Placement:
    """Where the compile profile put the two programs (a program with no QPC record: [0])."""
    ids = []
    for name in PROGRAMS:
        qpc = manifest.program(name).qpc
        ids.append(tuple(qpc.device_ids) if qpc is not None else (0,))
    return Placement(*ids)


def _ids(value, what: str) -> tuple[int, ...]:
    """A non-empty list of distinct integers ≥ 0, or a BackendError naming `what`."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise BackendError(
            f"{what} must be a list of device ids, e.g. [4] or [4, 5] (got {value!r})"
        )
    bad = [d for d in value if isinstance(d, bool) or not isinstance(d, numbers.Integral)]
    if bad:
        raise BackendError(f"{what}: device ids are integers (got {bad[0]!r} in {list(value)})")
    if not value:
        raise BackendError(f"{what} is empty: name at least one device, e.g. [0]")
    negative = [d for d in value if d < 0]
    if negative:
        raise BackendError(
            f"{what}: device ids are ≥ 0 (got {negative[0]} in {list(value)}); "
            "`qaic-util -q` lists a host's devices as QID 0, 1, …"
        )
    if len(set(value)) != len(value):
        twice = sorted({d for d in value if list(value).count(d) > 1})
        raise BackendError(
            f"{what} names device {twice[0]} twice ({list(value)}): each device of a replica once"
        )
    return tuple(int(d) for d in value)


def _shape(profile: Placement) -> str:
    return f"the target on {list(profile.target)}, the draft on {list(profile.draft)}"


def place(device_ids, profile: Placement) -> Placement:
    """The placement `device_ids` (see the module's docstring) gives programs the profile put
    at `profile`; a BackendError naming the problem and the fix when it cannot."""
    if isinstance(device_ids, Mapping):
        return _place_each(device_ids, profile)
    ids = _ids(device_ids, "device_ids")
    used = profile.devices
    if len(ids) != len(used):
        nt, nd = len(profile.target), len(profile.draft)
        hint = (
            f"; to give the target and the draft devices of their own, pass device_ids="
            f'{{"target": {list(ids[:nt])}, "draft": {list(ids[nt:])}}}'
            if len(ids) == nt + nd and set(profile.target) & set(profile.draft)
            else ""
        )
        raise BackendError(
            f"device_ids {list(ids)} names {len(ids)} device{'s' * (len(ids) != 1)}, but these "
            f"artifacts' compile profile places the programs on {len(used)} "
            f"({_shape(profile)}): give {len(used)} device id{'s' * (len(used) != 1)}, one "
            f"for each of {list(used)} in order{hint}"
        )
    rename = dict(zip(used, ids))
    return Placement(
        tuple(rename[d] for d in profile.target), tuple(rename[d] for d in profile.draft)
    )


def _place_each(device_ids: Mapping, profile: Placement) -> Placement:
    keys = set(device_ids)
    if keys != set(PROGRAMS):
        raise BackendError(
            f"device_ids as a mapping names the devices of each program: its keys are 'target' "
            f"and 'draft' (got {sorted(map(str, keys))})"
        )
    out = {}
    for name in PROGRAMS:
        ids = _ids(device_ids[name], f"device_ids[{name!r}]")
        want = len(getattr(profile, name))
        if len(ids) != want:
            raise BackendError(
                f"device_ids[{name!r}] names {len(ids)} device{'s' * (len(ids) != 1)}, but the "
                f"{name} program was compiled for {want} ({_shape(profile)}): give {want}; "
                "the number of devices is fixed at compile time (tensor_slicing in the profile)"
            )
        out[name] = ids
    shared = sorted(set(out["target"]) & set(out["draft"]))
    if shared and not set(profile.target) & set(profile.draft):
        raise BackendError(
            f"device_ids puts the target and the draft both on device {shared[0]}, but their "
            f"compile profile placed them on separate devices ({_shape(profile)}), so their "
            "cores together may not fit one device: give the draft a device the target does "
            "not use, or re-export with a profile that places both on one device"
        )
    return Placement(out["target"], out["draft"])


def _output(command: list[str]) -> str | None:
    """A tool's stdout, or None when it is not installed or does not answer."""
    try:
        res = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.debug("cannot run %s: %s", command[0], e)
        return None
    return res.stdout


def qaic_util() -> Path:
    """The SDK's qaic-util, or the one on PATH when the SDK's directory has none."""
    found = None if QAIC_UTIL.is_file() else shutil.which("qaic-util")
    return Path(found) if found else QAIC_UTIL


def host_devices(tool: Path | None = None) -> tuple[int, ...] | None:
    """The AI100 devices on this host (the QIDs `qaic-util -q` lists), or None when the tool is
    not installed or does not answer (then nothing is checked here: opening a session on a
    missing device fails in the runtime instead)."""
    out = _output([str(tool or qaic_util()), "-q"])
    return None if out is None else parse_qids(out)


def host_generation(tool: Path | None = None) -> str | None:
    """The card generation on this host, "ai100" or "ai200", found as QEfficient finds it:
    the first `NSP IMAGE_VARIANT` `qaic-util -q` prints (AIC200… or AIC100…), else the first
    Qualcomm Cloud AI device `lspci` lists by PCI device id; None when neither says."""
    out = _output([str(tool or qaic_util()), "-q"])
    gen = parse_generation(out or "")
    return gen or parse_pci_generation(_output(["lspci"]) or "")


def parse_generation(text: str) -> str | None:
    """ "ai200" / "ai100" from the first `NSP IMAGE_VARIANT` of `qaic-util -q`'s output."""
    m = _VARIANT.search(text)
    variant = m.group(1).upper() if m else ""
    return "ai200" if "AIC200" in variant else "ai100" if "AIC100" in variant else None


def parse_pci_generation(text: str) -> str | None:
    """ "ai200" / "ai100" from the first Qualcomm line of `lspci`'s output that names a known
    device id (PCI_GENERATIONS)."""
    for line in text.splitlines():
        m = _PCI_DEVICE.search(line) if "qualcomm" in line.lower() else None
        if m and m.group(1).lower() in PCI_GENERATIONS:
            return PCI_GENERATIONS[m.group(1).lower()]
    return None


def check_generation(manifest, generation: str | None) -> None:
    """Every compiled program of `manifest` was compiled for the card `generation` (None:
    unknown, pass): its compile command's `-aic-hw-version` (absent: ai100, the compiler's
    default). A BackendError naming both and the fix otherwise."""
    if generation is None:
        return
    for p in manifest.programs.values():
        m = p.qpc and _HW_VERSION.search(p.qpc.command)
        built = m.group(1) if m else "ai100"
        if p.qpc is not None and built != generation:
            raise BackendError(
                f"the {p.kind} QPC was compiled for {built}, but this host's card is "
                f"{generation} (`qaic-util -q`): re-export with a profile of hw_version "
                f"{generation} (e.g. --qpc-config {EXAMPLE_PROFILE.get(generation, '…')})"
            )


def parse_qids(text: str) -> tuple[int, ...] | None:
    """The device ids in `qaic-util -q`'s output ("QID 0", "QID 1", …); None if it lists none."""
    qids = sorted({int(q) for q in _QID.findall(text)})
    return tuple(qids) or None


def check_present(placement: Placement, present: Sequence[int] | None) -> None:
    """Every device of `placement` is among the host's `present` ones (None: unknown, pass)."""
    if present is None:
        return
    missing = [d for d in placement.devices if d not in set(present)]
    if missing:
        raise BackendError(
            f"device {missing[0]} does not exist on this host: `qaic-util -q` lists devices "
            f"{list(present)}; pick device_ids among them"
        )


def parse_device_ids(text: str) -> list[int]:
    """`--device-ids 4,5` → [4, 5]; the values are checked by `place` at load."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--device-ids takes integers separated by commas, e.g. 4 or 4,5 (got {text!r})"
        ) from None
