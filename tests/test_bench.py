"""dflash-bench: the statistics against known values, the report rendered from a results dict,
and the CLI end to end on a tiny pair (no timing asserts: the machine is shared)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats as sps

from dflash_qaic.bench import report, stats
from dflash_qaic.bench.cli import main, parse_list
from dflash_qaic.bench.run import BenchError, Prompt, sample_seed

# ---------------------------------------------------------------------------- statistics


def test_tau_histogram_and_position_acceptance():
    lengths = [1, 3, 8, 2]
    assert stats.tau(lengths) == 3.5 and stats.tau([]) == 0.0
    assert stats.acceptance_histogram(lengths, 8) == [1, 1, 1, 0, 0, 0, 0, 1]
    # position j is accepted when the length is > j: 3 of 4 steps at j = 1, 2 at j = 2, 1 after
    pos = stats.position_acceptance(lengths, 8)
    assert pos == [0.75, 0.5, 0.25, 0.25, 0.25, 0.25, 0.25]
    assert math.isclose(sum(pos), stats.tau(lengths) - 1)
    assert stats.position_acceptance([], 4) == [0.0, 0.0, 0.0]
    for bad in ([9], [0]):
        with pytest.raises(ValueError):
            stats.acceptance_histogram(bad, 8)


def test_spread_and_bound():
    s = stats.spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["p25"], s["p75"], s["n"]) == (3, 1, 5, 2, 4, 5)
    with pytest.raises(ValueError):
        stats.spread([])
    # τ 4, decode 10 ms, verify 12 ms, draft 8 ms: 4 · 10 / 20 = 2
    assert stats.bound(4.0, 0.010, 0.012, 0.008) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        stats.bound(2.0, 1.0, 0.0, 0.0)


def _result(tokens, lengths, decode_s, calls, **extra):
    st = {"steps": len(lengths), "decode_s": decode_s, "new_tokens": len(tokens), **extra}
    st.setdefault("tpot_s", decode_s / len(tokens))
    return SimpleNamespace(tokens=tokens, acceptance_lengths=lengths, stats=st, call_times=calls)


def test_loop_costs_by_hand():
    # target alone: 8 decode calls of 10 ms in 100 ms (20 ms of host work)
    base = [_result([1] * 9, [1] * 8, 0.100, {"decode": [0.010] * 8})]
    # DFlash: 2 steps committing 4 tokens each; verify 12 ms, one draft call of 8 ms; 40 ms in all
    dfl = [_result([1] * 9, [4, 4], 0.040, {"verify": [0.012] * 2, "draft": [0.008]})]
    c = stats.loop_costs(base, dfl)
    assert c["tau"] == 4 and c["decode_s"] == pytest.approx(0.010)
    assert c["verify_s"] == pytest.approx(0.012) and c["draft_s"] == pytest.approx(0.004)
    assert c["token_s"] == pytest.approx(0.0125) and c["step_s"] == pytest.approx(0.020)
    assert c["host_per_step_s"] == pytest.approx(0.004)
    assert c["bound"] == pytest.approx(4 * 0.010 / 0.016)
    # pooled: exactly the ratio of the two loops' total decode times
    assert c["pooled"] == pytest.approx(0.100 / 0.040)
    assert c["fraction_of_bound"] == pytest.approx(c["pooled"] / c["bound"])


def test_cost_split_by_hand():
    long = {"decode": 0.010, "draft": 0.006}
    short = {"decode": 0.006, "draft": 0.005}  # at ctx 256 against 1024
    sampled = {"decode": 0.013, "draft": 0.006}
    c = stats.cost_split(long, short, sampled, (1024, 256), {"decode": 0.002, "draft": 0.001})
    d = c["decode"]
    # cache: 4 ms over 768 slots, linear through ctx 0: 4 · 1024 / 768
    assert d["cache_s"] == pytest.approx(0.004 * 1024 / 768)
    assert d["sampler_s"] == pytest.approx(0.003) and d["sampled_s"] == pytest.approx(0.013)
    parts = d["weights_s"] + d["cache_s"] + d["sampler_s"] + d["fixed_s"]
    assert parts == pytest.approx(d["sampled_s"])
    assert c["draft"]["sampler_s"] is None  # the draft has no sampler
    no_short = stats.cost_split(long, None, None, (1024, 256), {})
    assert no_short["decode"]["cache_s"] is None and no_short["decode"]["fixed_s"] == 0.010
    assert all("state_s" not in x for x in (*c.values(), *no_short.values()))  # dense: no state
    # a hybrid target: its state's 1 ms comes out of the fixed part, the draft has none
    h = stats.cost_split(long, short, sampled, (1024, 256), {"decode": 0.002}, {"decode": 0.001})
    assert h["decode"]["state_s"] == 0.001 and h["draft"]["state_s"] is None
    assert h["decode"]["fixed_s"] == pytest.approx(d["fixed_s"] - 0.001)
    assert h["draft"]["fixed_s"] == pytest.approx(c["draft"]["fixed_s"] + 0.001)  # no weights


def test_token_distribution_check_against_scipy():
    # A has tokens 1,1,2,2 and B 1,2,2,2: a 2 × 2 table, no merging
    pairs = [([1, 1], [1, 2]), ([2, 2], [2, 2])]
    r = stats.token_distribution_check(pairs, min_expected=0.5, permutations=0)
    chi2 = 2 * ((2 - 1.5) ** 2 / 1.5 + (2 - 2.5) ** 2 / 2.5)  # expected 1.5 and 2.5 per side
    assert r["chi2"] == pytest.approx(chi2) and r["df"] == 1 and r["bins"] == 2
    assert r["p_asymptotic"] == pytest.approx(sps.chi2.sf(chi2, 1))
    assert r["p_permutation"] is None and r["tokens"] == [4, 4]
    assert r["total_variation"] == pytest.approx(0.25)
    merged = stats.token_distribution_check(pairs, permutations=0)  # expected < 5: one bin
    assert merged["bins"] == 1 and merged["p_asymptotic"] == 1.0
    with pytest.raises(ValueError):
        stats.token_distribution_check([])


def test_token_distribution_check_null_and_alternative():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(30, 0.5))
    q = np.roll(p, 1)

    def runs(a, b, n=24, length=64):
        draw = lambda d: rng.choice(30, length, p=d).tolist()  # noqa: E731
        return [(draw(a), draw(b)) for _ in range(n)]

    same = stats.token_distribution_check(runs(p, p), permutations=400, seed=1)
    diff = stats.token_distribution_check(runs(p, q), permutations=400, seed=1)
    assert same["p_permutation"] > 0.001 and same["p_asymptotic"] > 0.001
    assert diff["p_permutation"] == pytest.approx(1 / 401)  # no swap reaches the statistic
    assert diff["p_asymptotic"] < 1e-6 and diff["total_variation"] > same["total_variation"]


def test_seeds_and_temperatures():
    keys = [(0, 1.0, i, r, m) for i in range(4) for r in range(3) for m in ("baseline", "dflash")]
    seeds = [sample_seed(*k) for k in keys]
    assert seeds == [sample_seed(*k) for k in keys] and len(set(seeds)) == len(seeds)
    assert parse_list("--temperatures", " 0.7 , 0 ,") == [0.7, 0.0]
    for bad in ("", "a", "-1", "nan", "inf", "1,1.0"):
        with pytest.raises(BenchError):
            parse_list("--temperatures", bad)


# ---------------------------------------------------------------------------- the report


def _section(T: float):
    """A section from hand-made runs: 2 prompts × 2 rounds, 9 tokens each."""
    runs = []
    for i in range(2):
        per = []
        for _ in range(2):
            b = _result([1] * 9, [1] * 8, 0.080, {"decode": [0.009] * 8}, host_s=0.008)
            d = _result([1 + i] * 9, [4, 4], 0.030, {"verify": [0.010] * 2, "draft": [0.008]})
            for r in (b, d):
                r.stats.update(ttft_s=0.02, prefill_s=0.02, host_s=0.005, bytes_per_step=100.0)
            per.append({"baseline": b, "dflash": d})
        runs.append(per)
    prompts = [Prompt("a", [1, 2]), Prompt("b", [3])]
    return stats.section(T, runs, [], prompts, 8, seed=0)


def _results() -> dict:
    secs = [_section(0.0), _section(1.0)]
    split = stats.cost_split(
        {"decode": 0.009}, {"decode": 0.005}, {"decode": 0.012}, (1024, 192), {"decode": 0.001}
    )
    return {
        "command": "dflash-bench x",
        "started": "now",
        "seconds": 1.0,
        "artifacts": {"path": "x", "backend": "ort", "block_size": 8, "ctx_len": 1024, "prefill_seq_len": 16, "hidden_size": 64, "vocab_size": 100, "target": {"n_layers": 4}, "draft": {"n_layers": 1}},
        "config": {"num_prompts": 2, "repeats": 2, "warmup": 0, "max_new_tokens": 9, "seed": 0, "prompts_source": "test"},
        "machine": {"cpu": "cpu", "cpus": 2, "threads": 2, "llc_bytes": 1 << 20, "load_start": [0.1, 0, 0], "load_end": [0.2, 0, 0], "platform": "p", "versions": {"numpy": "2"}},
        "temperatures": secs,
        "profile": {"ctx_len": 1024, "short_ctx_len": 192, "note": None, "calls": split},
        "bandwidth": {"copy_Bps": 4e9, "weight_bytes": {"target": 4000, "draft": 2000}},
        "peers": {"skipped": "--no-peers"},
    }  # fmt: skip


def test_cost_chart_bars_end_at_the_measured_totals():
    """A negative part (here a cache part below the noise) is drawn downward from the positive
    ones, so every bar ends at its call's measured total: dropping it drew 8.7 ms for 6.0 ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def call(w, cache, sampler, fixed):
        t = w + (cache or 0.0) + (sampler or 0.0) + fixed
        return dict(greedy_s=t - (sampler or 0.0), sampled_s=t, weights_s=w, cache_s=cache,
                    sampler_s=sampler, fixed_s=fixed)  # fmt: skip

    calls = {
        "decode": call(0.0019, -0.0027, 0.0, 0.0068),  # 6.0 ms; its positive parts: 8.7 ms
        "verify": call(0.0019, 0.0004, -0.0001, 0.0143),
        "draft": call(0.0009, None, None, 0.0078),  # no cache part measured, no sampler
    }
    segs = report.bar_segments(calls["decode"])
    assert [k for k, _, _ in segs] == ["weights_s", "fixed_s", "cache_s"]
    assert segs[-1][1] == pytest.approx(8.7) and segs[-1][2] == pytest.approx(-2.7)
    fig, ax = plt.subplots()
    report._profile_panel(ax, {"ctx_len": 1024, "calls": calls})
    drawn = {}
    for r in ax.patches:  # bars in drawing order, by category
        drawn.setdefault(round(r.get_x() + r.get_width() / 2), []).append(r)
    totals = [c["sampled_s"] * 1e3 for c in calls.values()]
    assert sorted(drawn) == [0, 1, 2]
    for i, total in enumerate(totals):
        assert sum(r.get_height() for r in drawn[i]) == pytest.approx(total)
        assert drawn[i][-1].get_y() + drawn[i][-1].get_height() == pytest.approx(total)
        assert all(r.get_y() >= 0 and r.get_y() + r.get_height() >= 0 for r in drawn[i])
    ticks = [y for line in ax.get_lines() for y in line.get_ydata()]
    assert ticks == pytest.approx(totals)
    plt.close(fig)


