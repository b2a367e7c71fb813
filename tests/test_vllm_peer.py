"""`dflash-bench --concurrency … --peers vllm` (bench/upstream.py, bench/vllm_peer.py).

Fast tier: the parts that need no vLLM — the flags, finding vLLM's Python, the subprocess
plumbing (a stand-in driver), the driver's closed loop and counters on a stand-in engine, the
summary of its output and the report's row, section and bars. Slow tier: the real thing, vLLM's
own DFlash in `.venv-vllm/` beside our programs on the built-in pair."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_qaic.bench import upstream, vllm_peer
from dflash_qaic.bench.cli import main
from dflash_qaic.bench.run import BenchError

ROOT = Path(__file__).resolve().parents[1]


def test_the_flags():
    assert upstream.parse_peers(None) == []
    assert upstream.parse_peers("vllm") == upstream.parse_peers("vllm,vllm") == ["vllm"]
    with pytest.raises(BenchError, match="known peers are vllm"):
        upstream.parse_peers("sglang")


def test_bad_input_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(upstream.PYTHON_ENV, raising=False)
    art, out = str(tmp_path / "none"), str(tmp_path / "out")
    assert main([art, "--peers", "vllm", "--out", out]) == 2
    assert "add --concurrency" in capsys.readouterr().err
    common = [art, "--concurrency", "1", "--peers", "vllm", "--out", out]
    assert main([*common, "--temperature", "1"]) == 2
    assert "--temperature 0" in capsys.readouterr().err
    assert main([*common, "--vllm-python", str(tmp_path / "nope")]) == 2
    assert "make setup-vllm" in capsys.readouterr().err


def test_finding_vllms_python(tmp_path, monkeypatch):
    monkeypatch.setenv(upstream.PYTHON_ENV, sys.executable)
    assert upstream.find_python() == Path(sys.executable)
    assert upstream.find_python(sys.executable) == Path(sys.executable)
    monkeypatch.delenv(upstream.PYTHON_ENV)
    monkeypatch.chdir(tmp_path)
    fake = tmp_path / ".venv-vllm/bin/python"
    if not (ROOT / ".venv-vllm/bin/python").exists():  # the checkout's own is found second
        with pytest.raises(BenchError, match="no Python at .*\\.venv-vllm/bin/python"):
            upstream.find_python()
    fake.parent.mkdir(parents=True)
    fake.symlink_to(sys.executable)
    assert upstream.find_python() == fake


def test_the_subprocess_plumbing(tmp_path, monkeypatch):
    """The driver's input reaches it as JSON and its output comes back; a failing driver is a
    BenchError quoting its log's last lines."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import json, sys\ncfg = json.load(open(sys.argv[1]))\n"
        "print('starting', file=sys.stderr)\n"
        "if cfg.get('fail'): sys.exit('engine died: out of memory')\n"
        "json.dump({'echo': cfg}, open(sys.argv[2], 'w'))\n"
    )
    monkeypatch.setattr(upstream, "DRIVER", driver)
    got = upstream.run_driver(Path(sys.executable), {"x": [1, 2]}, tmp_path / "log")
    assert got == {"echo": {"x": [1, 2]}}
    with pytest.raises(BenchError, match="exit 1.*engine died: out of memory.*whole log"):
        upstream.run_driver(Path(sys.executable), {"fail": True}, tmp_path / "log")


class _Engine:
    """vLLM's LLMEngine as the driver uses it: add_request, then step() returning each request's
    cumulative output; request r commits `per_step[r]` tokens per step after a prefill token."""

    def __init__(self, per_step: dict[int, int], n: int):
        self.per_step, self.n, self.live, self.max_live = per_step, n, {}, 0

    def add_request(self, rid, prompt, params):
        assert isinstance(prompt["prompt_token_ids"], list)
        self.live[int(rid)] = []
        self.max_live = max(self.max_live, len(self.live))

    def step(self):
        out = []
        for r, toks in list(self.live.items()):
            k = 1 if not toks else self.per_step[r]
            toks += [r * 100 + len(toks) + j for j in range(min(k, self.n - len(toks)))]
            done = len(toks) == self.n
            out.append(
                SimpleNamespace(
                    request_id=str(r),
                    outputs=[SimpleNamespace(token_ids=list(toks))],
                    finished=done,
                )
            )
            if done:
                del self.live[r]
        return out


