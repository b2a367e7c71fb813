"""gpt-oss targets (modeling/gpt_oss.py) and MXFP4 expert weights (dflash_qaic/mxfp4.py).

A tiny random `GptOssForCausalLM` (hidden 64, 4 layers alternating sliding (window 4) and full,
8 experts top-4 with router and expert biases, attention biases and sinks, YaRN): the exported
program on ONNX Runtime against Hugging Face over chunked prefill, a verify block and a decode;
MXFP4 dequantization against transformers' own, in memory and streamed from a safetensors file;
the family (dflash_qaic/families/gpt_oss.py) from its checkpoints: the published MXFP4 form and
the bf16 form, streamed export = in-memory export. The conformance ladder's `gpt_oss` case
(tests/test_conformance.py) runs the tiny MXFP4 pair end to end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from spec_loop import program_io
from test_target_export import (
    BLOCK,
    CHUNK,
    CTX,
    VOCAB,
    Runner,
    export_program,
    faithful_flows,
    hf_dims,
    hf_reference,
    make_draft_side,
    margin_ok,
    run_flow,
    session,
)

from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.exporter.target import export_target
from dflash_qaic.modeling.gpt_oss import GptOssMoE
from dflash_qaic.modeling.target import ExportTarget
from dflash_qaic.mxfp4 import dequantize, dequantize_file, mxfp4_chunks

H, E, K, INTER, WINDOW = 64, 8, 4, 32, 4
LAYER_IDS = [1, 3]


def gpt_oss_config(n_layers=4):
    from transformers import GptOssConfig

    cfg = GptOssConfig(
        **hf_dims(n_layers, intermediate_size=INTER, max_position_embeddings=256),
        num_local_experts=E,
        num_experts_per_tok=K,
        sliding_window=WINDOW,
        rope_parameters=dict(
            rope_type="yarn",
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=64,
            rope_theta=150000.0,
        ),
    )
    cfg._attn_implementation = "eager"
    return cfg


def make_gpt_oss(seed=0, n_layers=4):
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(gpt_oss_config(n_layers))
    with torch.no_grad():  # biases, sinks and a router that varies by token; experts that clamp
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.3)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


@pytest.fixture(scope="module")
def gpt_oss_model():
    return make_gpt_oss()


# ---------------------------------------------------------------- the MoE block


@torch.no_grad()
def test_moe_block_matches_hf(gpt_oss_model):
    hf = gpt_oss_model.model.layers[0].mlp
    ours = GptOssMoE.from_hf(hf)
    clamped = False
    for b, s in [(1, 1), (2, 1), (1, 3), (1, 16), (3, 7)]:
        x = torch.randn(b, s, H) * 3
        gu = x.reshape(-1, H) @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
        clamped |= bool((gu.abs() > hf.experts.limit).any())
        torch.testing.assert_close(ours(x), hf(x)[0], atol=2e-5, rtol=1e-5)
    assert clamped, "the inputs never reach the SwiGLU clamp: the test would not see it"


# ---------------------------------------------------------------- the program against HF


@pytest.fixture(scope="module")
def target_program(gpt_oss_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "target.onnx"
    e = export_program(gpt_oss_model, LAYER_IDS, path, emit_logits=True)
    io = program_io(e["facts"], path)
    assert io.ring_slots == (WINDOW + CHUNK, 0, WINDOW + CHUNK, 0)  # sliding layers: rings
    return dict(e, io=io)


@pytest.mark.parametrize("prompt_len", [21, 13])
def test_prefill_verify_decode_match_hf(target_program, prompt_len):
    e = target_program
    rng = np.random.default_rng(prompt_len)
    seq = rng.integers(0, VOCAB, prompt_len + BLOCK + 1).tolist()
    got = run_flow(Runner(session(str(e["path"])), e["io"]), seq, prompt_len)
    ref_logits, ref_hidden, _ = hf_reference(e["model"], seq, LAYER_IDS, e["fc"], *e["hn"])
    np.testing.assert_allclose(got[contract.LOGITS], ref_logits, atol=2e-4, rtol=1e-4)
    clear = margin_ok(ref_logits, 1e-3)
    assert clear.sum() >= len(seq) - 2
    np.testing.assert_array_equal(got[contract.NEXT_TOKENS][clear], ref_logits.argmax(-1)[clear])
    np.testing.assert_allclose(got[contract.HIDDEN_STATES], ref_hidden, atol=1e-4, rtol=1e-4)
    assert e["facts"]["model_type"] == "gpt_oss"


def test_cost_profile_counts_each_calls_experts(target_program):
    """The AI100 cost profile (bench/project.py count_graph) sees a call's experts as gathered
    rows: a call of n rows reads U = min(n·k, E) experts per layer (their weights and biases),
    never all E, which a verify-length choice then weighs (docs/DESIGN.md, A verify's experts;
    the union arithmetic E·(1 − (1 − k/E)^n) is what independently routed rows touch)."""
    import onnx

    from dflash_qaic.bench.project import count_graph

    model = onnx.load(str(target_program["path"]), load_external_data=False)
    per_expert = 2 * INTER * H + H * INTER + 2 * INTER + H  # gate_up, down and their biases
    ctx = {contract.BATCH: 1, contract.CTX: CTX, contract.CCL: CTX, contract.SAMPLE: 1}
    for n in (1, 2, 4):
        g = count_graph(model, {**ctx, contract.SEQ: n})
        assert len(g.layers) == 4
        for part in g.layers.values():
            assert part.gathered == min(n * K, E) * per_expert
        assert E * (1 - (1 - K / E) ** n) <= min(n * K, E)  # the union never exceeds U


@torch.no_grad()
def test_window_hides_old_keys(gpt_oss_model):
    """A sliding layer's output does not depend on keys W or more positions back; a full layer's
    does (so the mask, not luck, makes the comparison with HF pass)."""
    fc, hn_w, hn_eps = make_draft_side(len(LAYER_IDS))
    t = ExportTarget.from_hf(
        gpt_oss_model, fc, hn_w, hn_eps, LAYER_IDS, ctx_len=CTX, sampling=False
    )
    calls = t.call(torch.arange(10)[None], None, torch.arange(CTX)).attention
    sliding, full = calls["sliding_attention"].mask, calls["full_attention"].mask
    assert sliding.shape == full.shape == (1, 1, 2 * 10, CTX)
    row = 9  # position 9 sees 6 … 9 (sliding) and 0 … 9 (full)
    assert (sliding[0, 0, row, :10] == 0).tolist() == [False] * 6 + [True] * 4
    assert (full[0, 0, row, :10] == 0).all()


def test_refuses_unknown_layer_kind(gpt_oss_model):
    fc, hn_w, hn_eps = make_draft_side(len(LAYER_IDS))
    cfg = gpt_oss_model.config
    saved = list(cfg.layer_types)
    cfg.layer_types = ["chunked_attention"] + saved[1:]
    try:
        with pytest.raises(ValueError, match="layer_types"):
            ExportTarget.from_hf(gpt_oss_model, fc, hn_w, hn_eps, LAYER_IDS, ctx_len=CTX)
    finally:
        cfg.layer_types = saved


def test_tree_verification_is_refused_by_name(gpt_oss_model, tmp_path):
    """`--tree-budgets` on a gpt-oss target: refused at export, by name, before tracing (block
    verification works: tests/test_block_verify.py)."""
    fc, hn_w, hn_eps = make_draft_side(len(LAYER_IDS))
    with pytest.raises(
        ValueError, match=r"^tree verification .*sliding-window.* by chain or block"
    ):
        export_target(
            gpt_oss_model, fc, hn_w, hn_eps, LAYER_IDS, tmp_path / "target.onnx", ctx_len=CTX,
            prefill_seq_len=CHUNK, block_size=BLOCK, verify_rule="tree",
        )  # fmt: skip
    assert not (tmp_path / "target.onnx").exists()


# ---------------------------------------------------------------- MXFP4


def packed(shape, seed=0):
    """Random MXFP4 codes and scales: blocks uint8 [..., G, 16], scales uint8 [..., G] spanning
    2^-10 … 2^8 (all 16 codes, both nibbles)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(117, 136, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


def test_mxfp4_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = packed((3, 8, 4))  # [E, R, G, 16]: E 3, R 8 rows, 128 columns
    ours = dequantize(blocks, scales)  # [E, R, C]
    assert ours.shape == (3, 8, 128) and ours.dtype == torch.float32
    # transformers returns the experts' [E, C, R] layout; in fp32 and in bf16 (every value exact)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours.transpose(1, 2), ref)
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales).float())
    # one code by hand: low nibble 0b0111 (6.0), high nibble 0b1001 (-0.5), scale 2^(130-127)
    b, s = torch.tensor([[[0x97] + [0] * 15]], dtype=torch.uint8), torch.tensor([[130]]).byte()
    assert dequantize(b, s)[0, :2].tolist() == [48.0, -4.0]


