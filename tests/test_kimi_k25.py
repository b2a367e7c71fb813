"""Kimi K2.5's published multimodal wrapper (families/kimi_k25.py): the text model's config in
`text_config`, its tensors under `language_model.model.*`, its head `language_model.lm_head.weight`,
the vision tower's and projector's tensors skipped by name; the oracle is the text model built
from the text config (transformers' causal-LM class does not load the wrapper)."""

from __future__ import annotations

import json

import pytest
import torch
from test_conformance import hf_greedy

from dflash_qaic import checkpoints as ck
from dflash_qaic import families
from dflash_qaic.checkpoint_files.safetensors import read_safetensors_header
from dflash_qaic.families.kimi_k25 import HEAD, PREFIX, TINY_VISION

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance asserted (drafts accepted, every length), seeded tokens

PAIR = dict(target_layer_ids=[1, 3], block_size=4, agree=2.0)


def test_wrapper_config_and_layout_are_read(tiny_pair):
    t, d = tiny_pair(family="kimi_k25", multimodal=True, **PAIR)
    cfg = json.loads((t / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and "vision_config" in cfg
    header = read_safetensors_header(t / "model.safetensors")
    assert set(TINY_VISION) <= set(header)  # the vision tower is in the checkpoint …
    assert HEAD in header and "lm_head.weight" not in header
    pair = ck.read_pair(t, d)  # … and skipped by name
    assert pair.target.spec is families.get("kimi_k25")
    assert (pair.target.prefix, pair.target.num_layers) == (PREFIX, 4)
    assert pair.target.text["kv_lora_rank"] == 32
    used = set(ck.expected_target_shapes(pair.target))
    assert not used & set(TINY_VISION) and HEAD in used


def test_published_text_model_type_and_refusals(tmp_path):
    """The published config names its text model kimi_k2; a wrapper without `text_config`
    is refused naming the field."""
    text = dict(families.get("deepseek_v3").tiny_config(_spec()).to_dict(), model_type="kimi_k2")
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25"}
    t = families.for_config(cfg | {"text_config": text}, tmp_path).read(
        tmp_path, cfg | {"text_config": text}
    )
    assert t.family == "kimi_k25" and t.prefix == PREFIX and not t.tie_word_embeddings
    with pytest.raises(ck.CheckpointError, match="text_config"):
        families.get("kimi_k25").read(tmp_path, cfg)


def _spec():
    from dflash_lab.tiny import TinySpec

    return TinySpec.of("deepseek_v3", **families.get("deepseek_v3").tiny)


def test_oracle_is_the_text_model(tiny_pair, tmp_path):
    """load_target_model builds DeepSeek-V3's text model from the text config (its published
    model_type kimi_k2), its weights the checkpoint's under the wrapper's names."""
    import shutil

    from safetensors import safe_open

    src, _ = tiny_pair(family="kimi_k25", multimodal=True, **PAIR)
    t = shutil.copytree(src, tmp_path / "target")
    cfg = json.loads((t / "config.json").read_text())
    cfg["text_config"]["model_type"] = "kimi_k2"
    (t / "config.json").write_text(json.dumps(cfg))
    model = ck.load_target_model(t)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    with safe_open(str(t / "model.safetensors"), "pt") as f:
        head = f.get_tensor(HEAD).float()
        q = f.get_tensor(PREFIX + "layers.2.self_attn.q_b_proj.weight").float()
    assert torch.equal(model.lm_head.weight, head)
    assert torch.equal(model.model.layers[2].self_attn.q_b_proj.weight, q)


@pytest.mark.parametrize("fmt", ["plain", pytest.param("int4", marks=pytest.mark.slow)])
def test_tokens_equal_hf_greedy(exported, fmt):
    """The streamed export of the wrapper (vision tower skipped; INT4 experts in the published
    packed form): tokens equal HF greedy of the text model, drafts accepted."""
    pair = dict(PAIR, multimodal=True, weight_format=fmt)
    if fmt != "plain":
        pair.pop("agree")  # written tensor by tensor (no agreement bias)
    e = exported("kimi_k25", pair=pair, prefill_seq_len=8, ctx_len=96)
    model, pipe = e.model(), e.load(tokenizer=False)
    lengths = []
    for seed, (n, new) in enumerate([(3, 24), (13, 20)]):
        ids = torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        res = pipe.generate(ids, max_new_tokens=new, stop_token_ids=[])
        assert res.tokens == hf_greedy(model, ids, new), (n, fmt)
        lengths += res.acceptance_lengths
    assert fmt != "plain" or max(lengths) > 1, lengths
