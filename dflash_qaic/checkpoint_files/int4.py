"""INT4 weights in compressed-tensors' `pack-quantized` form (the Kimi K2-Thinking / K2.5 routed
experts; docs/DESIGN.md, Published quantized forms).

A Linear weight [R, C] is stored as three tensors:

    `…weight_packed` int32 [R, ceil(C/8)]   eight 4-bit codes per word, the first column in the
                                            lowest nibble: code(r, 8w + i) = (word >> 4i) & 0xF
    `…weight_scale`  [R, ceil(C/g)]         one scale per group of g columns (`group_size`)
    `…weight_shape`  int [2]                (R, C), which the padding of the last word hides

Codes are offset binary: the signed value q = code − 8 lies in [−8, 7] (symmetric, no zero
point), and the weight is q · scale[r, c // g]. The product of a 4-bit integer and a bf16 / fp16
scale is exact in fp32, so the dequantized fp32 weight is exact (compressed-tensors itself
multiplies in the scale's dtype, which can round).
"""

from __future__ import annotations

import numpy as np
import torch

PER_WORD = 8  # codes per int32 word
OFFSET = 8  # code = q + 8
CODE_VALUES = np.arange(16, dtype=np.float32) - OFFSET  # code -> q, as fp32


def unpack(words: np.ndarray, cols: int) -> np.ndarray:
    """uint8 codes [n, cols] of int32 words [n, ceil(cols/8)] (see the module)."""
    u = words.view(np.uint32)
    shifts = np.arange(PER_WORD, dtype=np.uint32) * 4
    codes = ((u[..., None] >> shifts) & 0xF).astype(np.uint8)  # [n, W, 8]
    return codes.reshape(*u.shape[:-1], -1)[..., :cols]


def pack(q: torch.Tensor) -> torch.Tensor:
    """int32 words [R, ceil(C/8)] of signed int4 values q [R, C] in [−8, 7] (the inverse of
    `unpack`, for writing checkpoints; padding codes are 0)."""
    if q.numel() and not (int(q.min()) >= -OFFSET and int(q.max()) < OFFSET):
        raise ValueError("int4 values must lie in [-8, 7]")
    R, C = q.shape
    W = -(-C // PER_WORD)
    codes = torch.zeros(R, W * PER_WORD, dtype=torch.int64)
    codes[:, :C] = q.to(torch.int64) + OFFSET
    shifts = torch.arange(PER_WORD, dtype=torch.int64) * 4
    words = (codes.view(R, W, PER_WORD) << shifts).sum(-1)  # in [0, 2^32): as int32 bits
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
