"""What is read from a checkpoint's bytes: its sha256 (`file_digest`), a cheap identity that
reads no weight bytes (`fingerprint`), the fp16 scale of the draft's fc, and the scan that checks
every used weight finite and within fp16's range while hashing (`scan_directory`)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dflash_qaic.checkpoint_files.config import CheckpointError
from dflash_qaic.checkpoint_files.quantized import QuantizedTensor, rows_peak, scale_grid
from dflash_qaic.checkpoint_files.safetensors import HEADER_MAX, INDEX_NAME, TensorInfo


def file_digest(directory: str | Path, *, chunk: int = 1 << 22) -> str:
    """sha256 over config.json and the safetensors files of a checkpoint directory."""
    import hashlib

    h = hashlib.sha256()
    d = Path(directory)
    for f in sorted([d / "config.json", *d.glob("*.safetensors")]):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while b := fh.read(chunk):
                h.update(b)
    return h.hexdigest()


# The tokenizer files a target directory may hold (copied into the artifacts when present).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
# Small files whose contents change a program or the runtime's behaviour.
FINGERPRINT_FILES = ("config.json", INDEX_NAME, "generation_config.json", *TOKENIZER_FILES)


def fingerprint(directory: str | Path) -> str:
    """A cheap identity of a checkpoint directory that reads no weight bytes: the contents of
    its config / index / tokenizer / generation-config files, and per safetensors file its
    name, size, mtime_ns and a hash of its header. A re-run decides "unchanged" in
    milliseconds; a rewritten weight file changes its mtime (and usually its header)."""
    import hashlib

    h = hashlib.sha256()
    d = Path(directory)
    for name in FINGERPRINT_FILES:
        f = d / name
        h.update(name.encode() + b"\0")
        h.update(f.read_bytes() if f.is_file() else b"<absent>")
    for f in sorted(d.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, HEADER_MAX)))
    return h.hexdigest()


def fp16_fc_scale(fc_weight: torch.Tensor, where: TensorInfo | None = None) -> float:
    """As QEfficient's DFlash export: divide fc by max(sqrt(in) · max_row_norm / 128, 1) so its output fits fp16.

    The scaled fc is what the card sees, at most 128 / sqrt(in) per element, so fc's raw weights
    may lie beyond fp16's range (docs/DESIGN.md, fp16). Only the scale must be a finite fp32
    number: a row norm whose squares overflow fp32 is taken in fp64; an fc that is not finite,
    or whose scale is beyond fp32's range, is refused (`where`: its checkpoint tensor)."""
    in_features = fc_weight.shape[1]
    row_norm = fc_weight.float().norm(dim=1).max().item()
    if math.isinf(row_norm):  # its squares overflowed fp32: the same norm in fp64
        row_norm = fc_weight.double().norm(dim=1).max().item()
    scale = max(math.sqrt(in_features) * row_norm / 128.0, 1.0)
    if not scale <= FP32_MAX:  # inf, NaN or too large for the fp32 division
        peak = fc_weight.abs().max().item()
        name = f"{where.file}: tensor `{where.name}`" if where else "the draft's `fc.weight`"
        if not math.isfinite(peak) or not math.isfinite(row_norm):
            raise _non_finite(name)
        raise CheckpointError(
            f"{name} holds values up to |x| = {peak:g}: the export divides fc by "
            f"max(sqrt(in) · max_row_norm / 128, 1) so the card's fc fits fp16, and that scale, "
            f"{scale:.3g}, is beyond fp32's range ({FP32_MAX:.4g}); the checkpoint is damaged, "
            "use a good copy"
        )
    return scale


# ---------------------------------------------------------------- weight values
#
# The card computes in fp16 (docs/DESIGN.md, fp16): a weight beyond fp16's largest finite value
# becomes inf there and the programs compute inf / NaN. `check_weight_values` reads every byte of
# both checkpoints once, before any tracing: the sha256 the manifest records (`file_digest`,
# which read them anyway) and, in the same pass, each used tensor's largest |value|.

FP16_MAX = 65504.0  # fp16's largest finite value
FP32_MAX = float(torch.finfo(torch.float32).max)
_SCAN_CHUNK = 16 << 20  # bytes read, hashed and checked at a time


def _non_finite(name: str) -> CheckpointError:
    return CheckpointError(
        f"{name} holds inf or NaN values; the checkpoint is damaged (a model with non-finite "
        "weights produces garbage); use a good copy"
    )


def beyond_fp16(info: TensorInfo, peak: float) -> CheckpointError:
    """The error for tensor `info` whose largest |value| `peak` does not fit fp16."""
    if not math.isfinite(peak):
        return _non_finite(f"{info.file}: tensor `{info.name}`")
    return CheckpointError(
        f"{info.file}: tensor `{info.name}` holds values up to |x| = {peak:g}, beyond 65,504, "
        "fp16's largest finite value: the AI100 computes in fp16, so this weight would be inf "
        "there and the programs would compute inf/NaN. The checkpoint is damaged or was not made "
        "for fp16 inference: use a good copy, or rescale the model so every weight fits fp16"
    )


def scan_directory(d: Path, checked: list[tuple[TensorInfo, float]]) -> str:
    """`file_digest(d)`, checking each tensor of `checked` against its limit on the way."""
    from concurrent.futures import ThreadPoolExecutor

    by_file: dict[Path, list] = {}
    for info, limit in checked:
        by_file.setdefault(info.file, []).append((info, limit))
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sha256") as pool:
        scan = _Scan(pool)
        for f in sorted([d / "config.json", *d.glob("*.safetensors")]):
            scan.hash(f.name.encode())
            with open(f, "rb") as fh:
                pos = 0
                for info, limit in sorted(by_file.get(f, ()), key=lambda e: e[0].offset):
                    scan.skip(fh, info.offset - pos)  # header, gaps, unused tensors
                    peak = scan.tensor(fh, info)
                    if not (math.isfinite(peak) and peak <= limit):
                        raise beyond_fp16(info, peak)
                    pos = info.offset + info.nbytes
                scan.skip(fh, None)
        return scan.hexdigest()


