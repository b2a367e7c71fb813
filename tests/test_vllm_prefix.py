"""Prefix caching under the vLLM plugin (docs/prefix-caching.md, under vLLM): a real `vllm
serve` from `.venv-vllm` over the continuous-batching artifacts of the built-in pair, with
vLLM's --enable-prefix-caching on by default. Our engine matches and resumes in its own cache
rows; vLLM's counters (`vllm:prefix_cache_queries` / `_hits`) and the answer's
`usage.prompt_tokens_details.cached_tokens` say what it found; tokens equal `pipe.generate`'s
(the tokens dflash-serve answers) and a server with --no-enable-prefix-caching.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI

import dflash_qaic
from dflash_qaic.bench.vllm_host import VllmServer, vllm_bin

B = 16
BLOCK = {"dflash_qaic": {"verify_lengths": [B], "threads": 1}}
ARGS = ("--max-num-seqs", "4", "--enable-prompt-tokens-details", "--kv-offloading-size", "0.25")
ARGS += ("--additional-config", json.dumps(BLOCK))
#: a long shared prefix (a system prompt) and the turns that follow it
PREFIX = [int(t) for t in np.random.default_rng(54).integers(1, 250, 300)]
TAILS = [[int(t) for t in np.random.default_rng(i).integers(1, 250, 20)] for i in range(6)]


@pytest.fixture(scope="module")
def pipe(cb_artifacts):
    p = dflash_qaic.load(cb_artifacts, threads=1)
    p.configure(verify_lengths=[B], enable_prefix_caching=False)  # every answer cold
    return p


@pytest.fixture(scope="module")
def server(cb_artifacts):
    """One `DFLASH_QAIC_VLLM=1 vllm serve` for the module, prefix caching as vLLM's default."""
    with VllmServer(cb_artifacts, *ARGS, timeout=420) as s:
        s.model = str(cb_artifacts)
        yield s


def complete(server, prompt, max_tokens=24, **extra):
    """One greedy completion: (token ids, cached_tokens of its usage)."""
    c = OpenAI(base_url=server.url + "/v1", api_key="x", http_client=httpx.Client(trust_env=False))
    out = c.completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )  # fmt: skip
    details = out.usage.prompt_tokens_details
    return out.choices[0].token_ids, None if details is None else details.cached_tokens


