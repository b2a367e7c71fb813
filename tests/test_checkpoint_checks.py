"""Checkpoint checks by name and in order: config fields type-checked by name, weights
beyond fp16's range refused while the checkpoint is read (before any tracing), and the root
cause of a bad pair reported first (config before shapes before values)."""

from __future__ import annotations

import json
import math
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file
from test_checkpoints import edit_tensors

from dflash_qaic import checkpoints as ck
from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
from dflash_qaic.exporter import weights

OPTS = dict(ctx_len=48, prefill_seq_len=12, compile=False)


def set_field(directory, dotted: str, value) -> None:
    """Set config field `a.b` of directory/config.json to `value` (JSON null for None)."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    *outer, key = dotted.split(".")
    node = cfg
    for k in outer:
        node = node.setdefault(k, {})
    node[key] = value
    path.write_text(json.dumps(cfg))


def refused(fn, *args) -> str:
    with pytest.raises(ck.CheckpointError) as e:
        fn(*args)
    return str(e.value)


# ---------------------------------------------------------------- config fields by name


BAD_FIELDS = [
    ("draft", "dflash_config.target_layer_ids", [1.5, 3], "list of integers"),
    ("draft", "dflash_config.target_layer_ids", [True, 3], "list of integers"),
    ("draft", "dflash_config.target_layer_ids", ["1", 3], "list of integers"),
    ("draft", "dflash_config.target_layer_ids", ["x", 3], "list of integers"),
    ("draft", "dflash_config.target_layer_ids", 3, "list of integers"),
    ("draft", "dflash_config.mask_token_id", 255.7, "an integer"),
    ("draft", "dflash_config.mask_token_id", True, "an integer"),
    ("draft", "dflash_config", [1], "an object"),
    ("draft", "block_size", "8", "a positive integer"),
    ("draft", "rms_norm_eps", "1e-6", "a positive number"),
    ("draft", "dflash_config.input_embedding_scale", "2", "a finite number"),
    ("target", "rms_norm_eps", "1e-6", "a positive number"),
    ("target", "rope_theta", "10000", "a positive number"),
    ("target", "rope_parameters", {"rope_type": "default", "rope_theta": "1e4"}, "positive"),
    ("target", "num_hidden_layers", 4.0, "a positive integer"),
    ("target", "tie_word_embeddings", "false", "true or false"),
    ("target", "hidden_act", 3, "a string"),
]


@pytest.mark.parametrize(
    "which, field, value, expected",
    BAD_FIELDS,
    ids=[f"{w}-{f}-{json.dumps(v)}" for w, f, v, _ in BAD_FIELDS],
)
def test_config_field_of_the_wrong_type_is_refused_by_name(
    pair_copy, which, field, value, expected
):
    """Not coerced ([1.5, 3] -> [1, 3], 255.7 -> 255), not a bare int() / transformers error:
    the message names the file, the field, the value found and the type expected."""
    d = pair_copy[0] if which == "target" else pair_copy[1]
    set_field(d, field, value)
    msg = refused(ck.read_pair, *pair_copy)
    named = f"{field}.rope_theta" if isinstance(value, dict) else field
    assert str(d / "config.json") in msg and f"`{named}`" in msg, msg
    shown = json.dumps(value["rope_theta"] if isinstance(value, dict) else value)
    assert shown in msg and expected in msg, msg


def test_null_fields_are_absent_fields(pair_copy):
    """Published configs write null for unset optional fields: read as absent, not refused."""
    t, d = pair_copy
    for field in ("rope_scaling", "head_dim", "sliding_window"):
        set_field(t, field, None)
    set_field(d, "dflash_config.final_logit_softcapping", None)
    p = ck.read_pair(t, d)
    assert p.target.head_dim == 16 and p.draft.final_logit_softcapping is None


def test_text_config_field_named_with_its_section(tiny_pair, tmp_path):
    """A hybrid's text model lives under `text_config`: the field is named with it."""
    src = tiny_pair(family="qwen3_5", multimodal=True, target_layer_ids=[1, 3])
    t = tmp_path / "target"
    shutil.copytree(src[0], t)
    set_field(t, "text_config.rms_norm_eps", "1e-6")
    msg = refused(ck.read_pair, t, src[1])
    assert "`text_config.rms_norm_eps`" in msg and str(t / "config.json") in msg


# ---------------------------------------------------------------- root cause first


def test_layer_ids_of_another_target_reported_before_the_fc_shape(pair_copy):
    """A draft whose ids are out of the target's range and whose fc does not fit them: the id
    (a draft made for another target) is the root cause, reported first."""
    t, d = pair_copy
    set_field(d, "dflash_config.target_layer_ids", [0, 9])
    edit_tensors(d, lambda s: s.update({"fc.weight": torch.zeros(64, 192)}))
    msg = refused(ck.read_pair, t, d)
    assert "target_layer_ids` [0, 9] has ids out of range [9]" in msg, msg


def test_pair_mismatch_reported_before_the_draft_shapes(pair_copy):
    """A draft config for another attention shape, its tensors of that shape: the mismatch with
    the target is reported, not the draft's q_proj shape."""
    t, d = pair_copy
    set_field(d, "num_attention_heads", 8)
    msg = refused(ck.read_pair, t, d)
    assert "`num_attention_heads` is 8 but the target" in msg, msg


def test_unsupported_target_config_reported_before_tensor_shapes(pair_copy):
    t, _ = pair_copy
    set_field(t, "hidden_act", "gelu")
    edit_tensors(t, lambda s: s.update({"model.norm.weight": torch.ones(3)}))
    msg = refused(ck.read_pair, *pair_copy)
    assert "hidden_act 'gelu' is not supported" in msg, msg


