"""Automatic prefix caching (runtime/prefix.py): the ladder-style rung "prefix hit = cold" for
a dense, an MoE, a hybrid (Gated DeltaNet) and a sliding-window target, greedy and seeded
(tokens and per-step acceptance equal with whole-block verify lengths and the `always` policy);
the share of a history found cached; the host tier's bound and its restored rows; and
`cache_salt` isolation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dflash_qaic.runtime import prefix

UNTIED = dict(tie_word_embeddings=False, target_layer_ids=[1, 3])
# case -> (family, TinySpec fields, prefill chunk, ctx_len), biased so acceptance varies
CASES = {
    "dense": ("qwen3", dict(block_size=4, agree=1.25), 8, 160),
    "moe": ("qwen3_moe", dict(block_size=4, agree=2.0), 8, 160),
    "hybrid": ("qwen3_5", dict(block_size=4, agree=1.0), 16, 112),
    "sliding": ("gemma4", dict(block_size=4, agree=0.9), 8, 160),
    # a sliding draft (its ring rolls): one sliding and one full layer
    "sliding-draft": (
        "qwen3",
        dict(block_size=4, agree=1.25, layer_types=["sliding_attention", "full_attention"],
             sliding_window=6),
        8,
        160,
    ),
}  # fmt: skip


def load(exported, case, rows=1, **engine):
    family, pair, chunk, ctx = CASES[case]
    e = exported(
        family, "dflash", pair={**UNTIED, **pair}, prefill_seq_len=chunk, ctx_len=ctx,
        full_batch_size=rows,
    )  # fmt: skip
    pipe = e.load(verify_lengths=pair["block_size"], tokenizer=False)
    pipe.configure(**{"spec_policy": "always", **engine})
    return pipe


def ids(n, seed, hi=200) -> list[int]:
    return np.random.default_rng(seed).integers(1, hi, n).tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefix_hit_equals_cold(exported, case):
    """A second turn (the first's prompt, its answer and a new message) resumes from the first
    turn's row: greedy and seeded, its tokens and acceptance equal a cold run's, and it finds
    the whole history its row holds cached (a rolling target resumes exactly there)."""
    pipe = load(exported, case)
    cold = load(exported, case, enable_prefix_caching=False)
    runs = [dict()] + ([dict(temperature=1.0, seed=9)] if pipe.can_sample else [])
    for i, sp in enumerate(runs):
        first = ids(21, 100 + i)
        pipe.generate(first, 13, stop_token_ids=[], **sp)
        (entry,) = pipe.prefix_cache.rows.values()
        # the tokens its row holds state for: the prompt and the answer up to its last token
        # (past it when max_new_tokens cut a step's committed tokens: a rolling state is there)
        history = entry.tokens.tolist()
        turn = history + ids(11, 200 + i)
        two = pipe.generate(turn, 17, stop_token_ids=[], **sp)
        ref = cold.generate(turn, 17, stop_token_ids=[], **sp)
        assert two.tokens == ref.tokens, (case, sp)
        assert two.acceptance_lengths == ref.acceptance_lengths, (case, sp)
        assert ref.stats["cached_tokens"] == 0
        assert two.stats["cached_tokens"] == len(history) >= 21, (case, sp)
        assert two.stats["prefill_calls"] < ref.stats["prefill_calls"], case
    assert pipe.prefix_cache.hits > 0 and pipe.prefix_cache.queries > pipe.prefix_cache.hits


def test_shared_history_is_found_cached(exported):
    """An agent-like conversation: each turn re-sends the whole history; from turn 2 on at
    least 90% of it is cached, and every turn's tokens equal the cold run's."""
    pipe, cold = load(exported, "dense"), load(exported, "dense", enable_prefix_caching=False)
    history = ids(40, 1)  # the system prompt and tools
    for turn in range(4):
        history = history + ids(7, 10 + turn)
        res = pipe.generate(history, 9, stop_token_ids=[])
        assert res.tokens == cold.generate(history, 9, stop_token_ids=[]).tokens
        if turn:
            assert res.stats["cached_tokens"] >= 0.9 * (len(history) - 7), turn
        history = history + res.tokens


def test_host_tier_bounded_and_restored(exported):
    """One cache row: an unrelated request evicts the first one's row to the host tier (its
    bytes never above the setting); the first conversation's next turn is restored from there
    (write_slot into the row, the draft's context with it) with the cold run's tokens and
    acceptance. A tier too small for one entry holds nothing."""
    cold = load(exported, "dense", enable_prefix_caching=False)
    first, other = ids(30, 3), ids(30, 4)
    probe = load(exported, "dense", kv_offloading_size=1.0)
    probe.generate(first, 10, stop_token_ids=[])
    probe.generate(other, 10, stop_token_ids=[])
    need = probe.prefix_cache.host_bytes  # one entry's bytes
    assert need > 0
    gib = 1.5 * need / prefix.GIB  # room for one entry, not two
    pipe = load(exported, "dense", kv_offloading_size=gib)
    one = pipe.generate(first, 10, stop_token_ids=[])
    pipe.generate(other, 10, stop_token_ids=[])  # evicts the first row to the host
    cache = pipe.prefix_cache
    assert len(cache.host) == 1 and 0 < cache.host_bytes <= cache.limit
    turn = first + one.tokens + ids(5, 5)
    res = pipe.generate(turn, 15, stop_token_ids=[])  # restored; the other row to the host
    ref = cold.generate(turn, 15, stop_token_ids=[])
    assert res.tokens == ref.tokens and res.acceptance_lengths == ref.acceptance_lengths
    assert res.stats["cached_tokens"] >= len(first) + len(one.tokens) - 1
    assert len(cache.host) == 1 and 0 < cache.host_bytes <= cache.limit
    small = load(exported, "dense", kv_offloading_size=0.5 * need / prefix.GIB)
    for p in (first, other):
        small.generate(p, 10, stop_token_ids=[])
    assert small.prefix_cache.host_bytes == 0 and not small.prefix_cache.host


def test_cache_salt_isolates(exported):
    """Requests of different `cache_salt`s never share a cached block; the same salt does."""
    pipe = load(exported, "dense")
    p = ids(40, 7)

    def run(salt, prompt):
        engine = pipe.engine()
        req = dataclasses.replace(pipe.request(prompt, 6, stop_token_ids=[]), cache_salt=salt)
        seq = engine.add(req)
        while engine.busy:
            engine.step()
        return seq.result

    run("tenant-a", p)
    assert run("tenant-a", p + [5]).stats["cached_tokens"] >= len(p)
    # tenant-a's row is resident and holds this prompt's prefix: other salts still miss
    assert run("tenant-b", p + [5, 6]).stats["cached_tokens"] == 0
    run("tenant-a", p)
    assert run(None, p + [5, 6]).stats["cached_tokens"] == 0


def test_block_hashes_chain():
    """A block's hash chains its parent's: equal prefixes give equal hashes, one changed token
    changes its block's hash and every later one; the root (salt) changes all."""
    root = prefix.root_key({"target_sha256": "x"}, None)
    a = list(range(50))
    b = a[:20] + [999] + a[21:]
    ha, hb = prefix.block_hashes(root, a), prefix.block_hashes(root, b)
    assert len(ha) == 50 // prefix.BLOCK and ha[0] == hb[0]
    assert all(x != y for x, y in zip(ha[1:], hb[1:]))
    salted = prefix.block_hashes(prefix.root_key({"target_sha256": "x"}, "s"), a)
    assert all(x != y for x, y in zip(ha, salted))
    assert prefix.block_hashes(ha[0], a, 1) == ha[1:]


def test_served_usage_metrics_and_flags(exported):
    """dflash-serve: every answer carries usage.prompt_tokens_details.cached_tokens (the second
    turn's history found, another salt's none); /metrics counts the tokens looked up and hit
    (vLLM's names) and the host tier's bytes; --no-enable-prefix-caching turns it off."""
    from fastapi.testclient import TestClient

    from dflash_qaic.serve import cli
    from dflash_qaic.serve.app import create_app
    from dflash_qaic.serve.engine import AsyncEngine

    pipe = load(exported, "dense")
    body = dict(prompt=ids(40, 11), max_tokens=6, temperature=0)
    with TestClient(create_app(AsyncEngine(pipe), "m", None)) as c:
        first = c.post("/v1/completions", json=body).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        body["prompt"] = body["prompt"] + [7, 8, 9]
        two = c.post("/v1/completions", json=body).json()
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= 40
        salted = c.post("/v1/completions", json={**body, "cache_salt": "t2"}).json()
        assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        text = c.get("/metrics").text
    series = {ln.split("{")[0]: float(ln.split()[-1]) for ln in text.splitlines() if "{" in ln}
    assert series["vllm:prefix_cache_queries_total"] == 40 + 2 * 43
    assert series["vllm:prefix_cache_hits_total"] >= 40
    assert series["dflash:prefix_cache_host_bytes"] == 0
    args = cli.parser().parse_args(["art", "--no-enable-prefix-caching"])
    assert args.enable_prefix_caching is False and args.kv_offloading_size is None
    args = cli.parser().parse_args(["art", "--kv-offloading-size", "2.5"])
    assert args.enable_prefix_caching is True and args.kv_offloading_size == 2.5


def run_choices(pipe, p, n, max_new, **sp):
    """n choices of prompt `p` through a new engine: the engine, their Sequences, and how many
    batch-1 target calls (prefill chunks) ran."""
    calls, run = [], pipe.target.run

    def counted(feeds):
        calls.append(feeds["input_ids"].shape)
        return run(feeds)

    pipe.target.run = counted
    try:
        engine = pipe.engine()
        seqs = engine.add_choices(pipe.request(p, max_new, stop_token_ids=[], **sp), n)
        while engine.busy:
            engine.step()
    finally:
        pipe.target.run = run
    return engine, seqs, sum(1 for s in calls if s[0] == 1)


def same_as_solo(solo, p, seqs, max_new, temperature, seed) -> list[list[int]]:
    """Choice i equals a lone run of `solo` seeded seed + i, tokens and acceptance; returns the
    choices' tokens."""
    out = []
    for i, seq in enumerate(seqs):
        ref = solo.generate(p, max_new, stop_token_ids=[], temperature=temperature, seed=seed + i)
        assert seq.result.tokens == ref.tokens, i
        assert seq.result.acceptance_lengths == ref.acceptance_lengths, i
        out.append(seq.result.tokens)
    return out


def test_n_choices_cost_one_prefill(exported):
    """n = 4 choices of one prompt: the prompt (but its last token) is prefilled once and
    forked into the four rows; choice i equals a lone run seeded seed + i (vLLM's seeding),
    tokens and acceptance. Prefill calls counted: ⌈(P − 1) / chunk⌉ + 4 (each choice's last
    prompt token with its own sampler) against 4 · ⌈P / chunk⌉ without the fork."""
    pipe = load(exported, "dense", rows=4)
    solo = load(exported, "dense", enable_prefix_caching=False)
    p, sp = ids(37, 12), dict(temperature=1.0, seed=40)
    engine, seqs, prefills = run_choices(pipe, p, 4, 12, **sp)
    assert prefills == -(-(len(p) - 1) // 8) + 4
    outs = [tuple(same_as_solo(solo, p, seqs, 12, **sp)[i]) for i in range(4)]
    assert len(set(outs)) > 1  # the choices sampled apart
    with pytest.raises(ValueError, match="n must be in 1"):
        engine.add_choices(pipe.request(p, 4), 5)


def test_bench_multi_turn(exported, tmp_path, capsys):
    """dflash-bench --multi-turn: the trace with and without the cache, the same tokens (exit
    0), each later turn's history found cached, the report written."""
    import json

    from dflash_qaic.bench import cli

    family, pair, chunk, ctx = CASES["dense"]
    e = exported(family, "dflash", pair={**UNTIED, **pair}, prefill_seq_len=chunk, ctx_len=ctx,
                 full_batch_size=1)  # fmt: skip
    out = tmp_path / "mt.json"
    argv = ["--multi-turn", str(e.artifacts), "--turns", "3", "--system-tokens", "40"]
    argv += ["--user-tokens", "6", "--max-new-tokens", "8", "--repeats", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["tokens_equal"] and len(report["turns"]) == 3
    first, *later = report["turns"]
    assert first["cached_tokens"] == 0
    assert all(t["cached_tokens"] >= t["prompt_tokens"] - 6 - 1 for t in later)
    assert "prefill tokens saved" in capsys.readouterr().out
    argv[argv.index("--turns") + 1] = "40"  # more than the context holds: refused
    assert cli.main(argv) == 2


def test_served_n_choices(exported):
    """dflash-serve n > 1: the choices by index, choice i equal to a lone run seeded seed + i,
    usage counting the prompt once (and the cached prefix a later group resumes from); streamed, every chunk names its choice and each choice
    ends once; n above the rows and best_of ≠ n are refused naming the field."""
    import json

    from fastapi.testclient import TestClient

    from dflash_qaic.serve.app import create_app
    from dflash_qaic.serve.engine import AsyncEngine

    pipe = load(exported, "dense", rows=4)
    solo = load(exported, "dense", enable_prefix_caching=False)
    p = ids(30, 21)
    body = dict(prompt=p, max_tokens=8, temperature=1.0, seed=5, n=3, return_token_ids=True)
    with TestClient(create_app(AsyncEngine(pipe), "m", None)) as c:
        r = c.post("/v1/completions", json=body).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2]
        for i, ch in enumerate(r["choices"]):
            ref = solo.generate(p, 8, temperature=1.0, seed=5 + i)
            assert ch["token_ids"] == ref.tokens, i
        assert r["usage"]["prompt_tokens"] == 30 and r["usage"]["completion_tokens"] == 24
        # the choices' rows hold the prompt: a longer one's n choices resume from it
        more = c.post("/v1/completions", json={**body, "prompt": p + [7, 8]}).json()
        assert more["usage"]["prompt_tokens_details"]["cached_tokens"] == 30
        for i, ch in enumerate(more["choices"]):
            assert (
                ch["token_ids"] == solo.generate(p + [7, 8], 8, temperature=1.0, seed=5 + i).tokens
            )
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(x)["choices"][0] for x in lines[:-1]]
        streamed = {i: [t for ch in chunks if ch["index"] == i for t in ch["token_ids"]]
                    for i in range(3)}  # fmt: skip
        assert streamed == {i: ch["token_ids"] for i, ch in enumerate(r["choices"])}
        assert sorted(ch["index"] for ch in chunks if ch["finish_reason"]) == [0, 1, 2]
        for bad, field in (({"n": 5}, "n"), ({"best_of": 4}, "best_of")):
            e = c.post("/v1/completions", json={**body, **bad})
            assert e.status_code == 400 and e.json()["error"]["param"] == field, e.text


def test_a_row_another_pipeline_writes_is_forgotten(exported):
    """Two pipelines over the same program objects (as dflash-bench --card-numerics pairs
    them): a row the second one writes leaves the first one's cache, so the first never
    resumes from a row that no longer holds its tokens."""
    from dflash_qaic.runtime.pipeline import Pipeline

    a = load(exported, "dense")
    b = Pipeline(a.artifacts, a.target, a.draft, None)
    b.configure(verify_lengths=[a.B], spec_policy="always", enable_prefix_caching=False)
    cold = load(exported, "dense", enable_prefix_caching=False)
    x = ids(35, 31)
    a.generate(x, 6, stop_token_ids=[])
    assert a.prefix_cache.rows
    b.generate(ids(35, 32), 6, stop_token_ids=[])  # row 0, written under a's entry
    assert not a.prefix_cache.rows
    res = a.generate(x + [4, 5], 10, stop_token_ids=[])
    assert res.stats["cached_tokens"] == 0
    assert res.tokens == cold.generate(x + [4, 5], 10, stop_token_ids=[]).tokens


def test_auto_policy_hit_equals_cold(exported):
    """Under the `auto` step policy a row may end with context the draft never took (decoded
    steps' features waiting): the hit sends it first, and the tokens equal a cold run's."""
    pipe = load(exported, "dense", spec_policy="auto")
    cold = load(exported, "dense", spec_policy="auto", enable_prefix_caching=False)
    first = ids(25, 41)
    pipe.generate(first, 30, stop_token_ids=[])
    (entry,) = pipe.prefix_cache.rows.values()
    turn = entry.tokens.tolist() + ids(9, 42)
    res = pipe.generate(turn, 20, stop_token_ids=[])
    assert res.stats["cached_tokens"] == entry.end
    assert res.tokens == cold.generate(turn, 20, stop_token_ids=[]).tokens
