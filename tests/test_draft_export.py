"""The draft program (ONNX Runtime) against the reference `dflash.model.DFlashDraftModel`:
proposals equal at every step of a growing context, for several configurations."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel

from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.exporter.draft import export_draft
from dflash_qaic.modeling.draft import DFlashDraft

CTX = 96


def _ort(path):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


class DraftRunner:
    """Drives the exported draft like the runtime does: context in chunks, caches carried."""

    def __init__(self, sess, facts):
        self.sess, self.facts = sess, facts
        self.cache = {
            s["name"]: np.zeros(
                [
                    CTX if d == contract.CTX else (1 if d == contract.BATCH else d)
                    for d in s["shape"]
                ],
                np.float32,
            )
            for s in facts["inputs"]
            if s["name"].startswith("past_")
        }
        self.calls = 0

    def call(self, fused, positions, chunk, block_ids, start):
        n = len(positions)
        H = fused.shape[-1]
        feats = np.zeros((1, chunk, H), np.float32)
        feats[0, :n] = fused
        pos_t = np.full((1, chunk), contract.PAD_POSITION, np.int64)
        pos_t[0, :n] = positions
        B = len(block_ids)
        feed = {
            contract.TARGET_HIDDEN: feats,
            contract.POSITION_IDS_TARGET: pos_t,
            contract.INPUT_IDS: np.array([block_ids], np.int64),
            contract.POSITION_IDS: np.arange(start, start + B, dtype=np.int64)[None],
            contract.COMP_CTX_LENGTHS: np.arange(CTX, dtype=np.int64),
            **self.cache,
        }
        out = dict(zip([o.name for o in self.sess.get_outputs()], self.sess.run(None, feed)))
        for name in self.cache:
            self.cache[name] = out[contract.retained(name)]
        self.calls += 1
        return out[contract.DRAFT_TOKENS][0]


CASES = [
    # family, block, draft layers, heads, kv heads, prefill chunk, prompt length
    ("qwen3", 4, 1, 4, 2, 8, 13),
    ("llama", 8, 3, 4, 1, 16, 21),
    ("qwen3", 16, 5, 4, 4, 32, 37),
    ("qwen3", 8, 2, 8, 2, 12, 5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-B{c[1]}-L{c[2]}-P{c[6]}")
@torch.no_grad()
def test_draft_program_matches_reference(tiny_pair, tmp_path, case):
    family, B, dl, heads, kv, chunk, P = case
    t, d = tiny_pair(
        family=family,
        block_size=B,
        draft_layers=dl,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=64 // heads,
        target_layer_ids=[0, 2, 3][: max(1, min(dl, 3))],
        tie_word_embeddings=family == "qwen3",
    )
    pair = ck.read_pair(t, d)
    target = ck.load_target_model(pair.target)
    state = ck.load_draft_state(pair.draft)
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    facts = export_draft(
        pair.draft,
        state,
        embed,
        head,
        tmp_path / "draft.onnx",
        ctx_len=CTX,
        prefill_seq_len=chunk,
        block_size=B,
    )
    assert facts["tied_head"] == (family == "qwen3")
    sess = _ort(facts["path"])
    ours = DFlashDraft.from_checkpoint(pair.draft, state)
    ref = DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()

    # Raw target features of a whole sequence; the context grows over it.
    total = P + 4 * B
    gen = torch.Generator().manual_seed(B)
    raw = torch.randn(1, total, len(pair.draft.target_layer_ids) * 64, generator=gen)
    fused = ours.fuse(raw)[0].numpy()
    tokens = torch.randint(0, 200, (total,), generator=gen).tolist()
    mask = pair.draft.mask_token_id
    run = DraftRunner(sess, facts)

    def reference(n_ctx):
        block = torch.tensor([[tokens[n_ctx]] + [mask] * (B - 1)])
        pos = torch.arange(n_ctx + B)[None]
        h = ref(
            position_ids=pos,
            noise_embedding=F.embedding(block, embed),
            target_hidden=raw[:, :n_ctx],
        )
        return ref.compute_logits(h[:, 1:], target.lm_head).argmax(-1)[0].numpy()

    # Prompt prefill: ⌈P / chunk⌉ calls; only the last one's proposals are used.
    n_calls = -(-P // chunk)
    for c in range(n_calls):
        lo, hi = c * chunk, min(P, (c + 1) * chunk)
        got = run.call(fused[lo:hi], range(lo, hi), chunk, [tokens[P]] + [mask] * (B - 1), P)
    assert run.calls == n_calls
    np.testing.assert_array_equal(got, reference(P))

    # Decode steps committing 1 … B rows each (B-row context specialization, padded).
    n_ctx = P
    for commit in [1, B, 2, B - 1, 3]:
        commit = min(commit, B)
        lo, hi = n_ctx, n_ctx + commit
        got = run.call(fused[lo:hi], range(lo, hi), B, [tokens[hi]] + [mask] * (B - 1), hi)
        n_ctx = hi
        np.testing.assert_array_equal(got, reference(n_ctx), err_msg=f"commit {commit}")


def test_draft_traffic_is_tokens_only(tiny_pair, tmp_path):
    """Per decode step the host sends B ids + committed feature rows and gets B−1 ids and their
    B−1 confidences back: no logits, no KV (the caches are retained state)."""
    t, d = tiny_pair(family="qwen3", target_layer_ids=[0, 3])
    pair = ck.read_pair(t, d)
    target = ck.load_target_model(pair.target)
    w = target.get_input_embeddings().weight
    facts = export_draft(
        pair.draft,
        ck.load_draft_state(pair.draft),
        w,
        w,
        tmp_path / "d.onnx",
        ctx_len=CTX,
        prefill_seq_len=16,
        block_size=8,
    )
    outs = [o["name"] for o in facts["outputs"] if not o["name"].endswith("_RetainedState")]
    assert outs == [contract.DRAFT_TOKENS, contract.DRAFT_CONFIDENCE]
    assert facts["outputs"][0]["shape"] == facts["outputs"][1]["shape"] == [contract.BATCH, 7]
    assert facts["outputs"][1]["dtype"] == "float32"
    ins = [i["name"] for i in facts["inputs"] if not i["name"].startswith("past_")]
    assert ins == [
        contract.TARGET_HIDDEN,
        contract.POSITION_IDS_TARGET,
        contract.INPUT_IDS,
        contract.POSITION_IDS,
        contract.COMP_CTX_LENGTHS,
    ]
    assert "Softmax" in facts["check"]["ops"] and "ArgMax" in facts["check"]["ops"]
    assert facts["check"]["ops"]["TopK"] == 1  # the confidences: one TopK over the vocabulary
    assert facts["check"]["fp16_runs"] == 2 and np.isfinite(facts["check"]["fp16_max_abs"])
    faithful = facts["check"]["fp16_faithful"]  # every op in fp16, as on the card
    assert faithful["ran"] and faithful["flagged"] == [] and faithful["max_abs"] < 65504 / 16
    assert (
        facts["check"].get("ops", {}).get("Cast", 0) <= 2 * pair.draft.num_layers
    )  # no fp32 casts


@pytest.mark.parametrize("tied", [True, False])
def test_vocab_table_stored_once_and_debug_logits(tiny_pair, tmp_path, tied):
    """A tied head is also the embedding: the V×H table is stored once. --emit-logits adds the
    full logits (QEfficient/vllm-qaic compatibility), whose argmax are the proposals."""
    import onnx

    t, d = tiny_pair(family="qwen3", target_layer_ids=[0, 3], tie_word_embeddings=tied)
    pair = ck.read_pair(t, d)
    target = ck.load_target_model(pair.target)
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    facts = export_draft(
        pair.draft,
        ck.load_draft_state(pair.draft),
        embed,
        head,
        tmp_path / "d.onnx",
        ctx_len=CTX,
        prefill_seq_len=16,
        block_size=8,
        emit_logits=True,
    )
    model = onnx.load(facts["path"])
    vocab_tables = [i for i in model.graph.initializer if 256 in i.dims and 64 in i.dims]
    assert len(vocab_tables) == (1 if tied else 2)
    sess = _ort(facts["path"])
    run = DraftRunner(sess, facts)
    feeds_out = {}
    orig = sess.run

    def spy(names, feed):
        res = orig(names, feed)
        feeds_out.update(zip([o.name for o in sess.get_outputs()], res))
        return res

    sess.run = spy
    fused = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    tokens = run.call(fused, range(5), 16, [3] + [pair.draft.mask_token_id] * 7, 5)
    logits = feeds_out[contract.LOGITS]
    assert logits.shape == (1, 7, 256)
    np.testing.assert_array_equal(logits[0].argmax(-1), tokens)
