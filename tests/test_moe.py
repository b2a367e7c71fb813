"""Mixture-of-experts targets (Qwen3-MoE; the shared expert of Qwen3.5-MoE): the block against
Hugging Face's, the program against HF at every specialization, reading only the routed experts,
routing ties and experts no token chose, streamed = in-memory, fp16-faithful, the checkpoint
forms and their errors (docs/DESIGN.md, Mixture of experts).

Tiny targets: hidden 64, 8 experts of 32, top-2, layer 1 dense (`mlp_only_layers`). End-to-end
losslessness, acceptance against the reference and batching are in tests/test_moe_runtime.py.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from test_fp16 import CH, SEQS, assert_same_tokens, plant_massive
from test_target_export import (
    BLOCK,
    CHUNK,
    VOCAB,
    Runner,
    export_program,
    faithful_flows,
    hf_dims,
    hf_reference,
    margin_ok,
    run_flow,
    session,
)

from dflash_lab.tiny import make_tiny_pair, preset_spec
from dflash_lab.tiny_writer import target_layout
from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.modeling.moe import SparseMoeBlock

H, E, K, INTER = 64, 8, 2, 32


def moe_config(n_layers=3, dense=(1,), norm_topk_prob=True, **kw):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **hf_dims(n_layers),
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(dense),
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
def target_program(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "target.onnx"
    e = export_program(make_moe(), LAYER_IDS, path, emit_logits=True)
    return dict(e, io=contract.TargetIO(3, 2, 16, H, VOCAB, emit_logits=True, comp_ctx=True))


@pytest.mark.parametrize("prompt_len", [16, 13])
def test_prefill_verify_decode_match_hf(target_program, prompt_len):
    e = target_program
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


def test_program_reads_only_the_routed_experts(target_program):
    """In the exported graph: a decode call gathers exactly its token's K experts per weight,
    a call of T tokens min(T·K, E), and no expert weight reaches a MatMul ungathered."""
    e = target_program
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


# ---------------------------------------------------------------- ties, unchosen experts


def export_block(block: SparseMoeBlock, path) -> ort.InferenceSession:
    """The block alone as an ONNX program, batch and sequence dynamic (as in the target)."""
    torch.onnx.export(
        block,
        (torch.randn(1, 2, H),),
        str(path),
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "b", 1: "s"}},
        dynamo=False,
        opset_version=17,
    )
    return session(str(path))


def tied_block(tie: bool = True):
    """Experts 2 and 5 share a router row (their logits tie on every token) and expert 0's row
    is twice theirs: x along that row ranks expert 0 first, then the tie. tie=False: expert
    5's row is half of 2's (no tie). The other experts' rows point away."""
    hf = hf_block(False)
    with torch.no_grad():
        w = hf.gate.weight
        v = w[2].clone()
        w[5] = v if tie else 0.5 * v
        w[0] = 2 * v
        for e in (1, 3, 4, 6, 7):
            w[e] = -v + 0.01 * torch.randn(H)
    return hf, v / v.norm() * 3


def hf_lower_index(hf, x: torch.Tensor):
    """Hugging Face's experts on x [T, H] routed with ties broken toward the lower expert
    index (a stable sort); and which tokens have a tie at the k-th place."""
    probs = hf.gate(x)[0].softmax(-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :K]
    p = probs.gather(1, order)
    kth, next_ = probs.sort(-1, descending=True).values[:, K - 1 : K + 1].unbind(-1)
    return hf.experts(x, order, p / p.sum(-1, keepdim=True)), kth == next_


