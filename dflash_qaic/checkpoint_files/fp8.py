"""FP8 E4M3 codes (the DeepSeek-V3 / Kimi / MiniMax-M2 published form; docs/DESIGN.md, Published
quantized forms): what each of the 256 byte values means.

    bit 7: sign    bits 6-3: exponent e (bias 7)    bits 2-0: mantissa m
    e > 0:  (-1)^s · (1 + m/8) · 2^(e - 7)       e = 0:  (-1)^s · (m/8) · 2^-6 (subnormals)
    0x7F / 0xFF: NaN (the "fn" variant has no infinities; its largest finite value is 448)

The table is taken from torch's own `float8_e4m3fn` conversion (every code is exact in fp32);
tests/test_weight_forms.py checks it against a decode written from the definition above.
"""

from __future__ import annotations

import numpy as np
import torch

NAN_CODES = (0x7F, 0xFF)
E4M3_MAX = 448.0


def e4m3_table() -> np.ndarray:
    """fp32 [256]: the value of each E4M3 code (NaN for 0x7F and 0xFF)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).float().numpy().copy()


E4M3 = e4m3_table()


def encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes of fp32 values (round to nearest even, saturating at ±448, as torch casts)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
