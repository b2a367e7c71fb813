"""Our PyTorch draft equals the reference `dflash.model.DFlashDraftModel` on the same weights,
and the reference `dflash_generate` (the oracle) equals Hugging Face greedy `generate`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel, dflash_generate

from dflash_qaic import checkpoints as ck
from dflash_qaic.modeling.draft import DFlashDraft

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance asserted (drafts accepted, every length), seeded tokens

CONFIGS = [
    # (family, heads, kv_heads, draft_layers, target_layers, layer_ids, tied)
    ("qwen3", 4, 4, 1, 4, None, True),  # MHA, one layer, default rule -> [2]
    ("qwen3", 4, 2, 2, 4, [0, 3], False),  # GQA 2, last target layer named
    ("llama", 8, 2, 3, 6, None, True),  # GQA 4, default rule
    ("qwen3", 4, 1, 5, 6, [0, 1, 2, 4, 5], False),  # MQA, five layers
    ("llama", 4, 2, 4, 5, [1, 2, 3, 4], False),
]


def _load(tiny_pair, family, heads, kv, dl, tl, ids, tied):
    t, d = tiny_pair(
        family=family,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=64 // heads,
        draft_layers=dl,
        target_layers=tl,
        target_layer_ids=ids,
        tie_word_embeddings=tied,
    )
    pair = ck.read_pair(t, d)
    target = ck.load_target_model(pair.target)
    ours = DFlashDraft.from_checkpoint(pair.draft, ck.load_draft_state(pair.draft))
    ref = DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
    return pair, target, ours, ref


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}-h{c[1]}kv{c[2]}-L{c[3]}")
@torch.no_grad()
def test_draft_forward_matches_reference(tiny_pair, cfg):
    pair, target, ours, ref = _load(tiny_pair, *cfg)
    assert list(ref.target_layer_ids) == list(pair.draft.target_layer_ids)
    torch.manual_seed(0)
    n_ctx, B = 11, pair.draft.block_size
    ids = torch.randint(0, 200, (1, n_ctx))
    hs = target(ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[j + 1] for j in pair.draft.target_layer_ids], dim=-1)
    block = torch.tensor([[7] + [pair.draft.mask_token_id] * (B - 1)])
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    pos = torch.arange(n_ctx + B)[None]

    expect = ref(position_ids=pos, noise_embedding=F.embedding(block, embed), target_hidden=feats)
    got = ours(ours.fuse(feats), pos[:, :n_ctx], ours.embed(block, embed), pos[:, n_ctx:])
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)

    ref_tokens = ref.compute_logits(expect[:, 1:], target.lm_head).argmax(-1)
    got_tokens = ours.propose(feats, pos[:, :n_ctx], block, pos[:, n_ctx:], embed, head)
    assert torch.equal(got_tokens, ref_tokens)
    assert pair.target.tie_word_embeddings == cfg[-1]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
# a draft that agrees (1.25) is the slow tier: the fast tier keeps the non-agreeing draft, and
# tests/test_default_pair.py checks a trained draft's acceptance against the reference
@pytest.mark.parametrize("agree", [0.0, pytest.param(1.25, marks=pytest.mark.slow)])
@torch.no_grad()
def test_reference_generate_is_target_greedy(tiny_pair, family, agree):
    """The oracle itself is checked: dflash_generate == HF greedy generate, token for token."""
    t, d = tiny_pair(family=family, agree=agree, target_layer_ids=[1, 3], tie_word_embeddings=False)
    target = ck.load_target_model(t)
    ref = DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
    lengths = []
    for seed, n in enumerate([1, 6, 11, 16, 21, 26, 31, 36]):
        ids = torch.randint(1, 200, (1, n), generator=torch.Generator().manual_seed(seed))
        hf = target.generate(ids, max_new_tokens=40, do_sample=False, min_new_tokens=40)
        out = dflash_generate(ref, target, ids, 40, None, return_stats=True)
        assert torch.equal(out.output_ids, hf), (family, agree, n)
        lengths += out.acceptance_lengths
    if agree:  # the biased pair makes acceptance vary, so the loop is really exercised
        assert min(lengths) == 1 and max(lengths) >= 7 and len(set(lengths)) >= 3, lengths
