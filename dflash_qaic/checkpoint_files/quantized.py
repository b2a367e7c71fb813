"""Weights published quantized, read as the fp32 weights they stand for, exactly and in bounded
memory, whatever the model family (docs/DESIGN.md, Published quantized forms).

Two forms are read (gpt-oss's MXFP4 experts have their own reader, dflash_qaic/mxfp4.py):

- **FP8** (`quantization_config.quant_method` "fp8", DeepSeek-V3 / Kimi K2 / MiniMax-M2):
  `X.weight` float8_e4m3fn [R, C] (checkpoint_files/fp8.py) beside `X.weight_scale_inv` [ceil(R/bR),
  ceil(C/bC)] with (bR, bC) = `weight_block_size` (128 × 128): weight[r, c] = e4m3(code[r, c]) ·
  scale_inv[r // bR, c // bC], the blocks at the right and bottom edges partial. Modules named by
  `modules_to_not_convert` (or `ignored_layers`) stay unquantized;
- **INT4** (`quant_method` "compressed-tensors", format `pack-quantized`, Kimi K2-Thinking /
  K2.5 experts): `X.weight_packed` / `X.weight_scale` / `X.weight_shape` (checkpoint_files/int4.py),
  weight[r, c] = q(r, c) · scale[r, c // g] with g = `group_size`; modules matched by `ignore` stay
  unquantized.

`published_tensors` turns a checkpoint's tensors into the weights they stand for: each quantized
set becomes one `QuantizedTensor` named `X.weight`, of the dequantized shape, so the layout check
and the weight sources see the names and shapes of the unquantized model. Every inconsistency (a
weight without its scale, a scale of the wrong shape, FP8 tensors under a config that does not
say FP8, a quantized module its config keeps unquantized) is refused by tensor name.

Both forms are block-scaled codes: a table gives each code's value, exact in fp32, and one scale
multiplies each block (fp8: 128 × 128; int4: 1 × g). The product is one fp32 multiply (exact for
int4; correctly rounded for fp8), which is the definition tests/test_weight_forms.py checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from dflash_qaic.checkpoint_files import fp8, int4
from dflash_qaic.checkpoint_files.config import CheckpointError
from dflash_qaic.checkpoint_files.safetensors import SAFETENSORS_DTYPES, TensorInfo

SUPPORTED = (
    "fp8 (float8_e4m3fn weights with block scales `weight_scale_inv`), compressed-tensors "
    "(pack-quantized int4, symmetric, group-wise) and mxfp4 (gpt-oss experts)"
)
FIX = "or dequantize the checkpoint to bf16 and remove `quantization_config` from config.json"
FP8_SCALE = "_scale_inv"  # X.weight -> X.weight_scale_inv
INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")


@dataclass(frozen=True)
class QuantForm:
    """What config.json's `quantization_config` says (method None: unquantized)."""

    method: str | None = None
    block: tuple[int, int] = (128, 128)  # fp8: weight_block_size
    group: int = 0  # int4: group_size
    keep: tuple[str, ...] = ()  # fp8: modules_to_not_convert / ignored_layers
    ignore: tuple[str, ...] = ()  # compressed-tensors: ignore ("re:" regexes, or names)


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight stored quantized, read as its dequantized fp32 [R, C] (`name`, `shape`): one code
    per element in `codes` (fp8: F8_E4M3 [R, C]; int4: I32 [R, ceil(C/8)]), one scale per
    block of `block` = (rows, cols) elements in `scale`. Where its bytes are (file, offset,
    nbytes) is where its codes are: the value scan reads them there."""

    name: str
    shape: tuple[int, int]
    form: str  # "fp8" | "int4"
    codes: TensorInfo
    scale: TensorInfo
    block: tuple[int, int]
    # a slice of a stored weight's rows (`row_slice`): the stored weight's first row of this one
    # and the stored block's rows; `block` is then (1, cols) and `scale_grid` one row per row
    rows_of: tuple[int, int] | None = None

    # where its bytes are, and their dtype: its codes' (TensorInfo's fields)
    file = property(lambda self: self.codes.file)
    offset = property(lambda self: self.codes.offset)
    nbytes = property(lambda self: self.codes.nbytes)
    dtype = property(lambda self: self.codes.dtype)

    @property
    def table(self) -> np.ndarray:
        """fp32: the value of each code."""
        return fp8.E4M3 if self.form == "fp8" else int4.CODE_VALUES

    @property
    def row_bytes(self) -> int:
        return self.codes.nbytes // max(self.shape[0], 1)


# ---------------------------------------------------------------- config.json


def quant_form(cfg: dict, text: dict | None, cpath: Path) -> QuantForm:
    """The quantization a target's config.json declares (top level, or its text config)."""
    q = cfg.get("quantization_config") or (text or {}).get("quantization_config")
    if not q:
        return QuantForm()
    if not isinstance(q, dict):
        raise CheckpointError(f"{cpath}: `quantization_config` must be an object of fields")
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_form(q, cpath)
    if method == "compressed-tensors":
        return _int4_form(q, cpath)
    if method == "mxfp4":
        return QuantForm("mxfp4")
    raise CheckpointError(
        f"{cpath}: `quantization_config.quant_method` {method!r} is not supported; supported: "
        f"{SUPPORTED}; {FIX}"
    )


