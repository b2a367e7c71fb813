"""The vLLM platform plugin (dflash_qaic/vllm/): a real `vllm serve` from `.venv-vllm` (make
setup-vllm) over the continuous-batching artifacts of the built-in pair, driven by the `openai`
client, against `pipe.generate` in this process (and Hugging Face greedy once).

The server runs with whole-block verifies (verify_lengths [16], as the reference pipe) on every
step (spec_policy "always"), so the acceptance of every step is determined and vLLM's spec-decode counters can be compared with
our acceptance lengths exactly.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI

import dflash_qaic
from dflash_qaic import assets
from dflash_qaic.bench.vllm_host import VllmServer, vllm_bin

B = 16
BLOCK = {"dflash_qaic": {"verify_lengths": [B], "spec_policy": "always", "threads": 1}}
PROMPTS = assets.heldout_prompts()
#: a prompt whose prefill call fails in the server (tests/vllm_fault/sitecustomize.py)
POISON = [11, 22, 33, 44, 55, 66, 77, 88]


@pytest.fixture(scope="module")
def pipe(cb_artifacts):
    p = dflash_qaic.load(cb_artifacts, threads=1)
    p.configure(verify_lengths=[B], spec_policy="always")
    return p


@pytest.fixture(scope="module")
def server(cb_artifacts):
    """One `DFLASH_QAIC_VLLM=1 vllm serve` for the module (fails without .venv-vllm)."""
    args = ("--max-num-seqs", "4", "--additional-config", json.dumps(BLOCK))
    fault = {
        "PYTHONPATH": str(Path(__file__).parent / "vllm_fault"),
        "FAULT_PROMPT": ",".join(map(str, POISON)),
    }
    with VllmServer(cb_artifacts, *args, timeout=420, env=fault) as s:
        s.model = str(cb_artifacts)
        yield s


def client(server) -> OpenAI:
    return OpenAI(
        base_url=server.url + "/v1", api_key="x", http_client=httpx.Client(trust_env=False)
    )


async def _one(ac, server, prompt, max_tokens, stream, **kw) -> list[int]:
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    args = dict(model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    args.update(kw)
    if not stream:
        out = await ac.completions.create(**args, extra_body=extra)
        return out.choices[0].token_ids
    ids = []
    async for chunk in await ac.completions.create(**args, stream=True, extra_body=extra):
        ids += chunk.choices[0].token_ids or []
    return ids


def run(server, jobs) -> list[list[int]]:
    """jobs: (prompt, max_tokens, stream, kwargs); all at once."""

    async def go():
        http = httpx.AsyncClient(trust_env=False, timeout=300)
        ac = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", http_client=http)
        try:
            return await asyncio.gather(*(_one(ac, server, p, n, s, **kw) for p, n, s, kw in jobs))
        finally:
            await http.aclose()

    return asyncio.run(go())


def metrics(server) -> dict:
    """vllm:spec_decode_* samples: name, or name[position] for the per-position counter."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", trust_env=False).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:spec_decode") and not s.name.endswith("_created"):
                pos = s.labels.get("position")
                out[s.name + (f"[{pos}]" if pos is not None else "")] = s.value
    return out


def test_engine_first_token_alone(pipe):
    """The engine seam the worker uses: a prompt that ends gives that step its first token only
    and steps from the next step, beside the others, each as its own run."""
    eng = pipe.engine("dflash", first_token_alone=True)
    a = eng.add(pipe.request(PROMPTS[0], 40, []))
    eng.step()
    assert len(a.tokens) == 1 and a.take() == [a.tokens]
    b = eng.add(pipe.request(PROMPTS[1], 40, []))
    eng.step()  # a verifies its first block while b prefills
    assert len(b.tokens) == 1 and len(a.tokens) > 1
    while eng.busy:
        eng.step()
    refs = pipe.generate(PROMPTS[:2], 40, stop_token_ids=[])
    assert [a.result.tokens, b.result.tokens] == [r.tokens for r in refs]


def test_vllm_environment_exists():
    """make test sets up .venv-vllm; without it the plugin's tests fail, never skip."""
    assert vllm_bin().is_file()


def test_greedy_alone_equals_pipe_streamed_and_not(server, pipe):
    for i, stream in ((0, False), (1, True)):
        ref = pipe.generate(PROMPTS[i], 64, stop_token_ids=[])
        [got] = run(server, [(PROMPTS[i], 64, stream, {"extra_body": {"ignore_eos": True}})])
        assert got == ref.tokens, (i, stream)
    out = client(server).completions.create(
        model=server.model, prompt=PROMPTS[2], max_tokens=40, temperature=0
    )
    ref = pipe.generate(PROMPTS[2], 40)  # EOS stops both (vLLM's own stop check)
    assert out.choices[0].text == ref.text
    assert out.usage.completion_tokens == len(ref.tokens)
    # a stop string: vLLM's detokenizer ends the request, the worker frees its row
    ref = pipe.generate(PROMPTS[3], 64, stop_token_ids=[])
    assert "\n" in ref.text
    out = client(server).completions.create(
        model=server.model, prompt=PROMPTS[3], max_tokens=64, temperature=0, stop=["\n"],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].text == ref.text.split("\n")[0]
    assert out.choices[0].finish_reason == "stop"


