"""The family registry (dflash_qaic/families/): every family's tiny preset reads back as that
family, its expected tensors are exactly its checkpoint's, and the one target skeleton builds
its layers of the kinds the family names, with the program's buffers derived from them."""

import json

import pytest
import torch

from dflash_qaic import checkpoints as ck
from dflash_qaic import contract, families
from dflash_qaic.exporter.target import set_rule, target_io
from dflash_qaic.families import base
from dflash_qaic.modeling.moe import SparseMoeBlock
from dflash_qaic.modeling.target import ExportTarget

# every family's program is the one skeleton's; a tiny-preset-only name (gemma4_moe: a Gemma 4
# checkpoint whose config enables the MoE block) reads back as the family it presets
READ_AS = {"gemma4_moe": "gemma4"}
# the verification rules a family's program supports (the others are refused at export by name):
# hybrids verify chains; sliding-window targets chains and blocks (no trees yet)
RULES = {"qwen3_5": ("chain",), "qwen3_5_moe": ("chain",)}
RULES |= dict.fromkeys(("gemma4", "gemma4_moe", "gpt_oss"), ("chain", "block"))


@pytest.mark.parametrize("family", families.all(), ids=families.names())
def test_tiny_preset_reads_back_and_builds(tiny_pair, family):
    t, d = tiny_pair(family=family.name)
    pair = ck.read_pair(t, d)  # expected shapes == the checkpoint's, nothing unknown
    read_as = families.get(READ_AS.get(family.name, family.name))
    assert pair.target.spec is read_as and pair.target.family == read_as.name
    assert pair.target.hybrid == family.hybrid and (pair.target.moe is not None) == family.moe

    model = ck.load_target_model(t)
    H = model.config.hidden_size
    ids = list(pair.draft.target_layer_ids)
    fc = torch.zeros(H, len(ids) * H)
    hybrid = dict(block_size=4, max_rows=8) if family.hybrid else {}
    module = ExportTarget.from_hf(model, fc, torch.ones(H), 1e-6, ids, ctx_len=32, **hybrid)
    kinds = family.layer_kinds(model.config.get_text_config().to_dict())
    assert [layer.mixer_name for layer in module.layers] == [
        "linear_attn" if k.mixer == base.DELTANET else "self_attn" for k in kinds
    ]
    experts = [
        isinstance(getattr(la, "moe", None) or la.mlp, SparseMoeBlock) for la in module.layers
    ]
    assert experts == [k.mlp != base.MLP for k in kinds]
    attention = [la.self_attn.kind for la in module.layers if la.mixer_name == "self_attn"]
    assert attention == [k.attention for k in kinds if k.mixer != base.DELTANET]
    assert set(module.kinds) == set(attention)
    rules = RULES.get(family.name, contract.VERIFY_RULES)
    assert module.verify_rules == rules
    for rule in sorted(set(contract.VERIFY_RULES) - set(rules)):
        with pytest.raises(ValueError, match=rf"^{rule} verification .* not built for .* by chain"):
            set_rule(module, rule, sampling=True, token_bitmask=False)
    io = target_io(module, H, emit_logits=False, sampling=True)
    assert module.retained_inputs == [s.name for s in io.kv]
    assert (contract.NUM_COMMITTED in [s.name for s in io.outputs]) == family.hybrid


def test_unknown_family_names_the_supported_ones(tiny_pair, tmp_path):
    t, d = tiny_pair(family="qwen3")
    cfg = json.loads((t / "config.json").read_text())
    cfg |= {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ck.CheckpointError) as e:
        ck.read_target_config(tmp_path)
    msg = str(e.value)
    assert "GemmaForCausalLM" in msg and all(name in msg for name in families.names())
    with pytest.raises(ValueError, match="supported families are qwen3, llama"):
        families.get("gemma")
