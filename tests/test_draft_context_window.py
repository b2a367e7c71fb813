"""A context window for a full draft (`--draft-context-window N`, docs/DESIGN.md, Sliding
drafts): its full layers attend only to the last N injected target-feature positions, in a ring
cache of N + 1 slots, so the draft's cost stops growing with the context. Lossless: the target
verifies.

Oracles: the draft's forward over only the last N context positions, call by call (the ring
wrapped inside one call and across calls, continuous batching, inactive rows); the target alone
on the same programs, token for token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sliding import DraftRunner

import dflash_qaic
from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.exporter.draft import export_draft
from dflash_qaic.exporter.options import ExportError, ExportOptions
from dflash_qaic.modeling.draft import DFlashDraft

V = 24  # a small vocabulary: a random draft agrees with the target often enough (test_sliding)
N = 5  # the context window


@torch.no_grad()
def test_windowed_program_equals_the_forward_over_the_last_n(tiny_pair, tmp_path):
    """Every active row's logits equal the draft's forward over the last N positions of its
    context (not over all of it), and each layer's cache keeps N + 1 slots."""
    t, d = tiny_pair(block_size=8, vocab_size=V, tie_word_embeddings=False)
    c = ck.read_draft_config(d)
    state, model, B, H = ck.load_draft_state(c), ck.load_target_model(t), 4, c.hidden_size
    draft, head_w = DFlashDraft.from_checkpoint(c, state), model.lm_head.weight
    emb_w = model.get_input_embeddings().weight
    sizes = dict(ctx_len=64, prefill_seq_len=16, block_size=B, full_batch_size=2)
    facts = export_draft(c, state, emb_w, head_w, tmp_path / "draft.onnx", **sizes,
                         emit_logits=True, fp16_check=False, context_window=N)  # fmt: skip
    io = contract.DraftIO(
        n_layers=c.num_layers, n_kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_size=H,
        vocab_size=V, block_size=B, emit_logits=True, continuous_batching=True, comp_ctx=True,
        confidence=True, ring_slots=(N + 1,) * c.num_layers,
    )  # fmt: skip
    shapes = [s["shape"] for s in facts["inputs"] if s["name"].startswith("past_key")]
    assert shapes == [[contract.FULL_BATCH, c.num_kv_heads, N + 1, c.head_dim]] * c.num_layers
    run = DraftRunner(tmp_path / "draft.onnx", facts, io)
    gen = torch.Generator().manual_seed(5)
    ctx = {s: torch.randn(1, 60, H, generator=gen) for s in "ab"}
    ids = {s: torch.randint(0, V, (60,), generator=gen) for s in "ab"}

    def expect(s, start, window):
        lo = max(0, start - window)
        blk = torch.cat([ids[s][start : start + 1], torch.full((B - 1,), c.mask_token_id)])
        h = draft(
            ctx[s][:, lo:start],
            torch.arange(lo, start)[None],
            draft.embed(blk[None], emb_w),
            torch.arange(start, start + B)[None],
        )
        return draft.logits(h[:, 1:], head_w)[0].numpy(), blk.numpy()

    def row_feed(row, seq_len):
        """One call row's (features, their positions, block, block positions, cache row); row:
        None (inactive: all padding) or (seq, first ctx position, ctx rows, start, cache row)."""
        x, cp = np.zeros((seq_len, H), np.float32), np.full(seq_len, -1, np.int64)
        if row is None:
            return x, cp, np.zeros(B, np.int64), np.full(B, -1, np.int64), -1
        s, lo, n, start, slot = row
        x[:n], cp[:n] = ctx[s][0, lo : lo + n].numpy(), np.arange(lo, lo + n)
        return x, cp, expect(s, start, N)[1], np.arange(start, start + B), slot

    def call(rows_, seq_len):
        x, cp, blk, bp, bidx = zip(*(row_feed(r, seq_len) for r in rows_))
        got = run(*map(np.stack, (x, cp, blk, bp)), np.array(bidx, np.int64)[:, None])
        for r, row in enumerate(rows_):
            if row is None:
                continue
            want = expect(row[0], row[3], N)[0]
            far = expect(row[0], row[3], row[3])[0]  # the whole context: the window matters
            assert np.abs(want - far).max() > 1e-3 or row[3] <= N
            np.testing.assert_allclose(got[r], want, atol=1e-4, rtol=1e-4)

    call([("a", 0, 3, 3, 1)], 16)  # shorter than the window
    call([None, ("a", 3, 4, 7, 1)], B)  # past it, wrapping the ring, beside an inactive row
    call([("b", 0, 13, 13, 0)], 16)  # a prefill call wrapping the ring twice
    call([("b", 13, 3, 16, 0), ("a", 7, 4, 11, 1)], B)  # both rows wrap
    call([("b", 16, 1, 17, 0), ("a", 11, 2, 13, 1)], B)


