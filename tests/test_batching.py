"""Continuous batching (docs/DESIGN.md, Continuous batching): programs exported with
`full_batch_size`, the engine that admits requests into free slots while others keep stepping,
and the list form of `generate`.

Lossless per request: every request's greedy tokens equal Hugging Face greedy generate and its
own solo run, whatever else shares the batch and whenever it joined; sampling is per-request
seeded (a request's tokens equal its solo run with the same seed) and distributed as the target's
own sampling. Inactive rows change nothing readable; the AI100 stand-in runs the same engine on
the compiled specializations only; bad batches fail clearly.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from test_runtime import hf_greedy, prompt
from test_sampling import PROMPT as SAMPLING_PROMPT
from test_sampling import V as SAMPLING_V
from test_sampling import batched_first_two, gof, gof_pvalue

import dflash_qaic
from dflash_qaic import checkpoints as ck
from dflash_qaic import contract
from dflash_qaic.artifacts.build import ExportError, ExportOptions, build_artifacts
from dflash_qaic.artifacts.manifest import ArtifactsError, Manifest
from dflash_qaic.runtime import GenerationError

pytestmark = pytest.mark.draft_every_step  # acceptance and seeded tokens compared across runs

N = 3  # slots: fewer than most batches below, so requests also queue for a free slot
# family, block, prefill chunk, ctx, agreement bias (see dflash_lab.tiny)
CONFIGS = [("qwen3", 4, 8, 160, 1.25), ("llama", 8, 16, 160, 1.25)]
CONFIGS += [("qwen3", 4, 32, 160, 2.0)]  # two prefill lengths, 8 and the chunk of 32


@pytest.fixture(scope="module")
def built(exported):
    """built(family, B, chunk, ctx, agree, …) -> (target, draft, artifacts, HF model), exported
    once per session (tests/conftest.py)."""

    def make(family, B, chunk, ctx, agree, full_batch_size=N, sampling=True, vocab=None):
        pair = dict(block_size=B, agree=agree, tie_word_embeddings=False, target_layer_ids=[1, 3])
        if vocab:
            pair["vocab_size"] = vocab
        e = exported(family, pair=pair, prefill_seq_len=chunk, ctx_len=ctx,
                     full_batch_size=full_batch_size, sampling=sampling)  # fmt: skip
        return e.target, e.draft, e.artifacts, e.model()

    return make


# ---------------------------------------------------------------- the programs


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2]], ids=["one-prefill-length", "two"])
def test_export_has_the_continuous_batching_form(built, cfg):
    _, _, art, _ = built(*cfg)
    m = dflash_qaic.load(art).artifacts
    assert m.full_batch_size == N
    for prog in (m.target, m.draft):
        names = [s.name for s in prog.io.inputs]
        assert contract.BATCH_INDEX in names
        bi = next(s for s in prog.io.inputs if s.name == contract.BATCH_INDEX)
        assert bi.shape == (contract.BATCH, 1) and bi.dtype == "int64"
        assert all(s.shape[0] == contract.FULL_BATCH for s in prog.io.kv)
        prefill = contract.PREFILLS if prog.kind == "target" else (contract.DRAFT_PREFILL,)
        for s in prog.specializations:
            want = 1 if s["kind"] in prefill else N
            assert s["symbols"][contract.BATCH] == want, s
        assert all(s["symbols"][contract.FULL_BATCH] == N for s in prog.specializations)
        graph = onnx.load(str(art / prog.onnx), load_external_data=False).graph
        ops = {n.op_type for n in graph.node}
        assert "CtxScatterCB" in ops and "CtxScatter" not in ops
        # the ONNX inputs are the contract's, in order, batch_index named as QEfficient does
        assert [i.name for i in graph.input] == names


def test_manifest_checks_full_batch_size(built):
    _, _, art, _ = built(*CONFIGS[0])
    data = dflash_qaic.load(art).artifacts.to_json()
    # the specializations are stored once, as the shape plan: they follow full_batch_size
    assert "specializations" not in data["target"] and "specializations" not in data["draft"]
    rows = {s["symbols"]["batch_size"] for s in Manifest.from_json(data).target.specializations}
    assert max(rows) == N
    other = Manifest.from_json({**data, "full_batch_size": N + 1}).target.specializations
    assert max(s["symbols"]["batch_size"] for s in other) == N + 1
    bad = {**data, "full_batch_size": None}  # the programs were exported with cache rows
    with pytest.raises(ArtifactsError, match="continuous_batching"):
        Manifest.from_json(bad)


def test_batch_size_flag_points_to_full_batch_size(tiny_pair, tmp_path):
    t, d = tiny_pair(family="qwen3")
    with pytest.raises(ExportError, match="--full-batch-size 4"):
        build_artifacts(t, d, tmp_path / "o", ExportOptions(batch_size=4, compile=False))
    with pytest.raises(ExportError, match="--full-batch-size must be an integer"):
        ExportOptions(full_batch_size=0)


def test_windows_option_is_checked():
    with pytest.raises(ExportError, match="--comp-ctx-lengths must be distinct ascending"):
        ExportOptions(ctx_len=256, comp_ctx_lengths=(128, 64, 256))
    with pytest.raises(ExportError, match="ending at --ctx-len 256"):
        ExportOptions(ctx_len=256, comp_ctx_lengths=(64, 128))
    assert ExportOptions(ctx_len=256, comp_ctx_lengths=[64, 256]).comp_ctx_lengths == (64, 256)


def _caches(prog) -> list[np.ndarray]:
    return [v.numpy().copy() for v in prog.caches]


def _feeds(pipe, rows, seq, ids, pos, bidx):
    m = pipe.artifacts
    f = {
        contract.INPUT_IDS: np.full((rows, seq), ids, np.int64),
        contract.POSITION_IDS: np.asarray(pos, np.int64).reshape(rows, seq),
        contract.BATCH_INDEX: np.asarray(bidx, np.int64).reshape(rows, 1),
        contract.COMP_CTX_LENGTHS: np.arange(m.ctx_len, dtype=np.int64),
    }
    if m.target.io.sampling:
        f[contract.TEMPERATURE] = np.zeros(rows, np.float32)
        f[contract.TOP_K] = np.zeros(rows, np.int64)
        f[contract.TOP_P] = np.ones(rows, np.float32)
        sl = m.plan.sample_len(seq, True)
        f[contract.RANDOM_U] = np.zeros((rows, sl, contract.N_RANDOM), np.float32)
    return f


def test_inactive_rows_change_nothing_readable(built):
    """A full-batch call whose rows are all inactive (batch_index and positions -1) writes only
    cache row 0's padding slot; a batch-1 prefill into slot 2 writes only cache row 2."""
    _, _, art, _ = built(*CONFIGS[0])
    pipe = dflash_qaic.load(art)
    pipe.generate([prompt(12, s) for s in range(N)], max_new_tokens=6)  # fill every row
    prog, B, ctx = pipe.target, pipe.B, pipe.ctx_len
    before = _caches(prog)
    pipe.target.run(_feeds(pipe, N, B, 5, [-1] * (N * B), [-1] * N))
    after = _caches(prog)
    pad = ctx - 1
    for a, b in zip(before, after):
        changed = np.argwhere((a != b).any(-1))  # (row, head, slot)
        assert {(int(r), int(s)) for r, _, s in changed} <= {(0, pad)}
        np.testing.assert_array_equal(a[..., :pad, :], b[..., :pad, :])
    # a prefill chunk at batch 1 into slot 2, its last rows padding
    chunk = pipe.chunk
    pos = list(range(4)) + [-1] * (chunk - 4)
    pipe.target.run(_feeds(pipe, 1, chunk, 7, pos, [2]))
    final = _caches(prog)
    for a, b in zip(after, final):
        rows = {int(r) for r, _, _ in np.argwhere((a != b).any(-1))}
        assert rows == {2}
        slots = {int(s) for _, s in np.argwhere((a[2] != b[2]).any(-1))}
        assert slots <= {0, 1, 2, 3, pad} and {0, 1, 2, 3} <= slots


