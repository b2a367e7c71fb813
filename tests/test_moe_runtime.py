"""A Qwen3-MoE pair end to end (`dflash-export` streamed from the checkpoints, the runtime on ONNX
Runtime): tokens equal Hugging Face greedy `generate`, per-step acceptance equal to the reference
`dflash_generate` with acceptance varying from 1 to B, batched = solo, sampling follows the
target's distribution (chi-square), and the streamed programs equal the in-memory export's on
per-expert and fused checkpoints.

Tiny pairs: hidden 64, 4 target layers (layer 1 dense), 8 experts of 32, top-2.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from dflash.model import DFlashDraftModel, dflash_generate
from test_runtime import _full_block_steps, hf_greedy, prompt
from test_sampling import PROMPT as SAMPLING_PROMPT
from test_sampling import exact_first_two, gof, gof_pvalue
from test_streaming_export import _feeds, _in_memory, _streamed

import dflash_qaic
from dflash_lab.tiny import make_tiny_pair
from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.artifacts.build import ExportOptions, build_artifacts

B, CHUNK, CTX = 4, 8, 160


@pytest.fixture(scope="module")
def built(tiny_pair, tmp_path_factory):
    cache = {}

    def make(agree=1.25, **kw):
        key = (agree, tuple(sorted(kw.items())))
        if key not in cache:
            full_batch_size = kw.pop("full_batch_size", None)
            ctx = kw.pop("ctx", CTX)
            t, d = tiny_pair(
                family="qwen3_moe",
                block_size=B,
                agree=agree,
                tie_word_embeddings=False,
                target_layer_ids=[1, 3],
                **kw,
            )
            out = tmp_path_factory.mktemp("moe-art")
            opts = ExportOptions(
                prefill_seq_len=CHUNK, ctx_len=ctx, compile=False, full_batch_size=full_batch_size
            )
            build_artifacts(t, d, out, opts, progress=lambda m: None)
            cache[key] = (t, d, out, ck.load_target_model(t))
        return cache[key]

    return make


def test_lossless_against_hf_generate(built):
    _, _, art, model = built()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[B])
    lengths = []
    for seed, (n, new) in enumerate([(1, 30), (CHUNK - 1, 41), (CHUNK + 3, 25), (3 * CHUNK, 40)]):
        ids = prompt(n, seed)
        res = pipe.generate(ids, max_new_tokens=new)
        assert res.tokens == hf_greedy(model, ids, new), (n, new)
        assert sum(res.acceptance_lengths) == new - 1
        lengths += res.acceptance_lengths
        # the target alone on the same program: the same tokens
        assert pipe.generate_baseline(ids, 12).tokens == res.tokens[:12]
    assert min(lengths) == 1 and max(lengths) == B and len(set(lengths)) >= 3, lengths


@torch.no_grad()
def test_acceptance_equals_reference(built):
    t, d, art, model = built(agree=2.0)
    ref = DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[B])  # whole blocks every step, as the reference verifies
    compared, lengths = 0, []
    for seed, n in enumerate([3, CHUNK + 1, 2 * CHUNK + 7]):
        ids = prompt(n, 100 + seed)
        out = dflash_generate(ref, model, torch.tensor([ids]), 48, None, return_stats=True)
        res = pipe.generate(ids, max_new_tokens=48)
        assert res.tokens == out.output_ids[0, n:].tolist()
        k = _full_block_steps(out.acceptance_lengths, n, 48, B)
        assert res.acceptance_lengths[:k] == out.acceptance_lengths[:k]
        compared += k
        lengths += res.acceptance_lengths[:k]
    assert compared >= 6 and len(set(lengths)) >= 3, lengths


def test_batch_equals_solo(built):
    _, _, art, model = built(full_batch_size=4)
    pipe = dflash_qaic.load(art)
    prompts = [prompt(n, 200 + n) for n in (2, 9, 5, 17, 12)]  # more requests than rows
    res = pipe.generate(prompts, max_new_tokens=20)
    for ids, r in zip(prompts, res):
        assert r.tokens == hf_greedy(model, ids, 20)
        assert r.tokens == pipe.generate(ids, max_new_tokens=20).tokens


def test_sampling_follows_the_target_distribution(built):
    """Seeded requests of one prompt, batched: the first two tokens follow the exact
    distribution of the target's own sampling (HF logits through temperature 1)."""
    _, _, art, model = built(agree=1.5, vocab_size=32, full_batch_size=4, ctx=32)
    pipe = dflash_qaic.load(art, threads=1)
    n = 400
    res = pipe.generate(
        [SAMPLING_PROMPT] * n, 2, stop_token_ids=[], temperature=1.0, seed=list(range(n))
    )
    a = np.array([r.tokens for r in res])
    p1, p2 = exact_first_two(model, (1.0, 0, 1.0))
    assert gof_pvalue([gof(a[:, 0], p1)]) > 1e-3 / 2
    assert gof_pvalue([gof(a[:, 1], p2)]) > 1e-3 / 2
    # the test can fail: the second token judged by the first token's distribution
    assert gof_pvalue([gof(a[:, 1], p1)]) < 1e-3 or np.allclose(p1, p2, atol=0.02)


@pytest.mark.parametrize(
    "form", [dict(dtype="bfloat16", shards=3), dict(fused_experts=True, dtype="float16")], ids=str
)
def test_streamed_programs_equal_in_memory_ones(tmp_path, form):
    t, d = make_tiny_pair(tmp_path / "pair", family="qwen3_moe", target_layer_ids=[1, 2], **form)
    pair = ck.read_pair(t, d)
    assert ck.experts_fused(pair.target_tensors) == bool(form.get("fused_experts"))
    model, tf_a, _ = _in_memory(pair, tmp_path / "a")
    tf_b, _ = _streamed(pair, tmp_path / "b")
    a = ort.InferenceSession(tf_a["path"], providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(tf_b["path"], providers=["CPUExecutionProvider"])
    for feed in _feeds("target", tf_a, pair):
        for x, y, spec in zip(a.run(None, feed), b.run(None, feed), a.get_outputs()):
            assert np.array_equal(x, y), f"output {spec.name} differs"
    ga = onnx.load(tf_a["path"], load_external_data=False).graph
    gb = onnx.load(tf_b["path"], load_external_data=False).graph
    assert len(ga.node) == len(gb.node) and len(ga.initializer) == len(gb.initializer)
    # and the streamed program's greedy tokens are Hugging Face's
    feed = _feeds("target", tf_b, pair)[0]
    feed[contract.TEMPERATURE][:] = 0.0
    s = feed[contract.INPUT_IDS].shape[1] - 1  # the last row is padding
    tokens = b.run([contract.NEXT_TOKENS], feed)[0][:, :s]
    with torch.no_grad():
        hf = model(torch.from_numpy(feed[contract.INPUT_IDS][:, :s])).logits.argmax(-1).numpy()
    assert (tokens == hf).mean() > 0.9
