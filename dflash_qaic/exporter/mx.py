"""OCP Microscaling (MX v1.0) rounding: what `-mxfp6-matmul` and an MXINT8 KV cache store.

An MX block is 32 elements that share one scale X = 2^s, stored as an E8M0 byte (s + 127;
0xFF is NaN, never produced here). The spec's conversion of a block {V_i}:

    s   = floor(log2(max_i |V_i|)) - emax_elem        (emax_elem: exponent of the element
    P_i = round(V_i / X) in the element format           format's largest normal number)

with values beyond the element's largest normal saturated to it. Element formats:

    format      bits  layout (sign, exponent, mantissa)   bias  largest  emax_elem
    fp6_e2m3    6     1, 2, 3                              1     7.5      2
    fp6_e3m2    6     1, 3, 2                              3     28       4
    fp4_e2m1    4     1, 2, 1                              1     6        2
    int8        8     two's complement, value k · 2^-6     -     127/64   0

FP elements have subnormals (exponent field 0), +/-0 and no Inf/NaN. Choices this module makes
where the spec leaves room, as Microsoft's MX reference implementation (microxcaling) does:
rounding is to nearest, ties to even (`np.rint`); MXINT8 is clamped symmetrically to ±127/64
(the code 0x80, -2.0, is never produced); an all-zero block gets the smallest scale, E8M0 0x00
(2^-127), and all-zero elements; s is clamped at -127 below (E8M0 has no smaller value); a block
holding NaN or ±Inf is refused (ValueError), since the spec makes it NaN and a program's weights
or cache must never be. The sign of a value that rounds to zero is kept (-0).

`mx_round(x, fmt, axis)` returns the values a block-of-32 MX store gives back (dequantized, in
x's dtype, exact: every MX value is a float32 value); `mx_quantize` also returns the codes (the
E8M0 byte per block and the element bit patterns), which the tests compare bit for bit with the
spec's rules. Both are vectorised over whole tensors (no Python loop over elements or blocks).
"""

from __future__ import annotations

import dataclasses

import numpy as np

BLOCK = 32  # elements per shared scale (MX v1.0: k = 32 for every concrete format)
E8M0_BIAS = 127
SCALE_MIN = -127  # the smallest E8M0 exponent (code 0x00)


@dataclasses.dataclass(frozen=True)
class MXFormat:
    """One MX element format: FP (ebits, mbits, bias) or INT8 (ebits = 0)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int  # exponent of the largest normal element (the spec's emax_elem)
    max_value: float  # the largest element magnitude

    @property
    def is_int(self) -> bool:
        return self.ebits == 0

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal element (FP)."""
        return 1 - self.bias

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


FP6_E2M3 = MXFormat("fp6_e2m3", 2, 3, 1, 2, 7.5)
FP6_E3M2 = MXFormat("fp6_e3m2", 3, 2, 3, 4, 28.0)
FP4_E2M1 = MXFormat("fp4_e2m1", 2, 1, 1, 2, 6.0)
INT8 = MXFormat("int8", 0, 7, 0, 0, 127 / 64)  # 7 magnitude bits, fixed point 1.6

FORMATS = {f.name: f for f in (FP6_E2M3, FP6_E3M2, FP4_E2M1, INT8)}
#: the names the compile profile's formats go by
MXFP6 = FP6_E2M3  # `-mxfp6-matmul`: E2M3 elements (docs/precision.md says where this is stated)
MXINT8 = INT8


def mx_format(name: str | MXFormat) -> MXFormat:
    if isinstance(name, MXFormat):
        return name
    alias = {"mxfp6": MXFP6, "mxint8": MXINT8, "mxfp4": FP4_E2M1}
    if name in alias:
        return alias[name]
    if name not in FORMATS:
        known = ", ".join([*FORMATS, *alias])
        raise ValueError(f"unknown MX element format {name!r} (known: {known})")
    return FORMATS[name]


def _blocks(x: np.ndarray, axis: int) -> tuple[np.ndarray, tuple[int, ...], int]:
    """x as float64 [..., n_blocks, BLOCK] along `axis` (zero-padded), with what undoes it."""
    moved = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
    n = moved.shape[-1]
    pad = (-n) % BLOCK
    if pad:
        moved = np.concatenate([moved, np.zeros((*moved.shape[:-1], pad))], axis=-1)
    return moved.reshape(*moved.shape[:-1], -1, BLOCK), moved.shape[:-1], n


def _unblock(b: np.ndarray, lead: tuple[int, ...], n: int, axis: int) -> np.ndarray:
    return np.moveaxis(b.reshape(*lead, -1)[..., :n], -1, axis)