def test_report_sections_render(tmp_path):
    res = _results()
    t0 = res["temperatures"][0]
    assert t0["tau"] == 4 and t0["check"] == {"kind": "lossless", "passed": True, "pairs": 4}
    # 0.080 s / 9 tokens against 0.030 s / 9 tokens, in every round
    assert t0["speedup"]["median"] == pytest.approx(0.080 / 0.030)
    assert t0["loop"]["bound"] == pytest.approx(4 * 0.009 / (0.010 + 0.004))
    screen = report.summary_screen(res)
    assert "2.67× [2.67×–2.67×]" in screen and "tokens identical" in screen
    assert "histograms p =" in screen and "decode" in screen and "2.57×" in screen
    md = report.render_markdown(res)
    assert md.index(screen.splitlines()[0]) < md.index("## Speed")  # the summary first
    for text in ("## Cost profile at ctx_len 1024", "Not run: --no-peers.", "χ²", "length ≥ k"):
        assert text in md, text
    assert "$" not in md.replace("$ ", "")  # every placeholder substituted
    assert "prefill chunks 16," in md and "was busy" not in md  # no prefill_lengths: the chunk
    # busy is the load before the run: after it, the benchmark's own threads count too
    res["machine"]["load_end"] = [1.3, 0, 0]
    res["artifacts"]["prefill_lengths"] = [16, 64]
    md = report.render_markdown(res)
    assert "was busy" not in md and "prefill chunks 16, 64," in md
    res["machine"]["load_start"] = [1.1, 0, 0]
    assert "was busy" in report.render_markdown(res)
    paths = report.write_outputs(res, tmp_path)
    assert json.loads(paths["json"].read_text())["temperatures"][0]["tau"] == 4
    assert paths["png"].stat().st_size > 0 and not list(tmp_path.glob(".*"))


