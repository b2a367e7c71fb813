"""MXFP4 expert weights (gpt-oss checkpoints), dequantized exactly, in bounded memory.

A gpt-oss checkpoint stores each MoE projection as two tensors (docs/DESIGN.md, gpt-oss):

    `…_blocks` uint8 [E, R, G, 16]   FP4 E2M1 codes, two per byte (low nibble first), 32 per block
    `…_scales` uint8 [E, R, G]       one E8M0 exponent per block: the block's values × 2^(s − 127)

    value[e, r, 32g + 2j]     = E2M1[blocks[e, r, g, j] & 0xF] · 2^(scales[e, r, g] − 127)
    value[e, r, 32g + 2j + 1] = E2M1[blocks[e, r, g, j] >> 4]  · 2^(scales[e, r, g] − 127)

so the dequantized tensor is [E, R, C] with C = 32·G: the rows R are the projection's outputs
(gate_up: 2I interleaved gate/up rows; down: H rows), the columns its inputs. Every value is a
small multiple of a power of two, exact in fp32 (and in bf16, so this equals transformers' own
dequantization bit for bit). `mxfp4_chunks` reads the two tensors straight from their safetensors
files a row block at a time, so a 20 GB expert stack never sits in memory at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

# FP4 E2M1: sign bit, 2 exponent bits, 1 mantissa bit (OCP MX spec); code -> value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)
E8M0_BIAS = 127
BLOCK = 32  # values per scale
CHUNK_BYTES = 64 << 20  # fp32 bytes produced at a time by mxfp4_chunks


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> fp32 [..., G·32] (see the module)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
            f"blocks must be [..., G, {BLOCK // 2}] and scales [..., G]"
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    codes = torch.stack(((b & 0x0F), (b >> 4)), dim=-1).long()  # [..., G, 16, 2]: lo, hi
    vals = lut[codes].flatten(-2)  # [..., G, 32]
    exp = scales.to(torch.int32) - E8M0_BIAS  # [..., G]
    return torch.ldexp(vals, exp[..., None]).flatten(-2)


def _read(path: Path, offset: int, nbytes: int) -> torch.Tensor:
    buf = bytearray(nbytes)
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(buf)
    if got != nbytes:
        raise ValueError(
            f"{path}: MXFP4 tensor cut short ({got} of {nbytes} bytes at {offset}); the file "
            "changed or is truncated; download it again"
        )
    return torch.frombuffer(buf, dtype=torch.uint8) if nbytes else torch.empty(0, torch.uint8)


def check_pair(blocks, scales) -> tuple[int, int]:
    """(rows, G) of a `_blocks` / `_scales` pair of checkpoint TensorInfos (uint8 both, blocks
    [..., G, 16], scales [..., G]); rows = the product of the leading axes."""
    for t in (blocks, scales):
        if t.dtype != "U8":
            raise ValueError(f"MXFP4 tensor `{t.name}` has dtype {t.dtype}, expected U8")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 tensors `{blocks.name}` {list(blocks.shape)} and `{scales.name}` "
            f"{list(scales.shape)} do not match: expected [..., G, {BLOCK // 2}] and [..., G]"
        )
    G = int(scales.shape[-1])
    return math.prod(scales.shape[:-1]), G


def mxfp4_chunks(blocks, scales, chunk_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """The dequantized [rows, G·32] fp32 tensor of a `_blocks` / `_scales` pair (checkpoint
    TensorInfos: file, offset, nbytes, shape) as row blocks in order: at most `chunk_bytes` of
    fp32 and its 9/64 in codes and scales in memory at a time."""
    rows, G = check_pair(blocks, scales)
    row_b, row_s = G * (BLOCK // 2), G  # bytes per row
    step = max(1, chunk_bytes // (4 * G * BLOCK))
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        b = _read(Path(blocks.file), blocks.offset + r0 * row_b, n * row_b).view(n, G, BLOCK // 2)
        s = _read(Path(scales.file), scales.offset + r0 * row_s, n * row_s).view(n, G)
        yield dequantize(b, s)


def dequantize_file(blocks, scales) -> torch.Tensor:
    """The whole dequantized tensor [..., R, G·32] (checkpoint layout), e.g. for a tiny model."""
    out = torch.cat(list(mxfp4_chunks(blocks, scales)))
    return out.view(*scales.shape[:-1], scales.shape[-1] * BLOCK)
