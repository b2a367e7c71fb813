"""Random targets in the published quantized forms (`dflash-make-tiny-pair --weight-format`),
written tensor by tensor by dflash_lab/tiny_writer.py (docs/DESIGN.md, Published quantized forms).

- `fp8`: every Linear weight of the decoder layers as DeepSeek-V3 / Kimi / MiniMax-M2 publish
  them: float8_e4m3fn codes beside fp32 `weight_scale_inv` 128 × 128 block scales, the router,
  embedding, head and norms unquantized; `quantization_config` quant_method "fp8" with
  `modules_to_not_convert` naming the router and the head;
- `int4`: the routed experts as Kimi K2-Thinking / K2.5 publish them: compressed-tensors'
  pack-quantized int4 (`weight_packed` / `weight_scale` bf16, groups of 32 / `weight_shape`),
  everything else unquantized; `quantization_config` quant_method "compressed-tensors".

Values are drawn so the dequantized weights are about N(0, 1/in), as tiny.py's recipe: FP8 codes
of N(0, 64²) values times 2^k / (64·√in) block scales, uniform int4 codes (RMS ≈ 4.64) times
2^k / (4.64·√in) group scales, k ∈ {−1, 0, 1} per block.
"""

from __future__ import annotations

import math

import torch

from dflash_qaic.checkpoint_files import fp8, int4

FORMATS = ("plain", "fp8", "int4")
FP8_BLOCK = (128, 128)
INT4_GROUP = 32
FP8_SPREAD, INT4_RMS = 64.0, math.sqrt(21.5)  # RMS of the codes' values (int4: uniform −8 … 7)
# kind -> (safetensors dtype, torch dtype) of the tensors only these forms write
STORED = {
    "fp8": ("F8_E4M3", torch.uint8),
    "fp8_scale": ("F32", torch.float32),
    "int4": ("I32", torch.int32),
    "int4_scale": ("BF16", torch.bfloat16),
    "int4_shape": ("I64", torch.int64),
}


def quantization_config(fmt: str) -> dict | None:
    """config.json's `quantization_config` of a target written in `fmt`."""
    if fmt == "fp8":
        return dict(
            quant_method="fp8",
            fmt="e4m3",
            activation_scheme="dynamic",
            weight_block_size=list(FP8_BLOCK),
            modules_to_not_convert=["gate", "e_score_correction_bias", "lm_head"],
        )
    if fmt == "int4":
        weights = dict(num_bits=4, type="int", symmetric=True, strategy="group")
        weights |= dict(group_size=INT4_GROUP, dynamic=False, actorder=None, observer="minmax")
        group = dict(targets=["Linear"], weights=weights, input_activations=None)
        group |= dict(output_activations=None, format="pack-quantized")
        return dict(
            quant_method="compressed-tensors",
            format="pack-quantized",
            quantization_status="compressed",
            config_groups={"group_0": group},
            ignore=["lm_head", r"re:.*self_attn.*", r"re:.*mlp\.(gate|up|down)_proj$"]
            + [r"re:.*shared_experts.*", r"re:.*mlp\.gate$"],
            kv_cache_scheme=None,
        )
    return None


def _quantized(name: str, fmt: str) -> bool:
    """Whether `fmt` stores Linear weight `name` quantized."""
    if fmt == "fp8":  # the routers (`….gate`) stay unquantized, as published
        return ".layers." in name and not name.endswith(".gate.weight")
    return fmt == "int4" and ".mlp.experts." in name


def quantized_layout(layout, fmt: str) -> list[tuple[str, tuple, str]]:
    """`layout` (name, shape, kind) with the Linear weights `fmt` quantizes replaced by their
    stored parts (kinds of STORED, carrying the dimensions their values need)."""
    if fmt == "plain":
        return list(layout)
    out = []
    for name, shape, kind in layout:
        if kind != "linear" or len(shape) != 2 or not _quantized(name, fmt):
            out.append((name, shape, kind))
            continue
        R, C = shape
        if fmt == "fp8":
            grid = (-(-R // FP8_BLOCK[0]), -(-C // FP8_BLOCK[1]))
            out += [(name, shape, "fp8"), (name + "_scale_inv", grid, f"fp8_scale:{C}")]
        else:
            W, G = -(-C // int4.PER_WORD), -(-C // INT4_GROUP)
            out += [(name + "_packed", (R, W), f"int4:{C}")]
            out += [(name + "_scale", (R, G), f"int4_scale:{C}")]
            out += [(name + "_shape", (2,), f"int4_shape:{R},{C}")]
    if len(out) == len(layout):
        raise ValueError(
            f"--weight-format {fmt}: this target has no weight the form quantizes (fp8: 2-D "
            "Linear weights of the decoder layers; int4: per-expert `mlp.experts.E.*` weights)"
        )
    return out


def check_format(s) -> None:
    """`s.weight_format` (s: a TinySpec) is one this family's writer applies."""
    from dflash_qaic import families

    fam = families.get(s.family)
    if s.weight_format not in FORMATS:
        raise ValueError(f"weight format {s.weight_format!r}: choose from {', '.join(FORMATS)}")
    if s.weight_format != "plain" and fam.tiny_layout in ("mxfp4", "hybrid"):
        raise ValueError(
            f"--weight-format {s.weight_format} is not written for {s.family} (its tiny target "
            "has its own writer; gpt-oss publishes MXFP4 experts)"
        )
    if s.weight_format == "int4" and not fam.moe:
        raise ValueError(f"--weight-format int4 quantizes routed experts; {s.family} has none")


def stored(kind: str):
    """(safetensors dtype, torch dtype) of a kind of STORED, else None."""
    return STORED.get(kind.split(":")[0])


def form_blocks(shape: tuple, kind: str, gen: torch.Generator, block_elems: int):
    """The values of a tensor of a kind of STORED, a block of rows at a time."""
    kind, _, arg = kind.partition(":")
    if kind == "int4_shape":
        yield torch.tensor([int(v) for v in arg.split(",")], dtype=torch.int64)
        return
    C = int(arg) if arg else shape[1]
    rows, cols = shape
    step = max(1, block_elems // max(C, cols))
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        if kind == "fp8":
            yield fp8.encode(FP8_SPREAD * torch.randn(n, cols, generator=gen))
        elif kind == "int4":
            yield int4.pack(torch.randint(-8, 8, (n, C), generator=gen))
        else:
            rms = FP8_SPREAD if kind == "fp8_scale" else INT4_RMS
            k = torch.randint(-1, 2, (n, cols), generator=gen).float()
            yield torch.exp2(k) / (rms * math.sqrt(C))