# ---------------------------------------------------------------- lossless per request


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}-B{c[1]}")
def test_batch_is_lossless_per_request(built, cfg, planned_chunks):
    _, B, chunk, _, _ = cfg
    _, _, art, model = built(*cfg)
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[B])  # whole blocks: every acceptance length happens
    shapes = [(1, 30), (chunk - 1, 41), (chunk + 3, 25), (2 * chunk + 5, 57), (3 * chunk - 2, 33)]
    prompts = [prompt(n, seed) for seed, (n, _) in enumerate(shapes)]
    news = [new for _, new in shapes]
    results = pipe.generate(prompts, max_new_tokens=news)
    assert isinstance(results, list) and len(results) == len(prompts)
    lengths = []
    for ids, new, res in zip(prompts, news, results):
        assert res.tokens == hf_greedy(model, ids, new), (len(ids), new)
        assert res.stop_reason == "max_new_tokens" and sum(res.acceptance_lengths) == new - 1
        assert res.stats["prefill_calls"] == len(
            planned_chunks(len(ids), contract.prefill_lengths(chunk, B))
        )
        assert 0 <= res.stats["slot"] < N
        lengths += res.acceptance_lengths
    assert min(lengths) == 1 and max(lengths) >= B - 1 and len(set(lengths)) >= 3, lengths
    # the same batch on the target alone (decode at N rows) gives the same tokens
    base = pipe.generate_baseline(prompts, max_new_tokens=news)
    assert [b.tokens for b in base] == [r.tokens for r in results]


