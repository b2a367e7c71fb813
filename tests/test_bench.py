"""dflash-bench: the statistics against hand-derived values, and one end-to-end CLI run on a tiny
pair's artifacts (no timing asserts: the machine is shared)."""

from __future__ import annotations

import json
import math

import pytest

from dflash_qaic.bench import stats

# ---------------------------------------------------------------------------- statistics


def test_tau_histogram_and_position_acceptance():
    lengths = [1, 3, 8, 2]
    assert stats.tau(lengths) == 3.5
    assert stats.tau([]) == 0.0
    assert stats.acceptance_histogram(lengths, 8) == [1, 1, 1, 0, 0, 0, 0, 1]
    # position j is accepted when the length is > j: 3 of 4 steps at j=1, 2 at j=2, 1 after
    pos = stats.position_acceptance(lengths, 8)
    assert pos == [0.75, 0.5, 0.25, 0.25, 0.25, 0.25, 0.25]
    assert math.isclose(sum(pos), stats.tau(lengths) - 1)
    assert stats.position_acceptance([], 4) == [0.0, 0.0, 0.0]
    assert stats.position_acceptance([4, 4], 4) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        stats.acceptance_histogram([9], 8)
    with pytest.raises(ValueError):
        stats.acceptance_histogram([0], 8)


def test_median_and_spread():
    s = stats.spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["p25"], s["p75"], s["n"]) == (3, 1, 5, 2, 4, 5)
    assert stats.median([1, 2, 3, 10]) == 2.5
    assert stats.spread([7.0])["min"] == stats.spread([7.0])["max"] == 7.0
    with pytest.raises(ValueError):
        stats.spread([])


def test_bound_speedup_and_fraction():
    # τ 4, decode 10 ms, verify 12 ms, draft 8 ms: 4 · 10 / 20 = 2
    assert stats.speedup_bound(4.0, 0.010, 0.012, 0.008) == pytest.approx(2.0)
    assert stats.speedup_bound(4.0, 0.010, 0.012, 0.008, 0.020) == pytest.approx(1.0)
    assert stats.speedup(0.030, 0.015) == pytest.approx(2.0)
    assert stats.fraction_of_bound(1.5, 2.0) == pytest.approx(0.75)
    assert math.isnan(stats.fraction_of_bound(1.0, 0.0))
    assert stats.break_even_tau(0.010, 0.012, 0.008) == pytest.approx(2.0)
    rows = stats.predicted_speedups(0.010, 0.012, 0.008, 0.005, [1, 5])
    assert rows[1] == {"tau": 5.0, "bound": pytest.approx(2.5), "with_host": pytest.approx(2.0)}
    assert stats.bandwidth(2e9, 0.5) == 4e9
    with pytest.raises(ValueError):
        stats.speedup_bound(2.0, 1.0, 0.0, 0.0)


def test_traffic_model_real_recipes():
    # the comparison design: fp32 logits for all 16 block rows over Qwen3's vocabulary
    q4 = stats.traffic_per_step(**stats.REAL_RECIPES["Qwen3-4B + DFlash-b16"])
    assert q4["logits_draft_out"] == 16 * 151936 * 4 == 9_723_904
    # Qwen3-4B, H 2560, B 16, int64 ids, fp32 features:
    #   draft in  16·8 ids + 16·8 positions + 16·2560·4 features + 16·8 positions = 164,224
    #   draft out 15·8 = 120;  verify in 16·8 + 16·8 = 256;  verify out 16·8 + 16·2560·4 = 163,968
    assert (q4["draft_in"], q4["draft_out"], q4["verify_in"], q4["verify_out"]) == (
        164_224,
        120,
        256,
        163_968,
    )
    assert q4["ours"] == 328_568
    assert q4["logits_design"] == 328_568 - 120 + 9_723_904 == 10_052_352
    q8 = stats.traffic_per_step(**stats.REAL_RECIPES["Qwen3-8B + DFlash-b16"])
    assert q8["ours"] == 384 + 262_144 + 120 + 256 + 128 + 262_144 == 525_176
    assert q8["logits_design"] == 10_248_960
    assert q8["ratio"] == pytest.approx(10_248_960 / 525_176)
    # minimal context: only the τ committed rows cross back
    m = stats.traffic_per_step(2560, 151936, 16, context_rows=4)
    assert m["draft_in"] == 16 * 8 * 2 + 4 * 2560 * 4 + 4 * 8