def test_the_drivers_closed_loop_and_counters():
    engine = _Engine({0: 3, 1: 2, 2: 4}, n=9)
    llm = SimpleNamespace(llm_engine=engine)
    wall, tokens, steps, tpot = vllm_peer.closed_loop(llm, [[1], [2], [3]], [0, 1, 2], 2, None)
    assert engine.max_live == 2 and wall > 0 and len(tpot) == 3 and min(tpot) > 0
    assert tokens[1] == [100 + j for j in range(9)]
    assert steps == {0: [1, 3, 3, 2], 1: [1, 2, 2, 2, 2], 2: [1, 4, 4]}

    def metric(name, value=None, values=None):
        return SimpleNamespace(name=name, value=value, values=values)

    before = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    llm = SimpleNamespace(
        get_metrics=lambda: [
            metric("vllm:spec_decode_num_drafts", 10),
            metric("vllm:spec_decode_num_draft_tokens", 150),
            metric("vllm:spec_decode_num_accepted_tokens", 27),
            metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[9, 8, 6, 4]),
            metric("vllm:num_requests_running", 0),
        ]
    )
    now = vllm_peer.counters(llm)
    assert now == {
        "drafts": 10,
        "draft_tokens": 150,
        "accepted": 27,
        "accepted_per_pos": [9, 8, 6, 4],
    }
    assert vllm_peer.delta(now, before) == now
    assert vllm_peer.delta(now, now)["accepted_per_pos"] == [0, 0, 0, 0]


RAW = {
    "vllm": "0.32.0",
    "load_s": 12.5,
    "solo": {"tokens": [[5, 6, 7], [8, 9, 9]], "steps": [[1, 2], [1, 1, 1]]},
    "runs": {
        "8": [
            {"wall_s": 2.0, "tokens": 400, "drafts": 40, "draft_tokens": 600, "accepted": 80,
             "accepted_per_pos": [30, 20], "same_as_solo": 4, "requests": 4,
             "tpot_s": [0.004, 0.005, 0.006]},
            {"wall_s": 1.0, "tokens": 400, "drafts": 40, "draft_tokens": 600, "accepted": 80,
             "accepted_per_pos": [30, 20], "same_as_solo": 4, "requests": 4},
        ],
        "1": [
            {"wall_s": 4.0, "tokens": 400, "drafts": 50, "draft_tokens": 750, "accepted": 100,
             "accepted_per_pos": [40, 30], "same_as_solo": 3, "requests": 4},
        ],
    },
}  # fmt: skip


def test_the_summary_of_the_drivers_output():
    v = upstream.summarise(RAW, [[5, 6, 7], [8, 9, 1]], [0, 1, 0, 1])["vllm"]
    one, eight = v["points"]
    assert (one["concurrency"], eight["concurrency"]) == (1, 8)
    assert one["tokens_per_s"]["median"] == 100.0 and eight["tokens_per_s"]["median"] == 300.0
    assert eight["tau"] == 3.0 and one["tau"] == 3.0
    assert eight["position_acceptance"] == [0.75, 0.5]
    assert v["same_tokens"] == 1 and v["prompts"] == 2
    assert v["problems"] == [
        "vLLM prompt 1: tokens differ from ours from index 2",
        "vLLM c=1: 1 requests differ from its solo run",
    ]
    assert v["solo_tau"] == 4 / 3  # the steps after each prompt's prefill token: 2; 1, 1


