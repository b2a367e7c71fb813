"""Mixture-of-experts targets (Qwen3-MoE; the shared expert of Qwen3.5-MoE): the block against
Hugging Face's, the program against HF at every specialization, reading only the routed experts,
routing ties and experts no token chose, streamed = in-memory, fp16-faithful, the checkpoint
forms and their errors (docs/DESIGN.md, Mixture of experts).

Tiny targets: hidden 64, 8 experts of 32, top-2, layer 1 dense (`mlp_only_layers`). End-to-end
losslessness, acceptance against the reference and batching are in tests/test_moe_runtime.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from test_target_export import (
    BLOCK,
    CHUNK,
    CTX,
    VOCAB,
    Runner,
    hf_reference,
    make_draft_side,
    margin_ok,
    run_flow,
    session,
)

from dflash_qaic import contract
from dflash_qaic.export.target import export_target
from dflash_qaic.modeling.moe import SparseMoeBlock

H, E, K, INTER = 64, 8, 2, 32


def moe_config(n_layers=3, dense=(1,), norm_topk_prob=True, **kw):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(dense),
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
        **kw,
    )


def make_moe(seed=0, **kw):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(moe_config(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)  # router logits of a few units: routing varies by token
    return model.eval()


# ---------------------------------------------------------------- the block


def hf_block(shared: bool, norm_topk_prob: bool = True, seed: int = 0):
    """Hugging Face's sparse MoE block: Qwen3-MoE's, or Qwen3.5-MoE's (shared expert + gate)."""
    torch.manual_seed(seed)
    if shared:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
            Qwen3_5MoeTextConfig,
        )
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeSparseMoeBlock,
        )

        cfg = Qwen3_5MoeTextConfig(
            hidden_size=H,
            moe_intermediate_size=INTER,
            shared_expert_intermediate_size=48,
            num_experts=E,
            num_experts_per_tok=K,
        )
        block = Qwen3_5MoeSparseMoeBlock(cfg)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(moe_config(norm_topk_prob=norm_topk_prob))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return block.eval()


@pytest.mark.parametrize("shared,norm", [(False, True), (False, False), (True, True)])
@torch.no_grad()
def test_block_matches_hf(shared, norm):
    hf = hf_block(shared, norm)
    ours = SparseMoeBlock.from_hf(hf)
    assert (ours.shared_expert is not None) == shared and ours.norm_topk_prob == norm
    for b, s in [(1, 1), (2, 1), (1, 3), (1, 16), (3, 7)]:
        x = torch.randn(b, s, H) * 2
        torch.testing.assert_close(ours(x), hf(x), atol=2e-6, rtol=1e-5)


@torch.no_grad()
def test_union_reads_min_of_routed_and_all_experts():
    """The experts a call reads: exactly a token's k at decode, min(T·k, E) for T tokens, the
    chosen ones first in index order (every routed expert is in the union)."""
    ours = SparseMoeBlock.from_hf(hf_block(False))
    for t in (1, 2, 3, 4, 9):
        x = torch.randn(t, H)
        _, top_i = ours.route(x)
        chosen = torch.zeros(E).index_fill_(0, top_i.flatten(), 1.0)
        union = ours.union(chosen, torch.tensor(t)).tolist()
        routed = sorted(set(top_i.flatten().tolist()))
        assert len(union) == min(t * K, E) and union[: len(routed)] == routed
        if t == 1:
            assert union == routed  # decode: its k experts, nothing else


# ---------------------------------------------------------------- the program against HF

LAYER_IDS = [0, 2]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = make_moe()
    fc, hn_w, hn_eps = make_draft_side(len(LAYER_IDS))
    path = tmp_path_factory.mktemp("moe") / "target.onnx"
    facts = export_target(
        model,
        fc,
        hn_w,
        hn_eps,
        LAYER_IDS,
        path,
        ctx_len=CTX,
        prefill_seq_len=CHUNK,
        block_size=BLOCK,
        emit_logits=True,
    )
    io = contract.TargetIO(3, 2, 16, H, VOCAB, emit_logits=True, comp_ctx=True)
    return dict(model=model, fc=fc, hn=(hn_w, hn_eps), path=path, facts=facts, io=io)


@pytest.mark.parametrize("prompt_len", [16, 13])
def test_prefill_verify_decode_match_hf(exported, prompt_len):
    e = exported
    seq = np.random.default_rng(prompt_len).integers(0, VOCAB, prompt_len + BLOCK + 1).tolist()
    got = run_flow(Runner(session(str(e["path"])), e["io"]), seq, prompt_len)
    logits, hidden, _ = hf_reference(e["model"], seq, LAYER_IDS, e["fc"], *e["hn"])
    np.testing.assert_allclose(got[contract.LOGITS], logits, atol=2e-4, rtol=1e-4)
    clear = margin_ok(logits, 1e-3)
    assert clear.sum() >= len(seq) - 2
    np.testing.assert_array_equal(got[contract.NEXT_TOKENS][clear], logits.argmax(-1)[clear])
    np.testing.assert_allclose(got[contract.HIDDEN_STATES], hidden, atol=1e-4, rtol=1e-4)


def expert_gathers(path) -> tuple[onnx.ModelProto, list[str]]:
    """The model with the outputs of its Gathers of stacked expert weights added as outputs."""
    model = onnx.load(str(path))
    stacked = {t.name for t in model.graph.initializer if len(t.dims) == 3}
    outs = [
        n.output[0] for n in model.graph.node if n.op_type == "Gather" and n.input[0] in stacked
    ]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(o) for o in outs)
    return model, outs


def test_program_reads_only_the_routed_experts(exported):
    """In the exported graph: a decode call gathers exactly its token's K experts per weight,
    a call of T tokens min(T·K, E), and no expert weight reaches a MatMul ungathered."""
    e = exported
    model, outs = expert_gathers(e["path"])
    assert len(outs) == 2 * 2  # gate_up and down of the two sparse layers
    stacked = {t.name for t in model.graph.initializer if len(t.dims) == 3}
    users = [n for n in model.graph.node if set(n.input) & stacked]
    assert {n.op_type for n in users} == {"Gather"}
    sess = session(model.SerializeToString())
    run = Runner(sess, e["io"])
    run.out_names = [o.name for o in sess.get_outputs()]
    run(list(range(3, 3 + CHUNK)), list(range(CHUNK)))  # a prefill chunk: every expert
    for t in (1, 2, 3, BLOCK):
        out = run(list(range(1, 1 + t)), list(range(CHUNK, CHUNK + t)))
        for name in outs:
            assert out[name].shape[0] == min(t * K, E), (t, name, out[name].shape)
