"""The compiler step: profiles, specializations.json, custom_io.yaml, command lines, QPC cache.

No AI100 compiler exists here: a small Python script stands in for it (via $QAIC_COMPILER),
records its argv and writes programqpc.bin into -aic-binary-dir.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from dflash_qaic import contract
from dflash_qaic.artifacts.manifest import QpcRecord
from dflash_qaic.compiler import qpc
from dflash_qaic.compiler.profiles import (
    CompileProfile,
    ProfileError,
    available_profiles,
    load_profile,
    profile_from_dict,
)

TIO = contract.TargetIO(n_layers=2, n_kv_heads=2, head_dim=16, hidden_size=64, vocab_size=256)
DIO = contract.DraftIO(
    n_layers=1, n_kv_heads=2, head_dim=16, hidden_size=64, vocab_size=256, block_size=4
)
TSPECS = contract.target_specializations(
    contract.shape_plan(4, 32, 128, verify_lengths=[4], sampling=False)
)
DSPECS = contract.draft_specializations(contract.shape_plan(4, 32, 128))
PROFILES = [
    "ai100_fp16",
    "ai100_mxfp6_mxint8",
    "ai100_split",
    "ai100_multidevice",
    "ai200_bf16",
]
SDK = "/opt/qti-aic/exec/qaic-compile"

# ---------------------------------------------------------------------------------------------
# expected texts: the compiler inputs as docs/DESIGN.md, Artifacts describes them

TARGET_NAMED = """\
{
  "specializations": [
    {"name": "Prefill[8]", "symbols": {"batch_size": "1", "seq_len": "8", "ctx_len": "128"}},
    {"name": "Prefill", "symbols": {"batch_size": "1", "seq_len": "32", "ctx_len": "128"}},
    {"name": "Verify", "symbols": {"batch_size": "1", "seq_len": "4", "ctx_len": "128"}},
    {"name": "Decode", "symbols": {"batch_size": "1", "seq_len": "1", "ctx_len": "128"}}
  ]
}
"""
TARGET_FLAT = """\
{
  "specializations": [
    {"batch_size": "1", "seq_len": "8", "ctx_len": "128"},
    {"batch_size": "1", "seq_len": "32", "ctx_len": "128"},
    {"batch_size": "1", "seq_len": "4", "ctx_len": "128"},
    {"batch_size": "1", "seq_len": "1", "ctx_len": "128"}
  ]
}
"""
DRAFT_NAMED = """\
{
  "specializations": [
    {"name": "DraftDecode", "symbols": {"batch_size": "1", "seq_len": "4", "ctx_len": "128"}},
    {"name": "DraftPrefill[8]", "symbols": {"batch_size": "1", "seq_len": "8", "ctx_len": "128"}},
    {"name": "DraftPrefill[32]", "symbols": {"batch_size": "1", "seq_len": "32", "ctx_len": "128"}},
    {"name": "DraftPrefill", "symbols": {"batch_size": "1", "seq_len": "96", "ctx_len": "128"}}
  ]
}
"""
DRAFT_FLAT = """\
{
  "specializations": [
    {"batch_size": "1", "seq_len": "4", "ctx_len": "128"},
    {"batch_size": "1", "seq_len": "8", "ctx_len": "128"},
    {"batch_size": "1", "seq_len": "32", "ctx_len": "128"},
    {"batch_size": "1", "seq_len": "96", "ctx_len": "128"}
  ]
}
"""
TARGET_IO_FP16 = """\
- IOName: past_key.0
  Precision: float16
- IOName: past_value.0
  Precision: float16
- IOName: past_key.1
  Precision: float16
- IOName: past_value.1
  Precision: float16
- IOName: past_key.0_RetainedState
  Precision: float16
- IOName: past_value.0_RetainedState
  Precision: float16
- IOName: past_key.1_RetainedState
  Precision: float16
- IOName: past_value.1_RetainedState
  Precision: float16
"""
TARGET_IO_MXINT8 = TARGET_IO_FP16.replace("float16", "mxint8")
DRAFT_IO_FP16 = """\
- IOName: past_key.0
  Precision: float16
- IOName: past_value.0
  Precision: float16
- IOName: past_key.0_RetainedState
  Precision: float16
- IOName: past_value.0_RetainedState
  Precision: float16
"""
DRAFT_IO_MXINT8 = """\
- IOName: past_key.0
  Precision: mxint8
- IOName: past_value.0
  Precision: mxint8
- IOName: past_key.0_RetainedState
  Precision: mxint8
- IOName: past_value.0_RetainedState
  Precision: mxint8
