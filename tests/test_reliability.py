"""Nothing lost, nothing silently wrong: export transactions, a manifest that is not
trusted blindly, processes that are cleaned up, arguments that are checked.

Every failure case asserts a clear error (exit 2 or an exception naming the problem) and that a
previous good artifacts directory is byte for byte what it was, and still loads.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import install_fake_compiler
from test_compile import FAKE_COMPILER

import dflash_qaic
from dflash_qaic import contract
from dflash_qaic.artifacts import build
from dflash_qaic.artifacts.manifest import ArtifactsError, Manifest
from dflash_qaic.compiler import qpc
from dflash_qaic.exporter.cli import main
from dflash_qaic.runtime import BackendError, GenerationError

WT = Path(__file__).resolve().parents[1]
SMALL = ["--prefill-seq-len", "16", "--ctx-len", "64", "--no-fp16-check", "--no-compile"]
BASE = ["--prefill-seq-len", "16", "--no-fp16-check"]  # + a --ctx-len of the test's choice


def snapshot(root: Path) -> dict:
    """Every path under `root` with its bytes (None for directories) and its mode."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None, p.lstat().st_mode)
        for p in sorted(root.rglob("*"))
    }


def run(capsys, *args):
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return rc, cap.out, cap.err


@pytest.fixture
def pair(tiny_pair):
    return tiny_pair(family="qwen3", target_layer_ids=[1, 3])


@pytest.fixture(scope="module")
def good_master(tiny_pair, tmp_path_factory):
    """One good artifacts directory (ctx 64), exported once; tests copy it."""
    t, d = tiny_pair(family="qwen3", target_layer_ids=[1, 3])
    out = tmp_path_factory.mktemp("master") / "art"
    assert main(["--target", str(t), "--draft", str(d), "--out", str(out), *SMALL, "--quiet"]) == 0
    return out


@pytest.fixture
def good(good_master, tmp_path):
    out = tmp_path / "art"
    shutil.copytree(good_master, out)
    return out


def intact(out: Path, before: dict) -> None:
    assert snapshot(out) == before
    pipe = dflash_qaic.load(out)
    assert len(pipe.generate([1, 2, 3], 4).tokens) == 4
    leftovers = [p.name for p in out.parent.iterdir() if ".staging-" in p.name or ".old-" in p.name]
    assert not leftovers


def copy_pair(pair, tmp_path) -> tuple[Path, Path]:
    t, d = tmp_path / "t", tmp_path / "d"
    shutil.copytree(pair[0], t)
    shutil.copytree(pair[1], d)
    return t, d


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ---------------------------------------------------------------------------------------------
# failed exports leave a previous good directory byte for byte


def test_failure_mid_export_keeps_previous(pair, good, capsys, monkeypatch):
    before = snapshot(good)
    from dflash_qaic.exporter import draft as draft_mod

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device", str(good / "draft" / "draft.onnx"))

    monkeypatch.setattr(draft_mod, "export_draft", disk_full)
    args = ["--target", pair[0], "--draft", pair[1], "--out", good, *BASE, "--ctx-len", "80"]
    rc, _, err = run(capsys, *args, "--no-compile")
    assert rc == 2 and "No space left on device" in err and "is unchanged" in err
    intact(good, before)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "nonsense", "rope_theta": 1e4}}, "unknown rope type"),
    ],
)
def test_unsupported_model_fails_before_work(
    pair, good, tmp_path, capsys, monkeypatch, change, match
):
    t, d = copy_pair(pair, tmp_path)
    edit_json(t / "config.json", **change)
    before = snapshot(good)
    called = []
    monkeypatch.setattr(build, "export_programs", lambda *a, **k: called.append(1))
    rc, _, err = run(capsys, "--target", t, "--draft", d, "--out", good, *SMALL)
    assert rc == 2 and match in err and not called
    intact(good, before)


