"""`dflash-bench --project ai100`: the graph counter against hand arithmetic, the roofline, the
command's outputs, and the real recipes' specialization counts (bench/project.py)."""

from __future__ import annotations

import json

import pytest

from dflash_qaic.bench import project as P
from dflash_qaic.compiler.profiles import load_profile


@pytest.fixture(scope="module")
def target_graph(default_artifacts):
    from dflash_qaic import assets
    from dflash_qaic.artifacts.manifest import read_manifest

    m = read_manifest(default_artifacts, check_files="none")
    cfg = json.loads((assets.default_pair()[0] / "config.json").read_text())
    return P.load_graph(default_artifacts / m.target.onnx), m, cfg


def _dims(m, cfg):
    t = m.target.io
    return dict(
        L=t.n_layers,
        H=m.hidden_size,
        V=m.vocab_size,
        nq=cfg["num_attention_heads"],
        nkv=t.n_kv_heads,
        hd=t.head_dim,
        inter=cfg["intermediate_size"],
        taps=len(m.target_layer_ids),
    )


def test_counts_match_hand_arithmetic(target_graph):
    """Weights by kind, KV read at a window and written for B rows, MatMul FLOPs for B rows of
    the built-in target, each from its config's dimensions by hand."""
    model, m, cfg = target_graph
    d = _dims(m, cfg)
    L, H, V, nq, nkv, hd, inter, taps = (
        d[k] for k in ("L", "H", "V", "nq", "nkv", "hd", "inter", "taps")
    )
    B, W = 16, 512
    sym = {"batch_size": 1, "seq_len": B, "ctx_len": m.ctx_len, "sample_len": 1}
    g = P.count_graph(model, {**sym, "comp_ctx_lengths": W}, state=m.target.state)
    c = g.total()
    per_layer = H * nq * hd + 2 * H * nkv * hd + nq * hd * H + 3 * H * inter
    rest = H * V + taps * H * H  # the (tied) head and fc
    assert c.matmul_weights == L * per_layer + rest
    assert [p.matmul_weights for p in g.layers.values()] == [per_layer] * L
    assert c.kv_read == L * 2 * nkv * W * hd and c.kv_write == L * 2 * nkv * B * hd
    attention = 2 * 2 * nq * B * hd * W  # Q·Kᵀ and P·V over W slots
    assert c.flops == 2 * B * (L * per_layer + rest) + L * attention
    assert g.uncounted_matmuls == 0 and {p.kind for p in g.layers.values()} == {"full_attention"}
    # the profile's formats: MXFP6 weights (6.25 bits), MXINT8 KV (8.25 bits), fp16 elsewhere
    fmt = P.Formats.of(load_profile("ai100_mxfp6_mxint8"))
    b = fmt.bytes(c)
    assert b["weights"] == pytest.approx(c.matmul_weights * 6.25 / 8 + c.other_weights * 2)
    assert b["kv"] == pytest.approx((c.kv_read + c.kv_write) * 8.25 / 8) and b["state"] == 0
    # scaling the graph: twice its layers doubles what the layers hold, not the rest
    two = g.scaled({"full_attention": 2 * L})
    assert two.matmul_weights == 2 * L * per_layer + rest
    with pytest.raises(P.ProjectionError, match="no linear_attention layer"):
        g.scaled({"full_attention": L, "linear_attention": 1})
    with pytest.raises(P.ProjectionError, match="full_attention layers the published shape"):
        g.scaled({})


def test_roofline_and_tokens_per_second():
    card = P.Card("test", socs=1, bandwidth=100e9, flops=100e12)
    assert card.seconds(1e9, 1e9, cores=16) == pytest.approx(0.01)  # bandwidth-bound
    assert card.seconds(1e6, 1e12, cores=16) == pytest.approx(0.01)  # compute-bound
    assert card.seconds(1e6, 1e12, cores=4) == pytest.approx(0.04)  # a quarter of the cores
    ultra = P.Card("u", socs=4, bandwidth=400e9, flops=400e12)
    assert ultra.seconds(4e9, 0, cores=16, socs=4) == pytest.approx(0.01)
    assert ultra.seconds(4e9, 0, cores=16, socs=1) == pytest.approx(0.04)
    assert P.tokens_per_second(8.0, 0.04) == pytest.approx(200.0)
    assert P.parse_tau("chain=8.88, 32=10.5") == {"chain": 8.88, 32: 10.5}
    for bad in ("chain", "x=2", "32=0.5"):
        with pytest.raises(P.ProjectionError, match="--tau"):
            P.parse_tau(bad)