def test_report_drafts_side_by_side(tmp_path):
    """--compare: both drafts' τ, speedup and check at every temperature in the screen, the
    report and results.json; the compared draft's differing tokens fail the run too."""
    res = _results()
    other = {**res["artifacts"], "path": "art/d2", "block_size": 8, "draft_form": "DFlash-2"}
    res["artifacts"] |= {"draft_form": "DFlash", "sources": {"draft": "d1"}}
    other["sources"] = {"draft": "d2"}
    secs = [_section(0.0), {"temperature": 1.0, "status": "skipped", "note": "no sampler"}]
    res["compare"] = {"artifacts": other, "temperatures": secs, "profile": {}, "peers": {}}
    res["drafts"] = [
        report.draft_summary(res["artifacts"], res["temperatures"]),
        report.draft_summary(other, secs),
    ]
    d1, d2 = res["drafts"]
    assert (d1["form"], d2["form"], d2["path"], d2["draft"]) == (
        "DFlash",
        "DFlash-2",
        "art/d2",
        "d2",
    )
    assert [s["tau"] for s in d1["temperatures"]] == [4, 4] and "tau" not in d2["temperatures"][1]
    screen = report.summary_screen(res)
    lines = screen.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("drafts side by side"))
    assert "T = 0" in lines[at] and "T = 1" in lines[at]
    assert (
        lines[at + 1].startswith("DFlash (x)")
        and "τ 4.00 · 2.67× · tokens identical" in lines[at + 1]
    )
    assert "histograms p =" in lines[at + 1]
    assert lines[at + 2].startswith("DFlash-2 (art/d2)") and "skipped: no sampler" in lines[at + 2]
    md = report.render_markdown(res)
    assert md.index("## Speed") < md.index("## Drafts side by side") < md.index("## Acceptance")
    head = "| draft | block | T = 0 τ | T = 0 speedup | T = 0 check | T = 1 τ | T = 1 speedup |"
    assert head in md and "| DFlash-2 (art/d2) | 8 | 4.00 | 2.67× [2.67×–2.67×] |" in md
    assert "no cost profile or peers for the compared draft" in md
    assert "## Drafts side by side" not in report.render_markdown(_results())
    assert report.problems(res) == []
    secs[0]["problems"] = ["a, round 0: DFlash tokens differ from index 3"]
    assert report.problems(res) == ["art/d2: a, round 0: DFlash tokens differ from index 3"]
    paths = report.write_outputs(res, tmp_path)
    assert json.loads(paths["json"].read_text())["drafts"][1]["temperatures"][0]["tau"] == 4


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_artifacts(tiny_pair, tmp_path_factory):
    from dflash_qaic.artifacts.build import ExportOptions, build_artifacts

    t, d = tiny_pair(family="qwen3", agree=1.25, block_size=8, target_layer_ids=[1, 3])
    out = tmp_path_factory.mktemp("bench-art")
    opts = ExportOptions(prefill_seq_len=16, ctx_len=256, compile=False, fp16_check=False)
    build_artifacts(t, d, out, opts)
    return out


