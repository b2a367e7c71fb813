"""Safetensors checkpoints read from their headers: every tensor's name, dtype, shape and byte
range, one file or shards named by model.safetensors.index.json, validated before any weight is
read; and the check of a tensor layout against the one a config expects."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_qaic.checkpoint_files.config import CheckpointError

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# MXFP4 expert weights (gpt-oss): uint8 codes and exponents, read only by dflash_qaic/mxfp4.py
MXFP4_SUFFIXES = ("_blocks", "_scales")
# A reduced draft vocabulary's maps (`d2t`, `t2d`; dflash_qaic/drafts.py): integer or bool
# tensors, read only by drafts.read_vocab_map
INDEX_DTYPES = {"I64": 8, "I32": 4, "BOOL": 1}
INDEX_TENSORS = ("d2t", "t2d")
# Parts of quantized weights (checkpoint_files/quantized.py): dtype -> (name suffixes, itemsize)
QUANT_PARTS = {
    "F8_E4M3": ((".weight",), 1),  # FP8 codes (their scales are F32 / BF16 tensors)
    "I32": ((".weight_packed", ".weight_shape"), 4),  # compressed-tensors' int4 words, shape
    "I64": ((".weight_shape",), 8),
}
INDEX_NAME = "model.safetensors.index.json"
HEADER_MAX = 100 * 1024 * 1024  # the safetensors format's own limit on the JSON header
# Tensors a checkpoint may carry that no program uses (Hugging Face ignores them too).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: `nbytes` at absolute `offset` of `file`."""

    file: Path
    name: str
    dtype: str  # a key of SAFETENSORS_DTYPES (or of QUANT_PARTS, "U8", INDEX_DTYPES)
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a valid safetensors file: {why}. The file is truncated or corrupt; "
        "download or save it again"
    )