def test_cli_writes_the_projection(default_artifacts, tmp_path, capsys):
    from dflash_qaic.bench.cli import main

    out = tmp_path / "proj"
    argv = ["--project", "ai100", "--artifacts", str(default_artifacts), "--out", str(out)]
    assert main([*argv, "--tree-budgets", "32", "--tau", "chain=8,32=10"]) == 0
    screen = capsys.readouterr().out
    assert "PROJECTION" in screen and "tree32" in screen
    assert {p.name for p in out.iterdir()} >= {
        "summary.txt",
        "table.md",
        "projection.png",
        "results.json",
    }
    assert (out / "projection.png").read_bytes()[:4] == b"\x89PNG"
    r = json.loads((out / "results.json").read_text())["results"][0]
    calls, tps = r["calls"], r["tokens_per_s"]
    chain_step = calls["draft"]["seconds"] + calls["verify16"]["seconds"]
    assert tps["ar"] == pytest.approx(1 / calls["decode"]["seconds"])
    assert tps["chain"] == pytest.approx(8 / chain_step)
    assert tps["tree32"] == pytest.approx(
        10 / (calls["draft"]["seconds"] + calls["tree32"]["seconds"])
    )
    assert calls["tree32"]["flops"] > calls["verify16"]["flops"]
    # the step policy's break-even τ on the card: (draft + verify) / decode, then verify alone
    assert r["policy_tau"] == pytest.approx(chain_step / calls["decode"]["seconds"])
    assert r["policy_tau_drafted"] == pytest.approx(
        calls["verify16"]["seconds"] / calls["decode"]["seconds"]
    )
    assert 1.0 <= r["policy_tau_drafted"] < r["policy_tau"]
    assert f"drafting pays from τ {r['policy_tau']:.2f}" in (out / "summary.txt").read_text()
    assert main([*argv, "--tau", "chain=oops"]) == 2
    assert "--tau" in capsys.readouterr().err


def test_ai200_asks_for_its_bandwidth(default_artifacts, tmp_path, capsys):
    """No published AI 200 bandwidth: the projection asks for --bandwidth-gbs, then scales
    with it (bf16 weights and KV by default); on an AI 100 the flag replaces the card's."""
    from dflash_qaic.bench.cli import main

    argv = ["--artifacts", str(default_artifacts), "--tree-budgets", "32", "--tau", "chain=8"]
    assert main(["--project", "ai200", *argv, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "AI 200 has no published memory bandwidth" in err and "--bandwidth-gbs" in err
    seconds = {}
    for name, extra in [("a", ["ai200", "--bandwidth-gbs", "274"]),
                        ("b", ["ai100", "--bandwidth-gbs", "274"]), ("c", ["ai100"])]:  # fmt: skip
        out = tmp_path / name
        assert main(["--project", extra[0], *argv, *extra[1:], "--out", str(out)]) == 0
        r = json.loads((out / "results.json").read_text())
        seconds[name] = r["results"][0]["calls"]["decode"]["seconds"]
        assert r["card"]["bandwidth"] == (274e9 if extra[1:] else 137e9)
    assert r["profile"] == "ai100_mxfp6_mxint8"
    assert "AI 200 PROJECTION" in capsys.readouterr().out
    assert seconds["b"] == pytest.approx(seconds["c"] / 2)  # twice the bandwidth: half the time
    assert seconds["a"] > seconds["b"]  # bf16 weights move more bytes than MXFP6
    bad = ["--project", "ai200", *argv, "--bandwidth-gbs", "274", "--qpc-config", "ai100_fp16"]
    assert main([*bad, "--out", str(tmp_path / "d")]) == 2
    assert "compiles for ai100, not ai200" in capsys.readouterr().err


def test_real_recipes_compile_few_specializations(default_artifacts):
    """Every shipped real-model recipe asks for ≤ 12 target specializations, counted through
    the options and shape plan the export uses (checked against an export's own count)."""
    from dflash_qaic.artifacts.manifest import read_manifest

    m = read_manifest(default_artifacts, check_files="none")
    assert P.recipe_specializations("default") == m.specialization_count
    counts = {r: P.recipe_specializations(r)["target"] for r in P.real_recipes()}
    assert len(counts) >= 9 and "default" not in counts
    assert max(counts.values()) <= 12, counts


def test_project_on_known_counts():
    """project(): call times on the roofline from counts given by hand, tokens/s of AR, chain
    and tree for a batch of 4 sequences, the τ a tree needs, and the best tree."""
    card = P.Card("test", socs=1, bandwidth=1e9, flops=1e12)
    prof = load_profile("ai100_fp16")  # fp16 everywhere; target 12 cores, draft 4
    weights = P.PartCounts(matmul_weights=5e6)  # 10 MB in fp16: 10 ms at 1 GB/s
    progs = P.Programs("t", False, 16, 64, 64, 0, 0, batch=4)
    progs.counts = {
        "decode": weights,
        "verify16": weights,
        "tree32": P.PartCounts(matmul_weights=5e6, flops=15e9),  # 20 ms on 12 of 16 cores
        "draft": P.PartCounts(matmul_weights=1e6),  # 2 ms
    }
    r = P.project(progs, prof, card, {"chain": 6.0, 32: 9.0}, (32,))
    assert r.calls["tree32"].bound == "compute" and r.calls["verify16"].bound == "bandwidth"
    assert r.calls["tree32"].seconds == pytest.approx(0.02)
    assert r.tokens_per_s["ar"] == pytest.approx(4 / 0.01)
    assert r.tokens_per_s["chain"] == pytest.approx(4 * 6.0 / 0.012)
    assert r.tokens_per_s["tree32"] == pytest.approx(4 * 9.0 / 0.022)
    assert r.break_even_tau["tree32"] == pytest.approx(6.0 * 0.022 / 0.012)
    assert r.pick == "tree32" and r.step_ratio["tree32"] == pytest.approx(0.022 / 0.012)
