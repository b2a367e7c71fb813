"""What every family's target program is checked for against Hugging Face, in one place for the
per-family tests (test_gemma4.py, test_gpt_oss.py, test_moe.py): the program exported with a
random draft side; chunked prefill, a verify block and a decode against HF; speculative decoding
= HF greedy at every acceptance length; batched = solo; the fp16-faithful export."""

from __future__ import annotations

import numpy as np
from spec_loop import assert_batched_equals_solo, hf_greedy, program_io, speculate
from test_fp16 import faithful_program
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
from dflash_qaic.exporter.target import export_target


def export_program(model, layer_ids, path, io=None, emit_logits=True) -> dict:
    """`model`'s target program written to `path` (the test shapes CTX, CHUNK, BLOCK), with a
    random draft side: dict(model, fc, hn, facts, io, path); `io` read from the program unless
    given."""
    fc, hn_w, hn_eps = make_draft_side(len(layer_ids))
    shapes = dict(ctx_len=CTX, prefill_seq_len=CHUNK, block_size=BLOCK, emit_logits=emit_logits)
    facts = export_target(model, fc, hn_w, hn_eps, layer_ids, path, **shapes)
    io = program_io(facts, path) if io is None else io
    return dict(model=model, fc=fc, hn=(hn_w, hn_eps), facts=facts, io=io, path=path)


def check_against_hf(e: dict, layer_ids, prompt_len: int) -> np.ndarray:
    """Chunked prefill, a verify block and a decode over a random sequence (seeded by
    prompt_len): logits and the fused feature as HF's, tokens HF's argmax wherever it is clear
    of a near-tie. Returns HF's logits."""
    seq = np.random.default_rng(prompt_len).integers(0, VOCAB, prompt_len + BLOCK + 1).tolist()
    got = run_flow(Runner(session(str(e["path"])), e["io"]), seq, prompt_len)
    logits, hidden, _ = hf_reference(e["model"], seq, layer_ids, e["fc"], *e["hn"])
    np.testing.assert_allclose(got[contract.LOGITS], logits, atol=2e-4, rtol=1e-4)
    clear = margin_ok(logits, 1e-3)
    assert clear.sum() >= len(seq) - 2
    np.testing.assert_array_equal(got[contract.NEXT_TOKENS][clear], logits.argmax(-1)[clear])
    np.testing.assert_allclose(got[contract.HIDDEN_STATES], hidden, atol=1e-4, rtol=1e-4)
    return logits


def check_speculation_equals_hf(e: dict) -> None:
    """Whatever a block's acceptance (0 … B − 1 proposals kept), the committed tokens are
    Hugging Face's greedy `generate`, and every acceptance length occurs."""
    prompt = np.random.default_rng(7).integers(0, VOCAB, 11).tolist()
    n = 24
    ref = hf_greedy(e["model"], prompt, n)
    got, accepted = speculate(Runner(session(str(e["path"])), e["io"]), prompt, ref, n)
    assert got == ref
    assert set(accepted) == set(range(BLOCK))  # every acceptance length occurred


def check_batched_equals_solo(e: dict) -> None:
    assert_batched_equals_solo(session(str(e["path"])), e["io"])


def faithful_export(model, layer_ids, path, io=None):
    """The fp16-faithful check of `model`'s exported program (as dflash-export runs it) found
    nothing near fp16's limit; returns (the export as `export_program`'s, the program evaluated
    with every op rounding in fp16)."""
    e = export_program(model, layer_ids, path, io, emit_logits=False)
    faithful = e["facts"]["check"]["fp16_faithful"]
    assert faithful["ran"] and faithful["flagged"] == [], faithful
    return e, faithful_program(path, e["io"])