def test_target_config_reported_before_its_missing_weights(pair_copy):
    t, _ = pair_copy
    set_field(t, "vocab_size", 0)
    (t / "model.safetensors").unlink()
    msg = refused(ck.read_pair, *pair_copy)
    assert "`vocab_size` is 0" in msg, msg


# ---------------------------------------------------------------- weights within fp16's range


def _poke(info: ck.TensorInfo, value: float) -> None:
    with open(info.file, "r+b") as f:
        f.seek(info.offset + info.nbytes // 2)
        dtype = ck.SAFETENSORS_DTYPES[info.dtype]
        f.write(torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes())


POKES = [
    ("target", "model.layers.1.mlp.down_proj.weight", 1e6),
    ("target", "model.embed_tokens.weight", -7e4),
    ("draft", "layers.0.self_attn.k_proj.weight", 1e6),
    ("draft", "hidden_norm.weight", math.inf),
]


@pytest.mark.parametrize("prog, name, value", POKES, ids=[f"{p}-{v:g}" for p, _, v in POKES])
def test_weight_beyond_fp16_refused_before_tracing(
    pair_copy, tmp_path, monkeypatch, prog, name, value
):
    p = ck.read_pair(*pair_copy)
    info = (p.target_tensors if prog == "target" else p.draft_tensors)[name]
    _poke(info, value)
    traced = []
    monkeypatch.setattr(weights, "placeholder_target", lambda *a: traced.append(a))
    with pytest.raises(ck.CheckpointError) as e:
        build_artifacts(*pair_copy, tmp_path / "out", ExportOptions(**OPTS))
    msg = str(e.value)
    assert not traced, "the weights are checked before any tracing"
    assert f"{info.file}: tensor `{info.name}`" in msg, msg
    if math.isfinite(value):
        assert f"{abs(value):g}" in msg and "65,504" in msg and "fp16" in msg, msg
    else:
        assert "inf or NaN" in msg, msg
    assert not (tmp_path / "out").exists()


def test_fp16_limit_is_exact_and_unused_tensors_are_not_checked(pair_copy):
    t, d = pair_copy
    p = ck.read_pair(t, d)
    info = p.target_tensors["model.norm.weight"]
    _poke(info, 65504.0)  # fp16's largest finite value: fits
    edit_tensors(t, lambda s: s.update({"model.rotary_emb.inv_freq": torch.full((8,), 1e9)}))
    p = ck.read_pair(t, d)  # the rewrite moved the offsets
    digests = ck.check_weight_values(p)
    assert digests == {"target": ck.file_digest(t), "draft": ck.file_digest(d)}
    _poke(p.target_tensors["model.norm.weight"], 65505.0)
    assert "65505" in refused(ck.check_weight_values, p)


def test_fc_is_checked_as_the_card_sees_it_scaled(pair_copy, tmp_path):
    """The export divides fc by its fp16 scale (docs/DESIGN.md, fp16): a raw fc element of 1e23
    is not refused; its scale is finite (its squares overflow fp32: the norm is taken in fp64),
    and the programs run finite in fp16."""
    t, d = pair_copy
    p = ck.read_pair(t, d)
    _poke(p.draft_tensors["fc.weight"], 1e23)
    res = build_artifacts(t, d, tmp_path / "out", ExportOptions(**OPTS, fp16_check=True))
    facts = res.manifest["target"]
    assert 1e23 * 128**0.5 / 128 == pytest.approx(facts["fc_scale"], rel=1e-3)
    assert facts["check"]["fp16_runs"] > 0


def test_fc_scale_beyond_fp32_refused_by_name():
    info = ck.TensorInfo(ck.Path("/ckpt/model.safetensors"), "fc.weight", "F32", (2, 4096), 0, 0)
    msg = refused(ck.fp16_fc_scale, torch.full((2, 4096), 3e38), info)
    assert "/ckpt/model.safetensors: tensor `fc.weight`" in msg and "3e+38" in msg, msg
    assert ck.fp16_fc_scale(torch.full((2, 4096), 1e30)) == pytest.approx(64 * 64e30 / 128)


PEAKS = [
    ([1.5, -3.25, 2.0], 3.25),
    ([-1.0, -2.0], 2.0),
    ([-0.0, 0.0], 0.0),
    ([-6e4, 5.0], 6e4),
    ([7.0, -math.inf], math.inf),
    ([math.nan, 1.0], math.nan),
    ([-math.nan, 1.0], math.nan),
]


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize(
    "values, peak", PEAKS, ids=["mixed", "negative", "zeros", "6e4", "-inf", "nan", "-nan"]
)
def test_largest_magnitude_read_from_the_bits(tmp_path, dtype, values, peak):
    """The scan takes |x|'s maximum from the bits (integer maxima, sign cleared): it equals
    torch's abs().max() in every dtype, signs, zeros, inf and NaN (of either sign) included."""
    x = torch.tensor(values, dtype=ck.SAFETENSORS_DTYPES[dtype])
    f = tmp_path / "model.safetensors"
    save_file({"w": x}, str(f))
    (info,) = ck.read_safetensors_header(f).values()
    with open(f, "rb") as fh, ThreadPoolExecutor(1) as pool:
        fh.seek(info.offset)
        got = ck._Scan(pool).tensor(fh, info)
    want = x.float().abs().max().item()
    assert (math.isnan(got) and math.isnan(want)) or got == want == pytest.approx(peak, rel=1e-2)
