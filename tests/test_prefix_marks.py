"""Prefix caching where a state rolls (runtime/prefix.py, Marks): hybrid (Gated DeltaNet) and
sliding-window targets and a sliding draft save their rolling states at chosen block boundaries
of a prompt, so a later prompt that shares the prefix up to such a boundary and diverges after it
resumes there ("prefix hit = cold": tokens and per-step acceptance under `always` and whole-block
verify lengths), from a resident row or the host tier; n > 1 groups resume from a cached prefix
for their one shared prefill; the engine flags on dflash-run and dflash-bench."""

from __future__ import annotations

import json

import pytest
from test_prefix_cache import CASES, UNTIED, ids, load, run_choices, same_as_solo

from dflash_qaic.runtime import prefix

ROLLING = ("hybrid", "sliding", "sliding-draft")


def diverging(first: list[int], at: int, n: int, seed: int) -> list[int]:
    """first[:at] and n other tokens, the first of them unlike first[at]."""
    tail = ids(n, seed)
    tail[0] = first[at] % 199 + 1  # 1 … 199, never first[at]
    return first[:at] + tail


@pytest.mark.parametrize("case", ROLLING)
def test_hit_at_a_block_boundary_equals_cold(exported, case):
    """A prompt of 45 tokens saves its rolling state at its last whole block (32); a second
    prompt sharing its first 32 tokens and diverging after them (a miss before marks) resumes
    there: cached_tokens = 32, tokens and acceptance those of a cold run, greedy and seeded. A
    prompt diverging inside the first block's successor (at 20) finds no state and misses."""
    pipe = load(exported, case)
    cold = load(exported, case, enable_prefix_caching=False)
    runs = [dict()] + ([dict(temperature=1.0, seed=9)] if pipe.can_sample else [])
    for i, sp in enumerate(runs):
        first = ids(45, 300 + i)
        pipe.generate(first, 9, stop_token_ids=[], **sp)
        (entry,) = pipe.prefix_cache.rows.values()
        assert [m.end for m in entry.marks] == [32], case
        turn = diverging(first, 32, 11, 400 + i)
        two = pipe.generate(turn, 15, stop_token_ids=[], **sp)
        ref = cold.generate(turn, 15, stop_token_ids=[], **sp)
        assert two.tokens == ref.tokens, (case, sp)
        assert two.acceptance_lengths == ref.acceptance_lengths, (case, sp)
        assert two.stats["cached_tokens"] == 32 and ref.stats["cached_tokens"] == 0, (case, sp)
        early = diverging(first, 20, 20, 500 + i)
        res = pipe.generate(early, 6, stop_token_ids=[], **sp)
        assert res.stats["cached_tokens"] == 0, (case, sp)
        assert res.tokens == cold.generate(early, 6, stop_token_ids=[], **sp).tokens


@pytest.mark.parametrize("host", [False, True], ids=["resident", "host"])
@pytest.mark.parametrize("case", ["hybrid", "sliding"])
def test_agent_turns_share_the_system_prompt(exported, case, host):
    """The agent case: one system prompt (37 tokens) and a different user message each time.
    Each request marks its last whole block (48); the second misses but branches from the
    first at block 32 and marks it too; every later one resumes there (cached_tokens 32), from the
    resident row, or (host) from the host tier after an unrelated request took the row; the
    tokens and acceptance equal a cold run's every time."""
    pipe = load(exported, case, kv_offloading_size=1.0 if host else None)
    cold = load(exported, case, enable_prefix_caching=False)
    system = ids(37, 600)
    for k in range(4):
        if host and k == 3:
            pipe.generate(ids(20, 700), 4, stop_token_ids=[])  # evicts the row to the host
            assert pipe.prefix_cache.host
        prompt = system + ids(12, 610 + k)
        res = pipe.generate(prompt, 10, stop_token_ids=[])
        ref = cold.generate(prompt, 10, stop_token_ids=[])
        assert res.tokens == ref.tokens and res.acceptance_lengths == ref.acceptance_lengths, k
        assert res.stats["cached_tokens"] == (0 if k < 2 else 32), k
    cache = pipe.prefix_cache
    assert cache.host_bytes <= cache.limit
    (entry,) = cache.rows.values()
    assert [m.end for m in entry.marks] == [32, 48]  # 32 carried from turn to turn


def test_a_mark_is_where_a_rolling_state_resumes():
    """A rolling target resumes at an entry's end or at a mark, never between (a full-attention
    one at the common prefix); a mark's bytes count in the entry's host bytes (the tier's bound
    covers them)."""
    import numpy as np

    from dflash_qaic.state import SlotState

    st = SlotState(0, {"past_state.0": np.zeros((2, 3, 4), np.float32)})
    mark = prefix.Mark(16, 10, np.zeros((6, 5), np.float32), st, None)
    assert mark.nbytes == 2 * 3 * 4 * 4 + 6 * 5 * 4
    e = prefix.Entry(b"r", np.arange(40), [], 30, np.zeros((10, 5), np.float32), marks=[mark])
    assert e.nbytes == mark.nbytes + 10 * 5 * 4
    # a rolling target resumes at its end or at a mark, never between
    hashes = prefix.block_hashes(b"r", np.arange(40))
    e.hashes = hashes
    prompt = list(range(30)) + [999] * 5
    assert e.resume(prompt, prefix.block_hashes(b"r", prompt), (True, False), True) == 16
    assert e.at(16, (True, False), True) is mark
    assert e.resume(prompt, prefix.block_hashes(b"r", prompt), (False, False), True) == 30
    assert e.at(30, (False, False), True) is None