@pytest.mark.parametrize("policy", [1, None], ids=["one-chunk-per-step", "all-prefills-first"])
def test_requests_joining_mid_flight_equal_their_solo_run(built, policy):
    """Requests admitted while others are mid-generation (and queued for a slot) commit exactly
    their solo tokens; each request's acceptance lengths equal its solo run's."""
    _, _, art, _ = built(*CONFIGS[1])
    pipe = dflash_qaic.load(art)
    pipe.configure(verify_lengths=[pipe.B])  # the same steps alone and batched
    reqs = [pipe.request(prompt(5 + 7 * i, 100 + i), 20 + 9 * i, []) for i in range(6)]
    solo = [pipe.generate(r.ids, r.max_new_tokens, stop_token_ids=[]) for r in reqs]
    engine = pipe.engine("dflash", prefill_chunks_per_step=policy)
    seqs, steps, in_flight = [], 0, []
    pending = list(reqs)
    while pending or engine.busy:
        if pending and steps % 2 == 0:  # a newcomer every other step
            seqs.append(engine.add(pending.pop(0)))
        engine.step()
        in_flight.append(engine.running)
        steps += 1
    assert max(in_flight) == N  # the slots really were shared
    for seq, ref in zip(seqs, solo):
        assert seq.result.tokens == ref.tokens
        assert seq.result.acceptance_lengths == ref.acceptance_lengths
    assert {s.result.stats["slot"] for s in seqs} == set(range(N))


