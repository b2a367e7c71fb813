"""A corrupted artifact file of any size is refused before it can produce a token; an untouched
directory loads without hashing again (the cache of checked files); a touched but unchanged
file is hashed again and accepted."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

import dflash_qaic
from dflash_qaic.artifacts import files
from dflash_qaic.artifacts.manifest import ArtifactsError
from dflash_qaic.exporter import weights
from dflash_qaic.exporter.cli import main

SMALL = ["--prefill-seq-len", "16", "--ctx-len", "64", "--no-fp16-check", "--no-compile"]
BIG = 80 << 20  # above the 64 MiB that loads used to size-check only


@pytest.fixture
def big(tiny_pair, tmp_path, monkeypatch):
    """Artifacts whose target weights are an external-data file grown (sparsely, so cheaply) to
    80 MiB; the manifest records its size and sha256 as an export would."""
    t, d = tiny_pair(family="qwen3", target_layer_ids=[1, 3])
    out = tmp_path / "art"
    monkeypatch.setattr(weights, "STREAM_INLINE_MAX", 0)  # weights to target.onnx.data
    assert main(["--target", str(t), "--draft", str(d), "--out", str(out), *SMALL, "--quiet"]) == 0
    data = out / "target" / "target.onnx.data"
    with open(data, "r+b") as f:
        f.truncate(BIG)  # a hole after the weights: nothing reads it
    m = json.loads((out / "manifest.json").read_text())
    (rec,) = [r for r in m["files"] if r["path"] == "target/target.onnx.data"]
    rec.update(size=BIG, sha256=hashlib.sha256(data.read_bytes()).hexdigest())
    (out / "manifest.json").write_text(json.dumps(m))
    return out, data


@pytest.fixture
def hashed(monkeypatch):
    """The files hashed (by name) since the fixture started."""
    seen: list[str] = []
    real = files.sha256_file

    def counting(path, *a, **k):
        seen.append(os.path.basename(path))
        return real(path, *a, **k)

    monkeypatch.setattr(files, "sha256_file", counting)
    return seen


def flip(path, offset: int = 4096, n: int = 4096) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        block = bytearray(f.read(n))
        f.seek(offset)
        f.write(bytes(b ^ 0x5A for b in block))


def test_same_size_flip_in_a_large_weight_file_is_refused(big, hashed):
    out, data = big
    ids = [5, 6, 7, 8]
    want = dflash_qaic.load(out, tokenizer=False).generate(ids, 8).tokens  # hashes, remembers
    assert "target.onnx.data" in hashed
    hashed.clear()
    again = dflash_qaic.load(out, tokenizer=False)  # untouched: nothing hashed again
    assert hashed == [] and again.generate(ids, 8).tokens == want

    st = os.stat(data)
    flip(data)  # 4 KiB inside the weights, same size
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its mtime put back
    assert os.stat(data).st_size == BIG
    for verify in ("fast", "full"):
        with pytest.raises(ArtifactsError, match=r"target/target\.onnx\.data .*sha256.*re-run"):
            dflash_qaic.load(out, tokenizer=False, check_files=verify)
    flip(data)  # undone: the same bytes as exported
    assert dflash_qaic.load(out, tokenizer=False).generate(ids, 8).tokens == want


def test_touched_but_unchanged_file_is_hashed_again_not_refused(big, hashed):
    out, data = big
    dflash_qaic.load(out, tokenizer=False)
    hashed.clear()
    os.utime(data)  # touch: a new mtime, the same bytes
    dflash_qaic.load(out, tokenizer=False)
    assert hashed == ["target.onnx.data"]
    hashed.clear()
    dflash_qaic.load(out, tokenizer=False, check_files="full")  # full: every file, cache or not
    assert "target.onnx.data" in hashed and "draft.onnx.data" in hashed


def test_export_remembers_what_it_hashed(tiny_pair, tmp_path, hashed):
    """The first load after an export hashes nothing: the exporter recorded every file."""
    t, d = tiny_pair(family="qwen3", target_layer_ids=[1, 3])
    out = tmp_path / "art"
    assert main(["--target", str(t), "--draft", str(d), "--out", str(out), *SMALL, "--quiet"]) == 0
    hashed.clear()
    dflash_qaic.load(out, tokenizer=False)
    assert hashed == []


def test_a_lost_cache_costs_a_hash_never_a_pass(big, hashed, tmp_path, monkeypatch):
    out, data = big
    dflash_qaic.load(out, tokenizer=False)
    monkeypatch.setenv(files.CACHE_ENV, str(tmp_path / "elsewhere"))  # an empty cache
    hashed.clear()
    dflash_qaic.load(out, tokenizer=False)
    assert "target.onnx.data" in hashed
    (tmp_path / "elsewhere" / files.CACHE_FILE).write_text("{not json")
    flip(data)
    with pytest.raises(ArtifactsError, match="target.onnx.data"):
        dflash_qaic.load(out, tokenizer=False)
