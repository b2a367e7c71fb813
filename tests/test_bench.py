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
    md = (out / "report.md").read_text()
    assert "Lossless check: passed" in md and "dflash-bench" in md


def test_cli_bad_input(tiny_artifacts, tmp_path, capsys):
    from dflash_qaic.bench.cli import main

    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "dflash-bench: error:" in capsys.readouterr().err
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"nothing": 1}\n')
    assert main([str(tiny_artifacts), "--prompts", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "prompt" in capsys.readouterr().err
    assert main([str(tiny_artifacts), "--profile-shapes", "qwen9-1b"]) == 2