def shared_exponents(blocks: np.ndarray, fmt: MXFormat) -> np.ndarray:
    """s per block [..., n_blocks]: floor(log2(amax)) - emax_elem, clamped at -127; -127 for an
    all-zero block. Exact (frexp), fp32 subnormals included."""
    amax = np.abs(blocks).max(axis=-1)
    _, e = np.frexp(amax)  # amax = m · 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    s = np.where(amax > 0, e - 1 - fmt.emax, SCALE_MIN)
    return np.maximum(s, SCALE_MIN).astype(np.int64)


def _round_elements(v: np.ndarray, fmt: MXFormat) -> np.ndarray:
    """v (already divided by the block's scale) rounded to the element grid, saturated."""
    a = np.abs(v)
    if fmt.is_int:
        q = np.rint(a * 64) / 64
    else:
        _, e = np.frexp(a)
        step_exp = np.maximum(e - 1, fmt.emin) - fmt.mbits  # subnormals share emin's step
        q = np.ldexp(np.rint(np.ldexp(a, -step_exp)), step_exp)
    return np.copysign(np.minimum(q, fmt.max_value), v)


def _element_codes(q: np.ndarray, fmt: MXFormat) -> np.ndarray:
    """The bit pattern of each (representable) element value q, as uint8."""
    sign = np.signbit(q)
    a = np.abs(q)
    if fmt.is_int:
        k = np.rint(a * 64).astype(np.int64)
        return np.where(sign, -k, k).astype(np.int8).view(np.uint8)
    _, e = np.frexp(a)
    normal = a >= 2.0**fmt.emin
    exp_field = np.where(normal, e - 1 + fmt.bias, 0)
    step_exp = np.where(normal, e - 1, fmt.emin) - fmt.mbits
    mant = np.rint(np.ldexp(a, -step_exp)).astype(np.int64) - np.where(normal, 1 << fmt.mbits, 0)
    code = (sign.astype(np.int64) << (fmt.ebits + fmt.mbits)) | (exp_field << fmt.mbits) | mant
    return code.astype(np.uint8)


def _check_finite(x: np.ndarray) -> None:
    bad = ~np.isfinite(x)
    if bad.any():
        idx = tuple(int(i[0]) for i in np.nonzero(bad))
        raise ValueError(
            f"MX rounding: {int(bad.sum())} non-finite value(s) (first at index {idx}: "
            f"{x[idx]}); the MX spec makes such a block NaN, and a program's weights or cache "
            "must be finite: find where the inf/NaN comes from (e.g. an fp16 overflow)"
        )


def mx_quantize(x, fmt: str | MXFormat, axis: int = -1):
    """MX-encode x in blocks of 32 along `axis`. Returns (scale_codes uint8 [..., n_blocks]
    along the other axes, element_codes uint8 shaped like x, values float64 shaped like x)."""
    fmt = mx_format(fmt)
    x = np.asarray(x)
    _check_finite(x)
    blocks, lead, n = _blocks(x, axis)
    s = shared_exponents(blocks, fmt)
    q = _round_elements(np.ldexp(blocks, -s[..., None]), fmt)
    values = np.ldexp(q, s[..., None])
    codes = _element_codes(q, fmt)
    scale = (s + E8M0_BIAS).astype(np.uint8)
    return scale, _unblock(codes, lead, n, axis), _unblock(values, lead, n, axis)


def mx_round(x, fmt: str | MXFormat, axis: int = -1) -> np.ndarray:
    """x with every block of 32 along `axis` stored in MX format `fmt` and read back, in x's
    dtype (float32 or float16: the MX values of a finite block are exact in float32; in float16
    a value below fp16's range rounds as the cast does)."""
    x = np.asarray(x)
    _, _, values = mx_quantize(x, fmt, axis)
    return values.astype(x.dtype)


def decode(scale_codes, element_codes, fmt: str | MXFormat) -> np.ndarray:
    """Values of MX codes (the inverse of `mx_quantize` along the last axis, for the tests):
    scale_codes [..., n_blocks], element_codes [..., n_blocks * 32] -> float64."""
    fmt = mx_format(fmt)
    sc = np.asarray(scale_codes).astype(np.int64)
    if (sc == 0xFF).any():
        raise ValueError("E8M0 0xFF is NaN: the block has no value")
    c = np.asarray(element_codes).astype(np.uint8)
    if fmt.is_int:
        q = c.view(np.int8).astype(np.float64) / 64
    else:
        c = c.astype(np.int64)
        sign = np.where(c >> (fmt.ebits + fmt.mbits) & 1, -1.0, 1.0)
        ef = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1)
        mant = c & ((1 << fmt.mbits) - 1)
        normal = ef > 0
        sig = np.where(normal, mant + (1 << fmt.mbits), mant).astype(np.float64)
        exp = np.where(normal, ef - fmt.bias, fmt.emin) - fmt.mbits
        q = sign * np.ldexp(sig, exp)
    scale = np.repeat(sc - E8M0_BIAS, BLOCK, axis=-1)[..., : q.shape[-1]]
    return np.ldexp(q, scale)
