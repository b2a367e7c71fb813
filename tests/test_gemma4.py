"""Gemma 4 targets (modeling/gemma4.py): the exported program on ONNX Runtime against Hugging Face.

Tiny random Gemma 4 text models (hidden 64, 6 layers: sliding (window 4) ×2, full, sliding ×2, full;
sliding layers 2 KV heads of 16, full layers 1 KV head of 32 with V = K, proportional RoPE;
√H embeddings, soft-capped logits, non-trivial norms and layer scalars), dense and MoE (8 experts,
top-2, beside the MLP), in the text-only form (`Gemma4ForCausalLM`) and the published multimodal
form (`Gemma4ForConditionalGeneration`, text under `model.language_model`, a vision tower ignored).
One graph serves chunked prefill, a verify block and a decode, each layer its own cache shape.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from spec_loop import hf_greedy, program_io
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

from dflash_qaic import contract
from dflash_qaic.modeling.target import ExportTarget

H, WINDOW = 64, 4
LAYER_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
LAYER_TYPES += ["full_attention"]
LAYER_IDS = [1, 3, 5]
LAYER_KV = (2, 16, 2, 16, 1, 32, 2, 16, 2, 16, 1, 32)  # (kv heads, head dim) per layer


def text_config(moe: bool):
    from transformers import Gemma4TextConfig

    extra = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
    return Gemma4TextConfig(
        **hf_dims(len(LAYER_TYPES), intermediate_size=64, max_position_embeddings=256),
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=list(LAYER_TYPES),
        sliding_window=WINDOW,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0,
        **(extra if moe else {}),
    )


def make_gemma4(form: str, seed: int = 0):
    """form: "text" (Gemma4ForCausalLM), "moe" (its MoE variant) or "multimodal"
    (Gemma4ForConditionalGeneration with a tiny vision tower)."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    text = text_config(form == "moe")
    if form == "multimodal":
        vision = dict(
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
        )
        cfg = Gemma4Config(text_config=text.to_dict(), vision_config=vision, audio_config=None)
        cfg.get_text_config()._attn_implementation = "eager"
        model = Gemma4ForConditionalGeneration(cfg)
        lm = model.model.language_model
    else:
        text._attn_implementation = "eager"
        model = Gemma4ForCausalLM(text)
        lm = model.model
    with torch.no_grad():  # non-trivial norms, router scales and layer scalars
        for name, p in lm.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.uniform_(0.5, 1.5)
        for i, layer in enumerate(lm.layers):
            layer.layer_scalar.fill_(0.5 + 0.1 * i)
    return model.eval()