def test_chi2_sf_against_scipy():
    sps = pytest.importorskip("scipy.stats")
    for x, df in [(0.5, 1), (3.0, 2), (10.0, 5), (100.0, 80), (300.0, 250), (50.0, 3), (1e-3, 3)]:
        assert stats.chi2_sf(x, df) == pytest.approx(sps.chi2.sf(x, df), rel=1e-9, abs=1e-300)
    assert stats.chi2_sf(0.0, 4) == 1.0
    # df 2: the survival function is exp(-x/2)
    assert stats.chi2_sf(6.0, 2) == pytest.approx(math.exp(-3.0))
    with pytest.raises(ValueError):
        stats.chi2_sf(1.0, 0)


def test_token_distribution_check_by_hand():
    # two pairs; A has tokens 1,1,2,2 and B 1,2,2,2 in all: a 2 × 2 table with no merging
    pairs = [([1, 1], [1, 2]), ([2, 2], [2, 2])]
    r = stats.token_distribution_check(pairs, min_expected=0.5, permutations=0)
    # pooled: token 1 3 of 8, token 2 5 of 8; expected per side 1.5 and 2.5
    chi2 = 2 * ((2 - 1.5) ** 2 / 1.5 + (2 - 2.5) ** 2 / 2.5)
    assert r["chi2"] == pytest.approx(chi2) and r["df"] == 1 and r["bins"] == 2
    assert r["p_asymptotic"] == pytest.approx(stats.chi2_sf(chi2, 1))
    assert r["p_permutation"] is None and r["tokens"] == [4, 4]
    assert r["total_variation"] == pytest.approx(0.25)  # |2/4 − 1/4| over two tokens, halved
    # rare tokens (expected < 5) are merged into one bin
    r = stats.token_distribution_check(pairs, permutations=0)
    assert r["bins"] == 1 and r["merged_tokens"] == 2 and r["p_asymptotic"] == 1.0
    with pytest.raises(ValueError):
        stats.token_distribution_check([])


def test_token_distribution_check_null_and_alternative():
    import numpy as np

    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(30, 0.5))
    q = np.roll(p, 1)  # a different distribution over the same tokens

    def runs(dist_a, dist_b, n=24, length=64):
        return [
            (rng.choice(30, length, p=dist_a).tolist(), rng.choice(30, length, p=dist_b).tolist())
            for _ in range(n)
        ]

    same = stats.token_distribution_check(runs(p, p), permutations=400, seed=1)
    diff = stats.token_distribution_check(runs(p, q), permutations=400, seed=1)
    assert same["p_permutation"] > 0.001 and same["p_asymptotic"] > 0.001
    assert diff["p_permutation"] == pytest.approx(1 / 401)  # no swap reaches the statistic
    assert diff["p_asymptotic"] < 1e-6 and diff["total_variation"] > same["total_variation"]
    small = runs(p, p, n=4)  # deterministic for a seed
    once = stats.token_distribution_check(small, permutations=50, seed=3)
    assert once == stats.token_distribution_check(small, permutations=50, seed=3)


def test_sample_seeds_are_deterministic_and_distinct():
    from dflash_qaic.bench.run import sample_seed

    keys = [(0, 1.0, i, r, m) for i in range(4) for r in range(3) for m in ("baseline", "dflash")]
    seeds = [sample_seed(*k) for k in keys]
    assert seeds == [sample_seed(*k) for k in keys]
    assert len(set(seeds)) == len(seeds) and all(s >= 0 for s in seeds)
    assert sample_seed(1, 1.0, 0, 0, "dflash") != sample_seed(0, 1.0, 0, 0, "dflash")
    assert sample_seed(0, 0.7, 0, 0, "dflash") != sample_seed(0, 1.0, 0, 0, "dflash")


