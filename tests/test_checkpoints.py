"""Checkpoint loading and pair validation: one clear error per problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_qaic import checkpoints as ck


def edit_config(directory, **changes):
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            if value is None:
                cfg[outer].pop(inner, None)
            else:
                cfg[outer][inner] = value
        elif value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def edit_tensors(directory, fn):
    path = directory / "model.safetensors"
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path))


def test_good_pair_reads(pair_copy):
    p = ck.read_pair(*pair_copy)
    assert p.target.family == "qwen3"
    assert p.draft.target_layer_ids == (0, 3)
    assert p.draft.block_size == 8 and p.draft.mask_token_id == 255


def test_llama_family(tiny_pair):
    p = ck.read_pair(*tiny_pair(family="llama", target_layer_ids=[1, 2]))
    assert p.target.family == "llama"


def test_default_layer_rule():
    assert ck.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert ck.default_target_layer_ids(36, 1) == [18]
    assert ck.default_target_layer_ids(28, 3) == [1, 13, 25]


def test_default_layer_ids_when_absent(pair_copy):
    _, d = pair_copy
    edit_config(d, **{"dflash_config.target_layer_ids": None})
    cfg = ck.read_draft_config(d)
    assert cfg.target_layer_ids == tuple(ck.default_target_layer_ids(4, 2))


def test_block_size_inside_dflash_config(pair_copy):
    _, d = pair_copy
    edit_config(d, block_size=None, **{"dflash_config.block_size": 16})
    assert ck.read_draft_config(d).block_size == 16


def test_rope_theta_both_spellings(pair_copy):
    t, d = pair_copy
    edit_config(d, rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert ck.read_draft_config(d).rope_theta == 5e5
    assert ck.read_target_config(t).rope_theta == 10000.0


def _raises(match, fn, *args):
    with pytest.raises(ck.CheckpointError, match=match) as e:
        fn(*args)
    return str(e.value)


def test_missing_directory(tmp_path):
    _raises("does not exist", ck.read_target_config, tmp_path / "nope")


def test_missing_config(pair_copy):
    t, d = pair_copy
    (d / "config.json").unlink()
    msg = _raises("config.json is missing", ck.read_pair, t, d)
    assert str(d) in msg


def test_missing_weights(pair_copy):
    t, d = pair_copy
    (t / "model.safetensors").unlink()
    _raises(r"no \*\.safetensors", ck.read_pair, t, d)


def test_unknown_keys_dflash2(pair_copy):
    t, d = pair_copy
    edit_tensors(
        d, lambda s: s.update({"candidate_selector.hidden_projection.weight": torch.zeros(4, 64)})
    )
    msg = _raises("unknown tensor keys", ck.read_pair, t, d)
    assert "candidate_selector.hidden_projection.weight" in msg and "model.safetensors" in msg


def test_missing_keys(pair_copy):
    t, d = pair_copy
    edit_tensors(d, lambda s: s.pop("layers.1.mlp.up_proj.weight"))
    msg = _raises("missing tensor keys", ck.read_pair, t, d)
    assert "layers.1.mlp.up_proj.weight" in msg


def test_wrong_tensor_shape(pair_copy):
    t, d = pair_copy
    edit_tensors(d, lambda s: s.update({"fc.weight": torch.zeros(64, 192)}))
    _raises(r"`fc.weight` has shape \[64, 192\], expected \[64, 128\]", ck.read_pair, t, d)


def test_wrong_architecture(pair_copy):
    t, d = pair_copy
    edit_config(d, architectures=["Qwen3ForCausalLM"])
    _raises("expected \\['DFlashDraftModel'\\]", ck.read_pair, t, d)


def test_unsupported_target(pair_copy):
    t, d = pair_copy
    edit_config(t, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    _raises("not supported", ck.read_pair, t, d)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("num_attention_heads", 8, "`num_attention_heads` is 8 but the target"),
        ("num_key_value_heads", 4, "`num_key_value_heads` is 4 but the target"),
        ("head_dim", 32, "`head_dim` is 32 but the target"),
        ("vocab_size", 512, "`vocab_size` is 512 but the target"),
        ("num_target_layers", 6, "`num_target_layers` is 6 but the target has 4"),
    ],
)
def test_pair_mismatch(pair_copy, field, value, match):
    t, d = pair_copy
    edit_config(d, **{field: value})
    if field in ("num_attention_heads", "head_dim"):
        # keep the tensor layout consistent so the config mismatch is what is reported
        c = ck.read_draft_config(d)
        from dflash_lab.tiny import TinySpec, random_draft_state

        spec = TinySpec(num_heads=c.num_heads, head_dim=c.head_dim, target_layer_ids=[0, 3])
        save_file(random_draft_state(spec, torch.Generator()), str(d / "model.safetensors"))
    if field == "num_key_value_heads":
        from dflash_lab.tiny import TinySpec, random_draft_state

        spec = TinySpec(num_kv_heads=4, target_layer_ids=[0, 3])
        save_file(random_draft_state(spec, torch.Generator()), str(d / "model.safetensors"))
    msg = _raises(match, ck.read_pair, t, d)
    assert str(d / "config.json") in msg


def test_hidden_size_mismatch(pair_copy):
    t, d = pair_copy
    edit_config(t, hidden_size=128, head_dim=16)
    _raises("`hidden_size` is 64 but the target", ck.read_pair, t, d)


def test_layer_ids_out_of_range(pair_copy):
    t, d = pair_copy
    edit_config(d, **{"dflash_config.target_layer_ids": [0, 4]})
    msg = _raises(r"target_layer_ids` \[0, 4\] has ids out of range \[4\]", ck.read_pair, t, d)
    assert "0 … 3" in msg


def test_mask_outside_vocab(pair_copy):
    t, d = pair_copy
    edit_config(d, **{"dflash_config.mask_token_id": 256})
    _raises("mask_token_id` 256 is outside the target's vocabulary", ck.read_pair, t, d)


def test_mask_missing(pair_copy):
    t, d = pair_copy
    edit_config(d, **{"dflash_config.mask_token_id": None})
    _raises("mask_token_id` is missing", ck.read_pair, t, d)


def test_block_size_too_small(pair_copy):
    t, d = pair_copy
    edit_config(d, block_size=1, **{"dflash_config.block_size": 1})
    _raises("`block_size` is 1", ck.read_pair, t, d)


def test_block_size_missing(pair_copy):
    t, d = pair_copy
    edit_config(d, block_size=None, **{"dflash_config.block_size": None})
    _raises("`block_size` is missing", ck.read_pair, t, d)


def test_causal_draft_read(pair_copy):
    t, d = pair_copy
    edit_config(d, is_causal=True)  # causal in the block, every layer (tests/test_sliding.py)
    assert ck.read_pair(t, d).draft.layer_attention(0) == (True, None)


def test_loads_weights(pair_copy):
    p = ck.read_pair(*pair_copy)
    model = ck.load_target_model(p.target)
    state = ck.load_draft_state(p.draft)
    assert model.config.num_hidden_layers == 4
    assert len(state) == 3 + 11 * 2 and all(v.dtype == torch.float32 for v in state.values())
    assert len(ck.file_digest(pair_copy[1])) == 64


def test_fp16_fc_scale():
    w = torch.full((4, 16), 100.0)
    assert ck.fp16_fc_scale(w) == pytest.approx(4 * 400 / 128)
    assert ck.fp16_fc_scale(torch.full((4, 16), 0.01)) == 1.0


# ---------------------------------------------------------------- formats and damage


@pytest.fixture
def sharded(tmp_path):
    """A bf16 target in 3 shards with an index, and its bf16 draft."""
    from dflash_lab.tiny import make_tiny_pair

    return make_tiny_pair(tmp_path, dtype="bfloat16", shards=3, target_layer_ids=[0, 3])


def _index(t):
    return json.loads((t / ck.INDEX_NAME).read_text())


def test_sharded_bf16_pair_reads(sharded):
    p = ck.read_pair(*sharded)
    assert len({i.file for i in p.target_tensors.values()}) == 3
    assert {i.dtype for i in p.target_tensors.values()} == {"BF16"}
    assert set(p.target_tensors) == set(ck.expected_target_shapes(p.target))


def test_missing_shard(sharded):
    t, d = sharded
    (t / "model-00002-of-00003.safetensors").unlink()
    _raises(r"shard model-00002-of-00003.safetensors named by .* is missing", ck.read_pair, t, d)


def test_index_names_absent_tensor(sharded):
    t, d = sharded
    idx = _index(t)
    idx["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00003.safetensors"
    (t / ck.INDEX_NAME).write_text(json.dumps(idx))
    _raises(
        r"names tensor `model.layers.9.mlp.up_proj.weight`.*does not hold it", ck.read_pair, t, d
    )


def test_unlisted_shard(sharded):
    t, d = sharded
    shutil.copy(t / "model-00001-of-00003.safetensors", t / "extra.safetensors")
    _raises(r"extra.safetensors is not listed in model.safetensors.index.json", ck.read_pair, t, d)


def _header_len(path):
    return int.from_bytes(path.read_bytes()[:8], "little")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: b[:4], "shorter than the 8-byte header"),
        (
            lambda b: (2**62).to_bytes(8, "little") + b[8:],
            r"header claims 4611686018427387904 bytes",
        ),
        (lambda b: b[:8] + b"\xff" * 40 + b[48:], "header is not JSON"),
        (lambda b: b[:-100], "data is shorter than declared"),
    ],
    ids=["tiny", "huge-header", "garbage-header", "truncated"],
)
def test_corrupt_safetensors(sharded, damage, match):
    t, d = sharded
    f = t / "model-00003-of-00003.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    msg = _raises(match, ck.read_pair, t, d)
    assert str(f) in msg and "download or save it again" in msg


def test_unsupported_dtype(pair_copy):
    t, d = pair_copy
    edit_tensors(t, lambda s: s.update({"model.norm.weight": s["model.norm.weight"].double()}))
    _raises(
        r"tensor `model.norm.weight` has dtype F64; supported: F32, F16, BF16", ck.read_pair, t, d
    )


def test_target_missing_one_tensor(pair_copy):
    t, d = pair_copy
    edit_tensors(t, lambda s: s.pop("model.layers.2.mlp.down_proj.weight"))
    _raises(r"missing tensor keys \['model.layers.2.mlp.down_proj.weight'\]", ck.read_pair, t, d)


def test_untied_target_without_lm_head(pair_copy):
    t, d = pair_copy
    edit_config(t, tie_word_embeddings=False)
    _raises(r"missing tensor keys \['lm_head.weight'\]", ck.read_pair, t, d)


def test_target_unknown_tensor(pair_copy):
    t, d = pair_copy
    edit_tensors(t, lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    _raises("unknown tensor keys .*model.layers.0.mlp.extra.weight", ck.read_pair, t, d)


def test_target_wrong_shape(pair_copy):
    t, d = pair_copy
    edit_tensors(t, lambda s: s.update({"model.norm.weight": torch.ones(3)}))
    _raises(r"`model.norm.weight` has shape \[3\], expected \[64\]", ck.read_pair, t, d)


def test_config_is_a_list(pair_copy):
    t, d = pair_copy
    (t / "config.json").write_text("[1, 2]")
    _raises("holds a JSON list, not an object", ck.read_pair, t, d)


def test_config_not_utf8(pair_copy):
    t, d = pair_copy
    (d / "config.json").write_bytes(b'{"hidden_size": "\xff\xfe"}')
    _raises("is not UTF-8 text", ck.read_pair, t, d)


@pytest.mark.parametrize("value", [None, 0, -2, 1.5, "64"])
def test_config_bad_field(pair_copy, value):
    t, d = pair_copy
    edit_config(t, num_hidden_layers=0)  # placeholder, replaced below (edit_config drops None)
    cfg = json.loads((t / "config.json").read_text())
    cfg["num_hidden_layers"] = value
    (t / "config.json").write_text(json.dumps(cfg))
    _raises(r"field `num_hidden_layers` is .*; it must be a positive integer", ck.read_pair, t, d)
