"""The draft knobs of published drafts (docs/DESIGN.md, Draft knobs): each read from the checkpoint
as the reference readers read it and honoured in the exported draft program.

Oracle per knob, on a tiny draft with that knob set: the reference `dflash.model.DFlashDraftModel`
where it implements the knob (attention biases, embedding scale / output multiplier / soft-cap,
YaRN) or where the knob is an input it takes (a mask embedding is a block embedding; a reduced
vocabulary is a head and a map applied to its hidden rows; the interleaved RoPE layout is the
half-split one on weights whose q/k dimensions are permuted); the sink logit against our eager
draft, whose attention is itself checked against the softmax-with-a-sink formula. A draft with a
reduced vocabulary runs end to end: tokens equal Hugging Face greedy `generate`.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel
from safetensors.torch import load_file, save_file

from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.exporter.draft import export_draft
from dflash_qaic.modeling.draft import DFlashDraft
from dflash_qaic.modeling.layers import MASK_VALUE

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance asserted (drafts accepted, every length), seeded tokens

V, H, B, CTX, N = 64, 64, 8, 32, 9  # vocabulary, hidden, block, ctx_len, context rows
DV = 40  # the reduced draft vocabulary


def _base(tiny_pair):
    return tiny_pair(vocab_size=V, tie_word_embeddings=False, target_layer_ids=[1, 3], block_size=B)


def _permutation(hd: int) -> torch.Tensor:
    """Even dimensions first, then odd: the interleaved layout's pairs as half-split ones."""
    return torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])