@pytest.mark.parametrize(
    "text,match",
    [
        ("{not json", "is not valid JSON"),
        (b"\xff\xfe{}", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"eos_token_id": "x"}', "eos_token_id 'x'"),
        ('{"eos_token_id": [5, 99999]}', "outside the vocabulary"),
    ],
)
def test_broken_generation_config(pair, good, tmp_path, capsys, monkeypatch, text, match):
    t, d = copy_pair(pair, tmp_path)
    f = t / "generation_config.json"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    before = snapshot(good)
    monkeypatch.setattr(build, "export_programs", lambda *a, **k: pytest.fail("exported"))
    rc, _, err = run(capsys, "--target", t, "--draft", d, "--out", good, *SMALL)
    assert rc == 2 and match in err and "generation_config.json" in err
    intact(good, before)


def test_bad_compiler_checked_before_export(pair, good, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(qpc.COMPILER_ENV, str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(build, "export_programs", lambda *a, **k: pytest.fail("exported"))
    before = snapshot(good)
    rc, _, err = run(capsys, "--target", pair[0], "--draft", pair[1], "--out", good, *SMALL[:-1])
    assert rc == 2 and "is not an executable file" in err
    intact(good, before)


def test_broken_tokenizer_checked_before_export(pair, tmp_path, capsys, monkeypatch):
    t, d = copy_pair(pair, tmp_path)
    (t / "tokenizer.json").write_text("{garbage")
    (t / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    monkeypatch.setattr(build, "export_programs", lambda *a, **k: pytest.fail("exported"))
    rc, _, err = run(capsys, "--target", t, "--draft", d, "--out", tmp_path / "o", *SMALL)
    assert rc == 2 and "tokenizer files" in err and "do not load" in err


def test_tokenizer_beyond_the_vocabulary_refused_before_export(pair, tmp_path, capsys):
    """The built-in pair's tokenizer (258 tokens) beside a 256-token model: refused at export,
    naming the sizes and the fix (before: exported, and failed only at generation)."""
    t, d = copy_pair(pair, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(dflash_qaic.__file__).parent / "assets/pair/target" / f, t / f)
    rc, _, err = run(capsys, "--target", t, "--draft", d, "--out", tmp_path / "o", *SMALL)
    assert rc == 2 and "has 2 tokens beyond the model's vocabulary of 256" in err, err
    assert "use the model's own tokenizer files" in err and not (tmp_path / "o").exists()


def test_tiny_pair_defaults_export(tmp_path, capsys):
    """dflash-make-tiny-pair with its defaults (4 target layers, 2 draft layers) writes a pair
    that exports (before: the default rule's target_layer_ids [1, 1], refused), and shapes with
    no distinct layers are refused naming the flags."""
    from dflash_lab.tiny import main as tiny

    tiny([str(tmp_path / "pair")])
    cfg = json.loads((tmp_path / "pair/draft/config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    pair = [tmp_path / "pair/target", tmp_path / "pair/draft"]
    rc, _, err = run(
        capsys, "--target", pair[0], "--draft", pair[1], "--out", tmp_path / "o", *SMALL
    )
    assert rc == 0, err
    with pytest.raises(SystemExit, match="--target-layers / --draft-layers"):
        tiny([str(tmp_path / "bad"), "--target-layers", "2", "--draft-layers", "3"])


# ---------------------------------------------------------------------------------------------
# directories the tool did not create


def test_foreign_directory_is_refused(pair, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    rc, _, err = run(capsys, "--target", pair[0], "--draft", pair[1], "--out", out, *SMALL)
    assert rc == 2 and "thesis.tex" in err and "never empties" in err
    assert (out / "thesis.tex").read_text() == "years of work"
    rc, _, err = run(capsys, "--target", pair[0], "--draft", pair[1], "--out", out / "thesis.tex")
    assert rc == 2 and "not a directory" in err


def test_users_tokenizer_and_symlinks_are_refused(pair, good, tmp_path, capsys):
    (good / "tokenizer").mkdir()  # the manifest names no tokenizer: not ours
    (good / "tokenizer" / "tokenizer.json").write_text("{}")
    before = snapshot(good)
    rc, _, err = run(capsys, "--target", pair[0], "--draft", pair[1], "--out", good, *SMALL)
    assert rc == 2 and "tokenizer (not written by dflash-export)" in err
    assert snapshot(good) == before
    shutil.rmtree(good / "tokenizer")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (good / "tokenizer").symlink_to(elsewhere)
    rc, _, err = run(capsys, "--target", pair[0], "--draft", pair[1], "--out", good, *SMALL)
    assert rc == 2 and "a symlink to" in err and elsewhere.is_dir()


def test_read_only_out_is_refused(pair, good, capsys):
    before = snapshot(good)
    good.chmod(0o555)
    try:
        rc, _, err = run(capsys, "--target", pair[0], "--draft", pair[1], "--out", good, *SMALL)
    finally:
        good.chmod(0o755)
    assert rc == 2 and "read-only" in err and "chmod u+w" in err
    intact(good, before)


# ---------------------------------------------------------------------------------------------
# concurrent and killed exports (real processes)

SLOW_DRAFT = """\
import os, sys, time
from dflash_qaic.exporter import draft as d
orig = d.export_draft
def slow(*a, **k):
    open(os.environ["MARK"], "w").close()
    t0 = time.monotonic()  # wait for the test's go (RELEASE) or SLEEP seconds
    while time.monotonic() - t0 < float(os.environ["SLEEP"]):
        if os.path.exists(os.environ.get("RELEASE", "/nonexistent")):
            break
        time.sleep(0.05)
    return orig(*a, **k)
d.export_draft = slow
from dflash_qaic.exporter.cli import main
sys.exit(main(sys.argv[1:]))
"""


def spawn(args, tmp_path, name, sleep="0", **env):
    script = tmp_path / "slow_export.py"
    script.write_text(SLOW_DRAFT)
    mark = tmp_path / f"{name}.mark"
    full_env = {**os.environ, "PYTHONPATH": str(WT), "MARK": str(mark), "SLEEP": sleep, **env}
    proc = subprocess.Popen(
        [sys.executable, str(script), *map(str, args)],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, mark


def wait_for(cond, proc, what, limit=300):
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, f"exited early waiting for {what}: {proc.communicate()}"
        assert time.monotonic() - t0 < limit, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_concurrent_exports_on_one_out(pair, tmp_path):
    out = tmp_path / "art"
    base = ["--target", pair[0], "--draft", pair[1], "--out", out, "--quiet", *BASE]
    release = tmp_path / "release"
    a, mark = spawn(
        [*base, "--ctx-len", "48", "--no-compile"], tmp_path, "a", sleep="120", RELEASE=str(release)
    )
    wait_for(mark.exists, a, "export A to hold the lock")
    lock = tmp_path / ".art.lock"
    with open(lock) as fh:  # A holds it
        with pytest.raises(BlockingIOError):
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    b = subprocess.run(
        [sys.executable, "-m", "dflash_qaic.exporter", *map(str, base), "--ctx-len", "32"],
        env={**os.environ, "PYTHONPATH": str(WT)},
        capture_output=True,
        text=True,
    )
    assert b.returncode == 2 and f"(pid {a.pid}) is writing" in b.stderr
    assert "Traceback" not in b.stderr
    assert not out.exists()  # B wrote nothing
    release.touch()
    _, err = a.communicate(timeout=300)
    assert a.returncode == 0, err
    # the manifest and the programs are A's, together: every file matches its recorded sha256
    pipe = dflash_qaic.load(out, check_files="full")
    assert pipe.artifacts.ctx_len == 48 and pipe.artifacts.options["ctx_len"] == 48
    assert len(pipe.generate([1, 2, 3], 4).tokens) == 4


@pytest.mark.slow  # the fast tier: a failed and a Ctrl-C'd export (test_export_cli)
def test_kill_9_mid_export_keeps_previous(pair, good, tmp_path):
    before = snapshot(good)
    base = ["--target", pair[0], "--draft", pair[1], "--out", good, "--quiet", *BASE]
    proc, mark = spawn([*base, "--ctx-len", "80", "--no-compile"], tmp_path, "k", sleep="60")
    wait_for(mark.exists, proc, "the export to be mid-way (target exported)")
    staged = list(tmp_path.glob(".art.staging-*/target/target.onnx"))
    assert staged, "the target program is written into a staging directory"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert snapshot(good) == before
    assert dflash_qaic.load(good).artifacts.ctx_len == 64
    # the next export cleans the leftovers up and succeeds
    assert main([*map(str, base), "--ctx-len", "80", "--no-compile"]) == 0
    intact(good, snapshot(good))
    assert dflash_qaic.load(good).artifacts.ctx_len == 80


def test_sigterm_kills_the_compiler_and_its_children(pair, good, tmp_path):
    before = snapshot(good)
    script = tmp_path / "bin" / "qaic-compile"
    script.parent.mkdir()
    script.write_text(FAKE_COMPILER.format(python=sys.executable))
    script.chmod(0o755)
    child_file = tmp_path / "child.pid"
    env = {
        qpc.COMPILER_ENV: str(script),
        "FAKE_QAIC_LOG": str(tmp_path / "log"),
        "FAKE_QAIC_MODE": "spawn",
        "FAKE_QAIC_CHILD": str(child_file),
    }
    base = ["--target", pair[0], "--draft", pair[1], "--out", good, "--quiet", *SMALL[:-1]]
    proc, _ = spawn(base, tmp_path, "c", **env)
    wait_for(child_file.exists, proc, "the compiler's child process")
    time.sleep(0.2)
    child = int(child_file.read_text())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "terminated" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    for _ in range(100):  # the compiler's own child is gone too (killed with its group)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the compiler's child outlived the export")
    intact(good, before)


def test_compile_timeout_flag(pair, tmp_path, capsys, monkeypatch):
    install_fake_compiler(tmp_path, monkeypatch, mode="hang")
    out = tmp_path / "o"
    args = ["--target", pair[0], "--draft", pair[1], "--out", out, *SMALL[:-1]]
    rc, _, err = run(capsys, *args, "--compile-timeout", "0.5")
    assert rc == 2 and "did not finish within 0.5 s" in err
    assert not out.exists() and not list(tmp_path.glob(".o.staging-*"))


# ---------------------------------------------------------------------------------------------
# checksums, reuse key, damaged artifacts


def test_damaged_artifact_detected_and_rebuilt(pair, good, capsys):
    m = json.loads((good / "manifest.json").read_text())
    assert {f["path"] for f in m["files"]} >= {"target/target.onnx", "draft/draft.onnx"}
    onnx_file = good / "target" / "target.onnx"
    data = onnx_file.read_bytes()
    onnx_file.write_bytes(data[: len(data) // 2])  # truncated, manifest intact
    with pytest.raises(ArtifactsError, match="damaged: target/target.onnx has .* bytes"):
        dflash_qaic.load(good)
    rc, out, _ = run(capsys, "--target", pair[0], "--draft", pair[1], "--out", good, *SMALL)
    assert rc == 0 and "reusing the exported" not in out and "not reusing" in out
    assert onnx_file.read_bytes() == data
    # same size, one byte changed: the hash catches it
    draft = good / "draft" / "draft.onnx"
    raw = bytearray(draft.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    draft.write_bytes(bytes(raw))
    with pytest.raises(ArtifactsError, match="does not match its recorded sha256"):
        dflash_qaic.load(good)
    dflash_qaic.load(good, check_files="none")  # explicitly unchecked


def test_reuse_key_covers_generation_config_and_options(pair, tmp_path, capsys):
    t, d = copy_pair(pair, tmp_path)
    out = tmp_path / "o"
    args = ["--target", t, "--draft", d, "--out", out, *SMALL]
    assert run(capsys, *args)[0] == 0
    rc, stdout, _ = run(capsys, *args)
    assert rc == 0 and "reusing the exported" in stdout
    edit_json(t / "generation_config.json", eos_token_id=[7])
    rc, stdout, _ = run(capsys, *args)
    assert rc == 0 and "reusing the exported" not in stdout
    assert dflash_qaic.load(out).eos == [7]
    rc, stdout, _ = run(capsys, *args, "--no-sampling")
    assert rc == 0 and "reusing the exported" not in stdout
    assert not dflash_qaic.load(out).can_sample


# ---------------------------------------------------------------------------------------------
# a manifest that is not trusted blindly


def rewrite(out: Path, fn) -> None:
    m = json.loads((out / "manifest.json").read_text())
    fn(m)
    (out / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda m: m["target"].update(onnx="../../etc/passwd"), "not a plain relative path"),
        (lambda m: m["target"].update(onnx="/etc/passwd"), "not a plain relative path"),
        (lambda m: m["files"][0].update(path="../x"), "not a plain relative path"),
        (lambda m: m.update(block_size="8"), "`block_size` must be an integer"),
        (lambda m: m.update(ctx_len=-1), "`ctx_len` must be an integer"),
        (lambda m: m.update(target=[]), "`target` must be a JSON object"),
        (lambda m: m["target"].update(n_layers=None), "`target.n_layers`"),
        (lambda m: m.update(mask_token_id=10**30), "`mask_token_id`"),
        (lambda m: m["draft"].update(specializations=[]), "`draft.specializations`"),
        (lambda m: m["files"][0].update(sha256="zz"), "64 lowercase hex"),
        (lambda m: m.update(files=[]), "has no size and sha256"),
        (lambda m: m.update(eos_token_ids=[1, True]), "`eos_token_ids`"),
        (lambda m: m.update(version=1), "manifest version 1"),
        (lambda m: m.update(verify_lengths=[2, 3]), "verify lengths must ascend"),
        (lambda m: m.update(prefill_lengths=[]), "prefill lengths must ascend"),
        (lambda m: m.update(draft_prefill_rows=[1 << 21]), "draft prefill rows"),
        (lambda m: m.pop("verify_lengths"), "`verify_lengths` is missing"),
        (lambda m: m.update(specialization_count={"target": 1, "draft": 1}), "specialization_co"),
        (lambda m: m.clear(), "not a dflash-qaic manifest"),
    ],
)
def test_malformed_manifest_values(good, edit, match):
    rewrite(good, edit)
    with pytest.raises(ArtifactsError, match=match):
        dflash_qaic.load(good)


def test_artifacts_of_an_earlier_manifest_version_are_refused(good):
    """Version 2 (the shape plan only in specialization names) is refused with the fix, before
    any program is opened: no branch reads the older form."""

    def older(m):
        for key in ("prefill_lengths", "verify_lengths", "draft_prefill_rows"):
            m.pop(key)
        m["version"] = 2

    rewrite(good, older)
    with pytest.raises(
        ArtifactsError, match=r"manifest version 2, written by an earlier .*re-export"
    ):
        dflash_qaic.load(good)


def test_artifacts_of_manifest_version_3_still_load(good):
    """Version 3 stored the shape plan twice (each program's specializations and sizes beside
    the plan) and a QPC `part`: it still loads, to the same manifest."""
    want = dflash_qaic.load(good).artifacts

    def v3(m):
        m["version"] = 3
        for p in ("target", "draft"):
            m[p]["specializations"] = [dict(s) for s in want.program(p).specializations]
            m[p].update(ctx_len=m["ctx_len"], prefill_seq_len=m["prefill_seq_len"], batch_size=1)

    rewrite(good, v3)
    assert dflash_qaic.load(good).artifacts == want


def test_manifest_not_json_and_symlink_out(good, tmp_path):
    outside = tmp_path / "outside.onnx"
    shutil.copy(good / "target" / "target.onnx", outside)
    (good / "target" / "target.onnx").unlink()
    (good / "target" / "target.onnx").symlink_to(outside)
    with pytest.raises(ArtifactsError, match="outside"):
        dflash_qaic.load(good)
    (good / "manifest.json").write_bytes(b"\xff{")
    with pytest.raises(ArtifactsError, match="not valid JSON"):
        dflash_qaic.load(good)
    (good / "manifest.json").write_text('{"format": "dflash-qaic-artifacts", "version": NaN}')
    with pytest.raises(ArtifactsError, match="not valid JSON"):
        dflash_qaic.load(good)


def test_typed_manifest_round_trip(good):
    pipe = dflash_qaic.load(good)
    m = pipe.artifacts
    assert isinstance(m.target.io, contract.TargetIO) and m.target.io.sampling
    assert isinstance(m.draft.io, contract.DraftIO) and m.draft.io.block_size == m.block_size
    assert Manifest.from_json(m.to_json()) == m
    assert pipe.manifest == m.to_json()


# ---------------------------------------------------------------------------------------------
# flags, API arguments, permissions


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--ctx-len", "200000000"], "--ctx-len: 200000000 is outside"),
        (["--batch-size", "0"], "--batch-size: 0 is outside"),
        (["--prefill-seq-len", "-1"], "--prefill-seq-len: -1 is outside"),
        (["--block-size", "x"], "'x' is not an integer"),
        (["--num-speculative-tokens", "0"], "is outside"),
        (["--block-size", "8", "--num-speculative-tokens", "3"], "disagree"),
        (["--num-cores", "99"], "--num-cores: 99 is outside"),
        (["--compile-timeout", "-5"], "seconds > 0"),
    ],
)
def test_bad_flags(pair, tmp_path, capsys, extra, match):
    rc, _, err = run(
        capsys, "--target", pair[0], "--draft", pair[1], "--out", tmp_path / "o", *extra
    )
    assert rc == 2 and match in err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def pipe(good_master):
    return dflash_qaic.load(good_master)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_new_tokens": "8"}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": 0}, "max_new_tokens must be ≥ 1"),
        ({"prompt": [1.0, 2.0]}, "integer token ids only; got 1.0"),
        ({"prompt": [True, 2]}, "got True"),
        ({"prompt": [1, [2, 3]]}, "mixes token ids and nested lists"),
        ({"prompt": np.array([[1, 2]])}, "1-D array"),
        ({"prompt": np.array([1.5])}, "1-D array of integer"),
        ({"prompt": [2**64]}, "outside the vocabulary"),
        ({"prompt": [-1]}, "outside the vocabulary"),
        ({"prompt": 5}, "must be a list"),
        ({"stop_token_ids": "abc"}, "stop_token_ids must be a list"),
        ({"stop_token_ids": [2**64]}, "are outside 0"),
        ({"on_tokens": 3}, "on_tokens must be callable"),
    ],
)
def test_generate_argument_checks(pipe, kwargs, match):
    kw = {"prompt": [1, 2, 3], "max_new_tokens": 4, **kwargs}
    for fn in (pipe.generate, pipe.generate_baseline):
        with pytest.raises(GenerationError, match=match):
            fn(**kw)
    if "on_tokens" not in kw:
        with pytest.raises(GenerationError, match=match):
            list(pipe.stream(**kw))


def test_valid_arguments_still_work(pipe):
    a = pipe.generate(np.array([1, 2, 3]), np.int64(4), stop_token_ids=(np.int64(9),))
    b = pipe.generate((1, 2, 3), 4, stop_token_ids=[9])
    assert a.tokens == b.tokens and len(a.tokens) >= 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"threads": 100000}, "threads must be None or an integer in"),
        ({"threads": 0}, "threads must be None"),
        ({"threads": "2"}, "threads must be None"),
        ({"tokenizer": "yes"}, "tokenizer must be True or False"),
        ({"backend": "cuda"}, "unknown backend"),
        ({"check_files": "some"}, "check_files must be one of fast, full, none"),
    ],
)
def test_load_argument_checks(good_master, kwargs, match):
    with pytest.raises(BackendError, match=match):
        dflash_qaic.load(good_master, **kwargs)