def test_eight_concurrent_streamed_and_not_equal_pipe(server, pipe):
    """8 requests at once on 4 cache rows: vLLM queues the rest, each equals its own run."""
    lengths = [48, 64, 30, 57, 64, 41, 50, 64]
    jobs = [
        (PROMPTS[3 + i], n, i % 2 == 0, {"extra_body": {"ignore_eos": True}})
        for i, n in enumerate(lengths)
    ]
    got = run(server, jobs)
    refs = pipe.generate([p for p, *_ in jobs], lengths, stop_token_ids=[])
    for i, (g, r) in enumerate(zip(got, refs)):
        assert g == r.tokens, i


def test_greedy_equals_hugging_face(server):
    """Token ids in, token ids out, against the target's own greedy generate."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_qaic.exporter.cli import load_recipe

    model = AutoModelForCausalLM.from_pretrained(load_recipe("default")["target"])
    ids = [int(t) for t in np.random.default_rng(0).integers(1, 250, 37)]
    want = model.generate(
        torch.tensor([ids]), max_new_tokens=60, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(ids) :].tolist()
    [got] = run(server, [(ids, 60, False, {"extra_body": {"ignore_eos": True}})])
    assert got == want


def test_spec_decode_metrics_count_what_our_steps_did(server, pipe):
    """vllm:spec_decode_* (vLLM's scheduler counts them from what the worker returns) equal our
    acceptance lengths: a draft per step, B − 1 draft tokens each, accepted = committed − 1."""
    before = metrics(server)
    prompts = PROMPTS[11:13]
    got = run(server, [(p, 96, False, {"extra_body": {"ignore_eos": True}}) for p in prompts])
    after = metrics(server)
    refs = pipe.generate(prompts, 96, stop_token_ids=[])
    assert got == [r.tokens for r in refs]
    lengths = [n for r in refs for n in r.acceptance_lengths]

    def d(name):
        return after[name] - before.get(name, 0.0)

    assert d("vllm:spec_decode_num_drafts_total") == len(lengths)
    assert d("vllm:spec_decode_num_draft_tokens_total") == (B - 1) * len(lengths)
    assert d("vllm:spec_decode_num_accepted_tokens_total") == sum(lengths) - len(lengths)
    for pos in range(B - 1):
        key = f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{pos}]"
        assert d(key) == sum(n - 1 > pos for n in lengths), pos
    tau = (d("vllm:spec_decode_num_accepted_tokens_total") + len(lengths)) / len(lengths)
    assert tau == pytest.approx(float(np.mean(lengths)))
    assert tau > 2  # the trained pair accepts: the counters saw real multi-token steps


def test_the_end_of_the_context(server, pipe):
    """max_model_len is ctx_len − 1: near it vLLM schedules fewer drafts and ends the request
    at exactly that many tokens ("length"), with the tokens of our own run; a prompt without
    room for one verify block is a 400."""
    ctx = pipe.ctx_len
    ids = [int(t) for t in np.random.default_rng(1).integers(1, 250, ctx - 130)]
    out = client(server).completions.create(
        model=server.model, prompt=ids, max_tokens=500, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    c = out.choices[0]
    assert c.finish_reason == "length"
    assert len(ids) + len(c.token_ids) == ctx - 1
    assert c.token_ids == pipe.generate(ids, ctx - 1 - len(ids), stop_token_ids=[]).tokens
    with pytest.raises(BadRequestError, match="room for one verify block"):
        client(server).completions.create(
            model=server.model, prompt=[5] * (ctx - B), max_tokens=1, temperature=0
        )


def test_seeded_sampling_equals_pipe(server, pipe):
    """T > 0: the programs' sampler with the request's seed, as pipe.generate draws it."""
    kw = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "extra_body": {"ignore_eos": True}}
    [got] = run(server, [(PROMPTS[5], 48, False, dict(kw))])
    ref = pipe.generate(PROMPTS[5], 48, stop_token_ids=[], temperature=1.0, top_p=0.9, seed=7)
    assert got == ref.tokens


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"logprobs": 2}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"extra_body": {"min_p": 0.1}}, "min_p"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
        ({"extra_body": {"min_tokens": 4}}, "min_tokens"),
        ({"extra_body": {"use_beam_search": True, "n": 2}}, None),
    ],
    ids=lambda x: str(x) if isinstance(x, str) else None,
)
def test_unsupported_sampling_params_are_400(server, kw, param):
    extra = kw.pop("extra_body", {})
    with pytest.raises(BadRequestError) as e:
        client(server).completions.create(
            model=server.model, prompt="x = 1", max_tokens=4, extra_body=extra, **kw
        )
    msg = str(e.value)  # ours, or vLLM's own for what it refuses with speculative decoding
    assert "supported" in msg or "beam" in msg.lower(), msg
    if param is not None:
        assert param in msg, msg


def test_n_choices_run_as_vllm_child_requests(server):
    """`n > 1` under the plugin (vLLM allows it only when sampling): vLLM's own parallel-sampling
    children, each choice its own 12 tokens, indexed."""
    r = client(server).completions.create(
        model=server.model, prompt=PROMPTS[3], max_tokens=12, n=2, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 24


def test_a_failed_program_call_ends_that_request_alone(server, pipe):
    """The target program raises on one request's prefill: that request gets vLLM's error, a
    request running beside it finishes as pipe.generate, and the server goes on."""
    from openai import APIError

    async def go():
        http = httpx.AsyncClient(trust_env=False, timeout=300)
        ac = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", http_client=http)
        try:
            good = asyncio.create_task(
                _one(ac, server, PROMPTS[12], 96, True, extra_body={"ignore_eos": True})
            )
            await asyncio.sleep(0)
            try:
                await _one(ac, server, POISON, 8, False)
                bad = None
            except APIError as e:
                bad = e
            return await good, bad

        finally:
            await http.aclose()

    got, bad = asyncio.run(go())
    assert bad is not None, "the failed request answered as if it had not failed"
    assert got == pipe.generate(PROMPTS[12], 96, stop_token_ids=[]).tokens
    assert "Traceback" not in str(bad)
    [after] = run(server, [(PROMPTS[13], 24, False, {"extra_body": {"ignore_eos": True}})])
    assert after == pipe.generate(PROMPTS[13], 24, stop_token_ids=[]).tokens
    assert "request" in server.log() and "injected fault" in server.log()


@pytest.mark.parametrize(
    "spec",
    [
        {"regex": "[a-z]{2,6}( [a-z]{2,6}){2}\\."},
        {"choice": ["alpha beta", "gamma", "delta epsilon zeta"]},
    ],
    ids=["regex", "choice"],
)
def test_structured_outputs_follow_vllms_bitmask(server, pipe, spec):
    """vLLM's structured_outputs: vLLM's own grammar masks each verify row on the device, and
    the text equals pipe.generate under the same grammar (our matcher), drafts and all."""
    kind, value = next(iter(spec.items()))
    out = client(server).completions.create(
        model=server.model, prompt=PROMPTS[14], max_tokens=40, temperature=0,
        extra_body={"structured_outputs": spec},
    )  # fmt: skip
    ref = pipe.generate(PROMPTS[14], 40, response_format={"type": kind, kind: value})
    assert ref.stop_reason == "stop_token" and ref.tokens[-1] in pipe.eos  # the grammar ended
    text = out.choices[0].text  # vLLM's text leaves the stop token out
    assert text == pipe.tokenizer.decode(ref.tokens[:-1])
    if kind == "choice":
        assert text in value
    else:
        import re

        assert re.fullmatch(value, text), text


def test_allowed_token_ids_are_a_mask_of_ours(server):
    allowed = [13, 42, 64, 101, 177, 220]
    out = client(server).completions.create(
        model=server.model, prompt=PROMPTS[15], max_tokens=24, temperature=0,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    ids = out.choices[0].token_ids
    assert len(ids) == 24 and set(ids) <= set(allowed), ids


def test_plugin_is_active_only_with_the_environment_variable(monkeypatch):
    from dflash_qaic import vllm as plugin

    monkeypatch.delenv(plugin.ENV, raising=False)
    assert plugin.register() is None
    monkeypatch.setenv(plugin.ENV, "1")
    assert plugin.register() == "dflash_qaic.vllm.platform.DFlashQaicPlatform"


def test_vllms_platform_choice_follows_the_environment_variable():
    """vLLM's own platform choice, with and without the variable (it asks the plugins each
    time)."""
    code = (
        "import os\n"
        "from vllm.platforms import resolve_current_platform_cls_qualname as choose\n"
        "os.environ.pop('DFLASH_QAIC_VLLM', None); print(choose())\n"
        "os.environ['DFLASH_QAIC_VLLM'] = '1'; print(choose())\n"
    )
    python = vllm_bin().parent / "python"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == [
        "vllm.platforms.cpu.CpuPlatform",
        "dflash_qaic.vllm.platform.DFlashQaicPlatform",
    ]


# ---------------------------------------------------------------- slow tier


@pytest.mark.slow
def test_sampling_through_vllm_is_distributed_as_the_target(server):
    """T = 1: the first token (the prefill's sample) and the second (the first verify's
    accept/reject) of 800 seeded requests against the target's exact distributions."""
    import torch
    from test_sampling import exact_probs, gof, gof_pvalue, hf_logits
    from transformers import AutoModelForCausalLM

    from dflash_qaic.exporter.cli import load_recipe

    model = AutoModelForCausalLM.from_pretrained(load_recipe("default")["target"]).float()
    prompt = [7, 19, 3, 25, 11, 40, 2]
    cfg = (1.0, 0, 1.0)
    with torch.no_grad():
        p1 = exact_probs(hf_logits(model, [prompt])[0, -1:], cfg)[0]
        V = len(p1)
        nxt = hf_logits(model, [prompt + [t] for t in range(V)])[:, -1]
    p2 = p1 @ exact_probs(nxt, cfg)
    n = 800
    jobs = [
        (prompt, 2, False, {"temperature": 1.0, "seed": i, "extra_body": {"ignore_eos": True}})
        for i in range(n)
    ]
    got = []
    for i in range(0, n, 16):
        got += run(server, jobs[i : i + 16])
    a = np.array(got)
    assert a.shape == (n, 2)
    for k, p in ((0, p1), (1, p2)):
        pv = gof_pvalue([gof(a[:, k], p)])
        assert pv > 1e-3 / 2, (k, pv)


