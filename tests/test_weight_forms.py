"""Weights in their published quantized forms (dflash_qaic/checkpoint_files/quantized.py):
FP8 e4m3 with block scales (DeepSeek-V3 / Kimi / MiniMax-M2) and compressed-tensors' packed
INT4 (Kimi K2-Thinking / K2.5 experts).

The oracle is a decode written here from the formats' definitions (not transformers', whose FP8
path mis-sizes partial edge blocks): e4m3 bits by sign / exponent / mantissa, int4 nibbles from
the low end of each word, the product of code value and block scale taken exactly (float64) and
rounded once to fp32. Tiny targets written in either form (dflash-make-tiny-pair
--weight-format) export to the programs of the same model with the dequantized weights, output
for output; inconsistent checkpoints are refused by tensor name.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_lab.tiny import make_tiny_pair
from dflash_qaic import checkpoints as ck
from dflash_qaic.checkpoint_files import fp8, int4, quantized
from dflash_qaic.checkpoint_files.quantized import QuantForm

# ---------------------------------------------------------------- the oracle


def e4m3_by_definition(code: int) -> float:
    """One E4M3 (fn) byte: sign, 4-bit exponent with bias 7, 3-bit mantissa, subnormals at
    exponent 0, NaN at S.1111.111, no infinities."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * math.ldexp(m, -9)  # m/8 · 2^(1−7)
    return sign * math.ldexp(8 + m, e - 10)  # (1 + m/8) · 2^(e−7)


def int4_by_definition(word: int, i: int) -> int:
    """The i-th signed int4 value of an int32 word (the first in the low nibble, offset 8)."""
    return ((word & 0xFFFFFFFF) >> (4 * i) & 0xF) - 8