@torch.no_grad()
def test_routing_ties(tmp_path):
    """Equal router logits: inside the top-k both experts are taken, as Hugging Face does. At
    the k-th place the program takes the lower expert index (ONNX TopK's rule) in every call
    shape; torch's CPU topk (HF) takes either, in its selection algorithm's order
    (docs/DESIGN.md, Mixture of experts), so the program equals HF's experts on that choice."""
    hf, v = tied_block()
    sess = export_block(SparseMoeBlock.from_hf(hf), tmp_path / "tie.onnx")
    x_tie = v[None]  # [1, H]: expert 0, then 2 = 5
    probs = hf.gate(x_tie)[0].softmax(-1)
    assert probs[0, 2] == probs[0, 5] and probs[0].argmax() == 0
    for t in (1, 5, 16):  # decode, verify, prefill: the tied token among random ones
        x = torch.randn(1, t, H)
        x[0, t // 2] = x_tie
        y = sess.run(None, {"x": x.numpy()})[0]
        want, boundary = hf_lower_index(hf, x[0])
        np.testing.assert_allclose(y[0], want.numpy(), atol=1e-5, rtol=1e-5)
        assert boundary[t // 2]
        clear = (~boundary).numpy()  # no tie at the k-th place: HF's own output
        np.testing.assert_allclose(y[0, clear], hf(x).numpy()[0, clear], atol=1e-5, rtol=1e-5)
    # a tie inside the top-2 (2 = 5, above every other expert): both taken, as HF takes them
    hf.gate.weight[0] = -hf.gate.weight[0]
    sess = export_block(SparseMoeBlock.from_hf(hf), tmp_path / "inside.onnx")
    x = v[None, None].repeat(1, 3, 1) + 0.01 * torch.randn(1, 3, H)
    assert (hf.gate(x[0])[2].sort(-1).values == torch.tensor([2, 5])).all()
    np.testing.assert_allclose(sess.run(None, {"x": x.numpy()})[0], hf(x).numpy(), atol=1e-5)


@torch.no_grad()
def test_unchosen_experts_contribute_nothing(tmp_path):
    """An expert no token chose contributes exactly 0, even where its activations overflow: a
    prefill chunk runs every expert on every token, and an unchosen pair must not turn into
    inf · 0 = NaN (the card's fp16 overflows far sooner than fp32 does here)."""
    hf, v = tied_block(tie=False)
    hf.experts.gate_up_proj[7] = 1e30  # its silu(gate) · up is inf on any token
    x = v[None, None].repeat(1, 16, 1) + 0.1 * torch.randn(1, 16, H)
    chosen = hf.gate(x[0])[2]
    assert 7 not in chosen.flatten().tolist()
    sess = export_block(SparseMoeBlock.from_hf(hf), tmp_path / "block.onnx")
    for t in (1, 16):  # decode (7 not read) and prefill (7 read and masked)
        y = sess.run(None, {"x": x[:, :t].numpy()})[0]
        assert np.isfinite(y).all()
        np.testing.assert_allclose(y, hf(x[:, :t]).numpy(), atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- fp16


@pytest.mark.parametrize("value", [1000.0, 4000.0])
@torch.no_grad()
def test_fp16_faithful_gives_fp32_tokens(tmp_path, value):
    """A massive activation (~value in one residual channel, written by the dense layer 0) runs
    through the sparse layers' router and experts: the fp16-faithful program gives the fp32
    tokens with no intermediate near fp16's limit."""
    model = make_moe(dense=(0,))

    def measure():
        return max(
            float(model(torch.tensor([s]), output_hidden_states=True).hidden_states[1][..., CH]
                  .abs().max())
            for s in SEQS
        )  # fmt: skip

    reached = plant_massive(
        model.model.embed_tokens.weight, model.model.layers[0].mlp, value, measure
    )
    assert 0.9 * value < reached < value
    model.model.norm.weight[CH] = 0.05
    for got, (logits, hidden, _) in faithful_flows(model, LAYER_IDS, tmp_path / "target.onnx"):
        assert_same_tokens(got[contract.NEXT_TOKENS], logits)
        np.testing.assert_allclose(got[contract.HIDDEN_STATES], hidden, atol=0.05, rtol=0.02)


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_forms_and_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    t, d = make_tiny_pair(tmp_path / "p", family="qwen3_moe", target_layer_ids=[1, 2])
    pair = ck.read_pair(t, d)
    m = pair.target.moe
    assert (m.num_experts, m.top_k, m.intermediate_size) == (E, K, INTER)
    assert m.sparse == (True, False, True, True) and m.norm_topk_prob
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in pair.target_tensors
    assert "model.layers.1.mlp.gate_proj.weight" in pair.target_tensors  # the dense layer

    state = load_file(str(t / "model.safetensors"))
    cfg = json.loads((t / "config.json").read_text())

    def broken(name, drop=(), **config):
        bad = tmp_path / name
        bad.mkdir()
        save_file({k: v for k, v in state.items() if k not in drop}, str(bad / "model.safetensors"))
        (bad / "config.json").write_text(json.dumps({**cfg, **config}))
        return bad

    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(ck.CheckpointError, match=f"missing tensor keys.*{gone}"):
        ck.check_target_tensors(ck.read_target_config(broken("missing", drop=[gone])))
    with pytest.raises(ck.CheckpointError, match="unknown tensor keys.*layers.0.mlp.experts"):
        ck.check_target_tensors(ck.read_target_config(broken("dense0", mlp_only_layers=[0, 1])))
    with pytest.raises(ck.CheckpointError, match="num_experts_per_tok` 9 exceeds"):
        ck.read_target_config(broken("topk", num_experts_per_tok=9))
    with pytest.raises(ck.CheckpointError, match="moe_intermediate_size` is null"):
        ck.read_target_config(broken("inter", moe_intermediate_size=None))
    # the published spelling `num_experts` (transformers 5.x writes `num_local_experts`)
    pub = broken("published", num_experts=E)
    published = {k: v for k, v in json.loads((pub / "config.json").read_text()).items()}
    del published["num_local_experts"]
    (pub / "config.json").write_text(json.dumps(published))
    assert ck.read_target_config(pub).moe.num_experts == E
    ck.check_target_tensors(ck.read_target_config(pub))


def test_preset_has_qwen3_30b_a3b_layers(tmp_path):
    """The preset's layout is what the checkpoint reader expects of its config (no weights
    written: 3.8 GB), with Qwen3-30B-A3B's per-layer shapes."""
    from dflash_lab.tiny import _target_config

    s = preset_spec("qwen3-30b-a3b")
    _target_config(s).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    t = ck.read_target_config(tmp_path)
    assert t.moe.sparse == (True,) * 4 and (t.moe.num_experts, t.moe.top_k) == (128, 8)
    layout = {name: list(shape) for name, shape, _ in target_layout(s)}
    assert layout == ck.expected_target_shapes(t)
    assert layout["model.layers.3.mlp.experts.127.down_proj.weight"] == [2048, 768]
    assert layout["model.layers.0.self_attn.q_proj.weight"] == [32 * 128, 2048]
    assert layout["model.layers.0.self_attn.k_proj.weight"] == [4 * 128, 2048]
    assert layout["lm_head.weight"] == [151936, 2048]