def _header_json(path: Path, size: int) -> tuple[dict, int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(path, f"it is {size} bytes long, shorter than the 8-byte header size")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, HEADER_MAX):
            raise _corrupt(path, f"its header claims {n} bytes but the file has {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, f"its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise _corrupt(path, "its header is not a JSON object")
    return header, 8 + n


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo from the header alone (no tensor data is read), validated:
    a supported dtype, data_offsets that match the shape, and data inside the file."""
    path = Path(path)
    size = path.stat().st_size
    header, base = _header_json(path, size)
    out: dict[str, TensorInfo] = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            numel = math.prod(int(d) for d in shape)
        except (KeyError, TypeError, ValueError) as err:
            raise _corrupt(path, f"the entry of tensor `{name}` is malformed ({err!r})") from err
        mxfp4 = dtype == "U8" and name.endswith(MXFP4_SUFFIXES)  # dflash_qaic/mxfp4.py
        index = dtype in INDEX_DTYPES and name in INDEX_TENSORS
        quant = dtype in QUANT_PARTS and name.endswith(QUANT_PARTS[dtype][0])
        if dtype not in SAFETENSORS_DTYPES and not (mxfp4 or index or quant):
            raise CheckpointError(
                f"{path}: tensor `{name}` has dtype {dtype}; supported: "
                f"{', '.join(SAFETENSORS_DTYPES)}, and the published FP8 / INT4 / MXFP4 forms "
                "(convert the checkpoint to bf16, fp16 or fp32)"
            )
        if index:
            itemsize = INDEX_DTYPES[dtype]
        elif quant:
            itemsize = QUANT_PARTS[dtype][1]
        else:
            itemsize = 1 if mxfp4 else SAFETENSORS_DTYPES[dtype].itemsize
        if not 0 <= begin <= end or end - begin != numel * itemsize:
            raise _corrupt(
                path, f"tensor `{name}` declares {end - begin} bytes for shape {list(shape)}"
            )
        if base + end > size:
            raise _corrupt(
                path,
                f"tensor `{name}` ends at byte {base + end} but the file has {size} (data is shorter than declared)",
            )
        out[name] = TensorInfo(path, name, dtype, shape, base + begin, end - begin)
    spans = sorted(out.values(), key=lambda i: (i.offset, i.nbytes))
    for a, b in zip(spans, spans[1:]):
        if b.offset < a.offset + a.nbytes:
            raise _corrupt(path, f"tensors `{a.name}` and `{b.name}` overlap")
    return out


def _read_index(index: Path) -> dict[str, str]:
    try:
        wm = json.loads(index.read_bytes().decode("utf-8")).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a valid index ({e}); download it again") from e
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index}: `weight_map` must map tensor names to shard file names")
    return wm


def checkpoint_tensors(
    directory: str | Path, what: str = "checkpoint", quantized: bool = False
) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory: one model.safetensors, or shards named by
    model.safetensors.index.json (each shard must exist, hold exactly what the index says).
    Parts of quantized weights are refused unless `quantized` (a target, whose config says how
    they read: checkpoint_files/quantized.py)."""
    tensors = _checkpoint_tensors(Path(directory), what)
    stored = [i for i in tensors.values() if i.dtype in QUANT_PARTS and i.name not in INDEX_TENSORS]
    if stored and not quantized:
        raise CheckpointError(
            f"{what} {directory}: tensor `{stored[0].name}` is stored quantized "
            f"({stored[0].dtype}); a quantized {what} is not supported: use its bf16 form"
        )
    return tensors


def _checkpoint_tensors(d: Path, what: str) -> dict[str, TensorInfo]:
    files = safetensors_files(d, what)
    index = d / INDEX_NAME
    if not index.is_file():
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_safetensors_header(f).items():
                if name in tensors:
                    raise CheckpointError(
                        f"{what} {d}: tensor `{name}` is in both {tensors[name].file.name} and "
                        f"{f.name}; keep one copy (or add {INDEX_NAME})"
                    )
                tensors[name] = info
        return tensors
    wm = _read_index(index)
    shards = sorted(set(wm.values()))
    missing = [s for s in shards if not (d / s).is_file()]
    if missing:
        raise CheckpointError(
            f"{what} {d}: shard {missing[0]} named by {INDEX_NAME} is missing "
            f"({len(missing)} of {len(shards)} missing); download the complete checkpoint"
        )
    unlisted = [f.name for f in files if f.name not in shards]
    if unlisted:
        raise CheckpointError(
            f"{what} {d}: {unlisted[0]} is not listed in {INDEX_NAME}; remove it or add its "
            "tensors to the index"
        )
    tensors = {}
    for s in shards:
        for name, info in read_safetensors_header(d / s).items():
            if wm.get(name) != s:
                raise CheckpointError(
                    f"{what} {d / s}: tensor `{name}` is not listed for this shard in {INDEX_NAME}"
                )
            tensors[name] = info
    absent = sorted(set(wm) - set(tensors))
    if absent:
        raise CheckpointError(
            f"{what} {d}: {INDEX_NAME} names tensor `{absent[0]}` in {wm[absent[0]]}, which does "
            f"not hold it ({len(absent)} such tensors); the index and the shards do not match"
        )
    return tensors


def safetensors_files(directory: Path, what: str) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{what} {directory} holds no *.safetensors weights (expected model.safetensors "
            "or sharded model-0000x-of-0000y.safetensors)"
        )
    return files


def check_layout(where, found: dict, expected: dict, ignored: set, hint: str) -> None:
    unknown = sorted(set(found) - set(expected) - ignored)
    if unknown:
        raise CheckpointError(
            f"{where}: unknown tensor keys {unknown[:6]}{' …' if len(unknown) > 6 else ''} "
            f"({len(unknown)} in all); {hint}. Unknown tensors are refused, not silently ignored"
        )
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"{where}: missing tensor keys {missing[:6]}{' …' if len(missing) > 6 else ''} "
            f"({len(missing)} in all); the checkpoint is incomplete for its config.json"
        )
    for name, shape in expected.items():
        if list(found[name]) != shape:
            raise CheckpointError(
                f"{where}: tensor `{name}` has shape {list(found[name])}, expected {shape} from "
                "config.json"
            )