def _knob_draft(src, out, knob: str):
    """A copy of draft `src` in `out` with `knob` set (config and tensors)."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    layers = range(cfg["num_hidden_layers"])
    if knob == "attention_bias":
        cfg["attention_bias"] = True
        for name in [k for k in state if k.endswith("_proj.weight") and ".self_attn." in k]:
            bias = 0.3 * torch.randn(state[name].shape[0], generator=gen)
            state[name.replace(".weight", ".bias")] = bias
    elif knob == "scales":
        cfg["dflash_config"] |= dict(
            input_embedding_scale=8.0, output_multiplier=0.5, final_logit_softcapping=2.0
        )
    elif knob == "yarn":
        cfg.pop("rope_theta")
        cfg["rope_parameters"] = dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8
        )
    elif knob == "attention_sink_bias":
        cfg["dflash_config"]["attention_sink_bias"] = True
        for i in layers:
            sink = 2.0 * torch.randn(cfg["num_attention_heads"], generator=gen)
            state[f"layers.{i}.self_attn.attention_sink_bias"] = sink
    elif knob == "mask_embedding":
        row = 3.0 * torch.randn(cfg["hidden_size"], generator=gen)
        mask = cfg["dflash_config"]["mask_token_id"]
        torch.save({"embedding": row, "mask_token_id": mask}, out / "mask_embedding.pt")
    elif knob == "draft_vocab_size":
        cfg["draft_vocab_size"] = DV
        targets = torch.randperm(V, generator=gen)[:DV].sort().values
        state["d2t"] = targets - torch.arange(DV)  # target id = d + d2t[d]
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[targets] = True
        state["t2d"] = t2d
        state["lm_head.weight"] = torch.randn(DV, cfg["hidden_size"], generator=gen) * 0.5
    elif knob == "is_neox_style":
        cfg["is_neox_style"] = False
    else:
        raise ValueError(knob)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(out / "model.safetensors"))
    return out


def _neox_twin(d, out):
    """The interleaved draft `d` as a half-split (neox) draft: q/k rows of every head and the
    q/k norms permuted (`_permutation`); the reference model runs it."""
    shutil.copytree(d, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("is_neox_style")
    state = load_file(str(out / "model.safetensors"))
    hd, perm = cfg["head_dim"], _permutation(cfg["head_dim"])
    for k in list(state):
        if k.endswith(("q_proj.weight", "k_proj.weight")):
            w = state[k]
            state[k] = w.view(-1, hd, w.shape[-1])[:, perm].reshape(w.shape).contiguous()
        elif k.endswith(("q_norm.weight", "k_norm.weight")):
            state[k] = state[k][perm].contiguous()
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(out / "model.safetensors"))
    return out


def _inputs(c, seed=0):
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, N, H * len(c.target_layer_ids), generator=gen)
    block = torch.tensor([[5] + [c.mask_token_id] * (B - 1)])
    return feats, block, torch.arange(N + B)[None]


def _run_program(facts, fused, block):
    """One draft call: N context rows at 0 … N−1, the block at N; -> outputs by name."""
    sess = ort.InferenceSession(str(facts["path"]), providers=["CPUExecutionProvider"])
    io_names = {i["name"]: i for i in facts["inputs"]}
    feeds = {
        contract.TARGET_HIDDEN: fused.numpy().astype(np.float32),
        contract.POSITION_IDS_TARGET: np.arange(N, dtype=np.int64)[None],
        contract.INPUT_IDS: block.numpy(),
        contract.POSITION_IDS: np.arange(N, N + B, dtype=np.int64)[None],
        contract.COMP_CTX_LENGTHS: np.arange(CTX, dtype=np.int64),
    }
    for name, spec in io_names.items():
        if name.startswith("past_"):
            shape = [
                CTX if s == contract.CTX else 1 if s == contract.BATCH else s for s in spec["shape"]
            ]
            feeds[name] = np.zeros(shape, np.float32)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in io_names})))


@torch.no_grad()
def _oracle(knob, d, c, target, feats, block, pos, tmp_path):
    """(hidden rows 1 … B−1 [1, B−1, H], logits over the target vocabulary [1, B−1, V]) of the
    knob's oracle (module docstring)."""
    embed, head = target.get_input_embeddings().weight, target.lm_head
    emb = F.embedding(block, embed)
    if knob == "attention_sink_bias":  # ours, eager (its attention checked in its own test)
        ours = DFlashDraft.from_checkpoint(c, ck.load_draft_state(c))
        n = feats.shape[1]
        h = ours(ours.fuse(feats), pos[:, :n], ours.embed(block, embed), pos[:, n:])[:, 1:]
        return h, ours.logits(h, head.weight)
    ref_dir = _neox_twin(d, tmp_path / "twin") if knob == "is_neox_style" else d
    ref = DFlashDraftModel.from_pretrained(ref_dir, dtype=torch.float32).eval()
    if knob == "mask_embedding":
        row = torch.load(d / "mask_embedding.pt")["embedding"]
        emb = torch.where((block == c.mask_token_id)[..., None], row, emb)
    scale = float((ref.config.dflash_config or {}).get("input_embedding_scale", 1.0))
    h = ref(position_ids=pos, noise_embedding=emb * scale, target_hidden=feats)[:, 1:]
    if knob != "draft_vocab_size":
        return h, ref.compute_logits(h, head)
    own = torch.nn.Linear(H, DV, bias=False)
    state = load_file(str(d / "model.safetensors"))
    own.weight.copy_(state["lm_head.weight"])
    small = ref.compute_logits(h, own)  # [1, B−1, DV]
    full = torch.full((1, B - 1, V), MASK_VALUE)
    full[..., torch.arange(DV) + state["d2t"]] = small
    return h, full


KNOBS = [
    "attention_bias",
    "scales",
    "yarn",
    "attention_sink_bias",
    "mask_embedding",
    "draft_vocab_size",
    "is_neox_style",
]