def _bits_value(bits: int, unsigned: str, floating: str) -> float:
    import numpy as np

    return float(np.array([bits], unsigned).view(floating)[0])


# dtype -> (unsigned and signed integer view, sign bit, bits of inf, largest |value| of bits):
# one single-threaded integer max per view and block, whatever the float format
_PEAK_BITS = {
    "F32": ("<u4", "<i4", 1 << 31, 0x7F800000, lambda b: _bits_value(b, "<u4", "<f4")),
    "F16": ("<u2", "<i2", 1 << 15, 0x7C00, lambda b: _bits_value(b, "<u2", "<f2")),
    "BF16": ("<u2", "<i2", 1 << 15, 0x7F80, lambda b: _bits_value(b << 16, "<u4", "<f4")),
}


class _Scan:
    """Reads a file block by block into two alternating buffers; each block is hashed by a
    worker thread (hashlib and numpy release the GIL) while the caller checks it, so the check
    costs little beyond the hash the manifest needs anyway."""

    def __init__(self, pool):
        import hashlib

        self._h, self._pool, self._pending = hashlib.sha256(), pool, None
        self._bufs, self._k = [memoryview(bytearray(_SCAN_CHUNK)) for _ in range(2)], 0

    def hash(self, data) -> None:
        """Hash `data` after every block before it (a buffer in use is never refilled: the
        block two reads back is hashed before the next read)."""
        if self._pending is not None:
            self._pending.result()
        self._pending = self._pool.submit(self._h.update, data)

    def read(self, fh, n: int) -> memoryview:
        """Up to `n` bytes of `fh` (hashed in the background)."""
        buf = self._bufs[self._k]
        self._k ^= 1
        view = buf[: fh.readinto(buf[: min(n, len(buf))])]
        self.hash(view)
        return view

    def skip(self, fh, n: int | None) -> None:
        """Hash the next `n` bytes of `fh` (None: to its end)."""
        while n is None or n > 0:
            got = len(self.read(fh, _SCAN_CHUNK if n is None else n))
            if not got:
                return
            if n is not None:
                n -= got

    def tensor(self, fh, info: TensorInfo) -> float:
        """Hash tensor `info`'s bytes (`fh` is at its start) and return its largest |value|
        (inf or NaN when it holds a non-finite value)."""
        import numpy as np

        if isinstance(info, QuantizedTensor):  # FP8 / INT4: its codes times their scales
            return self._quantized_peak(fh, info)
        if info.dtype == "U8":  # MXFP4 (dflash_qaic/mxfp4.py): codes are always finite
            return self._mxfp4_peak(fh, info)
        unsigned, signed, sign, inf, decode = _PEAK_BITS[info.dtype]
        size = np.dtype(unsigned).itemsize
        peak, left = 0, info.nbytes
        while left:
            block = self.read(fh, min(_SCAN_CHUNK - _SCAN_CHUNK % size, left))
            if not block or len(block) % size:
                raise CheckpointError(
                    f"{info.file}: tensor `{info.name}` is cut short; the file changed or is "
                    "truncated; download it again"
                )
            u = np.frombuffer(block, unsigned)
            # |x| orders as the bits without the sign: the largest negative magnitude is the
            # unsigned max (if any sign is set), the largest positive one the signed max
            top, pos = int(u.max()), int(u.view(signed).max())
            peak = max(peak, top - sign if top >= sign else 0, pos)
            left -= len(block)
        if peak > inf:
            return math.nan
        return math.inf if peak == inf else decode(peak)

    def _quantized_peak(self, fh, q: QuantizedTensor) -> float:
        """The largest |dequantized value| of a quantized weight, from its codes read here a
        few rows at a time (hashed on the way) and its scales (small, read beside); NaN as
        soon as a code is NaN (FP8 0x7F / 0xFF) or a scale is not finite."""
        grid, row = scale_grid(q), q.row_bytes
        rows = max(1, _SCAN_CHUNK // max(row, 1))
        peak = 0.0
        for r0 in range(0, q.shape[0], rows):
            n = min(rows, q.shape[0] - r0)
            block = self.read(fh, n * row)
            if len(block) != n * row:
                raise CheckpointError(
                    f"{q.file}: tensor `{q.codes.name}` is cut short; the file changed or is "
                    "truncated; download it again"
                )
            p = rows_peak(q, block, r0, grid)
            if not p <= peak:
                if math.isnan(p):
                    return p
                peak = p
        return peak

    def _mxfp4_peak(self, fh, info: TensorInfo) -> float:
        """An MXFP4 tensor's largest possible |value|: `…_blocks` hold E2M1 codes (at most 6,
        never inf or NaN), so 0 here; `…_scales` the E8M0 exponents, 6 · 2^(max − 127) of
        them (255, E8M0's NaN, reads as NaN)."""
        import numpy as np

        top, left = 0, info.nbytes
        while left:
            block = self.read(fh, min(_SCAN_CHUNK, left))
            if not block:
                raise CheckpointError(
                    f"{info.file}: tensor `{info.name}` is cut short; the file changed or is "
                    "truncated; download it again"
                )
            top = max(top, int(np.frombuffer(block, np.uint8).max()))
            left -= len(block)
        if not info.name.endswith("_scales"):
            return 0.0
        return math.nan if top == 255 else math.ldexp(6.0, top - 127)

    def hexdigest(self) -> str:
        if self._pending is not None:
            self._pending.result()
        return self._h.hexdigest()
