"""The built-in default pair through the whole pipeline: `dflash-export` with no arguments beyond
--out, then ONNX Runtime generation on held-out prompts — lossless, acceptance equal to the
reference step for step, and real acceptance (τ ≥ 4 at block 16)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from dflash.model import DFlashDraftModel, dflash_generate

import dflash_qaic
from dflash_qaic import assets
from dflash_qaic import checkpoints as ck
from dflash_qaic.exporter.cli import main as export_main

pytestmark = (
    pytest.mark.draft_every_step
)  # acceptance compared with the reference and across runs, seeded tokens


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("default")
    assert export_main(["--out", str(out), "--no-compile", "--quiet"]) == 0
    return out


def test_default_pair_draft_choices():
    target, draft = assets.default_pair()
    assert (target, draft) == (assets.ROOT / "pair" / "target", assets.ROOT / "pair" / "draft")
    assert assets.default_pair("dflash") == (target, draft)
    assert assets.default_pair(draft="dflash2") == (target, assets.ROOT / "pair" / "draft-dflash2")
    for bad in ("b16", "DFlash2", ""):
        with pytest.raises(ValueError, match=r"draft must be one of 'dflash', 'dflash2', got"):
            assets.default_pair(bad)


def test_default_export_is_complete_and_reused(artifacts, capsys):
    m = json.loads((artifacts / "manifest.json").read_text())
    assert m["block_size"] == 16 and m["tokenizer"] == "tokenizer"
    assert m["sources"]["target"]["sha256"] == ck.file_digest(assets.default_pair()[0])
    capsys.readouterr()
    assert export_main(["--out", str(artifacts), "--no-compile"]) == 0
    assert "reusing the exported programs" in capsys.readouterr().out


@torch.no_grad()
def test_heldout_prompts_lossless_with_reference_acceptance(artifacts):
    tdir, ddir = assets.default_pair()
    target = ck.load_target_model(tdir)
    ref = DFlashDraftModel.from_pretrained(ddir, dtype=torch.float32).eval()
    pipe = dflash_qaic.load(artifacts)
    pipe.configure(verify_lengths=[pipe.B])  # whole blocks every step, as the reference verifies
    assert pipe.tokenizer is not None
    lengths = []
    for text in assets.heldout_prompts()[:4]:
        ids = pipe.tokenizer(text)["input_ids"]
        res = pipe.generate(text, max_new_tokens=96, stop_token_ids=[])
        out = dflash_generate(ref, target, torch.tensor([ids]), 96, None, return_stats=True)
        assert res.tokens == out.output_ids[0, len(ids) :].tolist()
        # every reference step whose whole block fit before max_new_tokens
        start, k = len(ids), 0
        for n in out.acceptance_lengths:
            if len(ids) + 96 - start < 16:
                break
            start, k = start + n, k + 1
        assert k >= 1 and res.acceptance_lengths[:k] == out.acceptance_lengths[:k]
        assert res.text == pipe.tokenizer.decode(res.tokens)
        lengths += res.acceptance_lengths
    assert sum(lengths) / len(lengths) >= 4.0, lengths


def test_demo_runs_on_the_exported_pair(artifacts, capsys):
    from dflash_qaic import demo

    argv = ["--out", str(artifacts), "--prompts", "2", "--repeats", "1", "--max-new-tokens", "40"]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    assert "reusing the exported programs" in out
    assert "output identical to the target alone: yes" in out
    assert "speedup over the target alone = " in out and "2 prompt(s) × 1 rounds" in out
    # every thread count worth trying is tried, and the speedup is the fastest one's
    cpus = len(os.sched_getaffinity(0))
    if cpus > 1:
        line = next(x for x in out.splitlines() if x.startswith("fastest here:"))
        per = {int(t): float(ms) for t, ms in re.findall(r"(\d+) thread\(s\) ([\d.]+) ms", line)}
        assert set(per) == {1, cpus}, line
        best = min(per, key=per.get)
        assert (
            line.startswith(f"fastest here: {best} ONNX")
            and f"{best} ONNX Runtime thread(s))" in out
        )


def test_requests_at_the_end_of_the_context_get_every_token(artifacts):
    """The red team's cases on the built-in pair (ctx 1024, B 16): prompt + max_tokens up to
    ctx_len − 1, which the server and generate accept, give every token asked for, equal to the
    target alone (before: 1007 + 16 gave 2 tokens, 1000 + 23 gave 9, finish "length")."""
    pipe = dflash_qaic.load(artifacts)
    text = "\n".join(assets.heldout_prompts() * 8)
    ids = pipe.tokenizer(text)["input_ids"]
    for n_prompt, new in ((1007, 16), (1000, 23), (990, 33)):
        p = ids[:n_prompt]
        got = pipe.generate(p, max_new_tokens=new, stop_token_ids=[])
        base = pipe.generate_baseline(p, max_new_tokens=new, stop_token_ids=[])
        assert len(got.tokens) == new and got.stop_reason == "max_new_tokens", (n_prompt, new)
        assert got.tokens == base.tokens
