"""Multi-head latent attention (modeling/mla.py) and the DeepSeek-V3 family
(families/deepseek_v3.py): the cache is the latent and the RoPE key (kv_lora_rank +
qk_rope_head_dim values per token per layer); the absorbed form equals the expanded one, and the
program equals transformers' `DeepseekV3ForCausalLM` over prefill, verify and decode in each
variant (q through its LoRA or q_proj, interleaved RoPE or not, YaRN with mscale); the grouped
sigmoid routing equals transformers'; the MTP layer is ignored by name, the V3.2 indexer and KDA
layers refused by name. The conformance ladder's `deepseek_v3` case runs the tiny pair end to end.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from spec_loop import program_io
from test_conformance import hf_greedy
from test_target_export import (
    BLOCK,
    VOCAB,
    Runner,
    export_program,
    hf_dims,
    hf_reference,
    margin_ok,
    run_flow,
    session,
)

from dflash_qaic import checkpoints as ck
from dflash_qaic import contract, families
from dflash_qaic.checkpoint_files.safetensors import read_safetensors_header
from dflash_qaic.modeling.mla import latent_attention
from dflash_qaic.modeling.moe import SigmoidMoE

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance asserted (drafts accepted, every length), seeded tokens

LAYER_IDS = [1, 2]
R, DR, DN, DV, NH = 32, 16, 16, 24, 4
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0)
YARN |= dict(mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=128)


def deepseek(seed=0, q_lora_rank=48, rope_interleave=True, yarn=True, n_layers=3):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        **hf_dims(n_layers, num_key_value_heads=NH, head_dim=DR),
        kv_lora_rank=R, q_lora_rank=q_lora_rank, qk_rope_head_dim=DR, qk_nope_head_dim=DN,
        v_head_dim=DV, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, rope_interleave=rope_interleave,
        rope_parameters=YARN if yarn else {"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a router that varies by token, a correction bias that matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("gate.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.3)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.2)
    return model.eval()


def test_cache_holds_the_latent_and_the_rope_key(tmp_path):
    # DeepSeek-V3's published shape: 512 + 64 = 576 values per token per layer
    spec = contract.layer_states(61, 1, 576, latent_dims=(512, 64))[0]
    assert sum(b.shape[-1] for b in spec.buffers) == 576
    e = export_program(deepseek(n_layers=3), LAYER_IDS, tmp_path / "target.onnx")
    io = program_io(e["facts"], e["path"])
    assert io.latent_dims == (R, DR) and len(io.kv) == 2 * 3
    sym = {contract.BATCH: 1, contract.CTX: 64}
    per_token = [int(np.prod(s.bind(**sym))) // 64 for s in io.kv]
    assert per_token == [R, DR] * 3  # r + dr per token per layer, not 2 · heads · head_dim
    assert [type(s).__name__ for s in io.state] == ["LatentAttentionSpec"] * 3


def test_absorbed_equals_expanded():
    """(q_nope W_UK) · c = q_nope · (W_UK c) and W_UV (p · c) = p · (W_UV c), every head."""
    g = torch.Generator().manual_seed(0)
    b, s, L = 2, 3, 7
    q_nope, q_pe = torch.randn(b, NH, s, DN, generator=g), torch.randn(b, NH, s, DR, generator=g)
    lat, pe = torch.randn(b, 1, L, R, generator=g), torch.randn(b, 1, L, DR, generator=g)
    w_uk, w_uv = torch.randn(NH, DN, R, generator=g), torch.randn(NH, DV, R, generator=g)
    mask = torch.where(torch.rand(b, 1, s, L, generator=g) < 0.3, -2048.0, 0.0)
    scale = 0.17
    out = latent_attention(q_nope @ w_uk, q_pe, lat, pe, scale, torch.cat([mask] * NH, dim=2))
    got = (w_uv @ out.transpose(2, 3)).transpose(2, 3)  # [b, nh, s, dv]
    k = torch.cat([torch.einsum("hdr,blr->bhld", w_uk, lat[:, 0]), pe.expand(-1, NH, -1, -1)], -1)
    v = torch.einsum("hdr,blr->bhld", w_uv, lat[:, 0])
    q = torch.cat([q_nope, q_pe], -1)
    want = ((q @ k.transpose(2, 3)) * scale + mask).softmax(-1) @ v
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "variant",
    [dict(), dict(q_lora_rank=None, rope_interleave=False, yarn=False)],
    ids=["q-lora-interleaved-yarn", "q-proj-plain-rope"],
)
def test_program_equals_hf(variant, tmp_path):
    assert_program_equals_hf(deepseek(**variant), LAYER_IDS, tmp_path, seed=1)


def assert_program_equals_hf(model, layer_ids, tmp_path, seed: int) -> None:
    """`model`'s exported program on ONNX Runtime (chunked prefill of 13, a verify block, a
    decode) equals the model: logits, clear argmaxes and fused features."""
    e = export_program(model, layer_ids, tmp_path / "target.onnx", emit_logits=True)
    seq = np.random.default_rng(seed).integers(0, VOCAB, 13 + BLOCK + 1).tolist()
    got = run_flow(Runner(session(str(e["path"])), program_io(e["facts"], e["path"])), seq, 13)
    ref_logits, ref_hidden, _ = hf_reference(model, seq, layer_ids, e["fc"], *e["hn"])
    np.testing.assert_allclose(got[contract.LOGITS], ref_logits, atol=3e-4, rtol=1e-4)
    clear = margin_ok(ref_logits, 1e-3)
    np.testing.assert_array_equal(got[contract.NEXT_TOKENS][clear], ref_logits.argmax(-1)[clear])
    np.testing.assert_allclose(got[contract.HIDDEN_STATES], ref_hidden, atol=2e-4, rtol=1e-4)


@torch.no_grad()
def test_grouped_sigmoid_routing_equals_hf():
    model = deepseek()
    hf = model.model.layers[1].mlp
    ours = SigmoidMoE.from_hf(hf)
    assert (ours.n_group, ours.topk_group, ours.scaling) == (4, 2, 2.5)
    for b, s in [(1, 1), (2, 3), (1, 16)]:
        x = torch.randn(b, s, 64) * 2
        torch.testing.assert_close(ours(x), hf(x), atol=1e-4, rtol=1e-5)
    # the correction bias chooses: dropping it changes the experts of some token
    x = torch.randn(64, 64) * 2
    top_i = ours.route(x)[1]
    ours.bias.data.zero_()
    assert not torch.equal(ours.route(x)[1].sort(-1).values, top_i.sort(-1).values)


def _with_mtp_layer(src, dst, stray: str = ""):
    """A copy of tiny pair target `src` with a multi-token-prediction layer (layer L, as the
    published checkpoints store it) in a second file, and a `stray` tensor there if named."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    state = load_file(dst / "model.safetensors")
    mtp = {
        k.replace(f"layers.{L - 1}.", f"layers.{L}."): v.clone()
        for k, v in state.items()
        if f"layers.{L - 1}." in k
    }
    mtp[f"model.layers.{L}.eh_proj.weight"] = torch.zeros(4, 8)
    if stray:
        mtp[stray] = torch.zeros(4)
    (dst / "model.safetensors").unlink()
    save_file(state, dst / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(mtp, dst / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    files = {"model-00001-of-00002.safetensors": state, "model-00002-of-00002.safetensors": mtp}
    index = {"weight_map": {k: f for f, part in files.items() for k in part}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    return L


def test_mtp_layer_is_ignored_by_name(tiny_pair, tmp_path):
    t, d = tiny_pair(family="deepseek_v3")
    L = _with_mtp_layer(t, tmp_path / "target")
    pair = ck.read_pair(tmp_path / "target", d)
    assert pair.target.spec is families.get("deepseek_v3") and pair.target.num_layers == L
    header = read_safetensors_header(tmp_path / "target" / "model-00002-of-00002.safetensors")
    assert any(k.startswith(f"model.layers.{L}.") for k in header)
    # a stray tensor in a real layer is still refused
    _with_mtp_layer(t, tmp_path / "stray", stray="model.layers.1.self_attn.extra.weight")
    with pytest.raises(
        ck.CheckpointError, match=r"unknown tensor keys .*layers\.1\.self_attn\.extra"
    ):
        ck.read_pair(tmp_path / "stray", d)


@pytest.mark.parametrize(
    "edit, named",
    [
        (dict(model_type="deepseek_v32"), "DeepSeek-V3.2"),
        (dict(index_topk=2048, index_n_heads=64), "indexer .*index_topk"),
        (dict(linear_attn_config={"kda_layers": [1, 2]}), r"KDA\) layers .*linear_attn_config"),
        (dict(model_type="kimi_linear"), "KDA"),
        (dict(topk_method="greedy"), "topk_method.*greedy"),
        (dict(scoring_func="softmax"), "scoring_func.*softmax"),
        (dict(n_group=3), "groups"),
    ],
)
def test_unsupported_variants_refused_by_name(tiny_pair, tmp_path, edit, named):
    assert_refused(tiny_pair, tmp_path, "deepseek_v3", edit, named)


def assert_refused(tiny_pair, tmp_path, family: str, edit: dict, named: str) -> None:
    """The family's tiny pair with `edit` in its target config is refused, naming `named`."""
    t, d = tiny_pair(family=family)
    shutil.copytree(t, tmp_path / "target")
    cfg = json.loads((t / "config.json").read_text()) | edit
    (tmp_path / "target" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ck.CheckpointError, match=named):
        ck.read_pair(tmp_path / "target", d)


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2.5", "minimax-m2.5"])
def test_preset_layout_is_the_published_one(preset):
    """A real-shape preset's tensors are its family's expected ones at the published shape
    (nothing written: the layout alone)."""
    from dflash_lab.tiny import preset_spec
    from dflash_lab.tiny_writer import target_layout

    s = preset_spec(preset, target_layers=3)
    family = families.get(s.family)
    t = family.read(ck.Path("."), family.tiny_config(s).to_dict())
    layout = {name: list(shape) for name, shape, _ in target_layout(s)}
    assert layout == family.expected_shapes(t)
    if s.family == "deepseek_v3":  # 576 cached values per token per layer, at every shape
        assert t.text["kv_lora_rank"] + t.text["qk_rope_head_dim"] == 576
        kv_b = layout["model.layers.0.self_attn.kv_b_proj.weight"]
        assert kv_b == [s.num_heads * 256, 512]


def test_kimi_wrapper_preset_is_the_published_layout():
    """Kimi K2.5's published multimodal wrapper at its real shape (`--preset kimi-k2.5 --family
    kimi_k25 --multimodal`): the text model's tensors under `language_model.*` at the published
    shapes, and besides them only the vision tower's, which the export skips by name."""
    from dflash_lab.tiny import preset_spec
    from dflash_lab.tiny_writer import target_layout

    s = preset_spec("kimi-k2.5", target_layers=3, family="kimi_k25", multimodal=True)
    family = families.get(s.family)
    t = family.read(ck.Path("."), family.tiny_config(s).to_dict())
    layout = {name: list(shape) for name, shape, _ in target_layout(s)}
    expected = family.expected_shapes(t)
    assert {k: layout[k] for k in expected} == expected
    extra = set(layout) - set(expected)
    assert extra and all(k.startswith(("vision_tower.", "mm_projector.")) for k in extra)
    assert layout["language_model.lm_head.weight"] == [163840, 7168]
    assert layout["language_model.model.layers.1.mlp.experts.383.down_proj.weight"] == [7168, 2048]


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m2"])
def test_streamed_bf16_tiny_pair_reads_back_and_exports(tiny_pair, exported, family):
    t, d = tiny_pair(family=family, dtype="bfloat16", shards=2)
    pair = ck.read_pair(t, d)
    assert pair.target.spec is families.get(family)
    art = exported(family, pair=dict(dtype="bfloat16", shards=2), prefill_seq_len=8, ctx_len=64)
    ids = [5, 17, 3, 9, 11]
    tokens = art.load(tokenizer=False).generate(ids, max_new_tokens=12).tokens
    assert tokens == hf_greedy(art.model(), ids, 12)  # the bf16 weights, streamed, lossless


def test_tree_verification_equals_hf_greedy(exported):
    """A tree program of latent layers: each call attends to the cache as it came in plus its
    own rows, and only the accepted path's latent rows are written."""
    pair = dict(tie_word_embeddings=False, target_layer_ids=[1, 3], block_size=4, agree=2.0)
    e = exported("deepseek_v3", pair=pair, prefill_seq_len=8, ctx_len=160, tree_budgets=[8, 16])
    model, pipe = e.model(), e.load(tokenizer=False)
    for seed, (n, new) in enumerate([(3, 30), (13, 25)]):
        ids = torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = hf_greedy(model, ids, new)
        for budget in (16, None):
            pipe.configure(tree_budget=budget)
            res = pipe.generate(ids, max_new_tokens=new, stop_token_ids=[])
            assert res.tokens == want, (n, budget)
            assert max(res.acceptance_lengths) > 1


def test_bf16_buffer_placeholders_stay_distinct_at_large_counts(tiny_pair, tmp_path, monkeypatch):
    """A bf16 checkpoint's buffers (MiniMax-M2's correction bias) get placeholders no other has,
    however many placeholders came before (a large count is not exact in bf16: two marks once
    rounded to one value and the exporter merged the two weights, depending on test order)."""
    import itertools

    from dflash_qaic.artifacts.build import build_artifacts
    from dflash_qaic.exporter import weights
    from dflash_qaic.exporter.options import ExportOptions

    monkeypatch.setattr(weights, "_MARKS", itertools.count(3_000_001))
    a, b = (weights._marked_zeros((8,), torch.bfloat16) for _ in range(2))
    assert not torch.equal(a, b)
    t, d = tiny_pair(family="minimax_m2", dtype="bfloat16", shards=2)
    opts = ExportOptions(prefill_seq_len=8, ctx_len=64, compile=False)
    build_artifacts(t, d, tmp_path / "art", opts, progress=lambda m: None)
    assert (tmp_path / "art" / "manifest.json").exists()