@pytest.mark.parametrize("knob", KNOBS)
def test_exported_draft_with_knob_equals_oracle(tiny_pair, tmp_path, knob):
    t, base = _base(tiny_pair)
    d = _knob_draft(base, tmp_path / "draft", knob)
    c = ck.read_draft_config(d)
    ck.check_draft_tensors(c)
    target = ck.load_target_model(ck.read_target_config(t))
    state = ck.load_draft_state(c)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    facts = export_draft(
        c, state, embed, head, tmp_path / "d.onnx", ctx_len=CTX, prefill_seq_len=16,
        block_size=B, emit_logits=True, top_k=3, fp16_check=False,
    )  # fmt: skip
    feats, block, pos = _inputs(c)
    with torch.no_grad():
        fused = DFlashDraft.from_checkpoint(c, state).fuse(feats)
    out = _run_program(facts, fused, block)
    _, want = _oracle(knob, d, c, target, feats, block, pos, tmp_path)
    got = torch.from_numpy(out[contract.LOGITS])  # a reduced vocabulary: MASK_VALUE elsewhere
    torch.testing.assert_close(got.clamp(min=MASK_VALUE), want, atol=2e-4, rtol=1e-4)
    tokens = torch.from_numpy(out[contract.DRAFT_TOKENS])
    assert torch.equal(tokens, want.argmax(-1))  # target ids, also with a reduced vocabulary
    top = torch.from_numpy(out[contract.DRAFT_TOP_IDS])
    assert torch.equal(top, want.topk(3, dim=-1).indices)
    # the knob matters: the draft without it (the tiny base draft) proposes other logits
    plain = DFlashDraftModel.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        h0 = plain(position_ids=pos, noise_embedding=F.embedding(block, embed), target_hidden=feats)
        base_logits = plain.compute_logits(h0[:, 1:], target.lm_head)
    assert (got - base_logits).abs().max() > 1e-2


