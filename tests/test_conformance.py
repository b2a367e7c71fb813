"""The conformance ladder: every model family and draft form (tests/conftest.py: FAMILIES,
DRAFT_FORMS) climbs the same rungs, each rung one test, on one tiny pair per case exported once
per session (the `exported` fixture):

1. logits: every row the target program commits equals Hugging Face's own model class;
2. tokens: the whole loop equals HF greedy `generate` (lossless), acceptance varying 1 … B;
3. acceptance: per-step acceptance equals the reference `dflash_generate`'s (whole blocks;
   on hybrids only up to where the reference leaves HF greedy, REFERENCE.md §9);
4. batched = solo: continuous-batching artifacts, more requests than cache rows;
5. stand-in = ORT: the strict AI100 stand-in runs the same steps, greedy and sampled;
6. fp16-faithful: the export's fp16 run of every specialization flagged nothing;
7. slot round trip: a sequence's retained state read from its cache row (`read_slot`, through
   SlotState's bytes) and written into another (`write_slot`), target and draft, on ONNX
   Runtime and on the strict stand-in: both rows go on to the same tokens, acceptance and
   cache bytes (what a prefill/decode hand-off moves);
8. P/D = aggregated: a prefill pipeline's payload (the target's rows of the prompt's first
   P − 1 positions and the draft's context) admitted by a decode pipeline on the same
   artifacts: the same greedy and seeded tokens and acceptance as the aggregated run.

Streamed export = in-memory export per family lives in tests/test_streaming_export.py (dense
families), tests/test_moe_runtime.py (MoE forms) and tests/test_hybrid.py (the published
hybrid form), beside each family's edge cases.
"""

from __future__ import annotations

import copy
import heapq

import numpy as np
import pytest
import torch
from conftest import DRAFT_FORMS, FAMILIES, REFERENCE_LEAVES_HF

from dflash_qaic import contract
from dflash_qaic.runtime import handoff
from dflash_qaic.state import SlotState

pytestmark = (
    pytest.mark.draft_every_step
)  # per-step acceptance against the reference, across runs and programs

UNTIED = dict(tie_word_embeddings=False, target_layer_ids=[1, 3])
# case -> (family, draft form, TinySpec fields, prefill chunk, ctx_len); a biased pair (`agree`,
# or a small vocabulary) so acceptance varies from 1 to B
CASES = {
    "qwen3": ("qwen3", "dflash", dict(block_size=4, agree=1.25), 8, 160),
    "llama": ("llama", "dflash", dict(block_size=8, agree=1.25), 16, 160),
    "qwen3_moe": ("qwen3_moe", "dflash", dict(block_size=4, agree=2.0), 8, 160),
    "qwen3_5": ("qwen3_5", "dflash", dict(block_size=4, agree=1.0), 16, 112),
    "qwen3_5_moe": ("qwen3_5_moe", "dflash", dict(block_size=4, agree=1.0), 16, 112),
    "gemma4": ("gemma4", "dflash", dict(block_size=4, agree=0.9), 8, 160),
    "gemma4_moe": ("gemma4_moe", "dflash", dict(block_size=4, agree=0.9), 8, 160),
    "gpt_oss": ("gpt_oss", "dflash", dict(block_size=4, agree=3.0), 8, 160),
    "deepseek_v3": ("deepseek_v3", "dflash", dict(block_size=4, agree=2.0), 8, 160),
    "glm4_moe_lite": ("glm4_moe_lite", "dflash", dict(block_size=4, agree=2.0), 8, 160),
    "minimax_m2": ("minimax_m2", "dflash", dict(block_size=4, agree=2.0), 8, 160),
    "kimi_k25": ("kimi_k25", "dflash", dict(block_size=4, agree=2.0, multimodal=True), 8, 160),
    "qwen3-dflash2": ("qwen3", "dflash2", dict(block_size=8, vocab_size=24, agree=2.0), 16, 160),
    "qwen3-sliding": ("qwen3", "sliding", dict(block_size=8, vocab_size=24), 16, 160),
}
#: each family's own Hugging Face class, which the tiny target loads as
HF_CLASS = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "gemma4_moe": "Gemma4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "kimi_k25": "DeepseekV3ForCausalLM",  # the wrapper's text model (built from text_config)
}
assert (
    {c[0] for c in CASES.values()} == set(FAMILIES) == set(HF_CLASS)
)  # every family climbs the ladder
assert {c[1] for c in CASES.values()} == set(DRAFT_FORMS)  # and every draft form