def test_cli_end_to_end(tiny_artifacts, tmp_path, capsys):
    out = tmp_path / "bench"
    args = [str(tiny_artifacts), "--out", str(out), "--num-prompts", "2", "--repeats", "1"]
    assert main([*args, "--max-new-tokens", "12", "--threads", "1", "--seed", "5"]) == 0
    res = json.loads((out / "results.json").read_text())
    t0, t1 = res["temperatures"]
    assert (t0["temperature"], t1["temperature"]) == (0.0, 1.0)
    assert t0["check"]["passed"] and t0["problems"] == [] and t1["problems"] == []
    for s in (t0, t1):
        # τ, the histogram and per-position acceptance are three views of the same steps
        hist = s["histogram"]  # index k: steps that committed k + 1 tokens
        assert len(hist) == 8 and sum(hist) == s["steps"] > 0
        assert s["tau"] == pytest.approx(sum((k + 1) * n for k, n in enumerate(hist)) / s["steps"])
        assert sum(s["position_acceptance"]) == pytest.approx(s["tau"] - 1)
        assert all(p["steps"] > 0 for p in s["prompts"]) and s["loop"]["bound"] > 0
    assert 0 < t1["check"]["p_permutation"] <= 1 and t1["check"]["tokens"] == [24, 24]
    calls = res["profile"]["calls"]  # ctx_len 256 against the pair exported again at 64
    assert res["profile"]["short_ctx_len"] == 64 and set(calls) == {"decode", "verify", "draft"}
    assert calls["decode"]["cache_s"] is not None and calls["decode"]["sampler_s"] is not None
    # a dense target: no state part anywhere (the hybrid one: tests/test_bench_hybrid.py)
    assert res["artifacts"]["target"]["state_bytes"] == 0
    assert all("state_s" not in c for c in calls.values())
    peers = res["peers"]["systems"]  # the reference and HF greedy give our tokens
    assert all(s["same_tokens"] == 2 for s in peers.values())
    assert res["peers"]["torch_threads"] == 1 == res["machine"]["threads"]
    screen = capsys.readouterr().out
    assert screen.startswith("dflash-bench") and "speedup" in screen, screen[:600]
    md = (out / "report.md").read_text()
    assert md.startswith("# dflash-bench report") and "![" in md
    assert "| weights | cache | sampler | fixed |" in md and "state" not in md
    assert (out / "report.png").stat().st_size > 0


@pytest.fixture(scope="module")
def tiny_artifacts_dflash2(tiny_pair, tmp_path_factory):
    """The target of `tiny_artifacts` (the same spec and seed: the same checkpoint digest) with
    a DFlash-2 draft."""
    from dflash_qaic.artifacts.build import ExportOptions, build_artifacts

    kw = dict(family="qwen3", agree=1.25, block_size=8, target_layer_ids=[1, 3])
    t, d = tiny_pair(**kw, draft_form="dflash2")
    out = tmp_path_factory.mktemp("bench-art-dflash2")
    opts = ExportOptions(prefill_seq_len=16, ctx_len=256, compile=False, fp16_check=False)
    build_artifacts(t, d, out, opts)
    return out


