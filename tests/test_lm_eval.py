"""A real client of logprobs: lm-evaluation-harness' `local-completions` model (echo + logprobs,
as it scores loglikelihood tasks) against dflash-serve on the built-in pair, scores equal to the
same harness on Hugging Face transformers (`--model hf`). Needs the `eval` extra (lm-eval)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dflash_qaic
from dflash_qaic.exporter.cli import load_recipe
from dflash_qaic.serve.process import ServerProcess

DOCS = [
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"], 0),
    ("import numpy as", [" np", " pd", " os"], 0),
    ("for i in range(10):\n   ", [" print(i)", " return", " class"], 0),
    ("class Stack:\n    def __init__(self):\n        self.items =", [" []", " {}", " 0"], 0),
    ("if __name__ ==", [' "__main__":', " 3:", " None:"], 0),
    ("x = [1, 2, 3]\ny = len(", ["x)", "y)", "z)"], 0),
]
TASK = """task: dflash_tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""


def lm_eval(tasks: Path, out: Path, *model: str) -> dict:
    """Run lm_eval on the local task; returns {doc id: [loglikelihood per choice]} and acc."""
    argv = [sys.executable, "-m", "lm_eval", *model, "--tasks", "dflash_tiny_ll"]
    argv += ["--include_path", str(tasks), "--output_path", str(out), "--log_samples"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = next(out.rglob("samples_dflash_tiny_ll_*.jsonl"))
    lls = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        lls[s["doc_id"]] = [float(r[0][0]) for r in s["resps"]]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    return {"ll": lls, "acc": results["results"]["dflash_tiny_ll"]["acc,none"]}


@pytest.mark.slow  # two lm_eval runs and a dflash-serve process: about a minute
def test_lm_eval_local_completions_equals_hf(tmp_path):
    # a missing harness is a failure, not a skip: the slow tier installs the `eval` extra
    if importlib.util.find_spec("lm_eval") is None:
        pytest.fail("lm-evaluation-harness is not installed: pip install -e '.[eval]'")
    r = load_recipe("default")
    art = tmp_path / "art"
    dflash_qaic.export(
        r["target"], r["draft"], art, compile=False, ctx_len=512, prefill_seq_len=64, logprobs=1
    )
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"context": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in DOCS)
    )
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny.yaml").write_text(TASK.format(data=data))
    hf = lm_eval(
        tasks,
        tmp_path / "hf",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={r['target']},dtype=float32",
    )
    with ServerProcess(art, "--served-model-name", "m") as server:
        args = f"model=m,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
        args += f"tokenizer={art / 'tokenizer'},num_concurrent=1,max_retries=1"
        ours = lm_eval(
            tasks, tmp_path / "ours", "--model", "local-completions", "--model_args", args
        )
        assert server.stop() == 0, server.log()
    assert ours["acc"] == hf["acc"]
    for doc, lls in hf["ll"].items():
        assert ours["ll"][doc] == pytest.approx(lls, abs=2e-3), doc
