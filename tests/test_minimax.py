"""MiniMax-M2 targets (families/minimax_m2.py): the program equals transformers'
`MiniMaxM2ForCausalLM` over prefill, verify and decode (q/k norm over the whole projection,
RoPE on the first rotary_dim of each head, sigmoid routing with the correction bias); the
published per-expert w1/w3/w2 tensors are read as the program's stacked experts; MiniMax-M1's
lightning attention is refused by name. The ladder's `minimax_m2` case runs the tiny pair end to
end.
"""

from __future__ import annotations

import pytest
import torch
from test_mla import assert_program_equals_hf, assert_refused
from test_target_export import (
    hf_dims,
)

from dflash_qaic import checkpoints as ck
from dflash_qaic.exporter.weights import Stacked, placeholder_target, stream_ready, target_sources
from dflash_qaic.modeling.attention import Attention
from dflash_qaic.modeling.moe import SigmoidMoE
from dflash_qaic.modeling.target import ExportTarget

LAYER_IDS = [0, 1]


def minimax(seed=0, n_layers=2):
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    cfg = MiniMaxM2Config(
        **hf_dims(n_layers, intermediate_size=32), num_local_experts=8, num_experts_per_tok=2,
        rotary_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = MiniMaxM2ForCausalLM(cfg)
    with torch.no_grad():  # varied norms, a router that varies by token, a bias that matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("gate.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.3)
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.normal_(0.0, 0.2)
    return model.eval()


def test_program_equals_hf(tmp_path):
    model = minimax()
    attn = ExportTarget.from_hf(
        model, torch.zeros(64, 128), torch.ones(64), 1e-6, LAYER_IDS, ctx_len=32
    ).layers[0]
    assert isinstance(attn.self_attn, Attention) and attn.self_attn.whole_norm
    assert attn.self_attn.rotary_dim == 8 and isinstance(attn.mlp, SigmoidMoE)
    assert_program_equals_hf(model, LAYER_IDS, tmp_path, seed=2)


@torch.no_grad()
def test_sigmoid_routing_equals_hf():
    hf = minimax().model.layers[0].mlp
    ours = SigmoidMoE.from_hf(hf)
    assert (ours.n_group, ours.scaling, ours.shared_expert) == (1, 1.0, None)
    for b, s in [(1, 1), (2, 3), (1, 16)]:
        x = torch.randn(b, s, 64) * 2
        torch.testing.assert_close(ours(x), hf(x), atol=1e-4, rtol=1e-5)


def test_published_experts_are_the_stacked_ones(tiny_pair):
    t, d = tiny_pair(family="minimax_m2")
    pair = ck.read_pair(t, d)
    module = ExportTarget.from_hf(
        placeholder_target(pair.target), torch.zeros(64, 2 * 64), torch.ones(64), 1e-6,
        list(pair.draft.target_layer_ids), ctx_len=32,
    )  # fmt: skip
    sources = target_sources(stream_ready(module), pair)
    gu, down = sources["layers.0.mlp.gate_up"], sources["layers.0.mlp.down"]
    assert isinstance(gu, Stacked) and isinstance(down, Stacked)
    names = [p.name.rsplit("experts.", 1)[1] for p in gu.parts]
    assert names[:4] == ["0.w1.weight", "0.w3.weight", "1.w1.weight", "1.w3.weight"]
    assert [p.name.rsplit("experts.", 1)[1] for p in down.parts][:2] == [
        "0.w2.weight",
        "1.w2.weight",
    ]
    assert sources["layers.0.mlp.bias"].info.name.endswith(
        "block_sparse_moe.e_score_correction_bias"
    )


@pytest.mark.parametrize(
    "edit, named",
    [
        (dict(attn_type_list=[0, 1, 1, 1]), "lightning"),
        (dict(scoring_func="softmax"), "scoring_func.*softmax"),
        (dict(use_routing_bias=False), "use_routing_bias"),
    ],
)
def test_unsupported_variants_refused_by_name(tiny_pair, tmp_path, edit, named):
    assert_refused(tiny_pair, tmp_path, "minimax_m2", edit, named)