def test_engine_config_is_one_frozen_checked_value(built):
    from dataclasses import FrozenInstanceError

    from dflash_qaic.runtime.engine import EngineConfig

    for bad, match in (
        (dict(mode="fast"), "mode must be one of"),
        (dict(max_running=0), "max_running must be an integer ≥ 1 or None"),
        (dict(prefill_chunks_per_step=1.5), "prefill_chunks_per_step must be an integer"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    cfg = EngineConfig(verify_lengths=[4])
    assert cfg.verify_lengths == (4,)
    with pytest.raises(FrozenInstanceError):
        cfg.max_running = 2
    _, _, art, _ = built(*CONFIGS[0])
    pipe = dflash_qaic.load(art)
    old = pipe.configure(max_running=2, prefill_chunks_per_step=1)
    pinned = dict(spec_policy="always")  # the module's draft_every_step mark
    assert old == EngineConfig(**pinned) and pipe.config.max_running == 2
    engine = pipe.engine("baseline")  # a copy of the config, with the mode
    assert engine.config == EngineConfig("baseline", 2, 1, **pinned) and engine.max_running == 2
    pipe.configure(old)
    assert engine.config.max_running == 2  # an engine keeps the config it was made with
    with pytest.raises(ValueError, match="pick some of them"):
        pipe.configure(verify_lengths=[3])
    assert pipe.config == old  # a refused change leaves the config as it was


def test_max_running_holds_the_concurrency(built):
    _, _, art, _ = built(*CONFIGS[0])
    pipe = dflash_qaic.load(art)
    reqs = [pipe.request(prompt(4 + i, 200 + i), 12, []) for i in range(5)]
    engine = pipe.engine("dflash", max_running=2)
    seqs = [engine.add(r) for r in reqs]
    in_flight = []
    while engine.busy:
        engine.step()
        in_flight.append(engine.running)
    assert max(in_flight) == 2
    solo = [pipe.generate(r.ids, 12, stop_token_ids=[]).tokens for r in reqs]
    assert [s.result.tokens for s in seqs] == solo


def test_stops_and_context_end_inside_a_batch(tiny_pair, tmp_path):
    t, d = tiny_pair(
        family="qwen3", block_size=8, agree=1.25, tie_word_embeddings=False, target_layer_ids=[1, 3]
    )
    opts = ExportOptions(prefill_seq_len=8, ctx_len=40, compile=False, full_batch_size=2)
    build_artifacts(t, d, tmp_path, opts)
    pipe = dflash_qaic.load(tmp_path)
    model = ck.load_target_model(t)
    long = prompt(10, 3)
    alone = pipe.generate(long, 100, stop_token_ids=[])
    for seed in range(4, 40):  # a short prompt with a token the long one never makes
        short = prompt(4, seed)
        free = pipe.generate(short, 12, stop_token_ids=[])
        fresh = [t for t in free.tokens[2:] if t not in alone.tokens]
        if fresh:
            stop = fresh[0]
            break
    else:
        pytest.fail("no short prompt makes a token the long one never makes")
    res = pipe.generate([long, short, short], max_new_tokens=[100, 12, 12], stop_token_ids=[stop])
    assert res[0].stop_reason == "ctx_len" and len(long) + len(res[0].tokens) == 40
    assert res[0].tokens == hf_greedy(model, long, len(res[0].tokens))
    for r in res[1:]:
        assert r.stop_reason == "stop_token"
        assert r.tokens == free.tokens[: free.tokens.index(stop) + 1]


def test_standin_runs_the_same_engine(built):
    _, _, art, _ = built(*CONFIGS[0])
    prompts = [prompt(3 + 5 * i, 40 + i) for i in range(4)]
    ort_pipe = dflash_qaic.load(art)
    pipe = dflash_qaic.load(art, backend="qaic-standin")
    for p in (ort_pipe, pipe):  # the same steps on both (lengths picked by timing differ)
        p.configure(verify_lengths=[p.B])
    ort_res = ort_pipe.generate(prompts, max_new_tokens=15)
    res = pipe.generate(prompts, max_new_tokens=15)
    assert [r.tokens for r in res] == [r.tokens for r in ort_res]
    assert [r.acceptance_lengths for r in res] == [r.acceptance_lengths for r in ort_res]
    # short contexts run on the smallest attention window (specializations `<name>@<window>`)
    assert any("@" in n for n in pipe.target.session.used)
    m = pipe.artifacts
    kind = {s["name"]: s["kind"] for p in (m.target, m.draft) for s in p.specializations}
    used = {kind[n] for n in pipe.target.session.used}
    assert {contract.PREFILL, contract.VERIFY} <= used
    used = {kind[n] for n in pipe.draft.session.used}
    assert {contract.DRAFT_PREFILL, contract.DRAFT_DECODE} <= used


def test_standin_batches_prompts_over_two_prefill_lengths(built, planned_chunks):
    """Continuous batching with two prefill lengths on the strict stand-in: every prompt chunk
    runs at batch 1 on the planned Prefill specialization, and a batch equals ONNX Runtime's
    and each prompt's solo run."""
    _, B, chunk, _, _ = CONFIGS[2]
    _, _, art, _ = built(*CONFIGS[2])
    lengths = [5, 45, 70, 33]
    prompts = [prompt(n, 60 + n) for n in lengths]
    ort_pipe = dflash_qaic.load(art)
    pipe = dflash_qaic.load(art, backend="qaic-standin")
    for p in (ort_pipe, pipe):
        p.configure(verify_lengths=[p.B])
    res = pipe.generate(prompts, max_new_tokens=12)
    assert [r.tokens for r in res] == [r.tokens for r in ort_pipe.generate(prompts, 12)]
    assert [r.tokens for r in res] == [ort_pipe.generate(p, 12).tokens for p in prompts]
    used = [n.split("@")[0] for n in pipe.target.session.used if "Prefill" in n]
    want = [
        f"Prefill[{n}]" if n < chunk else "Prefill"
        for k in lengths
        for n in planned_chunks(k, contract.prefill_lengths(chunk, B))
    ]
    assert sorted(used) == sorted(want) and "Prefill[8]" in used


def test_artifacts_without_batching_run_a_list_one_by_one(built, tiny_pair, tmp_path):
    t, d, _, model = built(*CONFIGS[0])
    build_artifacts(t, d, tmp_path, ExportOptions(prefill_seq_len=8, ctx_len=160, compile=False))
    pipe = dflash_qaic.load(tmp_path)
    assert pipe.full_batch_size == 1
    prompts = [prompt(6, 7), prompt(11, 8)]
    res = pipe.generate(prompts, max_new_tokens=17)
    assert [r.tokens for r in res] == [hf_greedy(model, p, 17) for p in prompts]


# ---------------------------------------------------------------- sampling per request


@pytest.fixture(scope="module")
def sampling_pipe(built):
    _, _, art, model = built("qwen3", 4, 8, 32, 1.5, full_batch_size=4, vocab=SAMPLING_V)
    return dflash_qaic.load(art, threads=1), model


def test_sampling_is_seeded_per_request(sampling_pipe):
    pipe, _ = sampling_pipe
    seeds = [11, 12, 13, 11, 14]
    temps = [1.0, 0.0, 0.7, 1.0, 1.5]
    res = pipe.generate(
        [SAMPLING_PROMPT] * 5, 12, stop_token_ids=[], temperature=temps, seed=seeds, top_k=[0] * 5
    )
    for r, s, t in zip(res, seeds, temps):
        solo = pipe.generate(SAMPLING_PROMPT, 12, stop_token_ids=[], temperature=t, seed=s)
        assert r.tokens == solo.tokens and r.stats["seed"] == s
    assert res[0].tokens == res[3].tokens  # same seed, same settings, other slots


def test_batched_sampling_follows_the_target_distribution(sampling_pipe):
    """Many seeded requests of one prompt in batches of 4: the first two tokens follow the exact
    distribution of the target's own sampling (chi-square, as tests/test_sampling.py)."""
    pipe, model = sampling_pipe
    a, p1, p2 = batched_first_two(pipe, model)
    # a wrong rule is caught: the second token drawn as if it were the first
    assert gof_pvalue([gof(a[:, 1], p1)]) < 1e-3 or np.allclose(p1, p2, atol=0.02)


# ---------------------------------------------------------------- bad batches


@pytest.mark.parametrize(
    "prompts,kw,match",
    [
        ([], {}, "the list of prompts is empty"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1, 2], "text"], {}, "mixes text and token ids"),
        ([1, [2, 3]], {}, "mixes token ids and nested lists"),
        ([[[1, 2]], [3]], {}, "prompt 0 must hold integer token ids only.*not a nested list"),
        ([[1, 2], [3]], {"max_new_tokens": [4]}, "max_new_tokens has 1 values for 2 prompts"),
        ([[1, 2], [3]], {"temperature": [0.5, -1.0]}, "temperature must be a finite"),
        ([[1, 2], [3]], {"seed": [1, 2, 3]}, "seed has 3 values for 2 prompts"),
        ([[1, 2], [9999]], {}, "prompt 1: token ids \\[9999\\] are outside the vocabulary"),
    ],
)
def test_bad_batches_fail_clearly(built, prompts, kw, match):
    _, _, art, _ = built(*CONFIGS[0])
    pipe = dflash_qaic.load(art)
    for fn in (pipe.generate, pipe.generate_baseline):
        with pytest.raises(GenerationError, match=match):
            fn(prompts, **{"max_new_tokens": 4, **kw})