"""
MDP_4x12 = """\
{
  "connections": [{"devices": [0, 1, 2, 3], "type": "p2p"}],
  "partitions": [
    {
      "name": "Partition0",
      "devices": [
        {"deviceId": 0, "numCores": 12},
        {"deviceId": 1, "numCores": 12},
        {"deviceId": 2, "numCores": 12},
        {"deviceId": 3, "numCores": 12}
      ]
    }
  ]
}
"""

# Command lines for ONNX files /art/<program>/<program>.onnx and the QPC dir /art/<program>/qpc-K.
T = "-m=/art/target/target.onnx -retained-state -convert-to-fp16"
D = "-m=/art/draft/draft.onnx -retained-state -convert-to-fp16"
TFILES = (
    "-network-specialization-config=/art/target/qpc-K/specializations.json"
    " -custom-IO-list-file=/art/target/qpc-K/custom_io.yaml"
    " -aic-binary-dir=/art/target/qpc-K/qpc"
)
DFILES = (
    "-network-specialization-config=/art/draft/qpc-K/specializations.json"
    " -custom-IO-list-file=/art/draft/qpc-K/custom_io.yaml"
    " -aic-binary-dir=/art/draft/qpc-K/qpc"
)
HW = f"{SDK} -aic-hw -aic-hw-version=ai100"
COMMANDS = {
    ("ai100_fp16", "target"): (
        f"{HW} {T} -aic-num-cores=12 -mos=1 -aic-enable-depth-first {TFILES}"
    ),
    ("ai100_fp16", "draft"): f"{HW} {D} -aic-num-cores=4 {DFILES}",
    ("ai100_mxfp6_mxint8", "target"): (
        f"{HW} {T} -mxfp6-matmul -aic-num-cores=12 -mos=1 -aic-enable-depth-first {TFILES}"
    ),
    ("ai100_mxfp6_mxint8", "draft"): f"{HW} {D} -mxfp6-matmul -aic-num-cores=4 {DFILES}",
    ("ai100_split", "target"): (
        f"{HW} {T} -aic-num-cores=16 -mos=1 -aic-enable-depth-first {TFILES}"
    ),
    ("ai100_split", "draft"): f"{HW} {D} -aic-num-cores=16 {DFILES}",
    ("ai100_multidevice", "target"): (
        f"{HW} {T} -aic-num-cores=12 -mos=1 -aic-enable-depth-first"
        f" -mdp-load-partition-config=/art/target/qpc-K/mdp.json {TFILES}"
    ),
    ("ai100_multidevice", "draft"): f"{HW} {D} -aic-num-cores=4 {DFILES}",
}
# What each profile writes, per program: specializations.json, custom_io.yaml.
FILES = {
    "ai100_fp16": {
        "target": (TARGET_NAMED, TARGET_IO_FP16),
        "draft": (DRAFT_NAMED, DRAFT_IO_FP16),
    },
    "ai100_mxfp6_mxint8": {
        "target": (TARGET_NAMED, TARGET_IO_MXINT8),
        "draft": (DRAFT_NAMED, DRAFT_IO_MXINT8),
    },
    "ai100_split": {
        "target": (TARGET_NAMED, TARGET_IO_FP16),
        "draft": (DRAFT_NAMED, DRAFT_IO_FP16),
    },
    "ai100_multidevice": {
        "target": (TARGET_NAMED, TARGET_IO_FP16),
        "draft": (DRAFT_NAMED, DRAFT_IO_FP16),
    },
}
FLAT = {
    TARGET_NAMED: TARGET_FLAT,
    DRAFT_NAMED: DRAFT_FLAT,
}

FAKE_COMPILER = """\
#!{python}
import json, os, pathlib, sys
with open(os.environ["FAKE_QAIC_LOG"], "a") as fh:
    fh.write(json.dumps(sys.argv) + "\\n")
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
out = pathlib.Path(args["-aic-binary-dir"])
mode = os.environ.get("FAKE_QAIC_MODE", "ok")
out.mkdir(parents=True)
if mode == "fail":
    (out / "network.elf").write_bytes(b"half")
    (out / "programqpc.bin").write_bytes(b"truncated")
    print("compiling ...")
    print("Error: unsupported operator CtxScatter at node 17", file=sys.stderr)
    sys.exit(1)
if mode == "nomarker":
    sys.exit(0)
if mode == "tiny":
    (out / "programqpc.bin").write_bytes(b"QPC")
    sys.exit(0)
if mode == "spawn":  # a child that would outlive the compiler unless its group is killed
    import subprocess, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pathlib.Path(os.environ["FAKE_QAIC_CHILD"]).write_text(str(child.pid))
    time.sleep(60)
if mode == "hang":
    import time
    time.sleep(60)