def test_mxfp4_streamed_from_file(tmp_path):
    from safetensors.torch import save_file

    blocks, scales = packed((2, 12, 3), seed=1)
    path = tmp_path / "experts.safetensors"
    save_file({"w_blocks": blocks, "w_scales": scales, "other": torch.ones(3)}, str(path))
    infos = ck.read_safetensors_header(path)
    b, s = infos["w_blocks"], infos["w_scales"]
    whole = dequantize(blocks, scales)
    # chunks of 5 rows (5 · 96 · 4 bytes): bounded memory, the same values in order
    chunks = list(mxfp4_chunks(b, s, chunk_bytes=5 * 96 * 4))
    assert [c.shape[0] for c in chunks] == [5, 5, 5, 5, 4]
    assert torch.equal(torch.cat(chunks), whole.reshape(-1, 96))
    assert torch.equal(dequantize_file(b, s), whole)
    with pytest.raises(ValueError, match="`other` has dtype F32, expected U8"):
        list(mxfp4_chunks(b, infos["other"]))
    with pytest.raises(ValueError, match="do not match"):
        list(mxfp4_chunks(b, b))


# ---------------------------------------------------------------- fp16 with a massive channel


@pytest.mark.slow
@torch.no_grad()
def test_fp16_faithful_with_a_massive_channel(tmp_path):
    """Trigger tokens carry ~3000 in one residual channel through sinks, routers and the clamped
    experts: the fp16-faithful program gives the fp32 tokens, nothing near fp16's limit."""
    from test_fp16 import CH, TRIGGERS, assert_same_tokens

    model = make_gpt_oss()
    model.model.embed_tokens.weight[TRIGGERS, CH] = 3000.0
    model.model.norm.weight[CH] = 0.05
    for got, (logits, hidden, out) in faithful_flows(model, LAYER_IDS, tmp_path / "target.onnx"):
        assert float(out.hidden_states[2][0, :, CH].abs().max()) > 2000.0
        assert_same_tokens(got[contract.NEXT_TOKENS], logits)
        np.testing.assert_allclose(got[contract.HIDDEN_STATES], hidden, atol=0.05, rtol=0.02)


