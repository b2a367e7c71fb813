"""device_ids: placing one replica's programs (runtime/devices.py), through `load`, the qaic
backend's sessions and `dflash-serve --device-ids`; bad ids are clear errors at load."""

from __future__ import annotations

import sys

import pytest

import dflash_qaic
from dflash_qaic import runtime
from dflash_qaic.runtime import BackendError, devices
from dflash_qaic.runtime.devices import Placement, check_present, parse_qids, place

SHARED = Placement((0,), (0,))  # the shipped one-SoC profiles: both programs on device 0
SPLIT = Placement((0,), (1,))  # a profile that gives the draft a device of its own
SLICED = Placement((0, 1, 2, 3), (0,))  # a target sliced over 4, its draft beside slice 0


@pytest.mark.parametrize(
    "ids, profile, want",
    [
        ([4], SHARED, Placement((4,), (4,))),
        ((7,), SHARED, Placement((7,), (7,))),
        ([4, 5], SPLIT, Placement((4,), (5,))),
        ([5, 4], SPLIT, Placement((5,), (4,))),  # in order: profile device 0 -> 5, 1 -> 4
        ([4, 5, 6, 7], SLICED, Placement((4, 5, 6, 7), (4,))),
        ({"target": [4], "draft": [5]}, SHARED, Placement((4,), (5,))),  # separate is fine
        ({"target": [2], "draft": [2]}, SHARED, Placement((2,), (2,))),
        ({"target": [8, 9, 10, 11], "draft": [9]}, SLICED, Placement((8, 9, 10, 11), (9,))),
    ],
)
def test_place_renames_the_profiles_devices(ids, profile, want):
    assert place(ids, profile) == want


@pytest.mark.parametrize(
    "ids, profile, words",
    [
        ([-1], SHARED, ["≥ 0", "-1"]),
        ([4, 4], SPLIT, ["device 4 twice"]),
        ([], SHARED, ["empty"]),
        ([True], SHARED, ["integers", "True"]),
        ([1.0], SHARED, ["integers"]),
        ("4", SHARED, ["list of device ids"]),
        (4, SHARED, ["list of device ids"]),
        ([4, 5], SHARED, ["names 2 devices", "on 1", 'device_ids={"target": [4], "draft": [5]}']),
        ([4], SPLIT, ["names 1 device", "give 2 device ids"]),
        ([4, 5], SLICED, ["give 4 device ids"]),
        ({"target": [4]}, SHARED, ["'target' and 'draft'"]),
        ({"target": [4], "draft": [5], "x": [6]}, SHARED, ["'target' and 'draft'"]),
        ({"target": [4, 5], "draft": [6]}, SHARED, ["device_ids['target'] names 2", "give 1"]),
        ({"target": [4], "draft": [-5]}, SHARED, ["device_ids['draft']", "≥ 0"]),
        ({"target": [4], "draft": [4]}, SPLIT, ["both on device 4", "separate devices"]),
        ({"target": [4, 5, 6, 7], "draft": [7, 7]}, SLICED, ["twice"]),
    ],
)
def test_bad_device_ids_name_the_problem(ids, profile, words):
    with pytest.raises(BackendError) as e:
        place(ids, profile)
    for w in words:
        assert w in str(e.value)


def test_qaic_util_listing_and_missing_devices():
    text = "====\nQID 0\n\tStatus:Ready\nQID 1\n\tStatus:Ready\nQID 3\n\tStatus:Ready\n"
    assert parse_qids(text) == (0, 1, 3)
    assert parse_qids("qaic-util: no devices\n") is None
    check_present(Placement((3,), (3,)), (0, 1, 3))
    check_present(Placement((9,), (9,)), None)  # tool missing: nothing to check against
    with pytest.raises(BackendError, match=r"device 2 does not exist.*\[0, 1, 3\]"):
        check_present(Placement((1, 2), (1,)), (0, 1, 3))


def test_ort_records_the_ids_and_refuses_bad_ones(cb_artifacts):
    assert dflash_qaic.load(cb_artifacts, threads=1).device_ids is None  # not placed
    pipe = dflash_qaic.load(cb_artifacts, threads=1, device_ids=[6])
    assert pipe.device_ids == Placement((6,), (6,)) and pipe.device_ids.devices == (6,)
    with pytest.raises(BackendError, match="twice"):
        dflash_qaic.load(cb_artifacts, device_ids=[6, 6])
    with pytest.raises(BackendError, match="≥ 0"):
        dflash_qaic.load(cb_artifacts, device_ids={"target": [1], "draft": [-1]})


class _Session:
    """A QAICInferenceSession stand-in that records where it was opened."""

    opened: list = []

    def __init__(self, qpc, device_ids):
        self.opened.append((qpc, device_ids))

    def skip_buffers(self, names):
        pass


def test_qaic_backend_opens_each_program_on_its_devices(cb_artifacts, monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "qaic_session_factory", lambda: _Session)
    monkeypatch.setattr(runtime, "_qpc_path", lambda d, prog, name: tmp_path / f"{name}.qpc")
    monkeypatch.setattr(devices, "host_devices", lambda: (0, 1, 2, 3))
    _Session.opened = []
    pipe = dflash_qaic.load(cb_artifacts, "qaic", device_ids={"target": [2], "draft": [3]})
    assert pipe.device_ids == Placement((2,), (3,))
    assert _Session.opened == [
        (str(tmp_path / "target.qpc"), [2]),
        (str(tmp_path / "draft.qpc"), [3]),
    ]
    _Session.opened = []
    assert dflash_qaic.load(cb_artifacts, "qaic").device_ids == SHARED  # the profile's own
    assert [ids for _, ids in _Session.opened] == [[0], [0]]
    with pytest.raises(BackendError, match=r"device 4 does not exist on this host.*\[0, 1, 2, 3\]"):
        dflash_qaic.load(cb_artifacts, "qaic", device_ids=[4])