def counters(server) -> dict:
    """vllm:prefix_cache_queries / _hits totals, summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", trust_env=False).text
    out = {"queries": 0.0, "hits": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            for k in out:
                if s.name == f"vllm:prefix_cache_{k}_total":
                    out[k] += s.value
    return out


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def test_a_shared_prefix_hits_and_the_tokens_are_a_cold_runs(server, pipe):
    """Two requests sharing a 300-token prefix: the second finds it (vLLM's hits counter and its
    cached_tokens), and each answer equals its own cold run."""
    first, second = PREFIX + TAILS[0], PREFIX + TAILS[1]
    before = counters(server)
    got1, cached1 = complete(server, first)
    mid = counters(server)
    got2, cached2 = complete(server, second)
    after = counters(server)
    assert delta(before, mid) == {"queries": len(first), "hits": 0}
    assert cached1 == 0
    d = delta(mid, after)
    assert d["queries"] == len(second)
    assert len(PREFIX) <= d["hits"] < len(second)  # the prefix (its 16-token blocks and more)
    assert cached2 == d["hits"]
    assert got1 == pipe.generate(first, 24, stop_token_ids=[]).tokens
    assert got2 == pipe.generate(second, 24, stop_token_ids=[]).tokens


def test_a_conversation_resumes_after_the_answer(server, pipe):
    """The next turn re-sends the history with the answer: it resumes past the prefix, in the
    answer (up to its last token, which no state holds yet)."""
    turn1 = PREFIX[:150] + TAILS[2]
    answer, _ = complete(server, turn1, 32)
    turn2 = turn1 + answer + TAILS[3]
    got, cached = complete(server, turn2, 32)
    assert cached >= len(turn1) + len(answer) - 1
    assert got == pipe.generate(turn2, 32, stop_token_ids=[]).tokens


def test_a_different_cache_salt_never_hits(server, pipe):
    """cache_salt is the sharing boundary: the same prompt under another salt finds nothing,
    under its own salt again it does."""
    prompt = PREFIX[:200] + TAILS[4]
    want = pipe.generate(prompt, 24, stop_token_ids=[]).tokens
    got, _ = complete(server, prompt, cache_salt="tenant-a")
    assert got == want
    before = counters(server)
    got, cached = complete(server, prompt, cache_salt="tenant-b")
    assert got == want
    assert cached == 0 and delta(before, counters(server))["hits"] == 0
    got, cached = complete(server, prompt, cache_salt="tenant-a")
    assert got == want and cached >= 200


def test_an_evicted_row_hits_in_the_host_tier(server, pipe):
    """--kv-offloading-size (vLLM's option, our engine's host tier): four other prompts take
    the four cache rows, the least recently used, this prompt's, goes to the host, and the
    next turn still finds it there. One salt of its own, and first tokens all different, so no
    other request of the module hits or evicts what this one holds."""
    rng = np.random.default_rng(7)
    firsts = rng.choice(np.arange(1, 251), 5, replace=False)
    prompts = [[int(f)] + [int(t) for t in rng.integers(1, 250, 119)] for f in firsts]
    salt = {"cache_salt": "host-tier"}
    complete(server, prompts[0] + TAILS[0], **salt)
    for other in prompts[1:]:  # each misses: a row holding nothing, else the LRU one
        assert complete(server, other, **salt)[1] == 0
    again = prompts[0] + TAILS[1]
    got, cached = complete(server, again, **salt)
    assert cached >= len(prompts[0])
    assert got == pipe.generate(again, 24, stop_token_ids=[]).tokens


def test_no_enable_prefix_caching_turns_it_off(cb_artifacts, server):
    """--no-enable-prefix-caching: the same two requests find nothing (hits stay 0), and the
    tokens are the caching server's."""
    first, second = PREFIX + TAILS[0], PREFIX + TAILS[5]
    before = counters(server)
    with_cache = [complete(server, p)[0] for p in (first, second)]
    assert delta(before, counters(server))["hits"] >= len(PREFIX)  # here the prefix hits
    with VllmServer(cb_artifacts, *ARGS, "--no-enable-prefix-caching", timeout=420) as off:
        off.model = str(cb_artifacts)
        got = [complete(off, p) for p in (first, second)]
        c = counters(off)
    assert [ids for ids, _ in got] == with_cache
    assert c == {"queries": 0, "hits": 0}  # vLLM counts no lookup when caching is off
    assert all(not cached for _, cached in got)


SETTINGS_CHECKS = """
import json
from types import SimpleNamespace as NS
from dflash_qaic.vllm import platform

def config(on, size):
    return NS(additional_config={}, cache_config=NS(enable_prefix_caching=on, kv_offloading_size=size))

out = {}
for on, size in ((True, None), (False, 2.5)):
    c = config(on, size)
    platform._keep_prefix_caching(c)
    first = platform.prefix_caching(c)
    platform._keep_prefix_caching(c)  # the engine-core process re-runs it on this config
    out[str(on)] = [first, platform.prefix_caching(c), c.cache_config.enable_prefix_caching,
                    c.cache_config.kv_offloading_size]
out["default"] = platform.prefix_caching(NS(additional_config=None))
try:
    platform._keep_prefix_caching(config(True, -1.0))
except platform.PluginConfigError as e:
    out["negative"] = str(e)
print(json.dumps(out))
"""


def test_vllms_settings_are_kept_for_our_engine_and_vllms_turned_off():
    """The platform keeps vLLM's --enable-prefix-caching and --kv-offloading-size for the
    worker (also through the engine-core process's second pass, where vLLM's are off) and turns
    vLLM's own off; a negative size is refused naming the option."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    py = vllm_bin().parent / "python"
    run = subprocess.run(
        [str(py), "-c", SETTINGS_CHECKS], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    on = {"enable_prefix_caching": True, "kv_offloading_size": None}
    off = {"enable_prefix_caching": False, "kv_offloading_size": 2.5}
    assert out["True"] == [on, on, False, None]
    assert out["False"] == [off, off, False, None]
    assert out["default"] == on
    assert "--kv-offloading-size -1.0" in out["negative"]