def test_stream_takes_one_prompt(built):
    _, _, art, _ = built(*CONFIGS[0])
    pipe = dflash_qaic.load(art)
    with pytest.raises(GenerationError, match="stream takes one prompt"):
        list(pipe.stream([[1, 2], [3]]))
    # more requests than slots in a blocking call queue for a free slot
    res = pipe.generate([[5 + i] for i in range(2 * N + 1)], max_new_tokens=3)
    assert len(res) == 2 * N + 1 and all(len(r.tokens) == 3 for r in res)


def test_small_single_sequence_programs_run_on_one_thread(built, tmp_path):
    t, d, art, _ = built(*CONFIGS[0])
    assert dflash_qaic.load(art).threads is None  # batched calls: ONNX Runtime's default
    assert dflash_qaic.load(art, threads=2).threads == 2
    opts = ExportOptions(prefill_seq_len=8, ctx_len=160, compile=False)
    build_artifacts(t, d, tmp_path, opts)
    assert dflash_qaic.load(tmp_path).threads == 1  # tiny ops: a second thread costs more


def test_batched_reads_are_the_call_rows_windows():
    """ops.cache_reads + update_cache: one Gather at a flat index gives, for each call row, its
    cache row's window after the write, exactly what the window over every cache row and then
    the call's rows (the two copies it replaces) give; inactive rows (-1) read cache row 0."""
    from dflash_qaic.modeling.ops import cache_reads, cache_rows, cache_slots, update_cache

    torch.manual_seed(0)
    N, h, ctx, d, s = 5, 3, 40, 4, 2
    cache = torch.randn(N, h, ctx, d)
    rows = cache_rows(torch.tensor([[3], [-1], [4]]))
    slots = cache_slots(torch.tensor([[7, 8], [-1, -1], [20, 21]]), ctx)
    new = torch.randn(3, h, s, d)
    for window in (torch.arange(24), None):
        written, got = update_cache(cache, rows, slots, new, cache_reads(rows, window, h, ctx))
        want = written if window is None else written[:, :, window]
        assert torch.equal(got, want[rows[:, 0]])
        assert torch.equal(written[3][:, 7:9], new[0]) and torch.equal(written[4][:, 20:22], new[2])
        assert torch.equal(got[1], want[0])  # the inactive row reads cache row 0
