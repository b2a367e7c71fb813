"""`manifest.json`: everything the runtime needs from an artifacts directory.

The exporter writes it last and atomically; a directory without a complete, readable manifest
is not an artifact. Paths inside are relative to the artifacts directory, so it can be moved.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

FORMAT = "dflash-qaic-artifacts"
VERSION = 1
NAME = "manifest.json"
REQUIRED = (
    "format",
    "version",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "prefill_seq_len",
    "ctx_len",
    "batch_size",
    "vocab_size",
    "hidden_size",
    "target",
    "draft",
)


class ArtifactsError(ValueError):
    """An artifacts directory is missing, incomplete or from another version."""


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write JSON to a temp file beside `path`, fsync, then rename over it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> Path:
    manifest = {"format": FORMAT, "version": VERSION, **manifest}
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise ValueError(f"manifest lacks {missing}")
    path = Path(out_dir) / NAME
    write_json_atomic(path, manifest)
    return path


def read_manifest(artifacts_dir: str | os.PathLike) -> dict:
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
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactsError(f"{path} is not valid JSON ({e}); re-run dflash-export") from e
    if m.get("format") != FORMAT:
        raise ArtifactsError(f"{path} is not a dflash-qaic manifest (format {m.get('format')!r})")
    if m.get("version") != VERSION:
        raise ArtifactsError(
            f"{path} has manifest version {m.get('version')}, this dflash-qaic reads {VERSION}: "
            "re-export with this version"
        )
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        raise ArtifactsError(f"{path} lacks fields {missing}; re-run dflash-export")
    for prog in ("target", "draft"):
        onnx_path = d / m[prog]["onnx"]
        if not onnx_path.is_file():
            raise ArtifactsError(
                f"{path} names {m[prog]['onnx']} but {onnx_path} is missing; re-run dflash-export"
            )
    return m
