"""fp16 as the card computes it (docs/DESIGN.md, fp16; docs/precision.md).

Tiny Qwen3 and Llama targets and drafts whose residual stream carries a *massive activation*
(Sun et al., 2024): one MLP neuron of the first layer writes ~1,000 or ~4,000 into one channel at
every position holding a trigger token, as real checkpoints do on a few tokens. Every exported
program is evaluated fp16-faithfully (each op computes and rounds in fp16, `fp16_check`) and must
give the fp32 tokens and features, with no intermediate within a factor 16 of fp16's maximum;
the whole greedy loop over fp16-faithful programs must commit Hugging Face's fp32 tokens. The
old, unscaled RMSNorm fails the same check (so the check can fail).
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_target_export import (
    BLOCK,
    CHUNK,
    CTX,
    VOCAB,
    greedy_feed,
    hf_reference,
    make_draft_side,
    make_hf,
)

import dflash_qaic
from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
from dflash_qaic.exporter import fp16_check
from dflash_qaic.exporter.graph_check import GraphCheckError, check_graph
from dflash_qaic.exporter.target import check_feeds, export_target
from dflash_qaic.modeling import layers
from dflash_qaic.runtime.pipeline import Pipeline

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance asserted (drafts accepted, every length), seeded tokens

CH = 5  # the massive channel
TRIGGERS = [7, 11]  # the tokens that raise it
LIMIT = fp16_check.FP16_MAX / fp16_check.MARGIN  # 4094


# ---------------------------------------------------------------- massive activations


@torch.no_grad()
def plant_massive(embed, mlp, value: float, measure, triggers=TRIGGERS, neuron=0) -> float:
    """Trigger tokens get 4.0 in channel CH of their embedding row (every other token 0: the
    trigger dominates its row's RMS, so the neuron's output hardly depends on the context); one
    neuron of `mlp` reads it and writes into CH, scaled so that `measure()` (the largest |CH| of
    the residual after that layer) reaches about `value`. Returns what it reaches."""
    embed[:, CH] = 0.0
    embed[triggers, CH] = 4.0
    for lin in (mlp.gate_proj, mlp.up_proj):
        lin.weight[neuron] = 0.0
        lin.weight[neuron, CH] = 2.0  # the neuron itself stays small (~600)
        if lin.bias is not None:
            lin.bias[neuron] = 0.0
    mlp.down_proj.weight[:, neuron] = 0.0
    mlp.down_proj.weight[CH, neuron] = 1.0
    mlp.down_proj.weight[CH, neuron] = 0.97 * value / measure()  # headroom: other contexts
    return measure()


def prompt_with_triggers(n: int, seed: int) -> list[int]:
    ids = np.random.default_rng(seed).integers(0, VOCAB, n)
    ids[[0, n // 3, n // 2]] = [TRIGGERS[0], TRIGGERS[1], TRIGGERS[0]]
    return ids.tolist()


# the target tests' sequences: prefill of p tokens, a verify block and a decode
SEQS = [prompt_with_triggers(p + BLOCK + 1, p) for p in (16, 13)]


def residual_peak(model, seqs, layer: int = 0) -> float:
    """Largest |channel CH| of the residual after `layer` over the sequences (fp32)."""
    return max(
        float(model(torch.tensor([s]), output_hidden_states=True).hidden_states[layer + 1][..., CH]
              .abs().max())
        for s in seqs
    )  # fmt: skip


def massive_target(family: str, n_layers: int, value: float, seqs=SEQS):
    model = make_hf(family, n_layers)

    def measure():
        return residual_peak(model, seqs)

    reached = plant_massive(
        model.model.embed_tokens.weight, model.model.layers[0].mlp, value, measure
    )
    assert 0.9 * value < reached < value  # the residual really carries it
    with torch.no_grad():  # as in real checkpoints, the final norm damps the massive channel
        model.model.norm.weight[CH] = 0.05
    return model


def residual_max(report: fp16_check.Fp16Report) -> float:
    """Largest value the residual stream reached (the decoder layers' residual Adds)."""
    adds = [
        v for v, op in report.op_of.items() if re.match(r"Add /layers\.\d+/Add(_1)? ", op + " ")
    ]
    assert adds
    return max(report.max_abs[v] for v in adds)


def faithful_program(path, io, batch=1) -> fp16_check.FaithfulProgram:
    specs = lambda ts: [{"name": s.name, "shape": list(s.shape)} for s in ts]  # noqa: E731
    symbols = {contract.BATCH: batch, contract.CTX: CTX}
    return fp16_check.FaithfulProgram(path, specs(io.inputs), specs(io.outputs), symbols)


def target_flow(prog, seq: list[int], p: int) -> dict[str, np.ndarray]:
    """Chunked prefill of seq[:p] (last chunk padded), a verify block, a decode; all rows."""
    rows = {contract.NEXT_TOKENS: [], contract.HIDDEN_STATES: []}

    def call(ids, pos, n):
        feed = {
            contract.INPUT_IDS: np.asarray([ids], np.int64),
            contract.POSITION_IDS: np.asarray([pos], np.int64),
            **greedy_feed(1, len(ids)),
        }
        out = prog.run(feed)
        for k in rows:
            rows[k].append(out[k][0, :n])

    for lo in range(0, p, CHUNK):
        ids = seq[lo : min(p, lo + CHUNK)]
        n = len(ids)
        pad = CHUNK - n
        call(ids + [0] * pad, list(range(lo, lo + n)) + [contract.PAD_POSITION] * pad, n)
    call(seq[p : p + BLOCK], list(range(p, p + BLOCK)), BLOCK)
    call(seq[p + BLOCK : p + BLOCK + 1], [p + BLOCK], 1)
    return {k: np.concatenate(v) for k, v in rows.items()}


def assert_same_tokens(tokens: np.ndarray, logits: np.ndarray, tie: float = 0.02) -> None:
    """fp16 tokens equal the fp32 argmax, except where fp32 itself has a near-tie: the chosen
    token's fp32 logit within `tie` of the best (fp16 rounding moves these logits ~1e-2)."""
    ref = logits.argmax(-1)
    chosen = np.take_along_axis(logits, tokens[:, None], -1)[:, 0]
    gap = logits.max(-1) - chosen
    assert (gap < tie).all(), f"fp16 picks {tokens}, fp32 {ref}; logit gaps {gap}"
    assert (tokens == ref).sum() >= len(ref) - 1, (tokens, ref)


FAMILIES = {"qwen3": (3, [0, 2]), "llama": (4, [1, 3, 0])}


def export_massive_target(tmp_path, family, value):
    n_layers, ids = FAMILIES[family]
    model = massive_target(family, n_layers, value)
    fc, hn_w, hn_eps = make_draft_side(len(ids))
    path = tmp_path / "target.onnx"
    facts = export_target(
        model, fc, hn_w, hn_eps, ids, path, ctx_len=CTX, prefill_seq_len=CHUNK, block_size=BLOCK
    )
    io = contract.TargetIO(n_layers, 2, 16, 64, VOCAB, comp_ctx=True)
    return model, (ids, fc, hn_w, hn_eps), path, facts, io


# ---------------------------------------------------------------- the target program


@pytest.mark.parametrize("value", [1000.0, 4000.0])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_target_fp16_faithful_gives_fp32_tokens(tmp_path, family, value):
    model, (ids, fc, hn_w, hn_eps), path, facts, io = export_massive_target(tmp_path, family, value)
    # the export's own graph check ran the faithful evaluation and found nothing near overflow
    faithful = facts["check"]["fp16_faithful"]
    assert faithful["ran"] and faithful["flagged"] == [], faithful
    assert faithful["max_abs"] < LIMIT

    prog = faithful_program(path, io)
    for p, seq in zip((16, 13), SEQS):
        got = target_flow(prog, seq, p)
        logits, hidden, out = hf_reference(model, seq, ids, fc, hn_w, hn_eps)
        assert float(out.hidden_states[-2][0, :, CH].abs().max()) > 0.8 * value
        assert_same_tokens(got[contract.NEXT_TOKENS], logits)
        np.testing.assert_allclose(got[contract.HIDDEN_STATES], hidden, atol=0.05, rtol=0.02)
    report = prog.report
    assert report.runs == 8 and report.flagged == [], report.summary()
    assert 0.9 * value < residual_max(report) < LIMIT, report.summary()


def _plain_rms_forward(self, x, eps_root=None):
    """The old form: squares the raw row (overflows fp16 above |x| ≈ 256)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def trigger_feeds(io, specs) -> list[dict]:
    """The export's check feeds with the trigger tokens in them."""
    feeds = check_feeds(io, specs)
    for f in feeds:
        n = min(len(TRIGGERS), f[contract.INPUT_IDS].shape[1])
        f[contract.INPUT_IDS][:, :n] = TRIGGERS[:n]
    return feeds


def test_unscaled_rmsnorm_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(layers.RMSNorm, "forward", _plain_rms_forward)
    model = massive_target("qwen3", 3, 1000.0)
    path = tmp_path / "target.onnx"
    io = contract.TargetIO(3, 2, 16, 64, VOCAB, comp_ctx=True)
    fc, hn_w, hn_eps = make_draft_side(2)
    export_target(
        model, fc, hn_w, hn_eps, [0, 2], path, ctx_len=CTX, prefill_seq_len=CHUNK,
        block_size=BLOCK, fp16_check=False,
    )  # fmt: skip
    # the graph check fails it ...
    specs = contract.target_specializations(
        contract.shape_plan(BLOCK, CHUNK, CTX, windows=[CTX], verify_lengths=[BLOCK])
    )
    with pytest.raises(GraphCheckError, match="fp16 overflow.*Pow"):
        check_graph(path, io, specs, trigger_feeds(io, specs))
    # ... while ONNX Runtime's fp16 run (fp32 Pow / ReduceMean inside) sees nothing wrong
    check_graph(path, io, specs, trigger_feeds(io, specs), faithful_max_bytes=0)
    # and evaluated faithfully it picks wrong tokens
    prog = faithful_program(path, io)
    got = target_flow(prog, SEQS[0], 16)
    logits, _, _ = hf_reference(model, SEQS[0], [0, 2], fc, hn_w, hn_eps)
    bad = prog.report.nonfinite
    assert bad and any(prog.report.op_of[v].startswith("Pow") for v in bad)
    assert (got[contract.NEXT_TOKENS] != logits.argmax(-1)).sum() >= 3


def test_rmsnorm_fp16_exact_on_tiny_and_huge_rows():
    """The prescaled RMSNorm equals the textbook one in fp32, keeps eps's meaning on tiny rows,
    and stays finite on rows ORT's fp16 would overflow."""
    norm = layers.RMSNorm(8, 1e-6, torch.linspace(0.5, 1.5, 8))
    g = torch.Generator().manual_seed(0)
    for scale in (1e-6, 1e-3, 1.0, 300.0, 4000.0):
        x = torch.randn(3, 8, generator=g, dtype=torch.float64).float() * scale
        want = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(norm(torch.zeros(2, 8)), torch.zeros(2, 8))


def test_graph_check_reports_skip_and_layers(tmp_path):
    model, _, path, facts, io = export_massive_target(tmp_path, "llama", 1000.0)
    check = facts["check"]
    per_layer = check["nodes_per_layer"]
    assert list(per_layer) == ["0", "1", "2", "3", "other"]
    # identical layers, identical graphs (layer 0 also holds the constants they share)
    assert len({per_layer[k] for k in "123"}) == 1 and per_layer["0"] >= per_layer["1"]
    assert sum(per_layer.values()) == check["n_nodes"]
    specs = contract.target_specializations(
        contract.shape_plan(BLOCK, CHUNK, CTX, windows=[CTX], verify_lengths=[BLOCK])
    )
    feeds = check_feeds(io, specs)
    skipped = check_graph(path, io, specs, feeds, faithful_max_bytes=0)
    assert not skipped["fp16_faithful"]["ran"]
    assert "above the faithful check's limit of 0 MiB" in skipped["fp16_faithful"]["skipped"]
    assert skipped["fp16_runs"] == 5 and skipped["fp16_max_abs"] > 0  # ORT fp16 still ran
    off = check_graph(path, io, specs)
    assert "fp16_check off" in off["fp16_faithful"]["skipped"]


# ---------------------------------------------------------------- the whole greedy loop


def massive_pair(tiny_pair, tmp_path, family: str, prompts, value: float):
    """A tiny agreeing pair (acceptance varies) whose target and draft both carry the massive
    channel (the draft at 0.7 of the target's value; both calibrated on `prompts`, and other
    contexts move them by tens of percent): written as checkpoints, so the export path is the
    real one."""
    tied = family == "qwen3"
    t, d = tiny_pair(family=family, agree=3.0, tie_word_embeddings=tied, target_layer_ids=[1, 3])
    t2, d2 = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(t, t2)
    shutil.copytree(d, d2)
    pair = ck.read_pair(t2, d2)
    model = ck.load_target_model(pair.target)

    def measure_target():
        return residual_peak(model, prompts)

    # the draft's MASK token triggers too, so every draft block carries the massive channel
    triggers = TRIGGERS + [pair.draft.mask_token_id]
    embed = model.model.embed_tokens.weight
    mlp = model.model.layers[0].mlp
    assert plant_massive(embed, mlp, value, measure_target, triggers) > 0.9 * value
    with torch.no_grad():
        model.model.norm.weight[CH] = 0.05

    from dflash_qaic.modeling.draft import DFlashDraft

    draft = DFlashDraft.from_checkpoint(pair.draft, ck.load_draft_state(pair.draft))
    seen = {}
    draft.layers[0].register_forward_hook(lambda m, a, out: seen.update(h=out))

    ctx = torch.randn(1, 3, pair.draft.hidden_size, generator=torch.Generator().manual_seed(0))

    def measure_draft():
        block = torch.tensor([TRIGGERS + [pair.draft.mask_token_id] * 2])
        draft(ctx, torch.arange(3)[None], draft.embed(block, embed), 3 + torch.arange(4)[None])
        return float(seen["h"][0, :, CH].abs().max())

    with torch.no_grad():
        reached = plant_massive(embed, draft.layers[0].mlp, 0.7 * value, measure_draft, triggers)
    assert reached > 0.6 * value
    model.save_pretrained(t2)  # the draft reads the target's embedding from here
    state = {k: v.contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(d2 / "model.safetensors"), metadata={"format": "pt"})
    return t2, d2, model


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_loop_under_fp16_faithful_programs(tiny_pair, tmp_path, family):
    prompts = [prompt_with_triggers(n, seed) for seed, n in enumerate((5, 11))]
    prompts = [[i % 200 for i in p] for p in prompts]  # inside the tiny vocabulary (256)
    t, d, model = massive_pair(tiny_pair, tmp_path, family, prompts, 3500.0)
    out = tmp_path / "art"
    m = build_artifacts(
        t, d, out, ExportOptions(prefill_seq_len=8, ctx_len=64, compile=False)
    ).manifest
    for prog in ("target", "draft"):
        faithful = m[prog]["check"]["fp16_faithful"]
        assert faithful["ran"] and faithful["flagged"] == [], (prog, faithful)

    symbols = {contract.BATCH: int(m["batch_size"]), contract.CTX: int(m["ctx_len"])}
    programs = {
        p: fp16_check.FaithfulProgram(out / m[p]["onnx"], m[p]["inputs"], m[p]["outputs"], symbols)
        for p in ("target", "draft")
    }
    pipe = Pipeline(m, programs["target"], programs["draft"])
    fp32 = dflash_qaic.load(out)
    lengths = []
    for ids, new in zip(prompts, (14, 12)):
        n = len(ids)
        want = model.generate(
            torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0
        )[0, n:].tolist()
        res = pipe.generate(ids, max_new_tokens=new)
        assert res.tokens == want, (ids, res.tokens, want)
        assert fp32.generate(ids, max_new_tokens=new).tokens == want
        lengths += res.acceptance_lengths
    assert max(lengths) > 1  # the draft's proposals were accepted, so the draft ran for real
    for name, prog in programs.items():
        report = prog.report
        assert report.flagged == [], (name, report.summary())
        assert 0.5 * 0.7 * 3500 < residual_max(report) < LIMIT, (name, report.summary())