(out / "programqpc.bin").write_bytes(b"QPC:" + " ".join(sys.argv[1:]).encode())
"""


# ---------------------------------------------------------------------------------------------
# helpers and fixtures


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """A stand-in compiler; returns a function giving the recorded argv lists."""
    script = tmp_path / "bin" / "fake-qaic-compile"
    script.parent.mkdir()
    script.write_text(FAKE_COMPILER.format(python=sys.executable))
    script.chmod(0o755)
    log = tmp_path / "invocations.jsonl"
    monkeypatch.setenv(qpc.COMPILER_ENV, str(script))
    monkeypatch.setenv("FAKE_QAIC_LOG", str(log))
    monkeypatch.delenv("FAKE_QAIC_MODE", raising=False)

    def calls() -> list[list[str]]:
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines()]

    calls.script = script
    return calls


@pytest.fixture
def art(tmp_path):
    """An artifacts directory with placeholder ONNX files (the compile step does not parse them)."""
    out = tmp_path / "art"
    for program in ("target", "draft"):
        (out / program).mkdir(parents=True)
        (out / program / f"{program}.onnx").write_bytes(f"dummy {program} onnx\n".encode())
    return out


def compile_target(art: Path, profile: CompileProfile, **kw):
    return qpc.compile_program(
        art / "target" / "target.onnx", art / "target", TIO, TSPECS, profile, "target", **kw
    )


# ---------------------------------------------------------------------------------------------
# profiles


def test_shipped_profiles_load():
    assert available_profiles() == sorted(PROFILES)
    fp16 = load_profile("ai100_fp16")
    assert (fp16.kv_dtype, fp16.mxfp6_matmul, fp16.convert_to_fp16) == ("float16", False, True)
    assert (fp16.target.num_cores, fp16.draft.num_cores) == (12, 4)
    assert fp16.target.device_ids == fp16.draft.device_ids == (0,)
    mx = load_profile("ai100_mxfp6_mxint8")
    assert (mx.kv_dtype, mx.mxfp6_matmul) == ("mxint8", True)
    split = load_profile("ai100_split")
    assert split.target.device_ids != split.draft.device_ids
    multi = load_profile("ai100_multidevice")
    assert multi.target.tensor_slicing == 4 and multi.target.device_ids == (0, 1, 2, 3)
    for name in PROFILES:
        p = load_profile(name)
        assert p.name == name and p.description
        assert profile_from_dict(p.to_dict(), source="roundtrip") == p


def test_profile_from_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "hw_version: ai200\nkv_dtype: bfloat16\ntarget: {num_cores: 8}\ndraft: {num_cores: 8}\n"
    )
    p = load_profile(path)
    assert (p.name, p.kv_dtype, p.compiler, p.specializations_format) == (
        "mine",
        "bfloat16",
        "qaic-compile",
        "named",
    )
    assert p.target.device_ids == (0,) and p.target.mos is None


GOOD = {"kv_dtype": "float16", "target": {"num_cores": 8}, "draft": {"num_cores": 4}}


def _with(**changes):
    data = json.loads(json.dumps(GOOD))
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for p in parents:
            node = node[p]
        node[last] = value
    return data


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        (_with(num_core=4), ["unknown key 'num_core'", "allowed keys", "kv_dtype", "draft"]),
        (
            _with(target__num_corse=4),
            ["unknown key 'target.num_corse'", "num_cores", "tensor_slicing"],
        ),
        (_with(draft__disaggregate=True), ["unknown key 'draft.disaggregate'", "num_cores"]),
        (_with(target__num_cores=0), ["'target.num_cores'", ">= 1"]),
        (_with(draft__num_cores=17), ["'draft.num_cores'", "<= 16"]),
        (_with(target__num_cores="12"), ["'target.num_cores'", "integer"]),
        (_with(kv_dtype="int4"), ["'kv_dtype'", "float16, bfloat16, mxint8", "int4"]),
        (_with(hw_version="ai300"), ["'hw_version'", "ai100, ai200"]),
        (_with(aic_hw_version="ai300"), ["'aic_hw_version'", "ai100, ai200"]),
        (_with(hw_version="ai100", aic_hw_version="ai200"), ["'aic_hw_version'", "one of them"]),
        (_with(kv_dtype="bfloat16"), ["'kv_dtype'", "bfloat16 needs hw_version ai200", "float16"]),
        (_with(compiler="gcc"), ["'compiler'", "qaic-compile, qaic-exec"]),
        (_with(specializations_format="nested"), ["'specializations_format'", "named, flat"]),
        (_with(mxfp6_matmul="yes"), ["'mxfp6_matmul'", "true or false"]),
        (_with(target__mos=0), ["'target.mos'", ">= 1"]),
        (_with(target__device_ids=[0, 0]), ["'target.device_ids'", "twice"]),
        (_with(target__device_ids=[0, 1]), ["'target.device_ids'", "tensor_slicing"]),
        (
            _with(target__tensor_slicing=4, target__device_ids=[0, 1]),
            ["'target.device_ids'", "tensor_slicing = 4"],
        ),
        (_with(target__extra_flags="-v"), ["'target.extra_flags'", "list"]),
        (_with(target__extra_flags=["-aic-num-cores=2"]), ["'target.extra_flags'", "num_cores"]),
        (_with(target__num_cores=14), ["device 0", "target 14 + draft 4 = 18", "core budget"]),
        ({"target": {"num_cores": 4}, "draft": {"num_cores": 4}}, ["missing", "'kv_dtype'"]),
        ({"kv_dtype": "float16", "draft": {"num_cores": 4}}, ["missing", "'target'"]),
        (_with(draft={"device_ids": [0]}), ["missing", "'draft.num_cores'"]),
        (_with(target=[12]), ["'target'", "mapping"]),
        ([1, 2], ["mapping"]),
    ],
)
def test_bad_profiles(tmp_path, data, needles):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError) as exc:
        load_profile(path)
    message = str(exc.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message, message


def test_bad_profile_yaml(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("kv_dtype: float16\nkv_dtype: mxint8\ntarget: {num_cores: 1}\n")
    with pytest.raises(ProfileError, match="duplicate key 'kv_dtype'"):
        load_profile(dup)
    broken = tmp_path / "broken.yaml"
    broken.write_text("target: [\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(broken)
    with pytest.raises(ProfileError, match="no such compile profile"):
        load_profile("ai100_nonexistent")


# ---------------------------------------------------------------------------------------------
# the compiler's input files and command lines


def test_specializations_json_values_are_strings():
    named = qpc.specializations_json(TSPECS, "named")
    assert named["specializations"][:2] == [
        {"name": "Prefill[8]", "symbols": {"batch_size": "1", "seq_len": "8", "ctx_len": "128"}},
        {"name": "Prefill", "symbols": {"batch_size": "1", "seq_len": "32", "ctx_len": "128"}},
    ]
    flat = qpc.specializations_json(DSPECS, "flat")
    assert flat == {
        "specializations": [
            {"batch_size": "1", "seq_len": "4", "ctx_len": "128"},
            {"batch_size": "1", "seq_len": "8", "ctx_len": "128"},  # the prefill lengths
            {"batch_size": "1", "seq_len": "32", "ctx_len": "128"},
            {"batch_size": "1", "seq_len": "96", "ctx_len": "128"},  # 3 chunks fit ctx_len 128
        ]
    }
    with pytest.raises(ValueError, match="fmt"):
        qpc.specializations_json(TSPECS, "nested")
    with pytest.raises(ValueError, match="positive int"):
        qpc.specializations_json([{"name": "X", "symbols": {"seq_len": 0}}])


@pytest.mark.parametrize(
    ("specs", "fmt", "expected"),
    [
        (TSPECS, "named", TARGET_NAMED),
        (TSPECS, "flat", TARGET_FLAT),
        (DSPECS, "named", DRAFT_NAMED),
        (DSPECS, "flat", DRAFT_FLAT),
    ],
)
def test_specializations_text(specs, fmt, expected):
    text = qpc.specializations_text(specs, fmt)
    assert text == expected
    assert json.loads(text) == qpc.specializations_json(specs, fmt)


@pytest.mark.parametrize(
    ("io", "dtype", "expected"),
    [
        (TIO, "float16", TARGET_IO_FP16),
        (TIO, "mxint8", TARGET_IO_MXINT8),
        (DIO, "float16", DRAFT_IO_FP16),
        (DIO, "mxint8", DRAFT_IO_MXINT8),
    ],
)
def test_custom_io_yaml(io, dtype, expected):
    text = qpc.custom_io_yaml(io, dtype)
    assert text == expected
    entries = yaml.safe_load(text)
    past = {s.name for s in io.kv}
    retained = {o.name for o in io.outputs if o.name.endswith(contract.RETAINED_SUFFIX)}
    assert {e["IOName"] for e in entries} == past | retained
    assert {contract.retained(n) for n in past} == retained
    assert {e["Precision"] for e in entries} == {dtype}


def test_custom_io_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="kv_dtype"):
        qpc.custom_io_yaml(TIO, "int4")


def test_mdp_partition_config():
    assert qpc.mdp_text(4, 12) == MDP_4x12
    assert json.loads(MDP_4x12) == qpc.mdp_partition_config(4, 12)


@pytest.mark.parametrize("key", sorted(COMMANDS), ids=lambda k: "-".join(k))
def test_compile_command(key):
    name, program = key
    profile = load_profile(name)
    pp = profile.program(program)  # one QPC per program
    argv = qpc.compile_command(
        SDK, f"/art/{program}/{program}.onnx", f"/art/{program}/qpc-K", pp, profile
    )
    assert shlex.join(argv) == COMMANDS[key]


def test_compile_command_older_sdk_and_extra_flags():
    profile = profile_from_dict(
        _with(
            compiler="qaic-exec",
            convert_to_fp16=False,
            draft__extra_flags=["-aic-perf-metrics", "-stats-level=70"],
        ),
        default_name="custom",
    )
    argv = qpc.compile_command(
        "/opt/qti-aic/exec/qaic-exec", "/m.onnx", "/q", profile.draft, profile
    )
    assert shlex.join(argv) == (
        "/opt/qti-aic/exec/qaic-exec -aic-hw -compile-only -aic-hw-version=ai100 -m=/m.onnx"
        " -retained-state -aic-num-cores=4 -aic-perf-metrics -stats-level=70"
        " -network-specialization-config=/q/specializations.json"
        " -custom-IO-list-file=/q/custom_io.yaml -aic-binary-dir=/q/qpc"
    )


# ---------------------------------------------------------------------------------------------
# compile_program without a compiler: inputs written, result skipped


def test_default_compiler_path():
    assert qpc.default_compiler_path() == Path("/opt/qti-aic/exec/qaic-compile")
    assert qpc.default_compiler_path("qaic-exec") == Path("/opt/qti-aic/exec/qaic-exec")


@pytest.mark.parametrize("name", [p for p in PROFILES if p.startswith("ai100")])  # pinned below
def test_no_compiler_writes_inputs(name, art, no_compiler):
    profile = load_profile(name)
    for program, io, specs in (("target", TIO, TSPECS), ("draft", DIO, DSPECS)):
        onnx = art / program / f"{program}.onnx"
        res = qpc.compile_program(onnx, art / program, io, specs, profile, program)
        assert res.skipped and not res.cached and not res.ready and res.compiler is None
        assert res.looked_in == (
            "$QAIC_COMPILER (not set)",
            str(qpc.SDK_EXEC_DIR / "qaic-compile"),
            "qaic-compile on PATH",
        )
        q = res
        spec_text, io_text = FILES[name][program]
        qdir = art / q.dir  # paths relative to the artifacts directory
        assert q.status == "skipped"
        assert qdir.parent == art / program and qdir.name == f"qpc-{q.key}"
        assert len(q.key) == 16 and int(q.key, 16) >= 0
        assert (qdir / "specializations.json").read_text() == spec_text
        assert (qdir / "custom_io.yaml").read_text() == io_text
        assert (qdir / "compile.cmd").read_text() == q.command + "\n"
        # the command is the pinned one, with paths relative to the artifacts directory
        # (so the directory can be copied to an AI100 host) and the SDK's compiler
        pinned = COMMANDS[(name, program)]
        pinned = pinned.replace(f"/art/{program}/qpc-K", f"{program}/qpc-{q.key}")
        pinned = pinned.replace(f"/art/{program}/{program}.onnx", f"{program}/{program}.onnx")
        # (the fixture points the SDK directory at an empty one, so no real compiler is found)
        pinned = pinned.replace(SDK, str(qpc.SDK_EXEC_DIR / "qaic-compile"))
        assert q.command == pinned
        has_mdp = q.tensor_slicing is not None and q.tensor_slicing > 1
        assert (qdir / "mdp.json").exists() == has_mdp
        if has_mdp:
            assert (qdir / "mdp.json").read_text() == MDP_4x12
        assert not (art / q.qpc).exists()
        assert "On an AI100 host, in the artifacts directory, run:" in res.summary()
        # the result lists every specialization exactly once
        assert list(res.specializations) == [s["name"] for s in specs]


# A profile written for the removed disaggregated prefill (ai100_disaggregated.yaml as shipped
# before): a target prefill QPC on device 1, verify + decode on device 0.
OLD_DISAGGREGATED = """\
name: ai100_disaggregated
kv_dtype: float16
target:
  num_cores: 12
  device_ids: [0]
  disaggregate: true
  prefill:
    num_cores: 16
    device_ids: [1]