def test_load_takes_the_old_name_of_check_files(good_master):
    with pytest.warns(DeprecationWarning, match=r"verify=.*deprecated: use load\(check_files="):
        pipe = dflash_qaic.load(good_master, verify="full", tokenizer=False)
    assert pipe.artifacts.ctx_len == 64
    with pytest.warns(DeprecationWarning), pytest.raises(BackendError, match="check_files must"):
        dflash_qaic.load(good_master, verify="some")


def test_files_get_the_umask_permissions(pair, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "o"
        assert (
            main(["--target", str(pair[0]), "--draft", str(pair[1]), "--out", str(out), *SMALL])
            == 0
        )
    finally:
        os.umask(old)
    assert (out / "manifest.json").stat().st_mode & 0o777 == 0o644
    assert out.stat().st_mode & 0o777 == 0o755
    assert (out / "target" / "target.onnx").stat().st_mode & 0o777 == 0o644


# ---------------------------------------------------------------------------------------------
# the Python export / compile API, compile overrides, relative compile.cmd


def test_python_api_export_then_compile_elsewhere(pair, tmp_path, monkeypatch, no_compiler):
    built = tmp_path / "built"
    m = dflash_qaic.export(
        pair[0],
        pair[1],
        built,
        num_speculative_tokens=3,
        prefill_seq_len=16,
        ctx_len=64,
        fp16_check=False,
        compile=False,
    )
    assert m.block_size == 4 and m.target.qpc is None
    with pytest.raises(build.ExportError, match="disagree"):
        dflash_qaic.export(pair[0], pair[1], built, block_size=5, num_speculative_tokens=3)
    with pytest.raises(build.ExportError, match="--ctx-len must be an integer"):
        dflash_qaic.export(pair[0], pair[1], built, ctx_len="64")

    # copied to "an AI100 host", compiled there with QEfficient-named overrides
    host = tmp_path / "host" / "art"
    shutil.copytree(built, host)
    script, _ = install_fake_compiler(tmp_path, monkeypatch)
    m = dflash_qaic.compile(host, num_cores=8, mxint8_kv_cache=True, mos=2)
    assert m.compiled and "num_cores=8" in m.qpc_config
    target_qpc = m.target.qpc
    cmd = (host / target_qpc.dir / "compile.cmd").read_text()
    assert "-aic-num-cores=8" in cmd and "-mos=2" in cmd and "-m=target/target.onnx" in cmd
    assert str(tmp_path) not in cmd.replace(str(script), "")  # no absolute artifact paths
    assert "mxint8" in (host / target_qpc.dir / "custom_io.yaml").read_text()
    recorded = {f.path for f in m.files}
    assert f"{target_qpc.qpc}/programqpc.bin" in recorded
    assert dflash_qaic.load(host).artifacts == m


def test_compile_overrides_checked(pair, tmp_path, capsys):
    args = ["--target", pair[0], "--draft", pair[1], "--out", tmp_path / "o", *SMALL[:-1]]
    rc, _, err = run(capsys, *args, "--num-cores", "16")  # + the draft's 4 on device 0
    assert rc == 2 and "over its core budget" in err


def test_tokenizer_is_recorded_and_tracked(tiny_pair, tmp_path, capsys):
    pair = tiny_pair(family="qwen3", target_layer_ids=[1, 3], vocab_size=258)  # the tokenizer's
    t, d = copy_pair(pair, tmp_path)
    assets = Path(dflash_qaic.__file__).parent / "assets" / "pair" / "target"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets / name, t / name)
    out = tmp_path / "o"
    args = ["--target", t, "--draft", d, "--out", out, *SMALL]
    assert run(capsys, *args)[0] == 0
    m = dflash_qaic.load(out).artifacts
    assert m.tokenizer == "tokenizer"
    assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= {
        f.path for f in m.files
    }
    (out / "tokenizer" / "tokenizer.json").write_text("{}")  # damaged: caught at load
    with pytest.raises(ArtifactsError, match="tokenizer/tokenizer.json"):
        dflash_qaic.load(out)
    rc, stdout, _ = run(capsys, *args)  # rebuilt, not reused
    assert rc == 0 and "not reusing" in stdout
    dflash_qaic.load(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the target loses its tokenizer
        (t / name).unlink()
    rc, stdout, _ = run(capsys, *args)
    assert rc == 0 and "reusing the exported" not in stdout
    assert dflash_qaic.load(out).tokenizer is None and not (out / "tokenizer").exists()