def test_dflash_serve_refuses_bad_device_ids_before_serving(cb_artifacts, capsys):
    from dflash_qaic.serve.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(cb_artifacts), "--port", "0", "--device-ids", "4,x"])
    assert e.value.code == 2
    assert "integers separated by commas, e.g. 4 or 4,5" in capsys.readouterr().err
    assert main([str(cb_artifacts), "--port", "0", "--device-ids", "4,4"]) == 2
    assert "dflash-serve: error: device_ids names device 4 twice" in capsys.readouterr().err


# ---------------------------------------------------------------- the card generation

QAIC_UTIL_OUTPUT = """
====================================================================
QID 0
--------------------------------------------------------------------
\tStatus:Ready
\tNSP IMAGE_VARIANT:{variant}
\tNetworks Loaded:0
QID 1
\tStatus:Ready
\tNSP IMAGE_VARIANT:{variant}
"""


def fake_tool(tmp_path, monkeypatch, name: str, output: str) -> None:
    """A stand-in `name` on PATH (the SDK's own qaic-util absent) that prints `output`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!{sys.executable}\nprint({output!r})\n")
    (bin_dir / name).chmod(0o755)
    monkeypatch.setattr(devices, "QAIC_UTIL", tmp_path / "no-sdk" / "qaic-util")
    monkeypatch.setenv("PATH", str(bin_dir))


def _manifest(**commands):
    from types import SimpleNamespace as NS

    progs = {k: NS(kind=k, qpc=None if c is None else NS(command=c)) for k, c in commands.items()}
    return NS(programs=progs)


@pytest.mark.parametrize(
    "variant,want", [("AIC200_STANDARD", "ai200"), ("AIC100_PRO", "ai100"), ("UNKNOWN", None)]
)
def test_the_generation_from_qaic_util_on_path(tmp_path, monkeypatch, variant, want):
    fake_tool(tmp_path, monkeypatch, "qaic-util", QAIC_UTIL_OUTPUT.format(variant=variant))
    assert devices.host_devices() == (0, 1)
    assert devices.host_generation() == want  # no lspci on this PATH: qaic-util alone


def test_the_generation_from_lspci_when_qaic_util_says_nothing(tmp_path, monkeypatch):
    fake_tool(tmp_path, monkeypatch, "lspci", "00:1f.0 ISA bridge: Intel Device 7a06\n"
              "76:00.0 Processing accelerators: Qualcomm Technologies, Inc Device a110 (rev 01)")  # fmt: skip
    assert devices.host_generation() == "ai200"  # no qaic-util at all
    assert devices.parse_pci_generation("03:00.0 Unassigned class: Qualcomm Device a100") == "ai100"
    assert devices.parse_pci_generation("03:00.0 Ethernet: Intel Device a110") is None


def test_qpcs_of_another_generation_are_refused():
    ai100 = "qaic-compile -aic-hw -aic-hw-version=ai100 -m=target.onnx"
    ai200 = "qaic-compile -aic-hw -aic-hw-version=ai200 -m=draft.onnx"
    devices.check_generation(_manifest(target=ai100, draft=ai100), "ai100")
    devices.check_generation(_manifest(target=ai200, draft=ai200), None)  # unknown: pass
    devices.check_generation(_manifest(target=None, draft=None), "ai200")  # not compiled
    devices.check_generation(_manifest(target="qaic-exec -aic-hw -m=t.onnx"), "ai100")
    with pytest.raises(BackendError, match=r"draft QPC was compiled for ai200.*card is ai100"):
        devices.check_generation(_manifest(target=ai100, draft=ai200), "ai100")
    with pytest.raises(BackendError, match="--qpc-config ai200_bf16"):
        devices.check_generation(_manifest(target=ai100), "ai200")


def test_the_qaic_backend_reads_the_generation_at_load(cb_artifacts, monkeypatch, tmp_path):
    """`load(..., "qaic")` asks the card's generation (here a fake qaic-util on PATH) and checks
    the QPCs against it: these artifacts' QPCs (as an ai100 compile records them) refused on an
    AI200 card, loaded on an AI100 one."""
    import dataclasses

    from dflash_qaic.artifacts import manifest as mf

    monkeypatch.setattr(runtime, "qaic_session_factory", lambda: _Session)
    monkeypatch.setattr(runtime, "_qpc_path", lambda d, prog, name: tmp_path / f"{name}.qpc")
    read = mf.read_manifest
    rec = mf.QpcRecord(("Decode",), "0" * 16, "target/qpc-0", "target/qpc-0/qpc",
                       "qaic-compile -aic-hw -aic-hw-version=ai100", 12, (0,), None, "built")  # fmt: skip

    def compiled(*a, **kw):  # the manifest as a compiled export records it
        m = read(*a, **kw)
        progs = {k: dataclasses.replace(p, qpc=rec) for k, p in m.programs.items()}
        return dataclasses.replace(m, programs=progs)

    monkeypatch.setattr(runtime, "read_manifest", compiled)
    fake_tool(tmp_path, monkeypatch, "qaic-util", QAIC_UTIL_OUTPUT.format(variant="AIC200"))
    with pytest.raises(BackendError, match="compiled for ai100, but this host's card is ai200"):
        dflash_qaic.load(cb_artifacts, "qaic")
    fake_tool(tmp_path, monkeypatch, "qaic-util", QAIC_UTIL_OUTPUT.format(variant="AIC100"))
    assert dflash_qaic.load(cb_artifacts, "qaic").backend == "qaic"