def test_parse_temperatures():
    from dflash_qaic.bench.cli import parse_temperatures
    from dflash_qaic.bench.run import BenchError

    assert parse_temperatures("0,1") == [0.0, 1.0]
    assert parse_temperatures(" 0.7 , 0 ,") == [0.7, 0.0]
    for bad in ("", "a", "-1", "nan", "inf", "1,1.0"):
        with pytest.raises(BenchError):
            parse_temperatures(bad)


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_artifacts(tiny_pair, tmp_path_factory):
    from dflash_qaic.export.artifacts import ExportOptions, build_artifacts

    t, d = tiny_pair(
        family="qwen3", agree=1.25, tie_word_embeddings=False, block_size=8, target_layer_ids=[1, 3]
    )
    out = tmp_path_factory.mktemp("bench-art")
    build_artifacts(
        t,
        d,
        out,
        ExportOptions(prefill_seq_len=16, ctx_len=128, compile=False),
        progress=lambda _m: None,
    )
    return out


def test_traffic_from_manifest_matches_formula(tiny_artifacts):
    from dflash_qaic.manifest import read_manifest

    m = read_manifest(tiny_artifacts)
    per_call = stats.traffic_from_manifest(m)
    formula = stats.traffic_per_step(m["hidden_size"], m["vocab_size"], m["block_size"])
    extra = per_call["extra"]  # I/O beyond the model (e.g. the target's sampling inputs)
    for k in ("draft_in", "draft_out", "verify_in", "verify_out"):
        more = sum(nb for name, nb in extra.items() if name.startswith(k + ":"))
        assert per_call[k] == formula[k] + more, k
    assert per_call["step"] == formula["ours"] + sum(extra.values())


