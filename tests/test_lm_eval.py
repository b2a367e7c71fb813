"""A real client: lm-evaluation-harness' `local-completions` model against dflash-serve on the
built-in pair, two tasks from local files: a loglikelihood (multiple-choice) one, which it scores
with echo + logprobs, and a generate-until one (greedy, `until` stop strings, exact match),
scores and per-document answers equal to the same harness on Hugging Face transformers
(`--model hf`). Needs the `eval` extra (lm-eval)."""

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
#: generate-until: (context, the answer exact match wants): the name or expression that comes
#: next, cut at a newline or an opening parenthesis (the built-in pair gets a few of them right)
GEN_DOCS = [
    ("class Foo(object):\n    def", " __init__"),
    ("    def __init__(self):\n        super().", "__init__"),
    ("import numpy as", " np"),
    ("def add(a, b):\n    return", " a + b"),
    ("from collections import", " OrderedDict"),
    ("def main():\n    args = parser.", "parse_args"),
    ("if __name__ ==", ' "__main__":'),
    ("with open(path) as f:\n    data =", " f.read"),
]
GEN_TASK = """task: dflash_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n", "("]
  do_sample: false
  temperature: 0.0
  max_gen_toks: 24
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
TASKS = ("dflash_tiny_ll", "dflash_tiny_gen")


def write_tasks(d: Path) -> Path:
    """The two tasks' YAML and JSON lines under d/tasks (the --include_path)."""
    tasks = d / "tasks"
    tasks.mkdir()
    rows = [{"context": c, "choices": ch, "answer": a} for c, ch, a in DOCS]
    gen_rows = [{"context": c, "answer": a} for c, a in GEN_DOCS]
    for name, template, docs in (("ll", TASK, rows), ("gen", GEN_TASK, gen_rows)):
        data = d / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in docs))
        (tasks / f"{name}.yaml").write_text(template.format(data=data))
    return tasks


def lm_eval(tasks: Path, out: Path, *model: str) -> dict:
    """Run lm_eval on the local tasks; returns, per task, {doc id: its responses} (the
    loglikelihood per choice; the generated text) and the task's score."""
    argv = [sys.executable, "-m", "lm_eval", *model, "--tasks", ",".join(TASKS)]
    argv += ["--include_path", str(tasks), "--output_path", str(out), "--log_samples"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    got = {}
    for task, metric in zip(TASKS, ("acc,none", "exact_match,none"), strict=True):
        samples = next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()
        resps = {}
        for s in map(json.loads, samples):
            resps[s["doc_id"]] = s["filtered_resps"] if task == TASKS[1] else s["resps"]
        got[task] = {"resps": resps, "score": results[task][metric]}
    return got


@pytest.mark.slow  # two lm_eval runs (two tasks each) and a dflash-serve process: about a minute
def test_lm_eval_local_completions_equals_hf(tmp_path):
    # a missing harness is a failure, not a skip: the slow tier installs the `eval` extra
    if importlib.util.find_spec("lm_eval") is None:
        pytest.fail("lm-evaluation-harness is not installed: pip install -e '.[eval]'")
    r = load_recipe("default")
    art = tmp_path / "art"
    dflash_qaic.export(
        r["target"], r["draft"], art, compile=False, ctx_len=512, prefill_seq_len=64, logprobs=1
    )
    tasks = write_tasks(tmp_path)
    hf_args = f"pretrained={r['target']},dtype=float32"
    hf = lm_eval(tasks, tmp_path / "hf", "--model", "hf", "--model_args", hf_args)
    with ServerProcess(art, "--served-model-name", "m") as server:
        args = f"model=m,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
        args += f"tokenizer={art / 'tokenizer'},num_concurrent=1,max_retries=1"
        ours = lm_eval(
            tasks, tmp_path / "ours", "--model", "local-completions", "--model_args", args
        )
        assert server.stop() == 0, server.log()
    ll, gen = TASKS
    assert ours[ll]["score"] == hf[ll]["score"]
    for doc, resps in hf[ll]["resps"].items():
        lls = [float(x[0][0]) for x in resps]
        assert [float(x[0][0]) for x in ours[ll]["resps"][doc]] == pytest.approx(lls, abs=2e-3)
    # greedy generations cut at the `until` strings: the same text, so the same score
    assert ours[gen]["resps"] == hf[gen]["resps"]
    assert ours[gen]["score"] == hf[gen]["score"]
    assert 0 < hf[gen]["score"] < 1, hf[gen]  # some answers match, some do not