draft:
  num_cores: 4
"""


@pytest.mark.parametrize(
    ("target", "keys", "fix"),
    [
        (None, "'target.disaggregate' and 'target.prefill'", "remove these keys"),
        ({"num_cores": 8, "disaggregate": False}, "'target.disaggregate'", "remove this key"),
        ({"num_cores": 8, "prefill": {"num_cores": 4}}, "'target.prefill'", "remove this key"),
    ],
)
def test_disaggregated_profile_is_refused(tmp_path, target, keys, fix):
    path = tmp_path / "old.yaml"
    text = OLD_DISAGGREGATED if target is None else yaml.safe_dump(_with(target=target))
    path.write_text(text)
    with pytest.raises(ProfileError) as exc:
        load_profile(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: {keys}: disaggregated prefill")
    for needle in (
        "no longer supported",
        "off the card and back through the host",  # why
        fix,
        "see docs/DESIGN.md, Disaggregated prefill",
    ):
        assert needle in message, message
    assert "\n" not in message  # one message, not a traceback of checks
    # the shipped profile is gone: its name now lists the ones that exist
    with pytest.raises(ProfileError, match="no such compile profile.*ai100_fp16"):
        load_profile("ai100_disaggregated")


def test_one_qpc_per_program_for_manifest(art, no_compiler):
    res = compile_target(art, load_profile("ai100_split"))
    assert res.qpc_path == art / res.qpc and res.qpc_dir == art / res.dir
    assert res.device_ids == (0,) and res.num_cores == 16
    record = QpcRecord.of(res).to_json()  # what the manifest records of it
    json.dumps(record)
    assert record["specializations"] == ["Prefill[8]", "Prefill", "Verify", "Decode"]
    assert record["qpc"] == f"target/qpc-{res.key}/qpc" and record["key"] == res.key


def test_older_sdk_flat_profile(art, no_compiler):
    profile = replace(
        load_profile("ai100_fp16"), compiler="qaic-exec", specializations_format="flat"
    )
    res = compile_target(art, profile)
    assert res.looked_in[1] == str(qpc.SDK_EXEC_DIR / "qaic-exec")
    assert res.argv[:3] == [str(qpc.SDK_EXEC_DIR / "qaic-exec"), "-aic-hw", "-compile-only"]
    assert (res.qpc_dir / "specializations.json").read_text() == TARGET_FLAT
    assert FLAT[TARGET_NAMED] == TARGET_FLAT


# ---------------------------------------------------------------------------------------------
# compile_program with a (fake) compiler


def test_invocation_and_cache(art, fake_compiler, caplog):
    profile = load_profile("ai100_fp16")
    caplog.set_level("INFO", logger="dflash_qaic")
    res = compile_target(art, profile)
    messages = [r.getMessage() for r in caplog.records]
    assert res.status == "built" and not res.cached and not res.skipped
    assert res.compiler == fake_compiler.script and res.ready
    (argv,) = fake_compiler()
    cmd = shlex.split((res.qpc_dir / "compile.cmd").read_text())
    assert cmd == res.argv and cmd[0] == str(fake_compiler.script)
    # The run is compile.cmd exactly, except that the compiler writes into a staging directory
    # that is renamed to qpc/ once programqpc.bin exists.
    assert argv[:-1] == cmd[:-1]
    assert cmd[-1] == f"-aic-binary-dir=target/qpc-{res.key}/qpc"
    assert "-m=target/target.onnx" in cmd  # relative to the artifacts directory
    staging = art / argv[-1].removeprefix("-aic-binary-dir=")
    assert staging.parent.parent == res.qpc_dir and staging.name == "qpc"
    assert not staging.parent.exists()
    marker = res.qpc_path / "programqpc.bin"
    assert marker.read_bytes().startswith(b"QPC:-aic-hw ")
    assert (res.qpc_dir / "compile.stdout.log").exists()
    assert any("compiling Prefill[8]+Prefill+Verify+Decode" in m for m in messages)

    again = compile_target(art, profile)
    assert again.cached and again.qpc_path == res.qpc_path and again.key == res.key
    assert len(fake_compiler()) == 1


def test_half_finished_qpc_is_rebuilt(art, fake_compiler):
    profile = load_profile("ai100_fp16")
    res = compile_target(art, profile)
    (res.qpc_path / "programqpc.bin").unlink()  # e.g. killed mid-compile by hand
    (res.qpc_path / "leftover.bin").write_bytes(b"junk")
    (res.qpc_dir / ".build-stale").mkdir()  # a staging dir from a killed run
    again = compile_target(art, profile)
    assert again.status == "built" and again.ready
    assert len(fake_compiler()) == 2
    assert not (again.qpc_path / "leftover.bin").exists()
    assert not (again.qpc_dir / ".build-stale").exists()


def test_draft_build(art, fake_compiler):
    res = qpc.compile_program(
        art / "draft" / "draft.onnx",
        art / "draft",
        DIO,
        DSPECS,
        load_profile("ai100_fp16"),
        "draft",
    )
    assert res.ready and res.status == "built" and len(fake_compiler()) == 1
    assert (res.qpc_dir / "specializations.json").read_text() == DRAFT_NAMED
    assert (res.qpc_dir / "custom_io.yaml").read_text() == DRAFT_IO_FP16
    again = qpc.compile_program(
        art / "draft" / "draft.onnx",
        art / "draft",
        DIO,
        DSPECS,
        load_profile("ai100_fp16"),
        "draft",
    )
    assert again.cached and again.key == res.key and len(fake_compiler()) == 1


def test_multidevice_passes_mdp(art, fake_compiler):
    res = compile_target(art, load_profile("ai100_multidevice"))
    (argv,) = fake_compiler()
    assert f"-mdp-load-partition-config=target/qpc-{res.key}/mdp.json" in argv
    assert (res.qpc_dir / "mdp.json").read_text() == MDP_4x12
    assert res.device_ids == (0, 1, 2, 3)


def test_failing_compiler(art, fake_compiler, monkeypatch):
    monkeypatch.setenv("FAKE_QAIC_MODE", "fail")
    profile = load_profile("ai100_fp16")
    with pytest.raises(qpc.CompileError) as exc:
        compile_target(art, profile)
    err = exc.value
    assert "unsupported operator CtxScatter at node 17" in str(err)
    assert "unsupported operator CtxScatter" in err.stderr_tail
    assert err.returncode == 1
    (qpc_dir,) = (art / "target").glob("qpc-*")
    assert f"command: {(qpc_dir / 'compile.cmd').read_text().strip()}" in str(err)
    assert err.command == shlex.split((qpc_dir / "compile.cmd").read_text())
    # nothing that looks complete, no staging left behind, logs kept
    assert not (qpc_dir / "qpc").exists()
    assert not list(qpc_dir.rglob("programqpc.bin"))
    assert not list(qpc_dir.glob(".build-*"))
    assert "CtxScatter" in (qpc_dir / "compile.stderr.log").read_text()

    monkeypatch.setenv("FAKE_QAIC_MODE", "nomarker")
    with pytest.raises(qpc.CompileError, match="exited 0 but wrote no plausible programqpc.bin"):
        compile_target(art, profile)
    assert not (qpc_dir / "qpc").exists()

    monkeypatch.setenv("FAKE_QAIC_MODE", "tiny")  # a 3-byte "success" is not a program
    with pytest.raises(qpc.CompileError, match="no plausible programqpc.bin"):
        compile_target(art, profile)
    assert not (qpc_dir / "qpc").exists()

    monkeypatch.delenv("FAKE_QAIC_MODE")
    assert compile_target(art, profile).status == "built"


def test_compiler_timeout(art, fake_compiler, monkeypatch):
    monkeypatch.setenv("FAKE_QAIC_MODE", "hang")
    with pytest.raises(qpc.CompileError, match="did not finish within 0.5 s") as exc:
        compile_target(art, load_profile("ai100_fp16"), timeout=0.5)
    (qpc_dir,) = (art / "target").glob("qpc-*")
    assert exc.value.command == shlex.split((qpc_dir / "compile.cmd").read_text())
    assert not (qpc_dir / "qpc").exists() and not list(qpc_dir.glob(".build-*"))


def test_bad_compiler_env(art, tmp_path, monkeypatch):
    not_exec = tmp_path / "qaic-compile.txt"
    not_exec.write_text("nope")
    monkeypatch.setenv(qpc.COMPILER_ENV, str(not_exec))
    with pytest.raises(qpc.CompileError, match="QAIC_COMPILER"):
        compile_target(art, load_profile("ai100_fp16"))


def test_compiler_search_order(tmp_path, monkeypatch, no_compiler):
    assert qpc.compiler_search()[0] is None
    on_path = tmp_path / "empty-path" / "qaic-compile"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert qpc.compiler_search()[0] == on_path
    sdk = tmp_path / "no-sdk"
    sdk.mkdir()
    (sdk / "qaic-exec").write_text("#!/bin/sh\n")
    (sdk / "qaic-exec").chmod(0o755)
    assert qpc.compiler_search("qaic-exec")[0] == sdk / "qaic-exec"
    assert qpc.compiler_search("qaic-exec")[1] == [
        "$QAIC_COMPILER (not set)",
        str(sdk / "qaic-exec"),
    ]
    monkeypatch.setenv(qpc.COMPILER_ENV, str(on_path))
    path, looked = qpc.compiler_search("qaic-exec")
    assert path == on_path and looked == [f"$QAIC_COMPILER={on_path}"]


# ---------------------------------------------------------------------------------------------
# the cache key


def _key(art: Path, profile: CompileProfile, specs=TSPECS, io=TIO) -> str:
    res = qpc.compile_program(
        art / "target" / "target.onnx", art / "target", io, specs, profile, "target"
    )
    return res.key


def test_cache_key_tracks_inputs(art, no_compiler, tmp_path):
    base = load_profile("ai100_fp16")
    k0 = _key(art, base)
    assert _key(art, base) == k0  # deterministic
    keys = {
        "num_cores": _key(art, replace(base, target=replace(base.target, num_cores=11))),
        "mos": _key(art, replace(base, target=replace(base.target, mos=None))),
        "flags": _key(art, replace(base, target=replace(base.target, extra_flags=("-v",)))),
        "kv": _key(art, replace(base, kv_dtype="mxint8")),
        "mxfp6": _key(art, replace(base, mxfp6_matmul=True)),
        "format": _key(art, replace(base, specializations_format="flat")),
        "compiler": _key(art, replace(base, compiler="qaic-exec")),
        "specs": _key(
            art,
            base,
            specs=contract.target_specializations(
                contract.shape_plan(4, 32, 256, verify_lengths=[4])
            ),
        ),
        "io": _key(art, base, io=replace(TIO, n_layers=3)),
    }
    assert len(set(keys.values()) | {k0}) == len(keys) + 1, keys
    # device_ids say where the QPC is loaded, not how it is built
    assert _key(art, replace(base, target=replace(base.target, device_ids=(3,)))) == k0
    # ONNX bytes
    (art / "target" / "target.onnx").write_bytes(b"another model\n")
    k1 = _key(art, base)
    assert k1 != k0
    # moving the artifacts directory keeps the key (paths are normalised)
    moved = tmp_path / "moved"
    (art / "target").rename(tmp_path / "keep")
    (moved / "target").mkdir(parents=True)
    (moved / "target" / "target.onnx").write_bytes(b"another model\n")
    assert _key(moved, base) == k1


def test_cache_key_hashes_external_data(art, no_compiler):
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [weight],
    )
    model = helper.make_model(graph)
    path = art / "target" / "target.onnx"
    onnx.save_model(
        model, str(path), save_as_external_data=True, location="target.data", size_threshold=0
    )
    assert qpc.onnx_files(path) == [path, art / "target" / "target.data"]
    k0 = _key(art, load_profile("ai100_fp16"))
    data = art / "target" / "target.data"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert _key(art, load_profile("ai100_fp16")) != k0
    data.unlink()
    with pytest.raises(qpc.CompileError, match="external data"):
        _key(art, load_profile("ai100_fp16"))


def test_program_and_io_must_agree(art, no_compiler):
    with pytest.raises(TypeError, match="TargetIO"):
        qpc.compile_program(
            art / "target" / "target.onnx",
            art / "target",
            DIO,
            TSPECS,
            load_profile("ai100_fp16"),
            "target",
        )
    with pytest.raises(TypeError, match="DraftIO"):
        qpc.compile_program(
            art / "draft" / "draft.onnx",
            art / "draft",
            TIO,
            DSPECS,
            load_profile("ai100_fp16"),
            "draft",
        )


# ---------------------------------------------------------------------------------------------
# continuous batching: the default pair exported with full_batch_size, compiled

# Prefill / DraftPrefill at batch 1 (one sequence into its cache row), the others at the 4 rows;
# full_batch_size (the cache rows) bound in every specialization.
CB_TARGET_NAMED = """\
{
  "specializations": [
    {"name": "Prefill", "symbols": {"batch_size": "1", "full_batch_size": "4", "seq_len": "64", "ctx_len": "1024", "sample_len": "1", "comp_ctx_lengths": "1024"}},
    {"name": "PrefillSampled", "symbols": {"batch_size": "1", "full_batch_size": "4", "seq_len": "64", "ctx_len": "1024", "sample_len": "64", "comp_ctx_lengths": "1024"}},
    {"name": "Verify", "symbols": {"batch_size": "4", "full_batch_size": "4", "seq_len": "16", "ctx_len": "1024", "sample_len": "1", "comp_ctx_lengths": "1024"}},
    {"name": "VerifySampled", "symbols": {"batch_size": "4", "full_batch_size": "4", "seq_len": "16", "ctx_len": "1024", "sample_len": "16", "comp_ctx_lengths": "1024"}},
    {"name": "Decode", "symbols": {"batch_size": "4", "full_batch_size": "4", "seq_len": "1", "ctx_len": "1024", "sample_len": "1", "comp_ctx_lengths": "1024"}}
  ]
}
"""  # noqa: E501
CB_TARGET_FLAT = """\
{
  "specializations": [
    {"batch_size": "1", "full_batch_size": "4", "seq_len": "64", "ctx_len": "1024", "sample_len": "1", "comp_ctx_lengths": "1024"},
    {"batch_size": "1", "full_batch_size": "4", "seq_len": "64", "ctx_len": "1024", "sample_len": "64", "comp_ctx_lengths": "1024"},
    {"batch_size": "4", "full_batch_size": "4", "seq_len": "16", "ctx_len": "1024", "sample_len": "1", "comp_ctx_lengths": "1024"},
    {"batch_size": "4", "full_batch_size": "4", "seq_len": "16", "ctx_len": "1024", "sample_len": "16", "comp_ctx_lengths": "1024"},
    {"batch_size": "4", "full_batch_size": "4", "seq_len": "1", "ctx_len": "1024", "sample_len": "1", "comp_ctx_lengths": "1024"}
  ]
}
"""  # noqa: E501
CB_DRAFT_NAMED = """\
{
  "specializations": [
    {"name": "DraftDecode", "symbols": {"batch_size": "4", "full_batch_size": "4", "seq_len": "16", "ctx_len": "1024", "comp_ctx_lengths": "1024"}},
    {"name": "DraftPrefill[64]", "symbols": {"batch_size": "1", "full_batch_size": "4", "seq_len": "64", "ctx_len": "1024", "comp_ctx_lengths": "1024"}},
    {"name": "DraftPrefill", "symbols": {"batch_size": "1", "full_batch_size": "4", "seq_len": "256", "ctx_len": "1024", "comp_ctx_lengths": "1024"}}
  ]
}
"""  # noqa: E501
CB_DRAFT_FLAT = """\
{
  "specializations": [
    {"batch_size": "4", "full_batch_size": "4", "seq_len": "16", "ctx_len": "1024", "comp_ctx_lengths": "1024"},
    {"batch_size": "1", "full_batch_size": "4", "seq_len": "64", "ctx_len": "1024", "comp_ctx_lengths": "1024"},
    {"batch_size": "1", "full_batch_size": "4", "seq_len": "256", "ctx_len": "1024", "comp_ctx_lengths": "1024"}
  ]
}
"""


def _kv_io(n_layers: int) -> str:
    """custom_io.yaml of an fp16 KV cache: every past_* input, then its retained output."""
    names = [f"past_{kv}.{i}" for i in range(n_layers) for kv in ("key", "value")]
    names += [f"{n}_RetainedState" for n in names]
    return "".join(f"- IOName: {n}\n  Precision: float16\n" for n in names)


def _onnx_inputs(path: Path) -> dict[str, list]:
    onnx = pytest.importorskip("onnx")
    model = onnx.load(str(path), load_external_data=False)
    dims = lambda i: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]  # noqa: E731
    return {i.name: dims(i) for i in model.graph.input}


def test_continuous_batching_pair_compiles(tmp_path, fake_compiler):
    import dflash_qaic
    from dflash_qaic.artifacts.manifest import ArtifactsError, Manifest
    from dflash_qaic.exporter.cli import load_recipe
    from dflash_qaic.runtime import _qpc_path

    recipe = load_recipe("default")
    out = tmp_path / "cb"
    # fp16_check off: the fp16 graph check is test_fp16's; here only the compile inputs matter
    m = dflash_qaic.export(
        recipe["target"],
        recipe["draft"],
        out,
        full_batch_size=4,
        prefill_seq_len=64,
        ctx_len=1024,
        comp_ctx_lengths=[1024],  # one window and one verify length: the pinned texts below
        verify_lengths=[16],  # stay short (other lengths are more of the same Verify entries)
        fp16_check=False,
    )
    # the programs really are in the continuous-batching form
    for name, prog in (("target", m.target), ("draft", m.draft)):
        inputs = _onnx_inputs(out / prog.onnx)
        assert inputs["batch_index"] == ["batch_size", 1], name
        assert inputs["past_key.0"][0] == "full_batch_size", name
    assert (m.target.io.n_layers, m.draft.io.n_layers) == (4, 2)

    assert len(fake_compiler()) == 2  # one compiler run per program
    expected = {
        "target": (CB_TARGET_NAMED, _kv_io(4), COMMANDS[("ai100_fp16", "target")]),
        "draft": (CB_DRAFT_NAMED, _kv_io(2), COMMANDS[("ai100_fp16", "draft")]),
    }
    for name, prog in (("target", m.target), ("draft", m.draft)):
        spec_text, io_text, pinned = expected[name]
        rec = prog.qpc
        assert rec.status == "built"
        assert rec.specializations == tuple(s["name"] for s in prog.specializations)
        qdir = out / rec.dir
        assert (qdir / "specializations.json").read_text() == spec_text
        # ... which are the manifest's (the runtime's view of the program), values as strings
        assert json.loads(spec_text)["specializations"] == [
            {"name": s["name"], "symbols": {k: str(v) for k, v in s["symbols"].items()}}
            for s in prog.specializations
        ]
        assert (qdir / "custom_io.yaml").read_text() == io_text  # no batch_index in it
        # the command line is the one without continuous batching: no flag added
        pinned = pinned.replace(SDK, str(fake_compiler.script))
        pinned = pinned.replace(f"/art/{name}/qpc-K", rec.dir)
        pinned = pinned.replace(f"/art/{name}/{name}.onnx", prog.onnx)
        assert rec.command == pinned
        assert (qdir / "compile.cmd").read_text() == pinned + "\n"
        assert _qpc_path(out, prog, name) == out / rec.qpc

    # the flat format (older SDKs) of the same specializations
    flat = replace(load_profile("ai100_fp16"), specializations_format="flat")
    for name, prog, text in (
        ("target", m.target, CB_TARGET_FLAT),
        ("draft", m.draft, CB_DRAFT_FLAT),
    ):
        specs = [dict(s) for s in prog.specializations]
        res = qpc.compile_program(out / prog.onnx, out / name, prog.io, specs, flat, name)
        assert (res.qpc_dir / "specializations.json").read_text() == text
        assert res.argv[:-3] == shlex.split(prog.qpc.command)[:-3]

    # artifacts of the removed disaggregated profile (two target QPCs): re-export
    data = m.to_json()
    (rec,) = data["target"]["qpc"]
    data["target"]["qpc"] = [{**rec, "part": "prefill"}, {**rec, "part": "verify_decode"}]
    with pytest.raises(ArtifactsError, match="older version .* disaggregated profile.*re-export"):
        Manifest.from_json(data)


def test_full_batch_size_must_agree():
    plan = contract.shape_plan(4, 32, 128, sampling=False, full_batch_size=4)
    specs = contract.target_specializations(plan)
    assert qpc.specializations_json(specs)["specializations"][1]["symbols"] == {
        "batch_size": "1",
        "full_batch_size": "4",
        "seq_len": "32",
        "ctx_len": "128",
    }
    specs[2]["symbols"]["full_batch_size"] = 8
    with pytest.raises(ValueError, match="full_batch_size to the same value"):
        qpc.specializations_json(specs)
    del specs[2]["symbols"]["full_batch_size"]
    with pytest.raises(ValueError, match="full_batch_size to the same value"):
        qpc.specializations_json(specs)