def test_cli_end_to_end(tiny_artifacts, tmp_path):
    from dflash_qaic.bench.cli import main

    out = tmp_path / "bench"
    args = [str(tiny_artifacts), "--out", str(out), "--num-prompts", "2", "--repeats", "1"]
    args += ["--temperatures", "0,1", "--seed", "5", "--sampled-repeats", "2"]
    rc = main([*args, "--max-new-tokens", "16", "--peer-repeats", "1", "--threads", "1"])
    assert rc == 0
    for name in ("results.json", "report.md", "report.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left
    res = json.loads((out / "results.json").read_text())
    for key in (
        "command",
        "config",
        "machine",
        "lossless",
        "aggregate",
        "prompts",
        "acceptance",
        "bound",
        "bandwidth",
        "peers",
        "traffic",
        "profiles",
    ):
        assert key in res, key
    assert res["lossless"]["passed"] and res["lossless"]["failures"] == []
    assert len(res["prompts"]) == 2
    a = res["aggregate"]
    assert 1.0 <= a["tau"] <= 8
    for p in res["prompts"]:
        assert p["new_tokens"] == 16 and sum(p["acceptance_lengths"]) == 15
        assert sum(p["acceptance_histogram"]) == p["steps"]
    assert sum(res["acceptance"]["histogram"]) == a["steps"]
    assert len(res["acceptance"]["position_acceptance"]) == 7
    assert res["bound"]["bound"] > 0 and res["bound"]["fraction_of_bound"] > 0
    assert res["traffic"]["model_matches_measurement"]
    assert res["bandwidth"]["copy_read_plus_write_Bps"] > 0
    # the peers run the same pair: the reference and HF greedy give our tokens
    peers = res["peers"]["systems"]
    assert set(peers) == {"reference_dflash", "reference_target", "hf_generate"}
    for s in peers.values():
        assert s["tokens_match_ours"] == 2
    assert res["peers"]["reference_acceptance_equal_ours"] == 2
    # one section per temperature; the top level is the T = 0 one
    t0, t1 = res["temperatures"]
    assert (t0["temperature"], t1["temperature"]) == (0.0, 1.0)
    assert t0["status"] == t1["status"] == "measured"
    assert t0["aggregate"] == a and res["primary_temperature"] == 0.0
    assert t0["lossless"]["passed"] and "distribution_check" not in t0
    assert (t1["num_prompts"], t1["repeats"], t1["seed"]) == (2, 2, 5)
    assert t1["reduced"] and "lossless" not in t1 and t1["problems"] == []
    a1 = t1["aggregate"]
    assert 1.0 <= a1["tau"] <= 8 and a1["speedup"]["n"] == 2
    for p in t1["prompts"]:  # acceptance pooled over both sampled rounds
        assert p["rounds"] == 2 and sum(p["acceptance_lengths"]) == 2 * 15
        assert sum(p["acceptance_histogram"]) == p["steps"] == len(p["acceptance_lengths"])
    assert sum(t1["acceptance"]["histogram"]) == a1["steps"]
    assert t1["bound"]["bound"] > 0
    dc = t1["distribution_check"]
    assert dc["tokens"] == [2 * 2 * 16, 2 * 2 * 16] and dc["pairs"] == 4
    assert 0 < dc["p_asymptotic"] <= 1 and 0 < dc["p_permutation"] <= 1
    assert res["config"]["temperatures"] == [0.0, 1.0]
    md = (out / "report.md").read_text()
    assert "Lossless check (T = 0): passed" in md and "dflash-bench" in md
    assert "## Speedup by temperature" in md and "## Sampling at T = 1" in md
    assert "not a proof" in md and "tests/test_sampling.py" in md and "T = 0 only" in md
    assert "fewer runs than at T = 0" in md


def test_cli_without_sampler_skips_sampling(tiny_pair, tmp_path):
    from dflash_qaic.bench.cli import main
    from dflash_qaic.export.artifacts import ExportOptions, build_artifacts

    t, d = tiny_pair(family="qwen3", agree=1.25, block_size=8, target_layer_ids=[1, 3])
    art = tmp_path / "art"
    opts = ExportOptions(prefill_seq_len=16, ctx_len=64, compile=False, sampling=False)
    build_artifacts(t, d, art, opts, progress=lambda _m: None)
    out = tmp_path / "bench"
    base = [str(art), "--num-prompts", "1", "--repeats", "1", "--warmup", "0"]
    base += ["--max-new-tokens", "16", "--no-peers", "--threads", "1"]
    assert main([*base, "--out", str(out), "--temperatures", "0,1"]) == 0
    res = json.loads((out / "results.json").read_text())
    t0, t1 = res["temperatures"]
    assert t0["status"] == "measured" and res["lossless"]["passed"]
    assert t1["status"] == "skipped" and "--no-sampling" in t1["note"]
    md = (out / "report.md").read_text()
    assert "T = 1 skipped:" in md and "no sampler" in md
    # sampling alone cannot run on these artifacts: bad input, not a crash
    assert main([*base, "--out", str(tmp_path / "b2"), "--temperature", "1"]) == 2


def test_cli_bad_input(tiny_artifacts, tmp_path, capsys):
    from dflash_qaic.bench.cli import main

    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "dflash-bench: error:" in capsys.readouterr().err
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"nothing": 1}\n')
    assert main([str(tiny_artifacts), "--prompts", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "prompt" in capsys.readouterr().err
    assert main([str(tiny_artifacts), "--profile-shapes", "qwen9-1b"]) == 2
    for bad in (["--temperatures", "0,-1"], ["--top-p", "0"], ["--top-k", "-2"]):
        assert main([str(tiny_artifacts), "--out", str(tmp_path / "o"), *bad]) == 2, bad
    assert "dflash-bench: error:" in capsys.readouterr().err


def test_cli_sampling_alone(tiny_artifacts, tmp_path):
    from dflash_qaic.bench.cli import main

    out = tmp_path / "bench"
    args = [str(tiny_artifacts), "--out", str(out), "--num-prompts", "1", "--repeats", "1"]
    args += ["--warmup", "0", "--max-new-tokens", "16", "--threads", "1", "--temperature", "1"]
    assert main([*args, "--top-k", "5", "--top-p", "0.9"]) == 0
    res = json.loads((out / "results.json").read_text())
    (sec,) = res["temperatures"]
    assert sec["temperature"] == res["primary_temperature"] == 1.0
    assert (sec["top_k"], sec["top_p"], sec["seed"]) == (5, 0.9, 0)
    assert res["aggregate"] == sec["aggregate"] and "distribution_check" in sec
    assert res["lossless"]["checked"] is False and res["lossless"]["passed"] is None
    assert "T = 0" in res["peers"]["skipped"]  # the peers run greedy only
    md = (out / "report.md").read_text()
    assert "Lossless check: not run" in md and "## Aggregate (T = 1)" in md