# the text form in the fast tier; the MoE and the multimodal form (two more exports) are slow
FORMS = ["text", pytest.param("moe", marks=pytest.mark.slow)]
FORMS += [pytest.param("multimodal", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=FORMS)
def target_program(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gemma4_{request.param}") / "target.onnx"
    e = export_program(make_gemma4(request.param), LAYER_IDS, path, emit_logits=True)
    io = program_io(e["facts"], path)
    assert io.layer_kv == LAYER_KV
    assert io.ring_slots == tuple(
        WINDOW + CHUNK if t == "sliding_attention" else 0 for t in LAYER_TYPES
    )
    return dict(e, io=io)


@pytest.mark.parametrize("prompt_len", [21, 13])
def test_prefill_verify_decode_match_hf(target_program, prompt_len):
    e = target_program
    rng = np.random.default_rng(prompt_len)
    seq = rng.integers(0, VOCAB, prompt_len + BLOCK + 1).tolist()
    got = run_flow(Runner(session(str(e["path"])), e["io"]), seq, prompt_len)
    ref_logits, ref_hidden, _ = hf_reference(e["model"], seq, LAYER_IDS, e["fc"], *e["hn"])
    assert np.abs(ref_logits).max() < 30.0  # soft-capped
    np.testing.assert_allclose(got[contract.LOGITS], ref_logits, atol=2e-4, rtol=1e-4)
    clear = margin_ok(ref_logits, 1e-3)
    assert clear.sum() >= len(seq) - 2
    np.testing.assert_array_equal(got[contract.NEXT_TOKENS][clear], ref_logits.argmax(-1)[clear])
    np.testing.assert_allclose(got[contract.HIDDEN_STATES], ref_hidden, atol=1e-4, rtol=1e-4)


def test_program_declares_each_layers_cache(target_program):
    shapes = {s["name"]: s["shape"] for s in target_program["facts"]["inputs"]}
    ring = WINDOW + CHUNK  # R + 1 slots, R = W + S − 1
    assert shapes[contract.past_key(0)][1:] == [2, ring, 16]  # sliding: a ring, 2 heads of 16
    assert shapes[contract.past_value(2)][1:] == [1, contract.CTX, 32]  # full: 1 head of 32 (V = K)


@pytest.mark.parametrize(
    "field,value",
    [("hidden_size_per_layer_input", 16), ("num_kv_shared_layers", 2), ("attention_bias", True)],
)
def test_refuses_unsupported_fields(field, value):
    model = make_gemma4("text")
    setattr(model.config, field, value)
    fc, hn_w, hn_eps = make_draft_side(len(LAYER_IDS))
    with pytest.raises(ValueError, match=field):
        ExportTarget.from_hf(model, fc, hn_w, hn_eps, LAYER_IDS, ctx_len=CTX)


# ---------------------------------------------------------------- fp16 with a massive channel


@pytest.mark.slow
@torch.no_grad()
def test_fp16_faithful_with_a_massive_channel(tmp_path):
    """Trigger tokens make layer 0's MLP write ~3600 into one residual channel (through a large
    post_feedforward_layernorm weight, as Gemma's checkpoints have, then √H-scaled embeddings
    and soft-capped logits downstream); the fp16-faithful program gives the fp32 tokens with
    nothing near fp16's limit."""
    from test_fp16 import CH, SEQS, TRIGGERS, plant_massive

    model = make_gemma4("text")
    lm = model.model
    norm = lm.layers[0].post_feedforward_layernorm.weight

    def measure():
        return max(
            float(model(torch.tensor([s]), output_hidden_states=True).hidden_states[1][..., CH]
                  .abs().max())
            for s in SEQS
        )  # fmt: skip

    plant_massive(lm.embed_tokens.weight, lm.layers[0].mlp, 1.0, lambda: 1.0)  # the neuron
    # the head is tied: the two triggers' rows differ in the channel, or their logits would tie
    lm.embed_tokens.weight[TRIGGERS[1], CH] = 2.0
    for _ in range(3):  # the channel is linear in the norm's weight, up to the embedding's part
        norm[CH] *= 1800.0 / measure()
    assert 1500.0 < measure() < 2100.0  # 3600 before layer 0's scalar 0.5
    lm.norm.weight[CH] = 0.05  # as in real checkpoints, the final norm damps the channel
    for got, (logits, hidden, _) in faithful_flows(model, LAYER_IDS, tmp_path / "target.onnx"):
        # fp32's argmax wherever it is clear by 0.05 (fp16 rounding moves logits ~1e-2; this
        # tiny random model has near-ties), and a near-tie's pick within 0.05 of the best
        tokens, clear = got[contract.NEXT_TOKENS], margin_ok(logits, 0.05)
        assert clear.sum() >= 0.7 * len(logits)
        np.testing.assert_array_equal(tokens[clear], logits.argmax(-1)[clear])
        chosen = np.take_along_axis(logits, tokens[:, None], -1)[:, 0]
        assert (logits.max(-1) - chosen < 0.05).all()
        # the draft's feature (it steers proposals only, never the committed tokens): nearly
        # every row within fp16's rounding; a row beside the massive ones may move further
        # (Gemma's unscaled scores: scaling 1.0; open, see docs/DESIGN.md, Gemma 4 targets)
        err = np.abs(got[contract.HIDDEN_STATES] - hidden).max(-1)  # per row
        assert (err < 0.05 + 0.02 * np.abs(hidden).max(-1)).mean() >= 0.9, err


# ---------------------------------------------------------------- lossless decoding


def test_speculative_decoding_equals_hf_generate(target_program):
    """Whatever a block's acceptance (0 … B − 1 proposals kept), the committed tokens are
    Hugging Face's greedy `generate` (soft-capped logits, both layer kinds' caches rolled back)."""
    from spec_loop import hf_greedy, speculate

    prompt = np.random.default_rng(7).integers(0, VOCAB, 11).tolist()
    n = 24
    ref = hf_greedy(target_program["model"], prompt, n)
    got, accepted = speculate(
        Runner(session(str(target_program["path"])), target_program["io"]), prompt, ref, n
    )
    assert got == ref
    assert set(accepted) == set(range(BLOCK))


def test_batched_equals_solo(target_program):
    from spec_loop import assert_batched_equals_solo

    assert_batched_equals_solo(session(str(target_program["path"])), target_program["io"])


# ---------------------------------------------------------------- from the checkpoints


def _pair(tmp_path, family: str, multimodal: bool):
    """A tiny Gemma 4 pair on disk (dflash-make-tiny-pair --family gemma4 | gemma4_moe): its
    draft with Gemma drafts' knobs (√H embedding scale, soft-capped logits)."""
    from dflash_lab.tiny import make_tiny_pair

    return make_tiny_pair(
        tmp_path / "pair", family=family, multimodal=multimodal, block_size=4,
        target_layer_ids=[1, 3], agree=1.25, input_embedding_scale=8.0,
        final_logit_softcapping=30.0,
    )  # fmt: skip


E2E_FORMS = [("gemma4", False), pytest.param("gemma4_moe", True, marks=pytest.mark.slow)]


@pytest.mark.draft_every_step  # acceptance 1 … B asserted
@pytest.mark.parametrize("family,multimodal", E2E_FORMS)
def test_lossless_from_the_checkpoints(tmp_path, family, multimodal):
    """dflash-export's streamed export of the on-disk pair (the multimodal form's vision tower
    ignored), the runtime on ONNX Runtime: tokens equal HF greedy `generate`, acceptance 1 … B."""
    import dflash_qaic
    from dflash_qaic import checkpoints as ck
    from dflash_qaic.artifacts.build import ExportOptions, build_artifacts

    t, d = _pair(tmp_path, family, multimodal)
    pair = ck.read_pair(t, d)
    assert pair.target.family == "gemma4"
    assert pair.target.prefix == ("model.language_model." if multimodal else "model.")
    opts = ExportOptions(prefill_seq_len=CHUNK, ctx_len=160, compile=False)
    build_artifacts(t, d, tmp_path / "art", opts, progress=lambda m: None)
    model = ck.load_target_model(t)
    pipe = dflash_qaic.load(tmp_path / "art")
    pipe.configure(verify_lengths=[pipe.B])  # whole blocks every step: acceptance 1 … B
    lengths = []
    for seed, (n, new) in enumerate([(1, 30), (CHUNK - 1, 41), (3 * CHUNK, 40)]):
        ids = np.random.default_rng(seed).integers(1, 255, n).tolist()
        res = pipe.generate(ids, max_new_tokens=new)
        assert res.tokens == hf_greedy(model, ids, new), (n, new)
        lengths += res.acceptance_lengths
    assert min(lengths) == 1 and max(lengths) == 4 and len(set(lengths)) >= 3, lengths


@pytest.mark.slow
def test_streamed_program_equals_in_memory(tmp_path):
    import onnxruntime as ort
    from test_streaming_export import _in_memory, _streamed

    from dflash_qaic import checkpoints as ck
    from dflash_qaic.exporter.target import check_feeds

    pair = ck.read_pair(*_pair(tmp_path, "gemma4_moe", True))
    _, tf_a, _ = _in_memory(pair, tmp_path / "a")
    tf_b, _ = _streamed(pair, tmp_path / "b")
    a = ort.InferenceSession(tf_a["path"], providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(tf_b["path"], providers=["CPUExecutionProvider"])
    io = program_io(tf_a, Path(tf_a["path"]))
    assert io.ring_slots  # the sliding layers stream into rings too
    for feed in check_feeds(io, tf_a["specializations"]):
        for x, y, spec in zip(a.run(None, feed), b.run(None, feed), a.get_outputs()):
            assert np.array_equal(x, y), f"output {spec.name} differs"


def test_preset_gemma_4_31b_layout():
    """`dflash-make-tiny-pair --preset gemma-4-31b --num-layers 6` (no bytes written here): the
    published form's config and every tensor at the 31B's shapes, 5 sliding : 1 full with the
    last layer full (head 512, 4 KV heads, V = K, no v_proj), the draft Gemma's √H and soft-cap."""
    from dflash_lab.tiny import _layer_ids, _target_config, draft_config_dict, preset_spec
    from dflash_lab.tiny_writer import target_layout

    s = _layer_ids(preset_spec("gemma-4-31b", target_layers=6, draft_layers=5))
    assert len(set(s.target_layer_ids)) == 5 and max(s.target_layer_ids) < 6
    text = _target_config(s).text_config
    assert text.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (text.sliding_window, text.vocab_size, text.hidden_size) == (512, 262144, 5376)
    shapes = {n: shape for n, shape, _ in target_layout(s)}
    p = "model.language_model.layers."
    assert shapes[p + "0.self_attn.k_proj.weight"] == (16 * 256, 5376)
    assert shapes[p + "0.self_attn.v_proj.weight"] == (16 * 256, 5376)
    assert shapes[p + "5.self_attn.q_proj.weight"] == (32 * 512, 5376)
    assert shapes[p + "5.self_attn.k_proj.weight"] == (4 * 512, 5376)
    assert p + "5.self_attn.v_proj.weight" not in shapes and "lm_head.weight" not in shapes
    assert shapes[p + "3.mlp.down_proj.weight"] == (5376, 21504)
    d = draft_config_dict(s)["dflash_config"]
    assert (
        d["final_logit_softcapping"] == 30.0 and abs(d["input_embedding_scale"] ** 2 - 5376) < 1e-6
    )