def _res() -> dict:
    def ours(c, d, b, tau):
        modes = {"dflash": {"tokens_per_s": {"median": d}, "tau": tau}}
        modes["baseline"] = {"tokens_per_s": {"median": b}}
        return {"concurrency": c, "modes": modes}

    res = {"points": [ours(1, 1000.0, 400.0, 8.5), ours(8, 900.0, 600.0, 8.4)]}
    res["peers"] = upstream.summarise(RAW, [[5, 6, 7], [8, 9, 9]], [0, 1, 0, 1])
    res["config"] = {"requests_per_prompt": 2, "max_new_tokens": 100}
    return res


def test_the_reports_row_section_and_bars(tmp_path):
    res = _res()
    rows = upstream.ratio_rows(res)
    assert [(r["concurrency"], r["ratio"]) for r in rows] == [(1, 10.0), (8, 3.0)]
    lines = upstream.summary_lines(res)
    assert "tokens identical to ours for 2/2 prompts" in lines[0] and "DIFFER" in lines[0]
    assert "ours ÷ vLLM 10.00×" in lines[1] and "(τ 3.00)" in lines[1]
    md = upstream.section_md(res)
    assert "| 8 | 900.0 | 300.0 [200.0–400.0] | 3.00× | 8.40 | 3.00 | — | 5.00 |" in md
    assert "vLLM c=1: 1 requests differ" in md and "0.80, 0.60" in md
    assert upstream.section_md({"peers": {"skipped": "no"}}).startswith("\n## Upstream vLLM")
    assert upstream.section_md({}) == "" and upstream.summary_lines({}) == []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    upstream.bar_panel(ax, res)
    heights = sorted(round(p.get_height()) for p in ax.patches)
    assert heights == [100, 300, 400, 600, 900, 1000]
    assert [t.get_text() for t in ax.texts] == ["10.0×", "3.0×"]
    plt.close(fig)


def test_one_request_over_more_prompts(default_artifacts, tmp_path):
    """--num-prompts: at concurrency 1 on single-sequence artifacts, the requests of several
    prompts one after another (the one-request side of --peers vllm)."""
    out = tmp_path / "one"
    argv = [str(default_artifacts), "--concurrency", "1", "--num-prompts", "3", "--out", str(out)]
    argv += ["--max-new-tokens", "8", "--repeats", "1", "--warmup", "0", "--threads", "1"]
    assert main([*argv, "--requests-per-prompt", "1"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert (
        len(res["config"]["prompts"]) == 3 and res["points"][0]["modes"]["dflash"]["requests"] == 3
    )
    # 3 requests × 2 modes × 2 admission policies, and the 3 solo runs DFlash against the target
    assert res["equality"]["passed"] and res["equality"]["total"] == 3 * 2 * 2 + 3
    assert main([*argv, "--num-prompts", "0"]) == 2


# ---------------------------------------------------------------------------- slow tier


@pytest.mark.slow
def test_vllm_beside_our_programs(cb_artifacts, tmp_path):
    """vLLM's own DFlash on the built-in pair's checkpoints, in the same run as our programs:
    its greedy tokens equal ours, τ comes from its counters, and the report has the row, the
    section and the bars."""
    python = ROOT / ".venv-vllm/bin/python"
    if not python.exists() and not os.environ.get(upstream.PYTHON_ENV):
        pytest.fail(f"the vLLM peer needs {python}: run `make setup-vllm` first")
    out = tmp_path / "bench"
    argv = [str(cb_artifacts), "--concurrency", "1,4", "--peers", "vllm", "--out", str(out)]
    argv += ["--max-new-tokens", "32", "--repeats", "1", "--warmup", "0"]
    argv += ["--requests-per-prompt", "1"]
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    v = res["peers"]["vllm"]
    assert v["same_tokens"] == v["prompts"] == 4 and not v["problems"], v["problems"]
    assert [p["concurrency"] for p in v["points"]] == [1, 4]
    for p in v["points"]:
        assert p["drafts"] > 0 and 1 < p["tau"] <= 16
        assert p["draft_tokens"] == 15 * p["drafts"]
    md = (out / "report.md").read_text()
    assert "## Upstream vLLM" in md and "ours ÷ vLLM" in md
    assert (out / "vllm_peer.log").stat().st_size > 0