def test_cli_compare_two_drafts(tiny_artifacts, tiny_artifacts_dflash2, tmp_path, capsys):
    out = tmp_path / "bench"
    args = [str(tiny_artifacts), "--compare", str(tiny_artifacts_dflash2), "--out", str(out)]
    args += ["--num-prompts", "2", "--repeats", "1", "--max-new-tokens", "12", "--threads", "1"]
    assert main([*args, "--no-peers", "--no-profile"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [s["temperature"] for s in res["temperatures"]] == [0.0, 1.0]  # ours, as without
    assert res["artifacts"]["draft_form"] == "DFlash" and res["config"]["compare"]
    c = res["compare"]
    assert c["artifacts"]["draft_form"] == "DFlash-2" and c["artifacts"]["path"] == str(
        tiny_artifacts_dflash2
    )
    assert "skipped" in c["profile"] and "skipped" in c["peers"]
    for s in c["temperatures"]:  # measured like ours: same prompts, rounds, tokens
        assert s["status"] == "measured" and sum(s["histogram"]) == s["steps"] > 0
        assert [p["name"] for p in s["prompts"]] == [
            p["name"] for p in res["temperatures"][0]["prompts"]
        ]
    assert [d["form"] for d in res["drafts"]] == ["DFlash", "DFlash-2"]
    for d, secs in zip(res["drafts"], (res["temperatures"], c["temperatures"])):
        assert [s["temperature"] for s in d["temperatures"]] == [0.0, 1.0]
        for s, full in zip(d["temperatures"], secs):
            assert s["tau"] == full["tau"] >= 1 and s["speedup"] == full["speedup"]
            assert s["speedup"]["median"] > 0
        assert (
            d["temperatures"][0]["check"]["passed"]
            and d["temperatures"][1]["check"]["kind"] == "histograms"
        )
    screen = capsys.readouterr().out
    assert "drafts side by side" in screen and f"DFlash-2 ({tiny_artifacts_dflash2})" in screen
    md = (out / "report.md").read_text()
    assert "## Drafts side by side" in md and "| T = 1 τ | T = 1 speedup | T = 1 check |" in md
    assert (
        f"| DFlash ({tiny_artifacts}) | 8 |" in md
        and f"| DFlash-2 ({tiny_artifacts_dflash2}) | 8 |" in md
    )


def test_cli_compare_refuses_another_target(tiny_artifacts, tmp_path, capsys):
    m = json.loads((tiny_artifacts / "manifest.json").read_text())
    other, bare = tmp_path / "other", tmp_path / "bare"
    for d, src in ((other, {"target": {**m["sources"]["target"], "sha256": "0" * 64}}), (bare, {})):
        d.mkdir()
        (d / "manifest.json").write_text(json.dumps({**m, "sources": src}))
    base = [str(tiny_artifacts), "--no-peers", "--no-profile", "--out", str(tmp_path / "o")]
    cases = {
        "was exported from another target": other,
        "records no target checkpoint digest": bare,
        "is the benchmarked directory": tiny_artifacts,
        "does not exist": tmp_path / "missing",
    }
    for expect, d in cases.items():
        assert main([*base, "--compare", str(d)]) == 2, expect
        err = capsys.readouterr().err
        assert "dflash-bench: error:" in err and expect in err and "Traceback" not in err, err
        assert not (tmp_path / "o" / "results.json").exists()  # refused before measuring


def test_peers_run_the_reference_dflash2_draft(tiny_pair, tiny_artifacts_dflash2, tmp_path):
    """The peers load a DFlash-2 draft as the reference's DFlash2DraftModel (its convs and
    selector), whose greedy dflash_generate gives our tokens."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    from dflash_qaic.bench.peers import reference_draft_class

    kw = dict(family="qwen3", agree=1.25, block_size=8, target_layer_ids=[1, 3])
    assert reference_draft_class(tiny_pair(**kw)[1]) is DFlashDraftModel
    assert reference_draft_class(tiny_pair(**kw, draft_form="dflash2")[1]) is DFlash2DraftModel
    out = tmp_path / "bench"
    args = [str(tiny_artifacts_dflash2), "--out", str(out), "--temperatures", "0", "--no-profile"]
    assert (
        main(
            [
                *args,
                "--num-prompts",
                "2",
                "--repeats",
                "1",
                "--max-new-tokens",
                "12",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    res = json.loads((out / "results.json").read_text())
    assert res["artifacts"]["draft_form"] == "DFlash-2" and "compare" not in res
    assert all(s["same_tokens"] == 2 for s in res["peers"]["systems"].values())
    assert res["peers"]["reference_tau"] >= 1
    assert res["peers"]["reference_draft"] == "DFlash2DraftModel"
    assert "(draft: `DFlash2DraftModel`)" in (out / "report.md").read_text()


def test_cli_bad_input(tiny_artifacts, tmp_path, capsys):
    base = [str(tiny_artifacts), "--no-peers", "--no-profile"]
    latin1 = tmp_path / "p.txt"
    latin1.write_bytes("café\n".encode("latin-1"))
    a_file = tmp_path / "f"
    a_file.write_text("x")
    bad_json = tmp_path / "p.jsonl"
    bad_json.write_text('{"nothing": 1}\n')
    cases = {
        "not UTF-8": [*base, "--prompts", str(latin1), "--out", str(tmp_path / "o")],
        "is a file": [*base, "--out", str(a_file)],
        '"prompt"': [*base, "--prompts", str(bad_json), "--out", str(tmp_path / "o")],
        "does not exist": [str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
        "--temperatures": [*base, "--temperatures", "0,-1"],
        "--top-p": [*base, "--top-p", "0"],
        "--threads": [*base, "--threads", "0"],
    }
    for expect, argv in cases.items():
        assert main(argv) == 2, expect
        err = capsys.readouterr().err
        assert "dflash-bench: error:" in err and expect in err and "Traceback" not in err, err


def test_export_and_serve_modes_are_delegated(monkeypatch, capsys):
    import sys
    import types

    got = {}
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the delegate renames argv[0]
    fake = types.ModuleType("dflash_lab.serve_bench")
    fake.main = lambda argv: got.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "dflash_lab.serve_bench", fake)
    assert main(["--serve", "artifacts/x", "--clients", "2"]) == 0
    assert got["argv"] == ["artifacts/x", "--clients", "2"]
    assert sys.argv[0] == "dflash-bench --serve"
    monkeypatch.setitem(sys.modules, "dflash_lab.export_bench", None)  # absent
    assert main(["--export"]) == 2
    assert "--export needs dflash_lab.export_bench, not installed" in capsys.readouterr().err


# ---------------------------------------------------------------------------- continuous batching


def _req(n_tokens, ttft, tpot, lengths=(), calls=None):
    st = {"new_tokens": n_tokens, "ttft_s": ttft, "tpot_s": tpot}
    return SimpleNamespace(
        tokens=[7] * n_tokens, acceptance_lengths=list(lengths), stats=st, call_times=calls or {}
    )


def _batch(c, wall, mode, tokens=100):
    """c requests of `tokens` tokens in `wall` seconds; request i has TTFT (i + 1) × 10 ms."""
    lengths = [4] * (tokens // 4) if mode == "dflash" else [1] * tokens
    kind = "verify" if mode == "dflash" else "decode"
    res = [
        _req(tokens, 0.01 * (i + 1), 0.002 * (i + 1), lengths, {kind: [0.01] * len(lengths)})
        for i in range(c)
    ]
    budget = {
        "prefill": {"calls": c, "s": 0.1 * wall},
        kind: {"calls": len(lengths), "s": 0.5 * wall},
    }
    return {"wall_s": wall, "results": res, "budget": budget}


def test_batch_point_by_hand():
    # two rounds of 4 requests × 100 tokens, in 1 s and 2 s: 400 and 200 tokens/s
    p = stats.batch_point([_batch(4, 1.0, "dflash"), _batch(4, 2.0, "dflash")])
    assert p["rounds_tokens_per_s"] == [400.0, 200.0] and p["tokens_per_s"]["median"] == 300.0
    assert p["requests"] == 8 and p["new_tokens"] == 800 and p["tau"] == 4.0
    ttft = [0.01, 0.02, 0.03, 0.04] * 2  # pooled over rounds; numpy's linear interpolation
    assert p["ttft_s"]["p50"] == pytest.approx(np.percentile(ttft, 50))
    assert p["ttft_s"]["p95"] == pytest.approx(np.percentile(ttft, 95)) and p["ttft_s"]["n"] == 8
    # TPOT 2, 4, 6, 8 ms twice: the 95th percentile sits between the two 8 ms, the median at 5
    assert p["tpot_s"]["p95"] == pytest.approx(0.008) and p["tpot_s"]["p50"] == pytest.approx(0.005)
    b = p["budget"]  # prefill 10 % and verify 50 % of each wall time: the host has the rest
    assert b["prefill"]["share"] == pytest.approx(0.1) and b["verify"]["calls_per_batch"] == 25
    assert b["verify"]["call_s"] == pytest.approx((0.5 + 1.0) / 50)
    assert b["host"]["share"] == pytest.approx(0.4)
    assert stats.round_ratios([4.0, 9.0], [2.0, 3.0])["median"] == pytest.approx(2.5)
    with pytest.raises(ValueError):
        stats.round_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        stats.batch_point([])


def _measured(walls: dict, concs=(1, 2, 8), rounds=2, default=1):
    """runs[(c, mode, policy)]: `rounds` batches of c requests in walls[c, mode] seconds; the
    other policy at the largest c runs 10 % slower."""
    runs = {
        (c, m, default): [_batch(c, walls[c, m], m) for _ in range(rounds)]
        for c in concs
        for m in ("dflash", "baseline")
    }
    other = None if default == 1 else 1
    for m in ("dflash", "baseline"):
        runs[max(concs), m, other] = [_batch(max(concs), 1.1 * walls[max(concs), m], m)] * rounds
    solo = {m: [[7] * 100 for _ in range(max(concs))] for m in ("dflash", "baseline")}
    checks = [{"label": f"c={c}", "mode": m, "tokens": [[7] * 100] * c} for (c, m, _p) in runs]
    return {"runs": runs, "solo": solo, "checks": checks, "default": default}


def _batch_results(measured, temperature=0.0, concs=(1, 2, 8)) -> dict:
    from dflash_qaic.bench import batch, batch_report

    res = _results()
    res["artifacts"].update(full_batch_size=8)
    res["config"] = {
        "concurrency": list(concs),
        "max_new_tokens": 100,
        "repeats": 2,
        "warmup": 0,
        "temperature": temperature,
        "prompts_source": "test",
        "prompts": [f"p{i}" for i in range(max(concs))],
    }
    res = {k: res[k] for k in ("command", "started", "seconds", "artifacts", "config", "machine")}
    return {
        "schema": batch_report.SCHEMA,
        **res,
        **batch.summarise(measured, list(concs), temperature),
    }


def test_batch_summary_and_report(tmp_path):
    from dflash_qaic.bench import batch_report

    # DFlash: 100 tokens/s alone, 8 × 100 tokens in 1.6 s at 8 = 500 tokens/s (5× one request's);
    # target alone: 8 × 100 tokens in 2 s = 400 tokens/s, so DFlash is 1.25× it
    walls = {(1, "dflash"): 1.0, (1, "baseline"): 1.25, (2, "dflash"): 1.0}
    walls.update({(2, "baseline"): 1.0, (8, "dflash"): 1.6, (8, "baseline"): 2.0})
    res = _batch_results(_measured(walls))
    p8 = res["points"][-1]
    assert p8["concurrency"] == 8 and p8["modes"]["dflash"]["tokens_per_s"]["median"] == 500
    assert p8["ratios"]["vs_c1"]["dflash"]["median"] == pytest.approx(5.0)
    assert p8["ratios"]["vs_c1"]["baseline"]["median"] == pytest.approx(400 / 80)
    assert p8["ratios"]["dflash_vs_target"]["median"] == pytest.approx(1.25)
    # bound: τ 4 × decode (0.5 × 2.0 s / 100 calls) ÷ verify (0.5 × 1.6 s / 25 calls), no draft
    assert p8["ratios"]["bound"] == pytest.approx(4 * 0.010 / 0.032)
    # steps: the same calls as spent, 100 decode calls against 25 verify calls per batch
    assert p8["ratios"]["steps"] == pytest.approx(100 * 0.010 / (25 * 0.032))
    assert "goals" not in res  # no targets of a tracker in the product's reports
    # (1 + 2 + 8) requests × 2 modes + 8 × 2 under the other policy + 8 solo pairs (T = 0)
    assert res["equality"] == {"equal": 46, "total": 46, "passed": True, "problems": []}
    pol = {x["prefill_chunks_per_step"]: x for x in res["policy"]["policies"]}
    assert set(pol) == {None, 1} and pol[1]["default"] and not pol[None]["default"]
    slower = pol[None]["modes"]["dflash"]["tokens_per_s"]["median"]
    assert slower == pytest.approx(800 / (1.1 * 1.6))
    screen = batch_report.summary_screen(res)
    lines = screen.splitlines()
    assert lines[2] == "requests equal to their solo run: 46/46" and len(lines) < 30
    assert "(steps)" in lines[3] and lines[6].split()[-4] == "1.25×"  # c = 8: (steps)
    assert lines[6].split()[-3:-1] == ["5.00×,", "5.00×"]  # c = 8 against c = 1, both modes
    assert "goal" not in screen.lower() and "MET" not in screen
    budget = [x for x in lines if "DFlash: prefill" in x]  # where the time goes, at every c
    assert [x.split()[0] for x in budget] == ["1", "2", "8"]
    md = batch_report.render_markdown(res)
    assert md.index(lines[0]) < md.index("## Reading the summary") < md.index("## Machine")
    assert "$" not in md and "None (default)" not in md and "1 (default)" in md
    paths = batch_report.write_outputs(res, tmp_path)
    back = json.loads(paths["json"].read_text())
    assert back["points"][0]["modes"]["dflash"]["tau"] == 4.0
    assert back["policy"]["policies"][0]["prefill_chunks_per_step"] is None
    assert paths["png"].stat().st_size > 0


def test_batch_policies_and_no_c1():
    walls = {(c, m): 1.0 for c in (1, 2) for m in ("dflash", "baseline")}
    res = _batch_results(_measured(walls, concs=(1, 2)), concs=(1, 2))
    assert res["policy"]["concurrency"] == 2 and len(res["policy"]["policies"]) == 2
    # without c = 1 there is no ratio against one request
    walls = {(c, m): 1.0 for c in (2, 4) for m in ("dflash", "baseline")}
    res = _batch_results(_measured(walls, concs=(2, 4)), concs=(2, 4))
    assert res["points"][0]["ratios"]["vs_c1"] == {"dflash": None, "baseline": None}


def test_batch_equality_finds_a_difference():
    from dflash_qaic.bench.batch import equality

    solo = {"dflash": [[1, 2, 3], [4, 5]], "baseline": [[1, 2, 3], [4, 6]]}
    checks = [
        {"label": "c=2 dflash", "mode": "dflash", "tokens": [[1, 2, 3], [4, 5]]},
        {"label": "c=2 baseline", "mode": "baseline", "tokens": [[1, 9, 3], [4, 6]]},
    ]
    e = equality(solo, checks, greedy=True)
    # the batch's prompt 0 differs at index 1; solo prompt 1 differs between the modes
    assert (e["equal"], e["total"], e["passed"]) == (4, 6, False)
    assert e["problems"] == [
        "c=2 baseline, prompt 0: tokens differ from index 1",
        "solo prompt 1, DFlash against the target alone: tokens differ from index 1",
    ]
    assert equality(solo, checks[:1], greedy=False)["passed"]


def test_parse_concurrency_and_fit():
    from dflash_qaic.bench.batch import check_fits

    assert parse_list("--concurrency", "8, 1,2 ,4,", int) == [8, 1, 2, 4]
    for bad in ("", "x", "0", "1,1", "-2"):
        with pytest.raises(BenchError):
            parse_list("--concurrency", bad, int)
    check_fits(8, [1, 8], "a")
    check_fits(None, [1], "a")  # one slot without continuous batching
    for rows in (4, None):
        with pytest.raises(BenchError, match="--full-batch-size 8"):
            check_fits(rows, [1, 8], "a")


@pytest.fixture(scope="module")
def default_cb2(tmp_path_factory):
    """The default pair exported in the continuous-batching form with 2 cache rows."""
    import dflash_qaic
    from dflash_qaic.exporter.cli import load_recipe

    r = load_recipe("default")
    out = tmp_path_factory.mktemp("default-cb2") / "art"
    dflash_qaic.export(
        r["target"],
        r["draft"],
        out,
        full_batch_size=2,
        compile=False,
        prefill_seq_len=64,
        ctx_len=1024,
        fp16_check=False,  # the fp16 check has its own tests
    )
    return out


def test_batch_cli_end_to_end(default_cb2, tmp_path, capsys):
    out = tmp_path / "batch"
    argv = [str(default_cb2), "--concurrency", "1,2", "--max-new-tokens", "8", "--repeats", "1"]
    assert main([*argv, "--warmup", "0", "--threads", "1", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["schema"] == "dflash-bench-batch/1" and res["artifacts"]["full_batch_size"] == 2
    assert [p["concurrency"] for p in res["points"]] == [1, 2]
    for p in res["points"]:
        for mode in ("dflash", "baseline"):
            x = p["modes"][mode]
            # every concurrency runs the same requests: 2 prompts × 2 (--requests-per-prompt)
            assert x["requests"] == 4 and x["new_tokens"] == 8 * 4
            assert x["tokens_per_s"]["median"] > 0 and x["ttft_s"]["p95"] >= x["ttft_s"]["p50"]
            assert sum(v["share"] for v in x["budget"].values()) == pytest.approx(1.0)
        assert p["modes"]["baseline"]["tau"] == 1.0 and p["modes"]["dflash"]["tau"] >= 1.0
        assert p["ratios"]["dflash_vs_target"]["n"] == 1 and p["ratios"]["bound"] > 0
        assert "verify" in p["modes"]["dflash"]["budget"]
        assert "decode" in p["modes"]["baseline"]["budget"]
        # the draft takes several target chunks of a prompt per call (and they are told apart)
        calls = {k: v["calls_per_batch"] for k, v in p["modes"]["dflash"]["budget"].items()}
        assert 1 <= calls["draft_prefill"] < calls["prefill"]
    assert res["points"][0]["ratios"]["vs_c1"]["dflash"]["median"] == pytest.approx(1.0)
    # the equality check ran: 2 solo comparisons + 4 requests × 2 modes × (c = 1, c = 2, the
    # other policy at c = 2)
    e = res["equality"]
    assert e == {"equal": 26, "total": 26, "passed": True, "problems": []}
    pol = res["policy"]
    assert pol["concurrency"] == 2 and len(pol["policies"]) == 2
    screen = capsys.readouterr().out
    assert screen.startswith("dflash-bench --concurrency") and "requests equal" in screen
    md = (out / "report.md").read_text()
    assert md.startswith("# dflash-bench report: continuous batching") and "![" in md
    assert (out / "report.png").stat().st_size > 0


def test_batch_cli_refuses_more_than_the_slots(default_cb2, tmp_path, capsys):
    argv = [str(default_cb2), "--concurrency", "1,4", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "dflash-bench: error:" in err and "--full-batch-size 4" in err
    assert "holds 2" in err and "Traceback" not in err
    assert main([str(default_cb2), "--concurrency", "1,x"]) == 2
    assert "'x' is not an integer" in capsys.readouterr().err
    bad_t = [str(default_cb2), "--concurrency", "1", "--temperature", "nan", "--out", str(tmp_path)]
    assert main(bad_t) == 2 and "--temperature must be" in capsys.readouterr().err


def test_the_built_in_target_is_known_by_its_digest_from_any_checkout(tmp_path):
    """Artifacts exported from a copy of the built-in target (another checkout or install) still
    get its held-out prompts: the target is recognised by its checkpoint digest, not only its
    path; another target is not."""
    import shutil

    from dflash_qaic import assets
    from dflash_qaic import checkpoints as ck
    from dflash_qaic.bench.run import is_default_target

    copy = tmp_path / "target"
    shutil.copytree(assets.default_pair()[0], copy)
    own = {"sources": {"target": str(assets.default_pair()[0])}, "target_sha256": None}
    moved = {"sources": {"target": str(copy)}, "target_sha256": ck.file_digest(copy)}
    assert is_default_target(own) and is_default_target(moved)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    other = {"sources": {"target": str(copy)}, "target_sha256": ck.file_digest(copy)}
    assert not is_default_target(other)
    assert not is_default_target({"sources": {"target": None}, "target_sha256": None})