# ---------------------------------------------------------------- lossless decoding


def test_speculative_decoding_equals_hf_generate(target_program):
    """Whatever a block's acceptance (0 … B − 1 proposals kept), the committed tokens are
    Hugging Face's greedy `generate`, the sliding layers' windows crossing rolled-back slots."""
    from spec_loop import hf_greedy, speculate

    prompt = np.random.default_rng(7).integers(0, VOCAB, 11).tolist()
    n = 24
    ref = hf_greedy(target_program["model"], prompt, n)
    got, accepted = speculate(
        Runner(session(str(target_program["path"])), target_program["io"]), prompt, ref, n
    )
    assert got == ref
    assert set(accepted) == set(range(BLOCK))  # every acceptance length occurred


def test_batched_equals_solo(target_program):
    from spec_loop import assert_batched_equals_solo

    assert_batched_equals_solo(session(str(target_program["path"])), target_program["io"])


# ---------------------------------------------------------------- draft knobs


def _draft_copy(tiny_pair, tmp_path, **config):
    """A copy of a tiny qwen3 pair's draft with `config` merged into its config.json."""
    import json
    import shutil

    _, d = tiny_pair(vocab_size=64, tie_word_embeddings=False, target_layer_ids=[1, 3])
    out = tmp_path / "draft"
    shutil.copytree(d, out)
    cfg = json.loads((out / "config.json").read_text())
    for k, v in config.items():
        if isinstance(v, dict):
            cfg.setdefault(k, {}).update(v)
        else:
            cfg[k] = v
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@torch.no_grad()
def test_draft_attention_bias_equals_reference(tiny_pair, tmp_path):
    """`attention_bias` (q/k/v/o biases, as gpt-oss drafts have): read from the config, the
    biases required in the checkpoint, and the draft's forward equal to the reference model's."""
    from dflash.model import DFlashDraftModel
    from safetensors.torch import load_file, save_file

    from dflash_qaic.modeling.draft import DFlashDraft

    d = _draft_copy(tiny_pair, tmp_path, attention_bias=True)
    c = ck.read_draft_config(d)
    assert c.attention_bias
    with pytest.raises(ck.CheckpointError, match="missing tensor keys.*q_proj.bias"):
        ck.check_draft_tensors(c)
    state = load_file(str(d / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for name in [k for k in state if k.endswith("_proj.weight") and ".self_attn." in k]:
        state[name.replace(".weight", ".bias")] = torch.randn(state[name].shape[0], generator=gen)
    save_file(state, str(d / "model.safetensors"))
    ck.check_draft_tensors(c)
    ours = DFlashDraft.from_checkpoint(c, ck.load_draft_state(c))
    ref = DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
    n, B, H = 9, c.block_size, c.hidden_size
    feats = torch.randn(1, n, H * len(c.target_layer_ids), generator=gen)
    emb = torch.randn(1, B, H, generator=gen)
    pos = torch.arange(n + B)[None]
    a = ours(ours.fuse(feats), pos[:, :n], emb, pos[:, n:])
    torch.testing.assert_close(a, ref(position_ids=pos, noise_embedding=emb, target_hidden=feats))
    for layer in ours.layers:  # the biases matter
        layer.self_attn.q_proj.bias.zero_()
    assert (ours(ours.fuse(feats), pos[:, :n], emb, pos[:, n:]) - a).abs().max() > 1e-3


# ---------------------------------------------------------------- from the checkpoints


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    """The tiny gpt-oss pair in the published on-disk form (dflash-make-tiny-pair --family
    gpt_oss: MXFP4 experts, a draft with attention biases)."""
    from dflash_lab.tiny import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("gpt_oss_pair"), family="gpt_oss", agree=3.0)


def _copy_target(src, dst, drop=(), edit=None, config=None):
    """A copy of target directory `src` without the tensors `drop`, each tensor through `edit`
    (name, tensor) -> tensor, and `config` merged into its config.json."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    state = {k: (edit(k, v) if edit else v) for k, v in state.items() if k not in drop}
    save_file(state, str(dst / "model.safetensors"))
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        for k, v in config.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_checkpoint_reads_as_gpt_oss(mxfp4_pair, tmp_path):
    """The published form reads as the gpt_oss family (MXFP4 experts, sinks, router biases);
    an incomplete checkpoint, an unknown quantization and an E8M0 NaN scale are refused by
    name before any tracing."""
    from dflash_qaic import families

    t, d = mxfp4_pair
    pair = ck.read_pair(t, d)
    assert pair.target.spec is families.get("gpt_oss") and pair.target.moe.top_k == 4
    assert pair.draft.attention_bias and pair.draft.block_size == 8
    blocks = "model.layers.2.mlp.experts.down_proj_blocks"
    assert pair.target_tensors[blocks].dtype == "U8"
    assert list(pair.target_tensors[blocks].shape) == [8, 64, 2, 16]  # [E, H, I/32, 16]
    ck.check_weight_values(pair)
    scales = "model.layers.1.mlp.experts.gate_up_proj_scales"
    cut = _copy_target(t, tmp_path / "cut", drop=(scales,))
    with pytest.raises(ck.CheckpointError, match=f"missing.*{scales}"):
        ck.read_pair(cut, d)
    fp8 = _copy_target(t, tmp_path / "fp8", config={"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ck.CheckpointError, match="quant_method` 'fp8' is not supported"):
        ck.read_pair(fp8, d)

    def nan_scale(name, v):
        if name == scales:
            v = v.clone()
            v[0, 0, 0] = 255  # E8M0's NaN
        return v

    bad = _copy_target(t, tmp_path / "nan", edit=nan_scale)
    with pytest.raises(ck.CheckpointError, match=f"`{scales}`.*inf/NaN|`{scales}`"):
        ck.check_weight_values(ck.read_pair(bad, d))


def test_preset_layout_is_the_published_one(tmp_path):
    """--preset gpt-oss-20b (shapes only, nothing written): every tensor the family expects
    at the published shapes, MXFP4 experts, nothing else; --target-layers keeps the first
    layers and the draft's taps among them."""
    from dflash_lab.tiny import _target_config, preset_spec
    from dflash_lab.tiny_writer import draft_layout, target_layout
    from dflash_qaic import families

    s = preset_spec("gpt-oss-20b", target_layers=3)
    assert s.target_layer_ids == [1] and s.attention_bias and s.block_size == 8
    full = preset_spec("gpt-oss-20b")
    assert full.target_layer_ids == [1, 6, 11, 16, 21] and full.mask_token_id == 200000
    _target_config(s).save_pretrained(tmp_path)
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    fam = families.for_config(cfg, tmp_path / "config.json")
    t = fam.read(tmp_path, cfg)
    fam.check_supported(cfg, tmp_path / "config.json")
    layout = {n: list(shape) for n, shape, _ in target_layout(s)}
    assert layout == fam.expected_shapes(t, fused=True)
    assert layout["model.layers.0.mlp.experts.gate_up_proj_blocks"] == [32, 5760, 90, 16]
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert cfg["sliding_window"] == 128 and cfg["vocab_size"] == 201088
    assert "layers.0.self_attn.o_proj.bias" in {n for n, _, _ in draft_layout(s)}


def _bf16_form(model, src, dst):
    """The dequantized form of target `src` (what save_pretrained of the loaded model writes:
    experts [E, in, out], no quantization_config), the experts in bf16 (every MXFP4 value is
    exact there), the rest as it was (fp32)."""
    from safetensors.torch import save_file

    _copy_target(src, dst, config={"quantization_config": None})
    state = {
        k: (v.to(torch.bfloat16) if k.endswith(("_proj", "down_proj")) else v).contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.slow
def test_streamed_program_equals_in_memory_both_forms(mxfp4_pair, tmp_path):
    """The streamed export of the MXFP4 checkpoint (experts dequantized a row block at a time),
    and of its bf16 form (experts transposed per expert on the way), equal the in-memory export
    from Hugging Face's loaded model, output for output."""
    import onnxruntime as ort
    from test_streaming_export import _in_memory, _streamed

    from dflash_qaic.exporter.target import check_feeds

    t, d = mxfp4_pair
    pair = ck.read_pair(t, d)
    _, tf_a, _ = _in_memory(pair, tmp_path / "a")
    tf_b, _ = _streamed(pair, tmp_path / "b")
    bf16 = ck.read_pair(_bf16_form(ck.load_target_model(t), t, tmp_path / "bf16"), d)
    assert not bf16.target.spec.experts_fused(bf16.target_tensors)  # the plain 3-D form
    tf_c, _ = _streamed(bf16, tmp_path / "c")
    runs = [ort.InferenceSession(tf["path"], providers=["CPUExecutionProvider"])
            for tf in (tf_a, tf_b, tf_c)]  # fmt: skip
    io = program_io(tf_a, Path(tf_a["path"]))
    assert io.ring_slots
    for feed in check_feeds(io, tf_a["specializations"]):
        a, b, c = (r.run(None, feed) for r in runs)
        for x, y, z, spec in zip(a, b, c, runs[0].get_outputs()):
            assert np.array_equal(x, y) and np.array_equal(x, z), f"output {spec.name} differs"