def _refuse(cpath: Path, field: str, value, want: str) -> CheckpointError:
    return CheckpointError(
        f"{cpath}: `quantization_config.{field}` is {value!r}; supported: {want} (the published "
        f"FP8 / INT4 forms); {FIX}"
    )


def _fp8_form(q: dict, cpath: Path) -> QuantForm:
    fmt = q.get("fmt")
    if fmt not in (None, "e4m3", "float8_e4m3fn"):
        raise _refuse(cpath, "fmt", fmt, "e4m3")
    act = q.get("activation_scheme")
    if act not in (None, "dynamic"):
        raise _refuse(cpath, "activation_scheme", act, "dynamic (no activation scales)")
    block = q.get("weight_block_size")
    ok = isinstance(block, list) and len(block) == 2
    if not (ok and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _refuse(cpath, "weight_block_size", block, "two positive integers, e.g. [128, 128]")
    keep = q.get("modules_to_not_convert") or q.get("ignored_layers") or []
    if not (isinstance(keep, list) and all(isinstance(k, str) for k in keep)):
        raise _refuse(cpath, "modules_to_not_convert", keep, "a list of module names")
    return QuantForm("fp8", block=(block[0], block[1]), keep=tuple(keep))


def _int4_form(q: dict, cpath: Path) -> QuantForm:
    fmt = q.get("format")
    if fmt not in (None, "pack-quantized"):
        raise _refuse(cpath, "format", fmt, "pack-quantized")
    status = q.get("quantization_status")
    if status not in (None, "compressed"):
        raise _refuse(cpath, "quantization_status", status, "compressed")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(cpath, "config_groups", groups, "one or more groups of int4 weights")
    sizes = set()
    for name, g in groups.items():
        w = (g or {}).get("weights") or {}
        where = f"config_groups.{name}"
        if (g or {}).get("format") not in (None, "pack-quantized"):
            raise _refuse(cpath, f"{where}.format", g.get("format"), "pack-quantized")
        for field, want in (("num_bits", 4), ("type", "int"), ("symmetric", True)):
            if w.get(field) != want:
                raise _refuse(cpath, f"{where}.weights.{field}", w.get(field), repr(want))
        if w.get("strategy") != "group":
            raise _refuse(cpath, f"{where}.weights.strategy", w.get("strategy"), "'group'")
        if (g or {}).get("input_activations"):
            raise _refuse(cpath, f"{where}.input_activations", "…", "null (weight-only)")
        size = w.get("group_size")
        if not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
            raise _refuse(cpath, f"{where}.weights.group_size", size, "a positive integer")
        sizes.add(size)
    if len(sizes) > 1:
        raise _refuse(cpath, "config_groups", sorted(sizes), "one group_size for every group")
    ignore = q.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(k, str) for k in ignore)):
        raise _refuse(cpath, "ignore", ignore, "a list of module names or 're:' patterns")
    return QuantForm("compressed-tensors", group=sizes.pop(), ignore=tuple(ignore))


def kept_by(module: str, form: QuantForm) -> str | None:
    """The pattern of `form` that keeps `module` unquantized, if any. fp8 (transformers' rule
    for `modules_to_not_convert`): the pattern matches from the start up to a module boundary,
    as a regex, or is a suffix of the name; compressed-tensors' `ignore`: "re:" + a regex
    matched from the start, else the exact name."""
    for p in form.keep:
        try:
            hit = re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module) is not None
        except re.error:
            hit = module == p or module.startswith(p + ".")
        if hit or module.endswith(p):
            return p
    for p in form.ignore:
        if (re.match(p[3:], module) is not None) if p.startswith("re:") else module == p:
            return p
    return None