def build(exported, case, **options):
    """The case's pair exported with these options (one export per (case, options) a session)."""
    family, form, pair, chunk, ctx = CASES[case]
    return exported(family, form, pair={**UNTIED, **pair}, prefill_seq_len=chunk, ctx_len=ctx,
                    **options)  # fmt: skip


def vocab(case) -> int:
    return CASES[case][2].get("vocab_size", 256)


def prompt(case, n, seed) -> list[int]:
    hi = min(200, vocab(case) - 1)
    return torch.randint(1, hi, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompts(case) -> list[tuple[int, int]]:
    """(prompt length, new tokens): one token, under a chunk, over one, over two."""
    chunk = CASES[case][3]
    return [(1, 30), (chunk - 1, 33), (chunk + 3, 25), (2 * chunk + 5, 41)]


def hf_greedy(model, ids, n, **kw) -> list[int]:
    """HF greedy `generate`'s n tokens after `ids`, no stop token; kw: more generate settings."""
    x = torch.tensor([ids])  # an explicit mask: token 0 in the ids is not padding
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0, **kw,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def whole_block_steps(ref_lengths, n, new, B) -> int:
    """How many leading reference steps verified a whole block (it shrinks its last blocks)."""
    start, k = n, 0
    for a in ref_lengths:
        if n + new - start < B:
            break
        start, k = start + a, k + 1
    return k


#: distinct acceptance lengths a biased case shows: the tiny Gemma 4 pairs accept 1 or B (their
#: soft-capped logits make the draft all right or wrong at once); every length 1 … B is forced
#: on them by tests/test_gemma4.py's speculative loop
VARIETY = {"gemma4": 2, "gemma4_moe": 2}


def assert_varied(pair, B, lengths, case="") -> None:
    """A biased pair's acceptance varies from 1 to B step to step; an unbiased one (the small
    vocabulary, the draft's own proposals) has steps that accept more than the target's token
    (the draft ran for real; rung 3 compares its steps with the reference's)."""
    if "agree" in pair:
        want = VARIETY.get(case, 3)
        assert min(lengths) == 1 and max(lengths) >= B - 1 and len(set(lengths)) >= want, lengths
    else:
        assert min(lengths) == 1 and max(lengths) > 1, lengths


parametrize = pytest.mark.parametrize("case", sorted(CASES))


def parametrize_but(**slow: str):
    """The cases, those named in `slow` (case -> the fast rung that covers its path) in the slow
    tier only: a rung whose code path another case's fast rung already runs."""
    marks = [pytest.mark.slow]
    return pytest.mark.parametrize(
        "case", [pytest.param(c, marks=marks) if c in slow else c for c in sorted(CASES)]
    )


# the draft form leaves the target program as it is: qwen3's target, rung 1 [qwen3]
@parametrize_but(**{"qwen3-dflash2": "[qwen3]", "qwen3-sliding": "[qwen3]"})
def test_logits_equal_hf(exported, case):
    """Every row of every target call that lies on the committed sequence (prefill rows, and
    verify rows up to the first rejected proposal) has HF's logits at that position."""
    e = build(exported, case, emit_logits=True, fp16_check=False)
    model = e.model()
    pipe = e.load(verify_lengths=CASES[case][2]["block_size"])
    calls = []
    run = pipe.target.run

    def record(feeds):
        out = run(feeds)
        ids, pos = feeds[contract.INPUT_IDS], feeds[contract.POSITION_IDS]
        calls.append((ids.copy(), pos.copy(), np.array(out[contract.LOGITS], copy=True)))
        return out

    pipe.target.run = record
    rows = 0
    for seed, (n, new) in enumerate(prompts(case)[1:3]):
        calls.clear()
        ids = prompt(case, n, 60 + seed)
        seq = ids + pipe.generate(ids, max_new_tokens=new, stop_token_ids=[]).tokens
        with torch.no_grad():
            want = model(torch.tensor([seq])).logits[0].numpy()
        worst = 0.0
        for x, p, logits in calls:
            for j in range(x.shape[1]):
                q = int(p[0, j])
                if q < 0 or q >= len(seq) - 1 or int(x[0, j]) != seq[q]:
                    break  # padding, past the end, or off the committed path
                worst = max(worst, float(np.abs(logits[0, j] - want[q]).max()))
                rows += 1
        assert worst < 1e-3, (case, n, worst)
    assert rows > 2 * CASES[case][3]  # the prompts' rows and many verify rows were compared


@parametrize
def test_tokens_equal_hf_greedy(exported, case, planned_chunks):
    e = build(exported, case)
    _, _, pair, chunk, ctx = CASES[case]
    B = pair["block_size"]
    model, pipe = e.model(), e.load(verify_lengths=B)
    assert type(model).__name__ == HF_CLASS[CASES[case][0]]
    lengths = []
    for seed, (n, new) in enumerate(prompts(case)):
        ids = prompt(case, n, seed)
        res = pipe.generate(ids, max_new_tokens=new, stop_token_ids=[])
        assert res.tokens == hf_greedy(model, ids, new), (case, n)
        assert len(res.tokens) == new and res.stop_reason == "max_new_tokens"
        assert sum(res.acceptance_lengths) == new - 1
        # the draft takes up to draft_prefill_rows of context a call: fewer calls than chunks
        rows = contract.draft_prefill_rows(ctx, chunk, B)
        assert rows > chunk and res.stats["draft_prefill_calls"] == -(-n // rows)
        chunks = contract.prefill_lengths(chunk, B)
        assert res.stats["prefill_calls"] == len(planned_chunks(n, chunks))
        lengths += res.acceptance_lengths
        # the target alone on the same programs: the same tokens
        assert pipe.generate_baseline(ids, 12, stop_token_ids=[]).tokens == res.tokens[:12]
    assert_varied(pair, B, lengths, case)


@parametrize
@torch.no_grad()
def test_acceptance_equals_reference(exported, case):
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate

    family, form, pair, chunk, _ = CASES[case]
    e = build(exported, case)
    B, model, pipe = pair["block_size"], e.model(), e.load(verify_lengths=pair["block_size"])
    cls = DFlash2DraftModel if form == "dflash2" else DFlashDraftModel
    ref = cls.from_pretrained(e.draft, dtype=torch.float32).eval()
    compared, lengths = 0, []
    for seed, n in enumerate([3, chunk + 1, 2 * chunk + 7]):
        ids = prompt(case, n, 100 + seed)
        out = dflash_generate(ref, model, torch.tensor([ids]), 40, None, return_stats=True)
        res = pipe.generate(ids, max_new_tokens=40, stop_token_ids=[])
        theirs = out.output_ids[0, n:].tolist()
        k = whole_block_steps(out.acceptance_lengths, n, 40, B)
        if family in REFERENCE_LEAVES_HF:
            # compared up to where the reference leaves HF greedy (our tokens are HF's: rung 2)
            same = next((i for i, (a, b) in enumerate(zip(res.tokens, theirs)) if a != b), 40)
            done, k2 = 1, 0  # the first token comes from prefill
            for a in out.acceptance_lengths[:k]:
                if done + a > same:
                    break
                done, k2 = done + a, k2 + 1
            k = k2
        else:
            assert res.tokens == theirs, (case, n)
        assert res.acceptance_lengths[:k] == out.acceptance_lengths[:k], (case, n)
        compared += k
        lengths += out.acceptance_lengths[:k]
    assert compared >= 6, compared
    # where the reference leaves HF greedy, only the steps before it compare: fewer lengths
    want = 2 if family in REFERENCE_LEAVES_HF else VARIETY.get(case, 3)
    assert len(set(lengths)) >= want if "agree" in pair else sum(a > 1 for a in lengths) >= 3, (
        lengths
    )


@parametrize
def test_batched_equals_solo(exported, case):
    """4 requests on 3 cache rows (one waits for a free row), mixed lengths: each equals its
    own run on the single-sequence programs, tokens and steps."""
    B, chunk = CASES[case][2]["block_size"], CASES[case][3]
    solo = build(exported, case).load(verify_lengths=B)
    pipe = build(exported, case, full_batch_size=3).load(verify_lengths=B)
    ps = [prompt(case, n, 40 + n) for n in (5, chunk + 2, 4 * chunk + 6, 9)]  # 70: rings wrap
    news = [20, 31, 17, 26]
    batch = pipe.generate(ps, max_new_tokens=news, stop_token_ids=[])
    free = build(exported, case, full_batch_size=3).load()  # verify lengths chosen by cost
    chosen = free.generate(ps, max_new_tokens=news, stop_token_ids=[])
    for ids, new, res, res2 in zip(ps, news, batch, chosen):
        one = solo.generate(ids, max_new_tokens=new, stop_token_ids=[])
        assert res.tokens == one.tokens and res.acceptance_lengths == one.acceptance_lengths
        assert res2.tokens == one.tokens
        assert pipe.generate_baseline(ids, 10, stop_token_ids=[]).tokens == one.tokens[:10]


# the stand-in keeps state as its dense sibling does (an MoE block holds none): [qwen3],
# [qwen3_5] and [gemma4] run the same buffer logic
@parametrize_but(qwen3_moe="[qwen3]", qwen3_5_moe="[qwen3_5]", gemma4_moe="[gemma4]")
def test_standin_equals_ort(exported, case):
    """The AI100 buffer logic (strict stand-in: compiled specializations only, retained state)
    runs the same steps as ONNX Runtime, greedy and seeded-sampled."""
    e = build(exported, case)
    B, chunk = CASES[case][2]["block_size"], CASES[case][3]
    a, s = e.load(verify_lengths=B), e.load(verify_lengths=B, backend="qaic-standin")
    # the prefix cache saves a rolling state at block boundaries through read_slot, an exchange
    # by design (docs/prefix-caching.md); the steps themselves make none
    s.configure(enable_prefix_caching=False)
    for n in (5, 4 * chunk + 6):
        ids = prompt(case, n, n)
        x, y = a.generate(ids, 24, stop_token_ids=[]), s.generate(ids, 24, stop_token_ids=[])
        assert x.tokens == y.tokens and x.acceptance_lengths == y.acceptance_lengths
    ids = prompt(case, chunk + 4, 3)
    x = a.generate(ids, 40, temperature=1.0, seed=5, stop_token_ids=[])
    y = s.generate(ids, 40, temperature=1.0, seed=5, stop_token_ids=[])
    assert x.tokens == y.tokens and x.acceptance_lengths == y.acceptance_lengths
    assert len(set(x.acceptance_lengths)) >= 2  # the sampled steps accepted differently
    # no retained state crossed to the host in any call
    assert s.target.session.exchanges == s.draft.session.exchanges == 0


def fork(engine, seq, row: int, programs) -> object:
    """A copy of `seq` (stepping in its cache row) in the free row `row`: each program's slot
    state moved through SlotState's bytes (read_slot, write_slot), and the host's per-slot
    step state and the sequence copied. Returns the copy."""
    a = seq.slot
    upto = int(engine.spec.state.start[a])  # the anchor's position: slots below it committed
    for p in programs:
        moved = SlotState.from_bytes(p.read_slot(a, upto).to_bytes())
        assert not p.read_slot(row, upto).same(moved)  # the row held none of it before
        p.write_slot(row, moved)
        assert p.read_slot(row, upto).same(moved)
    st, N = engine.spec.state, len(engine.slots)
    for value in vars(st).values():  # every per-slot array of the step state
        if isinstance(value, np.ndarray) and value.shape[:1] == (N,):
            value[row] = value[a]
    twin = copy.deepcopy(seq)
    twin.slot, engine.slots[row] = row, twin
    engine.free.remove(row)
    heapq.heapify(engine.free)
    engine.sampling.set_row(row, twin.req.sampling)
    engine.spec.join(row)
    engine._changed = True
    return twin


@parametrize
def test_slot_round_trip(exported, case):
    """Generate on row 0 for a few steps, move the sequence's state (target and draft) into
    row 2, continue both: the same tokens and acceptance as each other and as the sequence
    alone, and the same cache bytes, on ONNX Runtime and on the strict AI100 stand-in."""
    B, chunk = CASES[case][2]["block_size"], CASES[case][3]
    ids, new = prompt(case, chunk + 3, 21), 30
    solo = build(exported, case).load(verify_lengths=B).generate(ids, new, stop_token_ids=[])
    for backend in ("ort", "qaic-standin"):
        pipe = build(exported, case, full_batch_size=3).load(verify_lengths=B, backend=backend)
        engine = pipe.engine()
        seq = engine.add(pipe.request(ids, new, stop_token_ids=[]))
        while len(seq.lengths) < 2:
            engine.step()
        assert seq.slot == 0 and seq.decoding
        twin = fork(engine, seq, 2, (pipe.target, pipe.draft))
        while engine.busy:
            engine.step()
        assert seq.result.tokens == twin.result.tokens == solo.tokens, backend
        assert (
            twin.lengths == seq.lengths and seq.result.acceptance_lengths == solo.acceptance_lengths
        )
        upto = len(ids) + new - 1  # every position committed and written in both rows
        for p in (pipe.target, pipe.draft):
            assert p.read_slot(0, upto).same(p.read_slot(2, upto)), (backend, case)


@parametrize
def test_pd_equals_aggregated(exported, case):
    """P/D = aggregated: a prefill pipeline prefills the prompt's first P − 1 positions and
    exports the target's rows and the draft's context (runtime/handoff.py); a decode pipeline
    on the same artifacts admits the request with that payload, computes the last prompt token
    and goes on: greedy and seeded tokens and per-step acceptance equal the aggregated run's
    (whole-block verify lengths, the `always` policy), with two requests in flight."""
    B, chunk = CASES[case][2]["block_size"], CASES[case][3]
    ids, new = prompt(case, 4 * chunk + 6, 23), 24  # more context than one draft call takes
    agg = build(exported, case).load(verify_lengths=B)
    agg.configure(spec_policy="always")
    sampled = agg.can_sample
    runs = [dict()] + ([dict(temperature=1.0, seed=9)] if sampled else [])
    solo = [agg.generate(ids, new, stop_token_ids=[], **sp) for sp in runs]
    pre, dec = (build(exported, case, full_batch_size=2).load(verify_lengths=B) for _ in "pd")
    for p in (pre, dec):
        p.configure(spec_policy="always")
    payload = handoff.export(pre.engine(), pre.artifacts, ids)
    engine = dec.engine()
    seqs = [
        handoff.admit(
            engine, dec.artifacts, dec.request(ids, new, stop_token_ids=[], **sp), payload
        )
        for sp in runs
    ]
    while engine.busy:
        engine.step()
    for seq, ref in zip(seqs, solo, strict=True):
        assert seq.result.tokens == ref.tokens, case
        assert seq.result.acceptance_lengths == ref.acceptance_lengths, case
    assert not engine.running and sorted(engine.free) == [0, 1]


@parametrize
def test_fp16_faithful(exported, case):
    """The export ran both programs in fp16-faithful arithmetic over every specialization and
    found nothing near overflow (the check itself is tested in tests/test_fp16.py)."""
    m = build(exported, case).load(tokenizer=False).artifacts
    for prog in (m.target, m.draft):
        rep = prog.check["fp16_faithful"]
        assert rep["ran"] and not rep["flagged"] and np.isfinite(rep["max_abs"]), rep


def test_every_registered_family_climbs_the_ladder():
    """A family added to the registry (dflash_qaic/families/) without a ladder case fails here:
    add it to FAMILIES (tests/conftest.py) and a case to CASES above."""
    from dflash_qaic import families

    assert set(families.names()) == set(FAMILIES)
