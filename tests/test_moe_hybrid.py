"""Qwen3.5-MoE targets (hybrid and MoE at once: Gated DeltaNet and gated full attention, every MLP
routed experts plus a gated shared expert): both checkpoint forms read and validated, and the
published form's whole loop lossless against Hugging Face greedy `generate`, the oracle for this
family (REFERENCE: the reference `dflash_generate` leaves HF greedy on most prompts here); the
text form climbs the conformance ladder (tests/test_conformance.py). Tiny pairs: hidden 64,
4 layers (3 linear, 1 full), 8 experts of 32, top-2."""

from __future__ import annotations

import pytest
import torch
from test_hybrid import hf_greedy, prompt

import dflash_qaic
from dflash_qaic import checkpoints as ck

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance asserted (drafts accepted, every length), seeded tokens

B, CHUNK, CTX = 4, 16, 112
MOE = dict(family="qwen3_5_moe", block_size=B, tie_word_embeddings=False, target_layer_ids=[1, 3])
FORMS = {
    "text": dict(agree=1.0),
    # Qwen3_5MoeForConditionalGeneration, tensors under model.language_model.*, a vision tower,
    # bf16, 2 shards; its experts fused (mlp.experts.gate_up_proj), as transformers holds them
    "published": dict(agree=1.0, multimodal=True, dtype="bfloat16", shards=2),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_checkpoint_forms(tiny_pair, form):
    t, d = tiny_pair(**FORMS[form], **MOE)
    pair = ck.read_pair(t, d)
    m, p = pair.target.moe, pair.target.prefix
    assert pair.target.family == "qwen3_5_moe" and pair.target.hybrid
    assert (m.num_experts, m.top_k, m.shared_intermediate_size) == (8, 2, 48)
    assert m.sparse == (True,) * 4 and m.norm_topk_prob
    assert p == ("model.language_model." if form == "published" else "model.")
    assert p + "layers.0.mlp.shared_expert_gate.weight" in pair.target_tensors
    assert ck.experts_fused(pair.target_tensors) == (form == "published")


def test_published_form_lossless_against_hf_generate(exported):
    """The published form end to end (the text form climbs the conformance ladder,
    tests/test_conformance.py: tokens, acceptance where the reference holds, batched = solo)."""
    form = "published"
    pair = {**MOE, **FORMS[form]}
    del pair["family"]
    e = exported("qwen3_5_moe", pair=pair, prefill_seq_len=CHUNK, ctx_len=CTX)
    model = e.model()
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    pipe = dflash_qaic.load(e.artifacts)
    pipe.configure(verify_lengths=[B])
    lengths = []
    for seed, (n, new) in enumerate(
        [(1, 30), (CHUNK - 1, 33), (CHUNK + 3, 25), (2 * CHUNK + 5, 41)]
    ):
        ids = prompt(n, seed)
        res = pipe.generate(ids, max_new_tokens=new)
        with torch.no_grad():
            assert res.tokens == hf_greedy(model, ids, new), (form, n)
        lengths += res.acceptance_lengths
    assert min(lengths) == 1 and max(lengths) == B and len(set(lengths)) >= 3, lengths
