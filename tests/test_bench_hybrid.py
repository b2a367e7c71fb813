"""`dflash-bench` on a hybrid target (Qwen3.5: Gated DeltaNet + full attention): the cost
profile's state part is the recurrent state's bytes, read and written, ÷ the copy bandwidth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_qaic.artifacts.build import ExportOptions, build_artifacts
from dflash_qaic.bench import report
from dflash_qaic.bench.cli import main


@pytest.fixture(scope="module")
def hybrid(tiny_pair, tmp_path_factory):
    """(target checkpoint, artifacts): a tiny hybrid pair at ctx_len 256, prefill chunk 16."""
    t, d = tiny_pair(family="qwen3_5", agree=1.25, block_size=8, target_layer_ids=[1, 3])
    out = tmp_path_factory.mktemp("bench-hybrid")
    opts = ExportOptions(prefill_seq_len=16, ctx_len=256, compile=False, fp16_check=False)
    build_artifacts(t, d, out, opts, progress=lambda m: None)
    return t, out


def state_bytes_of(target_dir) -> int:
    """One sequence's state from the checkpoint's config (not from the manifest): per Gated
    DeltaNet layer an fp32 state [v_heads, dk, dv] and conv window [conv_dim, kernel − 1]."""
    cfg = json.loads(Path(target_dir, "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    hv, dk, dv = (cfg[f"linear_{k}"] for k in ("num_value_heads", "key_head_dim", "value_head_dim"))
    conv_dim = 2 * cfg["linear_num_key_heads"] * dk + hv * dv  # q, k and v go through the conv
    per_layer = hv * dk * dv + conv_dim * (cfg["linear_conv_kernel_dim"] - 1)
    return 4 * per_layer * cfg["layer_types"].count("linear_attention")


def test_hybrid_cost_profile_splits_out_the_state(hybrid, tmp_path, capsys):
    t, art = hybrid
    out = tmp_path / "bench"
    args = [str(art), "--out", str(out), "--num-prompts", "1", "--repeats", "1", "--warmup", "0"]
    args += ["--max-new-tokens", "8", "--threads", "1", "--no-peers", "--temperatures", "0"]
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    n = state_bytes_of(t)
    assert n == 4 * 3 * (4 * 16 * 16 + 128 * 3)  # 3 DeltaNet layers of the tiny pair
    assert res["artifacts"]["target"]["state_bytes"] == n
    p, bw = res["profile"], res["bandwidth"]["copy_Bps"]
    assert p["short_ctx_len"] == 64 and p["note"] is None  # the KV part measured: exported again
    calls = p["calls"]
    assert set(calls) == {"decode", "verify", "draft"}
    for kind, c in calls.items():
        # every target call reads the state whole and writes it back whole; the draft has none
        assert c["state_s"] == (None if kind == "draft" else pytest.approx(2 * n / bw)), kind
        assert c["cache_s"] is not None and c["sampler_s"] is not (kind == "draft")
        greedy = c["weights_s"] + c["cache_s"] + (c["state_s"] or 0.0) + c["fixed_s"]
        assert greedy == pytest.approx(c["greedy_s"]), kind
        assert greedy + (c["sampler_s"] or 0.0) == pytest.approx(c["sampled_s"]), kind
    assert calls["decode"]["state_s"] > 0
    screen = capsys.readouterr().out
    assert "total = weights + cache + state + sampler + fixed" in screen, screen[-600:]
    md = (out / "report.md").read_text()
    assert "| weights | cache | state | sampler | fixed |" in md
    assert f"recurrent state and conv windows ({report.mb(n)} a sequence)" in md
    assert (out / "report.png").stat().st_size > 0


def test_state_bar_is_drawn_between_cache_and_sampler():
    """The chart stacks the state part with the others, in its own colour; a dense call's bar
    keeps its parts and colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    call = dict(greedy_s=0.006, sampled_s=0.007, weights_s=0.002, cache_s=0.001, state_s=0.0015,
                sampler_s=0.001, fixed_s=0.0015)  # fmt: skip
    dense = {k: v for k, v in call.items() if k != "state_s"} | {"fixed_s": 0.003}
    assert [k for k, _, _ in report.bar_segments(call)] == list(report.parts({"": call}))
    assert report.parts({"": dense}) == report.PARTS
    assert [s[1] for s in report.bar_segments(call)] == pytest.approx([0, 2, 3, 4.5, 5.5])
    fig, ax = plt.subplots()
    report._profile_panel(ax, {"ctx_len": 256, "calls": {"verify": call, "draft": dense}})
    handles, labels = ax.get_legend_handles_labels()
    colours = {k: h.patches[0].get_facecolor() for h, k in zip(handles, labels) if k != "total"}
    assert set(colours) == {"weights", "cache", "state", "sampler", "fixed"}
    assert len({tuple(c) for c in colours.values()}) == 5
    plt.close(fig)