# ---------------------------------------------------------------- the checkpoint's tensors


def published_tensors(tensors: dict, form: QuantForm, where: Path) -> dict:
    """`tensors` (name -> TensorInfo) with every quantized set replaced by one QuantizedTensor
    named `X.weight` (see the module); refused by name when the sets are incomplete or
    disagree with `form`."""
    out = dict(tensors)
    fp8_names = [n for n, i in tensors.items() if i.dtype == "F8_E4M3"]
    packed = [n for n in tensors if n.endswith(".weight_packed")]
    for names, method in ((fp8_names, "fp8"), (packed, "compressed-tensors")):
        if names and form.method != method:
            raise CheckpointError(
                f"{where}: tensor `{names[0]}` ({len(names)} such) is stored "
                f"{'float8_e4m3fn' if method == 'fp8' else 'int4-packed'} but config.json's "
                f"`quantization_config.quant_method` is {form.method!r}, not {method!r}: the "
                "config does not belong to these weights; restore the published config.json"
            )
    for n in fp8_names:
        q = _fp8_tensor(tensors, n, form, where)
        del out[q.scale.name]
        out[n] = q
    for n in packed:
        q = _int4_tensor(tensors, n.removesuffix("_packed"), form, where)
        for part in INT4_PARTS:
            del out[f"{q.name}{part.removeprefix('weight')}"]
        if q.name in tensors:
            raise CheckpointError(
                f"{where}: both `{q.name}` and `{n}` are present: one module stored twice; "
                "the checkpoint is damaged, download it again"
            )
        out[q.name] = q
    _refuse_orphans(out, where)
    return out


def _refuse_orphans(out: dict, where: Path) -> None:
    """Scales or shapes left over: their weight is missing or not quantized."""
    for n, info in out.items():
        if isinstance(info, QuantizedTensor):
            continue
        if n.endswith(".weight" + FP8_SCALE):
            w = n.removesuffix(FP8_SCALE)
            raise CheckpointError(
                f"{where}: `{n}` scales `{w}`, which is "
                f"{'missing' if w not in out else 'not float8_e4m3fn (' + out[w].dtype + ')'}; "
                "the checkpoint is incomplete or mixed; download it again"
            )
        if n.endswith((".weight_scale", ".weight_shape")):
            raise CheckpointError(
                f"{where}: `{n}` has no `{n.rsplit('_', 1)[0]}_packed` beside it; the "
                "checkpoint is incomplete; download it again"
            )


def _kept_error(where: Path, name: str, module: str, pattern: str, field: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: `{name}` is stored quantized but `quantization_config.{field}` keeps module "
        f"`{module}` unquantized (pattern {pattern!r}); the config and the weights disagree; "
        "restore the published config.json"
    )