@torch.no_grad()
def test_sink_attention_equals_the_formula(tiny_pair, tmp_path):
    """Our attention with a sink: softmax over [scores ‖ sink_h] with the sink's share dropped,
    computed here head by head (query heads sharing a KV head, GQA)."""
    _, base = _base(tiny_pair)
    c = ck.read_draft_config(_knob_draft(base, tmp_path / "draft", "attention_sink_bias"))
    attn = DFlashDraft.from_checkpoint(c, ck.load_draft_state(c)).layers[0].self_attn
    gen = torch.Generator().manual_seed(3)
    x, ctx = torch.randn(1, B, H, generator=gen), torch.randn(1, N, H, generator=gen)
    cos, sin = torch.ones(1, B, c.head_dim), torch.zeros(1, B, c.head_dim)  # no rotation
    ck_, cv = attn.kv(ctx, cos[:, :1].expand(1, N, -1), sin[:, :1].expand(1, N, -1))
    got = attn(x, cos, sin, ck_, cv)
    q = attn.q_norm(attn.q_proj(x).view(1, B, -1, c.head_dim)).transpose(1, 2)
    bk, bv = attn.kv(x, cos, sin)
    k, v = torch.cat([ck_, bk], 2), torch.cat([cv, bv], 2)
    g = c.num_heads // c.num_kv_heads
    rows = []
    for h in range(c.num_heads):
        s = q[0, h] @ k[0, h // g].T * c.head_dim**-0.5  # [B, N + B]
        sink = attn.attention_sink_bias[h].expand(B, 1)
        p = torch.cat([s, sink], -1).softmax(-1)[:, :-1]
        rows.append(p @ v[0, h // g])
    want = attn.o_proj(torch.stack(rows, 1).reshape(1, B, -1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "edit,match",
    [
        ({"draft_vocab_size": 2 * V}, "`draft_vocab_size` 128 needs `vocab_size`"),
        ({"dflash_config": {"mask_embedding": "nope.pt"}}, "`mask_embedding` names 'nope.pt'"),
        ({"is_neox_style": "no"}, "`is_neox_style`"),
        ({"dflash_config": {"attention_sink_bias": 1}}, "`dflash_config.attention_sink_bias`"),
    ],
)
def test_bad_knob_values_are_refused_by_name(tiny_pair, tmp_path, edit, match):
    _, base = _base(tiny_pair)
    d = tmp_path / "draft"
    shutil.copytree(base, d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in edit.items():
        cfg[k] = cfg.get(k, {}) | v if isinstance(v, dict) else v
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ck.CheckpointError, match=match):
        ck.read_draft_config(d)


def test_knob_tensors_are_required(tiny_pair, tmp_path):
    """A config that sets a knob needs its tensors: the sink logits, the map and the head."""
    _, base = _base(tiny_pair)
    for knob, key in [("attention_sink_bias", "attention_sink_bias"), ("draft_vocab_size", "d2t")]:
        d = _knob_draft(base, tmp_path / knob, knob)
        state = load_file(str(d / "model.safetensors"))
        save_file({k: v for k, v in state.items() if key not in k}, str(d / "model.safetensors"))
        with pytest.raises(ck.CheckpointError, match=f"missing tensor keys.*{key}"):
            ck.check_draft_tensors(ck.read_draft_config(d))


@pytest.mark.slow
def test_reduced_vocabulary_draft_is_lossless_end_to_end(tiny_pair, tmp_path):
    """dflash-export's streamed export of a pair whose draft has `draft_vocab_size` with its
    `d2t` map and own head (and the sink logits, a mask embedding and interleaved RoPE, each
    streamed from its checkpoint tensor or file), run by the runtime on ONNX Runtime: tokens
    equal HF greedy `generate`, and the draft's proposals (target ids through the map) are
    accepted."""
    from spec_loop import hf_greedy

    import dflash_qaic
    from dflash_qaic.artifacts.build import ExportOptions, build_artifacts

    t, base = tiny_pair(
        vocab_size=V, tie_word_embeddings=False, target_layer_ids=[1, 3], block_size=4, agree=1.25
    )
    for knob in ("attention_sink_bias", "mask_embedding", "is_neox_style"):
        base = _knob_draft(base, tmp_path / knob, knob)
    d = tmp_path / "draft"
    shutil.copytree(base, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["draft_vocab_size"] = DV
    (d / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(d / "model.safetensors"))
    # the agreeing draft's zero norm ties its logits: it proposes draft id 0, mapped to the
    # target's favourite 0; the other ids map to a scattered subset of the target vocabulary
    targets = torch.cat([torch.tensor([0]), torch.randperm(V - 1)[: DV - 1].sort().values + 1])
    state["d2t"] = targets - torch.arange(DV)
    state["lm_head.weight"] = torch.randn(DV, H)
    save_file(state, str(d / "model.safetensors"))
    opts = ExportOptions(prefill_seq_len=16, ctx_len=96, compile=False)
    build_artifacts(t, d, tmp_path / "art", opts, progress=lambda m: None)
    model = ck.load_target_model(t)
    pipe = dflash_qaic.load(tmp_path / "art")
    lengths = []
    for seed, (n, new) in enumerate([(3, 30), (20, 30)]):
        ids = np.random.default_rng(seed).integers(1, V - 1, n).tolist()
        res = pipe.generate(ids, max_new_tokens=new)
        assert res.tokens == hf_greedy(model, ids, new), (n, new)
        lengths += res.acceptance_lengths
    assert min(lengths) == 1 and max(lengths) > 1, lengths


@pytest.mark.parametrize(
    "dflash,top,want",
    [
        ({"use_swa": True, "swa_window_size": 6}, {}, [(True, 6), (True, 6)]),
        ({"use_swa": True, "causal": False}, {"sliding_window": 5}, [(False, 5), (False, 5)]),
        ({"causal": True}, {}, [(True, None), (True, None)]),
        ({"causal": True}, {"is_causal": False}, [(False, None), (False, None)]),
    ],
)
def test_swa_and_causal_in_dflash_config(tiny_pair, tmp_path, dflash, top, want):
    """`dflash_config.use_swa` / `swa_window_size` / `causal` as vLLM reads them: every layer
    sliding with that window; causality below a top-level `is_causal`."""
    _, base = _base(tiny_pair)
    d = tmp_path / "draft"
    shutil.copytree(base, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"] |= dflash
    cfg |= top
    (d / "config.json").write_text(json.dumps(cfg))
    c = ck.read_draft_config(d)
    assert [c.layer_attention(i) for i in range(c.num_layers)] == want