@pytest.mark.parametrize("case", ["dense", "hybrid"])
def test_n_choices_resume_from_a_cached_prefix(exported, case):
    """n = 3 choices of a prompt whose first 32 tokens a finished request holds: their one
    shared prefill resumes there (a hybrid target at its mark), each choice reports
    cached_tokens 32 and equals a lone uncached run seeded seed + i, tokens and acceptance;
    prefill calls: ⌈(P − 1 − 32) / chunk⌉ + 3."""
    pipe = load(exported, case, rows=4)
    solo = load(exported, case, enable_prefix_caching=False)
    chunk = CASES[case][2]
    first = ids(45, 800)
    pipe.generate(first, 6, stop_token_ids=[])
    p, sp = diverging(first, 32, 11, 801), dict(temperature=1.0, seed=70)
    _, seqs, prefills = run_choices(pipe, p, 3, 10, **sp)
    assert prefills == -(-(len(p) - 1 - 32) // chunk) + 3
    assert [seq.result.stats["cached_tokens"] for seq in seqs] == [32] * 3
    same_as_solo(solo, p, seqs, 10, **sp)


def test_a_group_saves_its_marks(exported):
    """An n = 2 group's shared prefill of a 45-token prompt on a hybrid target ends a call at
    block 32 and saves it; both choices' rows keep it, and a lone prompt diverging after it
    resumes there with a cold run's tokens and acceptance."""
    pipe = load(exported, "hybrid", rows=4)
    cold = load(exported, "hybrid", enable_prefix_caching=False)
    first = ids(45, 820)
    _, seqs, _ = run_choices(pipe, first, 2, 6, temperature=1.0, seed=3)
    same_as_solo(cold, first, seqs, 6, temperature=1.0, seed=3)
    assert [[m.end for m in e.marks] for e in pipe.prefix_cache.rows.values()] == [[32], [32]]
    turn = diverging(first, 32, 11, 821)
    res = pipe.generate(turn, 12, stop_token_ids=[])
    ref = cold.generate(turn, 12, stop_token_ids=[])
    assert res.stats["cached_tokens"] == 32
    assert res.tokens == ref.tokens and res.acceptance_lengths == ref.acceptance_lengths


def test_the_flags_on_dflash_run(exported, capsys, monkeypatch):
    """dflash-run takes --enable-prefix-caching/--no-enable-prefix-caching and
    --kv-offloading-size (runtime/options.py): the run's pipeline caches its prompt (a longer
    one then finds it) with its host tier of that size, or caches nothing."""
    import dflash_qaic
    from dflash_qaic.runtime.cli import main, parser

    family, pair, chunk, ctx = CASES["dense"]
    e = exported(family, "dflash", pair={**UNTIED, **pair}, prefill_seq_len=chunk, ctx_len=ctx,
                 full_batch_size=1)  # fmt: skip
    args = parser().parse_args(["a", "--prompt", "x"])
    assert args.enable_prefix_caching is True and args.kv_offloading_size is None
    made, real = [], dflash_qaic.load
    monkeypatch.setattr(dflash_qaic, "load", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    argv = [str(e.artifacts), "--prompt-ids", ",".join(map(str, ids(30, 900)))]
    argv += ["--max-new-tokens", "6", "--stop-token-ids", "", "--json"]
    cached = {}
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        assert main([*argv, flag, "--kv-offloading-size", "0.25"]) == 0
        assert json.loads(capsys.readouterr().out)["stats"]["cached_tokens"] == 0
        again = made[-1].generate(ids(30, 900) + [5, 6], 4, stop_token_ids=[])
        cached[flag] = again.stats["cached_tokens"]
    assert cached["--enable-prefix-caching"] >= 30 and cached["--no-enable-prefix-caching"] == 0
    assert made[0].prefix_cache.limit == int(0.25 * prefix.GIB)
    assert made[1].prefix_cache is None


def test_the_flags_on_dflash_bench(exported, tmp_path):
    """dflash-bench takes both flags (the cache off by default there: rounds repeat each
    prompt); --multi-turn takes --kv-offloading-size for its cached runs and reports it, and
    --agent (no history) hits a hybrid target from its third turn."""
    from dflash_qaic.bench import cli, multi_turn

    for p in (cli.parser(), cli.common_parser("a\n\nb", "artifacts", [])):
        args = p.parse_args(["a"])
        assert args.enable_prefix_caching is False and args.kv_offloading_size is None
        args = p.parse_args(["a", "--enable-prefix-caching", "--kv-offloading-size", "2"])
        assert args.enable_prefix_caching is True and args.kv_offloading_size == 2.0
    assert multi_turn.parser().parse_args(["a"]).kv_offloading_size is None
    family, pair, chunk, ctx = CASES["hybrid"]
    e = exported(family, "dflash", pair={**UNTIED, **pair}, prefill_seq_len=chunk, ctx_len=ctx,
                 full_batch_size=1)  # fmt: skip
    out = tmp_path / "mt.json"
    argv = ["--multi-turn", str(e.artifacts), "--turns", "2", "--system-tokens", "30"]
    argv += ["--user-tokens", "5", "--max-new-tokens", "6", "--repeats", "1"]
    assert cli.main([*argv, "--kv-offloading-size", "0.5", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["kv_offloading_size"] == 0.5 and report["tokens_equal"]
    assert report["turns"][1]["cached_tokens"] > 0  # a hybrid target: the history's end
    # --agent: the system prompt and a new user message each turn; from the third turn on they
    # hit at the block where the prompts branch (the system prompt's last whole block)
    argv[argv.index("--turns") + 1] = "3"
    assert cli.main([*argv, "--agent", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [t["cached_tokens"] for t in report["turns"]] == [0, 0, 16] and report["tokens_equal"]
