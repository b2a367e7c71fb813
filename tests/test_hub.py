"""Hugging Face model ids where a directory is expected: resolved from the local cache, offline."""

from __future__ import annotations

import shutil

import pytest

from dflash_qaic import checkpoints as ck
from dflash_qaic.hub import looks_like_model_id, resolve_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache(root, repo_id: str, src) -> None:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(src, repo / "snapshots" / COMMIT)


@pytest.fixture
def hub(tiny_pair, tmp_path, monkeypatch):
    t, d = tiny_pair(family="qwen3", target_layer_ids=[0, 3])
    cache = tmp_path / "hub"
    _cache(cache, "acme/Tiny-Target", t)
    _cache(cache, "acme/Tiny-Draft", d)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return cache


def test_ids_resolve_from_the_cache(hub):
    path = resolve_checkpoint("acme/Tiny-Target", "target")
    assert path == hub / "models--acme--Tiny-Target" / "snapshots" / COMMIT
    p = ck.read_pair("acme/Tiny-Target", "acme/Tiny-Draft")
    assert p.target.path == path and p.target.num_layers == 4


def test_missing_id_names_the_id_and_the_cache(hub):
    with pytest.raises(ck.CheckpointError) as e:
        ck.read_pair("acme/Not-There", "acme/Tiny-Draft")
    msg = str(e.value)
    assert "'acme/Not-There'" in msg and str(hub) in msg and "HF_HUB_OFFLINE" in msg


def test_local_directory_wins(hub, tmp_path):
    local = tmp_path / "acme" / "Tiny-Target"
    shutil.copytree(hub / "models--acme--Tiny-Target" / "snapshots" / COMMIT, local)
    assert not looks_like_model_id("acme/Tiny-Target")  # it exists relative to the cwd
    assert resolve_checkpoint("acme/Tiny-Target") == local.relative_to(tmp_path)
    assert not looks_like_model_id("/abs/path") and not looks_like_model_id("../x/y")


def test_cli_accepts_ids(hub, tmp_path):
    from dflash_qaic.exporter.cli import main

    out = tmp_path / "out"
    rc = main(
        ["--target", "acme/Tiny-Target", "--draft", "acme/Tiny-Draft", "--out", str(out)]
        + ["--no-compile", "--ctx-len", "48", "--prefill-seq-len", "12", "--quiet"]
    )
    assert rc == 0 and (out / "manifest.json").is_file()