def _fp8_tensor(tensors: dict, name: str, form: QuantForm, where: Path) -> QuantizedTensor:
    codes = tensors[name]
    if not name.endswith(".weight"):
        raise CheckpointError(f"{where}: tensor `{name}` is float8_e4m3fn but not a `.weight`")
    scale = tensors.get(name + FP8_SCALE)
    if scale is None:
        raise CheckpointError(
            f"{where}: FP8 weight `{name}` has no `{name}{FP8_SCALE}` (its block scales); the "
            "checkpoint is incomplete; download the missing shard or file again"
        )
    module = name.removesuffix(".weight")
    if (p := kept_by(module, form)) is not None:
        raise _kept_error(where, name, module, p, "modules_to_not_convert")
    if len(codes.shape) != 2:
        raise CheckpointError(
            f"{where}: FP8 weight `{name}` has shape {list(codes.shape)}; only 2-D weights "
            "(one Linear each) are read"
        )
    R, C = codes.shape
    (bR, bC) = form.block
    _check_scale(where, scale, [-(-R // bR), -(-C // bC)], f"{name} {[R, C]} in {bR}×{bC} blocks")
    return QuantizedTensor(name, (R, C), "fp8", codes, scale, form.block)


def _check_scale(where: Path, scale: TensorInfo, want: list, what: str) -> None:
    if scale.dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{where}: scale `{scale.name}` has dtype {scale.dtype}; expected F32, BF16 or F16"
        )
    if list(scale.shape) != want:
        raise CheckpointError(
            f"{where}: scale `{scale.name}` has shape {list(scale.shape)}, expected {want} for "
            f"{what}; the scales do not belong to this weight (the checkpoint or its "
            "`quantization_config` block size is wrong)"
        )


def _int4_tensor(tensors: dict, stem: str, form: QuantForm, where: Path) -> QuantizedTensor:
    """`stem` + `_packed` / `_scale` / `_shape`, read as `stem` (`….weight`)."""
    parts = {p: tensors.get(f"{stem}{p.removeprefix('weight')}") for p in INT4_PARTS}
    missing = [f"{stem}{p.removeprefix('weight')}" for p, t in parts.items() if t is None]
    if missing:
        raise CheckpointError(
            f"{where}: INT4 weight `{stem}_packed` has no `{missing[0]}`; the checkpoint is "
            "incomplete; download the missing shard or file again"
        )
    module = stem.removesuffix(".weight")
    if (p := kept_by(module, form)) is not None:
        raise _kept_error(where, stem + "_packed", module, p, "ignore")
    packed, scale, shape_t = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
    R, C = _read_shape(shape_t, where)
    W, g = -(-C // int4.PER_WORD), form.group
    if packed.dtype != "I32" or list(packed.shape) != [R, W]:
        raise CheckpointError(
            f"{where}: `{packed.name}` is {packed.dtype} {list(packed.shape)}, expected I32 "
            f"{[R, W]} for a [{R}, {C}] weight (`{shape_t.name}`), 8 codes per word"
        )
    _check_scale(where, scale, [R, -(-C // g)], f"{stem} {[R, C]} in groups of {g}")
    return QuantizedTensor(stem, (R, C), "int4", packed, scale, (1, g))


def _read_shape(info: TensorInfo, where: Path) -> tuple[int, int]:
    """The (R, C) a `…weight_shape` tensor holds (16 bytes: read here, not in the scan)."""
    isz = {"I64": 8, "I32": 4}.get(info.dtype)
    if isz is None or list(info.shape) != [2]:
        raise CheckpointError(
            f"{where}: `{info.name}` is {info.dtype} {list(info.shape)}; expected an integer [2]"
        )
    raw = read_bytes(info, 0, info.nbytes)
    R, C = (int(v) for v in np.frombuffer(raw, f"<i{isz}"))
    if R < 1 or C < 1:
        raise CheckpointError(f"{where}: `{info.name}` holds [{R}, {C}], not a weight's shape")
    return R, C


def read_bytes(info: TensorInfo, start: int, n: int) -> bytearray:
    """`n` bytes of tensor `info`'s data from byte `start`."""
    buf = bytearray(n)
    with open(info.file, "rb") as f:
        f.seek(info.offset + start)
        got = f.readinto(buf)
    if got != n:
        raise CheckpointError(
            f"{info.file}: tensor `{info.name}` is cut short ({got} of {n} bytes read); the "
            "file changed or is truncated; download it again"
        )
    return buf


# ---------------------------------------------------------------- dequantization


def scale_grid(q: QuantizedTensor) -> np.ndarray:
    """fp32 [blocks down, blocks across]: the scales (bf16 / fp16 widen exactly); for a row
    slice, the scale row of each of its rows."""
    raw = read_bytes(q.scale, 0, q.scale.nbytes)
    t = torch.frombuffer(raw, dtype=SAFETENSORS_DTYPES[q.scale.dtype]) if raw else torch.empty(0)
    grid = t.float().numpy().reshape(q.scale.shape)
    if q.rows_of is None:
        return grid
    first, block_rows = q.rows_of
    return grid[(first + np.arange(q.shape[0])) // block_rows]


def row_slice(info, first: int, n: int, name: str):
    """Rows first … first + n − 1 of a stored weight [R, C] (a TensorInfo or a QuantizedTensor),
    read in place from its file: a program weight made of parts of one checkpoint tensor
    (families: `weight_parts`)."""
    row = info.nbytes // info.shape[0]
    shape = (n, info.shape[1])
    codes = info.codes if isinstance(info, QuantizedTensor) else info
    part = replace(codes, name=name, shape=shape, offset=codes.offset + first * row, nbytes=n * row)
    if not isinstance(info, QuantizedTensor):
        return part
    start, block_rows = info.rows_of or (0, info.block[0])
    rows_of = (start + first, block_rows)
    return replace(
        info, name=name, shape=shape, codes=part, block=(1, info.block[1]), rows_of=rows_of
    )


def code_rows(q: QuantizedTensor, raw, n: int) -> np.ndarray:
    """uint8 [n, C]: one code per element of `n` rows of `q`'s stored codes (`raw` bytes)."""
    C = q.shape[1]
    if q.form == "fp8":
        return np.frombuffer(raw, np.uint8).reshape(n, C)
    return int4.unpack(np.frombuffer(raw, "<i4").reshape(n, -1), C)


def _scaled(codes: np.ndarray, table, grid: np.ndarray, block, r0: int) -> np.ndarray:
    """fp32 [n, C]: table[codes] · the scale of each element's block (rows r0 … r0 + n − 1),
    multiplied in place block column by block column (views: no scale is repeated)."""
    n, C = codes.shape
    bC = block[1]
    rows = grid[np.arange(r0, r0 + n) // block[0]]  # [n, blocks across]
    vals = table[codes]
    full = C // bC
    whole = vals[:, : full * bC].reshape(n, full, bC)  # a view: the last axis split
    whole *= rows[:, :full, None]
    if full * bC < C:  # the partial block at the right edge
        vals[:, full * bC :] *= rows[:, full:]
    return vals


def chunks(q: QuantizedTensor, transpose: bool, chunk_bytes: int):
    """The dequantized fp32 weight (transposed when asked: [C, R]) as row blocks of at most
    `chunk_bytes`, in order. Memory: one block, its codes, and when transposed the whole
    weight's codes (one byte an element)."""
    R, C = q.shape
    grid, table = scale_grid(q), q.table
    step = max(1, chunk_bytes // (4 * C))
    if not transpose:
        for r0 in range(0, R, step):
            n = min(step, R - r0)
            codes = code_rows(q, read_bytes(q.codes, r0 * q.row_bytes, n * q.row_bytes), n)
            yield torch.from_numpy(_scaled(codes, table, grid, q.block, r0))
        return
    t = np.empty((C, R), np.uint8)
    for r0 in range(0, R, step):
        n = min(step, R - r0)
        t[:, r0 : r0 + n] = code_rows(
            q, read_bytes(q.codes, r0 * q.row_bytes, n * q.row_bytes), n
        ).T
    grid_t, block_t = np.ascontiguousarray(grid.T), (q.block[1], q.block[0])
    step = max(1, chunk_bytes // (4 * R))
    for c0 in range(0, C, step):
        yield torch.from_numpy(_scaled(t[c0 : c0 + step], table, grid_t, block_t, c0))


def dequantize(q: QuantizedTensor, chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """The whole dequantized fp32 weight [R, C] (for an in-memory model)."""
    return torch.cat(list(chunks(q, False, chunk_bytes))).view(q.shape)


def rows_peak(q: QuantizedTensor, raw, r0: int, grid: np.ndarray) -> float:
    """The largest |value| of the rows of `q` whose stored codes are `raw`, from row `r0`
    (NaN when a code is NaN or a scale is not finite): per element block, the largest |code
    value| times |its scale|, so no fp32 weight is materialised."""
    n = len(raw) // q.row_bytes
    rank, magnitude = _RANKS[q.form]
    ranks = rank[code_rows(q, raw, n)]  # uint8 [n, C], |value| ascending in the rank
    C, (bR, bC) = q.shape[1], q.block
    per_block = np.maximum.reduceat(ranks, np.arange(0, C, bC), axis=1)  # [n, blocks across]
    peaks = magnitude[per_block] * np.abs(grid[np.arange(r0, r0 + n) // bR])
    return float(peaks.max()) if peaks.size else 0.0


def _ranks(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rank of each code, |value| of each rank): codes ordered by |value|, NaN last, so the
    largest |value| of a block is read from the largest rank, a uint8 max."""
    mags = np.abs(table.astype(np.float64))
    order = np.argsort(np.where(np.isnan(mags), np.inf, mags), kind="stable")
    rank = np.empty(len(table), np.uint8)
    rank[order] = np.arange(len(table))
    return rank, mags[order].astype(np.float32)


_RANKS = {"fp8": _ranks(fp8.E4M3), "int4": _ranks(int4.CODE_VALUES)}