def test_the_option_is_checked_and_absent_from_the_default_key():
    with pytest.raises(ExportError, match="--draft-context-window"):
        ExportOptions(draft_context_window=0)
    assert "draft_context_window" not in ExportOptions().program_options(16)
    assert ExportOptions(draft_context_window=64).program_options(16)["draft_context_window"] == 64


@pytest.mark.draft_every_step  # τ asserted
@pytest.mark.parametrize("window", [4, 16])
def test_tokens_equal_the_target_alone(exported, window):
    """Prompts from shorter than the window to far longer (the ring wrapped many times): the
    tokens are the target's own, and drafts are still accepted (τ reported, above 1)."""
    e = exported(
        "qwen3",
        pair=dict(block_size=8, vocab_size=V, tie_word_embeddings=False, target_layer_ids=[1, 3]),
        prefill_seq_len=16,
        ctx_len=160,
        draft_context_window=window,
    )
    pipe = dflash_qaic.load(e.artifacts)
    assert pipe.artifacts.draft.io.ring_slots == (window + 1,) * 2
    taus = []
    for seed, n in enumerate([3, 17, 39, 70]):
        ids = torch.randint(1, V - 1, (n,), generator=torch.Generator().manual_seed(seed))
        res = pipe.generate(ids.tolist(), max_new_tokens=40)
        base = pipe.generate_baseline(ids.tolist(), max_new_tokens=40)
        assert res.tokens == base.tokens, n
        taus.append(res.stats["tau"])
    assert max(taus) > 1.0, taus


def test_long_context_bench_runs_dflash_against_the_target(exported, tmp_path):
    """`dflash-bench --long-context`: per context length, τ, both speeds, the speedup and the
    share of steps drafted; tokens identical (exit 0)."""
    import json

    from dflash_qaic.bench.cli import main

    e = exported(
        "qwen3",
        pair=dict(block_size=8, vocab_size=V, tie_word_embeddings=False, target_layer_ids=[1, 3]),
        prefill_seq_len=16,
        ctx_len=160,
        draft_context_window=16,
    )
    out = tmp_path / "long.json"
    argv = ["--long-context", str(e.artifacts), "--prompt-len", "40", "--positions", "10,100"]
    argv += ["--context-lens", "20,100", "--num-prompts", "2", "--max-new-tokens", "16"]
    argv += ["--spec-policy", "always"]  # every step drafts: τ and the share asserted
    assert main([*argv, "--repeats", "1", "--temperatures", "0,1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["ring_slots"] == [17, 17] and r["spec_policy"] == "always" and not r["problems"]
    assert [(x["context"], x["temperature"]) for x in r["speedup"]] == [
        (20, 0), (20, 1), (100, 0), (100, 1)
    ]  # fmt: skip
    for x in r["speedup"]:
        assert x["tau"] >= 1 and x["speedup"] > 0 and x["drafted_share"] == 1.0
        assert x["tokens_per_s"]["baseline"] > 0 and x["tokens_per_s"]["dflash"] > 0
    assert max(x["tau"] for x in r["speedup"]) > 1
