"""`dflash-export`: a complete artifacts directory, reuse, compile through a stand-in compiler,
clear errors before heavy work, and nothing that looks complete after a failure."""

from __future__ import annotations

import json

import pytest
from conftest import install_fake_compiler

import dflash_qaic
from dflash_qaic.artifacts import build
from dflash_qaic.exporter.cli import main

SMALL = ["--prefill-seq-len", "16", "--ctx-len", "64", "--no-fp16-check"]


@pytest.fixture
def pair(tiny_pair):
    return tiny_pair(family="qwen3", target_layer_ids=[1, 3])


def snapshot(root):
    """Every file under `root` with its bytes, and every directory (byte-for-byte comparison)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def run(capsys, *args):
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # argparse refuses a bad flag value: exit 2, usage + message
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_export_without_compiler_then_reuse(pair, tmp_path, capsys, no_compiler):
    t, d = pair
    out = tmp_path / "art"
    rc, stdout, _ = run(capsys, "--target", t, "--draft", d, "--out", out, *SMALL)
    assert rc == 0
    m = json.loads((out / "manifest.json").read_text())
    assert (out / m["target"]["onnx"]).is_file() and (out / m["draft"]["onnx"]).is_file()
    assert m["block_size"] == 8 and m["ctx_len"] == 64 and m["target_layer_ids"] == [1, 3]
    n = m["specialization_count"]
    typed = dflash_qaic.load(out).artifacts
    assert n == {"target": len(typed.target.specializations), "draft": 2 * 3}
    assert "specializations" not in m["target"]  # stored once: the shape plan
    assert f"specializations: target {n['target']}, draft {n['draft']}" in stdout
    line = [s for s in stdout.splitlines() if s.startswith("compilation skipped")]
    assert line and "$QAIC_COMPILER (not set)" in line[0]
    assert "-network-specialization-config=" in stdout and "-retained-state" in stdout
    for prog in ("target", "draft"):
        (qdir,) = (out / prog).glob("qpc-*")
        assert {p.name for p in qdir.iterdir()} >= {
            "specializations.json",
            "custom_io.yaml",
            "compile.cmd",
        }
        assert m[prog]["qpc"][0]["status"] == "skipped"
    pipe = dflash_qaic.load(out)
    assert len(pipe.generate([1, 2, 3], 5).tokens) == 5

    rc, stdout, _ = run(capsys, "--target", t, "--draft", d, "--out", out, *SMALL)
    assert rc == 0 and "reusing the exported programs" in stdout
    assert "| reused" in stdout


def test_compile_with_stand_in_compiler(pair, tmp_path, capsys, monkeypatch):
    t, d = pair
    _, log = install_fake_compiler(tmp_path, monkeypatch, log="calls.jsonl")
    out = tmp_path / "art"
    rc, stdout, _ = run(capsys, "--target", t, "--draft", d, "--out", out, *SMALL)
    assert rc == 0 and "compilation skipped" not in stdout
    m = json.loads((out / "manifest.json").read_text())
    for prog in ("target", "draft"):
        entry = m[prog]["qpc"][0]
        assert entry["status"] == "built"
        assert (out / entry["qpc"] / "programqpc.bin").is_file()
    assert len(log.read_text().splitlines()) == 2  # one process per program
    rc, stdout, _ = run(capsys, "--target", t, "--draft", d, "--out", out, *SMALL)
    assert rc == 0 and len(log.read_text().splitlines()) == 2  # cached
    assert json.loads((out / "manifest.json").read_text())["target"]["qpc"][0]["status"] == "cached"

    # a failing compiler: its stderr surfaces, and the directory does not look complete
    monkeypatch.setenv("FAKE_QAIC_MODE", "fail")
    out2 = tmp_path / "art2"
    rc, _, err = run(capsys, "--target", t, "--draft", d, "--out", out2, *SMALL)
    assert rc == 2 and "unsupported operator CtxScatter" in err
    assert not (out2 / "manifest.json").exists()
    assert not list(out2.glob("*/qpc-*/qpc/programqpc.bin"))


def test_interrupted_export_keeps_the_previous_artifact(pair, tmp_path, monkeypatch, no_compiler):
    t, d = pair
    out = tmp_path / "art"
    assert main(["--target", str(t), "--draft", str(d), "--out", str(out), *SMALL]) == 0
    before = snapshot(out)
    from dflash_qaic.exporter import draft as draft_mod

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(draft_mod, "export_draft", boom)
    # a different option forces a re-export; Ctrl-C: one line, exit 130, OUT untouched
    rc = main(["--target", str(t), "--draft", str(d), "--out", str(out), *SMALL, "--ctx-len", "80"])
    assert rc == 130
    assert snapshot(out) == before
    assert dflash_qaic.load(out).artifacts.ctx_len == 64
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".art")) == [".art.lock"]


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--block-size", "32"], "larger than --prefill-seq-len 16"),
        (["--ctx-len", "20"], "--ctx-len 20 is too small"),
        (["--block-size", "1"], "--block-size: 1 is outside [2, 1024]"),
        (["--batch-size", "4"], "use --full-batch-size 4"),
        (["--qpc-config", "nope"], "nope"),
    ],
)
def test_bad_options_fail_before_work(pair, tmp_path, capsys, extra, match, monkeypatch):
    t, d = pair
    called = []
    monkeypatch.setattr(build, "export_programs", lambda *a, **k: called.append(1))
    rc, _, err = run(capsys, "--target", t, "--draft", d, "--out", tmp_path / "o", *SMALL, *extra)
    assert rc == 2 and match in err and not called
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_bad_profile_key(pair, tmp_path, capsys):
    t, d = pair
    prof = tmp_path / "p.yaml"
    prof.write_text(
        "kv_dtype: float16\ntarget: {num_cores: 8, num_corez: 2}\ndraft: {num_cores: 4}\n"
    )
    rc, _, err = run(
        capsys, "--target", t, "--draft", d, "--out", tmp_path / "o", *SMALL, "--qpc-config", prof
    )
    assert rc == 2 and "num_corez" in err


def test_missing_dirs_and_bad_recipes(tmp_path, capsys, pair):
    rc, _, err = run(
        capsys, "--target", tmp_path / "x", "--draft", tmp_path / "y", "--out", tmp_path / "o"
    )
    assert rc == 2 and "does not exist" in err
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {tmp_path / 'absent'}\ndraft: {pair[1]}\n")
    with pytest.raises(SystemExit, match="does not exist: download the checkpoint"):
        main(["--recipe", str(recipe), "--out", str(tmp_path / "o")])
    recipe.write_text(f"target: {pair[0]}\ndraft: {pair[1]}\nblok_size: 4\n")
    with pytest.raises(SystemExit, match="unknown keys \\['blok_size'\\]"):
        main(["--recipe", str(recipe), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="known:"):
        main(["--recipe", "no-such-recipe", "--out", str(tmp_path / "o")])


def test_recipe_values_and_cli_overrides(pair, tmp_path, capsys, no_compiler):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"target: {pair[0]}\ndraft: {pair[1]}\nblock_size: 4\nprefill_seq_len: 8\nctx_len: 48\n"
    )
    out = tmp_path / "o"
    assert (
        main(["--recipe", str(recipe), "--out", str(out), "--ctx-len", "56", "--no-compile"]) == 0
    )
    m = json.loads((out / "manifest.json").read_text())
    assert (m["block_size"], m["prefill_seq_len"], m["ctx_len"]) == (4, 8, 56)
    assert m["target"]["qpc"] == [] and m["qpc_config"] is None
    # --num-speculative-tokens N is B = N + 1; overriding the recipe's block size
    out2 = tmp_path / "o2"
    argv = ["--recipe", str(recipe), "--out", str(out2), "--no-compile"]
    assert main([*argv, "--num-speculative-tokens", "5"]) == 0
    assert json.loads((out2 / "manifest.json").read_text())["block_size"] == 6


def test_shipped_recipes_parse():
    import yaml

    from dflash_qaic.exporter.cli import RECIPE_DIR, RECIPE_KEYS

    names = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
    assert {"default", "qwen3-4b-dflash-b16", "qwen3-8b-dflash-b16"} <= set(names)
    assert any(n.startswith("llama-3.1-8b") for n in names)
    for p in RECIPE_DIR.glob("*.yaml"):
        data = yaml.safe_load(p.read_text())
        # z-lab's gpt-oss and Kimi K2.5 drafts: block 8
        block = 8 if p.stem.startswith(("gpt-oss", "kimi-k2.5")) else 16
        assert set(data) <= RECIPE_KEYS and data["block_size"] == block


def test_default_dflash2_recipe():
    """`--recipe default-dflash2`: the built-in target with its DFlash-2 draft, every other
    setting as the default recipe's."""
    import yaml

    from dflash_qaic import assets
    from dflash_qaic.exporter.cli import RECIPE_DIR, _expand, load_recipe

    default, d2 = (
        yaml.safe_load((RECIPE_DIR / f"{n}.yaml").read_text())
        for n in ("default", "default-dflash2")
    )
    assert (
        d2["draft"] == "{assets}/pair/draft-dflash2" and default["draft"] == "{assets}/pair/draft"
    )
    same = set(default) - {"name", "description", "draft"}
    assert {k: d2[k] for k in same} == {k: default[k] for k in same} and set(d2) == set(default)
    path = RECIPE_DIR / "default-dflash2.yaml"
    assert (_expand(d2["target"], path), _expand(d2["draft"], path)) == assets.default_pair(
        "dflash2"
    )
    if assets.default_pair("dflash2")[1].is_dir():  # the committed draft
        r = load_recipe("default-dflash2")
        assert (r["target"], r["draft"]) == assets.default_pair("dflash2")
    else:  # before it is committed: refused, naming the directory
        with pytest.raises(SystemExit, match=r"draft-dflash2, which does not exist"):
            load_recipe("default-dflash2")


def test_greedy_only_export(pair, tmp_path, no_compiler):
    t, d = pair
    out = tmp_path / "g"
    assert (
        main(["--target", str(t), "--draft", str(d), "--out", str(out), *SMALL, "--no-sampling"])
        == 0
    )
    m = json.loads((out / "manifest.json").read_text())
    assert [i["name"] for i in m["target"]["inputs"][:4]] == [
        "input_ids",
        "position_ids",
        "comp_ctx_lengths",
        "past_key.0",
    ]
    pipe = dflash_qaic.load(out)
    assert len(pipe.generate([5, 6, 7], 6).tokens) == 6
    with pytest.raises(dflash_qaic.runtime.GenerationError, match="sampl"):
        pipe.generate([5, 6, 7], 6, temperature=1.0)