LLM_SCRIPT = """
import json, os, sys
os.environ["DFLASH_QAIC_VLLM"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main():
    from vllm import LLM, SamplingParams

    art, target, draft, other, prompts = json.loads(sys.argv[1])
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = LLM(model=art, additional_config={"dflash_qaic": {"threads": 1}})
    print("ARTIFACTS", json.dumps([o.outputs[0].token_ids for o in llm.generate(prompts, sp)]))
    llm.llm_engine.engine_core.shutdown()
    del llm
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": 15}
    llm = LLM(model=target, speculative_config=spec,
              additional_config={"dflash_qaic": {"artifacts": art, "threads": 1}})
    print("UPSTREAM", json.dumps([o.outputs[0].token_ids for o in llm.generate(prompts, sp)]))
    llm.llm_engine.engine_core.shutdown()
    del llm
    try:
        LLM(model=target, speculative_config={**spec, "model": other},
            additional_config={"dflash_qaic": {"artifacts": art}})
    except Exception as e:
        print("REFUSED", json.dumps(str(e)))


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_llm_class_and_the_upstream_spelling(cb_artifacts, pipe, tmp_path):
    """LLM(model=ARTIFACTS) and LLM(model=TARGET, speculative_config=dflash DRAFT,
    additional_config=ARTIFACTS) generate as pipe.generate; another draft is refused."""
    import shutil

    from dflash_qaic.exporter.cli import load_recipe

    r = load_recipe("default")
    other = tmp_path / "other-draft"  # the same draft, another checkpoint (its config differs)
    shutil.copytree(r["draft"], other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    prompts = PROMPTS[20:23]
    script = tmp_path / "llm.py"
    script.write_text(LLM_SCRIPT)
    arg = json.dumps([str(cb_artifacts), str(r["target"]), str(r["draft"]), str(other), prompts])
    python = vllm_bin().parent / "python"
    out = subprocess.run(
        [str(python), str(script), arg], capture_output=True, text=True, timeout=900
    )
    lines = {
        ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.stdout.splitlines() if " " in ln
    }
    assert "ARTIFACTS" in lines and "UPSTREAM" in lines, out.stdout[-3000:] + out.stderr[-3000:]
    want = [res.tokens for res in pipe.generate(prompts, 48, stop_token_ids=[])]
    assert json.loads(lines["ARTIFACTS"]) == want
    assert json.loads(lines["UPSTREAM"]) == want
    refused = json.loads(lines["REFUSED"])
    assert "were not exported from the draft" in refused, refused


@pytest.mark.slow
def test_more_sequences_than_cache_rows_are_refused(cb_artifacts):
    """--max-num-seqs above the artifacts' cache rows: vllm serve exits with the fix."""
    import os

    env = {**os.environ, "DFLASH_QAIC_VLLM": "1"}
    argv = [str(vllm_bin()), "serve", str(cb_artifacts), "--max-num-seqs", "8"]
    argv += ["--host", "127.0.0.1", "--port", "0"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert "at most 4 sequences run at once; use --max-num-seqs 4" in out.stdout + out.stderr