def block_oracle(values: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """fp32 [R, C]: values (float64, exact) times the scale of each element's block, exact in
    float64, rounded once to fp32."""
    R, C = values.shape
    out = np.empty((R, C), np.float64)
    for r in range(R):
        for j in range(scale.shape[1]):
            cols = slice(j * block[1], min((j + 1) * block[1], C))
            out[r, cols] = values[r, cols] * float(scale[r // block[0], j])
    return out.astype(np.float32)


def fp8_oracle(codes: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    table = np.array([e4m3_by_definition(c) for c in range(256)], np.float64)
    return block_oracle(table[codes], scale.astype(np.float64), block)


def int4_oracle(words: np.ndarray, cols: int, scale: np.ndarray, group: int) -> np.ndarray:
    q = np.array(
        [[int4_by_definition(int(row[c // 8]), c % 8) for c in range(cols)] for row in words],
        np.float64,
    )
    return block_oracle(q, scale.astype(np.float64), (1, group))


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------- the codes


def test_e4m3_table_is_the_format_definition():
    for code in range(256):
        want, got = e4m3_by_definition(code), float(fp8.E4M3[code])
        if code in fp8.NAN_CODES:
            assert math.isnan(got)
        else:
            assert got == want and math.copysign(1, got) == math.copysign(1, want), hex(code)
    assert fp8.E4M3[0x7E] == 448.0 and fp8.E4M3[0x01] == 2.0**-9  # largest, smallest subnormal
    assert np.isfinite(fp8.E4M3).sum() == 254  # no infinities: every other code is finite


def test_int4_unpacking_order_and_sign():
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, (5, 6), dtype=np.int64).astype(np.int32)
    codes = int4.unpack(words, 45)  # 45 columns: the last word half padding
    want = [[int4_by_definition(int(w[c // 8]), c % 8) for c in range(45)] for w in words]
    assert np.array_equal(codes.astype(np.int64) - 8, np.array(want))
    packed = int4.pack(torch.from_numpy(np.array(want))).numpy()  # the writer's inverse
    assert np.array_equal(packed[:, :5], words[:, :5])  # full words: the same bits
    assert np.array_equal(int4.unpack(packed, 45), codes)  # the last: padding nibbles zero


# ---------------------------------------------------------------- exact dequantization


def _fp8_file(path, shape, block, seed=0, scale_dtype=torch.float32):
    """A safetensors file with one FP8 weight `w.weight` of `shape` (random codes over every
    finite one, subnormals and signed zeros included) and its `w.weight_scale_inv`."""
    g = torch.Generator().manual_seed(seed)
    R, C = shape
    codes = torch.randint(0, 254, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    codes = torch.where(codes >= 0x7F, codes + 1, codes)  # skip 0x7F; 0xFF is out of range
    grid = (-(-R // block[0]), -(-C // block[1]))
    scale = torch.exp2(torch.randint(-24, 2, grid, generator=g).float())
    scale = (scale * (1 + torch.rand(grid, generator=g))).to(scale_dtype)  # full mantissas
    tensors = {"w.weight": codes.view(torch.float8_e4m3fn), "w.weight_scale_inv": scale}
    save_file(tensors, str(path))
    return codes.numpy(), scale.float().numpy()


@pytest.mark.parametrize(
    "shape, block",
    [((192, 64), (128, 128)), ((64, 320), (128, 128)), ((200, 300), (128, 128)),
     ((130, 257), (64, 96)), ((128, 256), (128, 128))],
)  # fmt: skip
def test_fp8_dequantization_is_exact_with_partial_blocks(tmp_path, shape, block):
    """192×64 and 64×320 are the shapes transformers' own dequantization gets wrong (a partial
    edge block); every value equals the oracle's bit for bit, whole, streamed in row blocks
    that cut across scale blocks, and transposed (the program's [in, out] layout)."""
    codes, scale = _fp8_file(tmp_path / "m.safetensors", shape, block)
    want = fp8_oracle(codes, scale, block)
    tensors = ck.read_safetensors_header(tmp_path / "m.safetensors")
    q = quantized.published_tensors(tensors, QuantForm("fp8", block=block), tmp_path)["w.weight"]
    assert q.shape == shape and q.form == "fp8"
    assert same_bits(quantized.dequantize(q), want)
    small = 4 * shape[1] * 7  # 7 rows a block: blocks straddle the 64 / 128-row scale blocks
    assert same_bits(torch.cat(list(quantized.chunks(q, False, small))), want)
    assert same_bits(torch.cat(list(quantized.chunks(q, True, 4 * shape[0] * 5))), want.T)
    assert _scanned_peak(q) == np.abs(want).max()  # the value check's peak, from the codes


def _scanned_peak(q) -> float:
    """The largest |value| the value scan computes for `q` (codes and scales, no weights)."""
    raw = quantized.read_bytes(q.codes, 0, q.codes.nbytes)
    return quantized.rows_peak(q, raw, 0, quantized.scale_grid(q))


def test_int4_dequantization_is_exact(tmp_path):
    """compressed-tensors' pack-quantized weight [R, C] with C not a multiple of 8 nor of the
    group: equal to the oracle, whole and transposed, with bf16 and fp16 scales."""
    g = torch.Generator().manual_seed(1)
    R, C, group = 37, 45, 16
    q = torch.randint(-8, 8, (R, C), generator=g)
    for dtype in (torch.bfloat16, torch.float16):
        scale = (torch.rand(R, -(-C // group), generator=g) * 0.1 + 1e-3).to(dtype)
        words = int4.pack(q)
        save_file(
            {"e.weight_packed": words, "e.weight_scale": scale,
             "e.weight_shape": torch.tensor([R, C])},
            str(tmp_path / "m.safetensors"),
        )  # fmt: skip
        tensors = ck.read_safetensors_header(tmp_path / "m.safetensors")
        form = QuantForm("compressed-tensors", group=group)
        qt = quantized.published_tensors(tensors, form, tmp_path)["e.weight"]
        want = int4_oracle(words.numpy(), C, scale.float().numpy(), group)
        assert qt.shape == (R, C) and same_bits(quantized.dequantize(qt), want)
        assert same_bits(torch.cat(list(quantized.chunks(qt, True, 4 * R * 3))), want.T)
        assert _scanned_peak(qt) == np.abs(want).max()


# ---------------------------------------------------------------- tiny targets in these forms

FORMS = {
    "qwen3-fp8-bf16-sharded": dict(family="qwen3", weight_format="fp8", dtype="bfloat16", shards=3),
    "qwen3_moe-fp8": dict(family="qwen3_moe", weight_format="fp8"),
    "qwen3_moe-int4": dict(family="qwen3_moe", weight_format="int4"),
    # latent attention: W_UK / W_UV are row slices of an FP8 kv_b_proj (quantized.row_slice)
    "deepseek_v3-fp8": dict(family="deepseek_v3", weight_format="fp8"),
}


@pytest.fixture(scope="module", params=sorted(FORMS))
def quantized_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    t, d = make_tiny_pair(root, target_layer_ids=[1, 2], **FORMS[request.param])
    return ck.read_pair(t, d)


def test_published_form_exports_the_dequantized_model(quantized_pair, tmp_path):
    """The streamed export of the quantized checkpoint (dequantized a block at a time) equals,
    output for output (tokens included), the in-memory export of the same model loaded with
    the dequantized weights; those weights are the oracle's."""
    from test_streaming_export import _in_memory, _streamed, assert_same_outputs

    pair = quantized_pair
    stored = {n: i for n, i in pair.target_tensors.items() if isinstance(i, ck.QuantizedTensor)}
    assert stored and all(".layers." in n for n in stored)  # embedding, head, norms plain
    model, tf_a, df_a = _in_memory(pair, tmp_path / "a")
    tf_b, df_b = _streamed(pair, tmp_path / "b")
    assert_same_outputs("target", tf_a, tf_b, pair)
    assert_same_outputs("draft", df_a, df_b, pair)
    sd = model.state_dict()
    names = [next(iter(stored)), sorted(stored)[-1]]  # the first and a last one
    if len({i.file for i in pair.target_tensors.values()}) > 1:  # sharded: a scale elsewhere
        split = [n for n, q in stored.items() if q.codes.file != q.scale.file]
        assert split, "no weight has its scale in another shard: the case is not covered"
        names.append(split[0])
    for name in names:
        assert same_bits(_loaded(sd, name), _oracle(stored[name])), name


def _loaded(sd: dict, name: str) -> np.ndarray:
    """Weight `name` of a loaded model's state dict; an expert's out of Hugging Face's fused
    experts ([E, 2I, H] gate then up; [E, H, I])."""
    if name in sd:
        return sd[name].numpy()
    layer, rest = name.split(".mlp.experts.")
    e, proj = int(rest.split(".")[0]), rest.split(".")[1]
    if proj == "down_proj":
        return sd[f"{layer}.mlp.experts.down_proj"][e].numpy()
    gate, up = sd[f"{layer}.mlp.experts.gate_up_proj"][e].chunk(2)
    return (gate if proj == "gate_proj" else up).numpy()


def _oracle(q: ck.QuantizedTensor) -> np.ndarray:
    """The oracle's decode of a checkpoint's quantized weight, from its raw tensors."""
    codes = load_file(str(q.codes.file))[q.codes.name]
    scale = load_file(str(q.scale.file))[q.scale.name].float().numpy()
    if q.form == "fp8":
        return fp8_oracle(codes.view(torch.uint8).numpy(), scale, q.block)
    return int4_oracle(codes.numpy(), q.shape[1], scale, q.block[1])


# ---------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("fp8"), family="qwen3", weight_format="fp8")


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    return make_tiny_pair(root, family="qwen3_moe", weight_format="int4")


def _edited(src, dst, drop=(), add=None, config=None):
    """A copy of target directory `src` without tensors `drop`, with tensors `add`, and
    `config` merged into its quantization_config (None: removed) / config.json (`…` keys)."""
    shutil.copytree(src, dst)
    state = {k: v for k, v in load_file(str(dst / "model.safetensors")).items() if k not in drop}
    save_file(state | (add or {}), str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in (config or {}).items():
        if k == "quantization_config" and v is None:
            cfg.pop(k)
        elif k == "quantization_config":
            cfg[k] = cfg[k] | v
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


Q0 = "model.layers.0.self_attn.q_proj.weight"
E0 = "model.layers.0.mlp.experts.1.down_proj.weight"
FP8_CASES = {
    "no scale": (dict(drop=(Q0 + "_scale_inv",)), f"`{Q0}` has no `{Q0}_scale_inv`"),
    "scale shape": (
        dict(add={Q0 + "_scale_inv": torch.ones(2, 1)}),
        rf"`{Q0}_scale_inv` has shape \[2, 1\], expected \[1, 1\]",
    ),
    "unknown method": (
        dict(config={"quantization_config": {"quant_method": "awq"}}),
        "quant_method` 'awq' is not supported; supported: fp8",
    ),
    "no config": (
        dict(config={"quantization_config": None}),
        "is stored float8_e4m3fn but config.json's `quantization_config.quant_method` is None",
    ),
    "kept module": (
        dict(
            config={"quantization_config": {"modules_to_not_convert": ["model.layers.0.self_attn"]}}
        ),
        r"keeps module `model.layers.0.self_attn.[qkvo]_proj` unquantized",
    ),
    "orphan scale": (
        dict(add={"model.norm.weight_scale_inv": torch.ones(1, 1)}),
        r"`model.norm.weight_scale_inv` scales `model.norm.weight`, which is not float8",
    ),
    "block size": (
        dict(config={"quantization_config": {"weight_block_size": [128]}}),
        "weight_block_size` is \\[128\\]; supported: two positive integers",
    ),
}
INT4_CASES = {
    "no shape": (dict(drop=(E0 + "_shape",)), f"`{E0}_packed` has no `{E0}_shape`"),
    "8 bits": (
        dict(
            config={"quantization_config": {"config_groups": {"g": {"weights": {"num_bits": 8}}}}}
        ),
        "config_groups.g.weights.num_bits` is 8",
    ),
    "ignored experts": (
        dict(config={"quantization_config": {"ignore": ["re:.*experts.*"]}}),
        "`quantization_config.ignore` keeps module",
    ),
}


@pytest.mark.parametrize("case", sorted(FP8_CASES) + sorted(INT4_CASES))
def test_inconsistent_checkpoints_are_refused_by_name(fp8_dirs, int4_dirs, tmp_path, case):
    (t, d), (edit, message) = (
        (fp8_dirs, FP8_CASES[case]) if case in FP8_CASES else (int4_dirs, INT4_CASES[case])
    )
    bad = _edited(t, tmp_path / "t", **edit)
    with pytest.raises(ck.CheckpointError, match=message):
        ck.read_pair(bad, d)


def _poke(info, offset: int, data: bytes) -> None:
    with open(info.file, "r+b") as f:
        f.seek(info.offset + offset)
        f.write(data)


def test_nan_codes_and_values_beyond_fp16_are_refused(fp8_dirs, tmp_path):
    """An FP8 NaN code (0x7F / 0xFF) and a block whose dequantized values pass fp16's 65,504
    are refused before any tracing, naming the weight; the same check passes the clean copy."""
    t, d = fp8_dirs
    ck.check_weight_values(ck.read_pair(t, d))
    for code in (0x7F, 0xFF):
        bad = _edited(t, tmp_path / f"nan{code}")
        q = ck.read_pair(bad, d).target_tensors[Q0]
        _poke(q.codes, 3 * q.shape[1] + 5, bytes([code]))
        with pytest.raises(ck.CheckpointError, match=rf"`{Q0}` holds inf or NaN"):
            ck.check_weight_values(ck.read_pair(bad, d))
    big = _edited(t, tmp_path / "big")
    pair = ck.read_pair(big, d)
    q = pair.target_tensors[Q0]
    _poke(q.codes, 0, bytes([0x7E]))  # 448
    _poke(q.scale, 0, np.array([150.0], np.float32).tobytes())  # 448 · 150 = 67,200
    with pytest.raises(ck.CheckpointError, match=rf"`{Q0}` holds values up to .*67200.*65,504"):
        ck.check_weight_values(ck.read_pair(big, d))


def test_a_quantized_draft_is_refused(fp8_dirs, tmp_path):
    t, d = fp8_dirs
    dd = tmp_path / "draft"
    shutil.copytree(d, dd)
    state = load_file(str(dd / "model.safetensors"))
    state["norm.weight"] = state["norm.weight"].to(torch.float8_e4m3fn)
    save_file(state, str(dd / "model.safetensors"))
    with pytest.raises(ck.CheckpointError, match="`norm.weight` is stored quantized"):
        ck.read_pair(t, dd)


def test_multi_token_prediction_layer_is_ignored_by_name(fp8_dirs, tmp_path):
    """DeepSeek-V3's MTP layer (layer num_hidden_layers, FP8 like the others) is left out by
    name when `num_nextn_predict_layers` declares it, and refused as unknown otherwise."""
    t, d = fp8_dirs
    L = json.loads((t / "config.json").read_text())["num_hidden_layers"]
    state = load_file(str(t / "model.safetensors"))
    mtp = {k.replace("layers.0.", f"layers.{L}."): v for k, v in state.items() if ".layers.0." in k}
    mtp[f"model.layers.{L}.eh_proj.weight"] = torch.zeros(64, 128)
    with_mtp = _edited(t, tmp_path / "mtp", add=mtp, config={"num_nextn_predict_layers": 1})
    pair = ck.read_pair(with_mtp, d)
    assert not any(f"layers.{L}." in n for n in pair.target_tensors)
    ck.check_weight_values(pair)
    undeclared = _edited(t, tmp_path / "undeclared", add=mtp)
    with pytest.raises(ck.CheckpointError, match=f"unknown tensor keys.*layers.{L}"):
        ck.read_pair(undeclared, d)


def test_writer_layout_and_refusals():
    """--weight-format fp8 at Qwen3-4B's shapes: every decoder Linear as codes + a ⌈R/128⌉ ×
    ⌈C/128⌉ scale grid, embedding and norms as they were; formats a family's writer cannot
    apply are refused by name."""
    from dflash_lab.tiny import TinySpec, preset_spec
    from dflash_lab.tiny_forms import quantized_layout
    from dflash_lab.tiny_writer import target_layout

    s = preset_spec("qwen3-4b", target_layers=2, weight_format="fp8")
    layout = {n: (shape, kind) for n, shape, kind in quantized_layout(target_layout(s), "fp8")}
    q = "model.layers.1.mlp.down_proj.weight"
    assert layout[q] == ((2560, 9728), "fp8")
    assert layout[q + "_scale_inv"] == ((20, 76), "fp8_scale:9728")
    assert layout["model.embed_tokens.weight"][1] == "embed"
    assert not any(
        n.startswith("model.norm") and k.startswith("fp8") for n, (_, k) in layout.items()
    )
    with pytest.raises(ValueError, match="int4 quantizes routed experts; qwen3 has none"):
        TinySpec(family="qwen3", weight_format="int4")
    with pytest.raises(ValueError, match="not written for gpt_oss"):
        TinySpec.of("gpt_oss", weight_format="fp8")
    with pytest.raises(ValueError, match="choose from plain, fp8, int4"):
        TinySpec(weight_format="fp4")


def test_export_of_a_quantized_target_with_its_mtp_layer(int4_dirs, tmp_path):
    """`dflash-export`'s path (checks, placeholders, streamed programs, manifest) on the INT4
    MoE target with a multi-token-prediction layer beside its decoder: the artifacts run, and
    the fused experts' shapes are refused for --weight-format int4 (nothing to quantize)."""
    from dflash_lab.tiny import TinySpec
    from dflash_lab.tiny_forms import quantized_layout
    from dflash_lab.tiny_writer import target_layout
    from dflash_qaic.artifacts.build import ExportOptions, build_artifacts

    t, d = int4_dirs
    L = json.loads((t / "config.json").read_text())["num_hidden_layers"]
    state = load_file(str(t / "model.safetensors"))
    mtp = {k.replace("layers.0.", f"layers.{L}."): v for k, v in state.items() if ".layers.0." in k}
    target = _edited(t, tmp_path / "t", add=mtp, config={"num_nextn_predict_layers": 1})
    opts = ExportOptions(ctx_len=48, prefill_seq_len=12, compile=False, fp16_check=False)
    res = build_artifacts(target, d, tmp_path / "out", opts)
    assert (tmp_path / "out" / "target" / "target.onnx").is_file() and res.manifest["target"]
    fused = TinySpec.of("qwen3_moe", fused_experts=True, weight_format="int4")
    with pytest.raises(ValueError, match="no weight the form quantizes"):
        quantized_layout(target_layout(fused), "int4")
