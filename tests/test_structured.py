"""Structured output (docs/DESIGN.md, Structured output): the token bitmask on the device, the
grammar on the host, response_format / tools on the server; lossless against the target alone
under the same constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient

import dflash_qaic
from dflash_qaic import contract
from dflash_qaic.artifacts.manifest import read_manifest
from dflash_qaic.modeling.sampler import token_allowed
from dflash_qaic.runtime.pipeline import GenerationError
from dflash_qaic.serve.app import create_app
from dflash_qaic.serve.engine import AsyncEngine

B = 16
PROMPT = "def person(name, age):\n    return "
# fixed keys, an enum, a bounded integer and a bounded string: every output ends (stop)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "admin"],
    "additionalProperties": False,
}
FORMATS = {
    "person": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    "choice": {"type": "choice", "choice": ["self.name", "None", "age + 1"]},
    "regex": {"type": "regex", "regex": r"[a-z_]{2,6}\(\d{1,2}\)"},
}
# a Qwen3-style chat template: tools in <tools></tools> in the system turn, calls answered as
# <tool_call>{"name": …, "arguments": …}</tool_call> (vLLM's hermes parser)
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\nCall a function as <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def pipe(cb_artifacts):
    pipe = dflash_qaic.load(cb_artifacts, threads=1)
    pipe.configure(verify_lengths=[B])  # whole blocks: τ depends on the proposals alone
    return pipe


def valid(spec: dict, text: str) -> bool:
    if spec["type"] == "json_schema":
        jsonschema.validate(json.loads(text), spec["json_schema"]["schema"])
        return True
    if spec["type"] == "choice":
        return text in spec["choice"]
    return re.fullmatch(spec["regex"], text) is not None


def test_bitmask_unpacks_as_xgrammar_packs():
    """Bit i % 32 of word i // 32 (sign bit included) is token i, for any word."""
    rng = np.random.default_rng(0)
    V = 77
    words = rng.integers(-(2**31), 2**31, (2, 3, contract.bitmask_words(V)), dtype=np.int64)
    words[0, 0] = [-(2**31), -1, 0]  # only bit 31; every bit; none
    mask = words.astype(np.int32)
    want = np.unpackbits(mask.view(np.uint8), axis=-1, bitorder="little")[..., :V].astype(bool)
    got = token_allowed(torch.from_numpy(mask), V).numpy()
    assert np.array_equal(got, want)


def test_constrained_dflash_equals_the_target_alone(pipe):
    """T = 0: DFlash under a grammar = the target alone under it, token for token; outputs
    that stop validate; proposals were both filled and cut; a batch of constrained and free
    rows equals their solo runs."""
    results = {}
    for name, spec in FORMATS.items():
        res = pipe.generate(PROMPT, 80, response_format=spec)
        base = pipe.generate_baseline(PROMPT, 80, response_format=spec)
        assert res.tokens == base.tokens, name
        assert res.stop_reason == "stop_token", (name, res.text)
        text = pipe.tokenizer.decode(res.tokens, skip_special_tokens=True)
        assert valid(spec, text), (name, text)
        results[name] = res
    st = results["person"].stats
    assert st["forced_proposals"] > 0 and st["cut_proposals"] > 0, st
    assert st["grammar_host_s"] > 0
    free = pipe.generate(PROMPT, 40)
    batch = pipe.generate(
        [PROMPT, PROMPT, PROMPT],
        [80, 40, 80],
        response_format=[FORMATS["person"], None, FORMATS["regex"]],
    )
    assert [r.tokens for r in batch] == [
        results["person"].tokens,
        free.tokens,
        results["regex"].tokens,
    ]
    assert "forced_proposals" not in batch[1].stats  # a free row has no grammar


def test_filling_forced_tokens_raises_tau(pipe):
    """On a schema of fixed keys, filling the tokens the grammar forces raises τ ≥ 1.2×, with
    the same tokens (the switch only changes the proposals)."""
    spec = FORMATS["person"]
    before = pipe.configure(spec_policy="always")  # τ compared: every step drafts
    try:
        filled = pipe.generate(PROMPT, 80, response_format=spec)
        pipe.configure(fill_forced_tokens=False)
        plain = pipe.generate(PROMPT, 80, response_format=spec)
    finally:
        pipe.configure(before)
    assert filled.tokens == plain.tokens
    assert plain.stats["forced_proposals"] == 0
    assert filled.stats["tau"] >= 1.2 * plain.stats["tau"], (filled.stats, plain.stats)


def test_sampled_outputs_follow_the_grammar(pipe):
    for seed in range(3):
        for name, spec in FORMATS.items():
            res = pipe.generate(PROMPT, 80, temperature=1.0, seed=seed, response_format=spec)
            text = pipe.tokenizer.decode(res.tokens, skip_special_tokens=True)
            if res.stop_reason == "stop_token":
                assert valid(spec, text), (name, seed, text)


def test_bad_formats_are_refused_by_name(pipe, default_artifacts):
    bad = [
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "nonsense"),
        ({"type": "regex", "regex": "(unclosed"}, "regex"),
        ({"type": "grammar", "grammar": "root ::= missing"}, "missing"),
        ({"type": "choice", "choice": []}, "choice"),
        ({"type": "xml"}, "type"),
    ]
    for spec, word in bad:
        with pytest.raises(GenerationError, match=word):
            pipe.generate(PROMPT, 4, response_format=spec)
    plain = dflash_qaic.load(default_artifacts, threads=1)  # exported without the option
    with pytest.raises(GenerationError, match="--structured-output"):
        plain.generate(PROMPT, 4, response_format=FORMATS["choice"])
    assert plain.generate(PROMPT, 4, response_format={"type": "text"}).tokens  # no constraint


@pytest.fixture(scope="module")
def app_client(pipe):
    app = create_app(
        AsyncEngine(pipe),
        "m",
        pipe.tokenizer,
        QWEN3_TEMPLATE,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def client(app_client):
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=app_client, max_retries=0
    )


def test_server_response_formats(app_client, pipe):
    """response_format, structured_outputs and guided_* on both endpoints, as the Python API."""
    want = pipe.generate(PROMPT, 80, response_format=FORMATS["person"]).tokens
    text = pipe.tokenizer.decode(want, skip_special_tokens=True)
    bodies = [
        {"response_format": FORMATS["person"]},
        {"structured_outputs": {"json": PERSON}},
        {"guided_json": PERSON},
    ]
    for extra in bodies:
        body = dict(prompt=PROMPT, max_tokens=80, temperature=0, return_token_ids=True, **extra)
        r = app_client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == text and choice["finish_reason"] == "stop", (extra, choice)
    r = app_client.post(
        "/v1/completions",
        json=dict(prompt=PROMPT, max_tokens=30, temperature=0, guided_choice=["yes", "no"]),
    )
    assert r.json()["choices"][0]["text"] in ("yes", "no")


def test_tool_calls_required_and_named(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = client.chat.completions.create(
            model="m",
            messages=msgs,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=120,
            temperature=0,
            parallel_tool_calls=False,  # one call: the tiny model would list calls to the end
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        calls = c.message.tool_calls
        assert calls and all(t.type == "function" for t in calls)
        for t in calls:
            params = next(
                x["function"]["parameters"]
                for x in TOOLS
                if x["function"]["name"] == t.function.name
            )
            jsonschema.validate(json.loads(t.function.arguments), params)
        if choice is named:
            assert [t.function.name for t in calls] == ["get_weather"]
    for choice in (named, "required"):  # streamed: the same calls, arguments in pieces
        whole = client.chat.completions.create(
            model="m", messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=120,
            temperature=0, parallel_tool_calls=False,
        ).choices[0].message.tool_calls  # fmt: skip
        stream = client.chat.completions.create(
            model="m", messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=120,
            temperature=0, parallel_tool_calls=False, stream=True,
        )  # fmt: skip
        args, names, reason, pieces = "", [], None, 0
        for chunk in stream:
            for d in chunk.choices[0].delta.tool_calls or ():
                args += d.function.arguments or ""
                names += [d.function.name] if d.function.name else []
                pieces += bool(d.function.arguments)
            reason = chunk.choices[0].finish_reason or reason
        assert names == [whole[0].function.name] and reason == "tool_calls"
        assert json.loads(args) == json.loads(whole[0].function.arguments)
        assert pieces > 1  # the arguments came as they were generated, not whole


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temprature": 0}, "temprature"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"min_p": 0.05}, "min_p"),
        ({"min_tokens": 3}, "min_tokens"),
        ({"allowed_token_ids": [65], "guided_regex": "A+"}, "allowed_token_ids"),
        ({"allowed_token_ids": [9999]}, "allowed_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ],
)
def test_fields_refused_by_name(app_client, body, param):
    r = app_client.post("/v1/completions", json=dict(prompt="ab", max_tokens=2, **body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param.split(".")[-1] in err["message"] or "json_schema" in err["message"], err


def test_allowed_token_ids(app_client):
    """vLLM's allowed_token_ids through the same bitmask: only those tokens, stop ids included
    when listed."""
    body = dict(prompt=PROMPT, max_tokens=24, temperature=0, allowed_token_ids=[97, 98, 256])
    r = app_client.post("/v1/completions", json={**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["token_ids"]) <= {97, 98, 256}


def test_chat_fields(app_client):
    msgs = [{"role": "user", "content": "hi"}]
    r = app_client.post(
        "/v1/chat/completions",
        json=dict(messages=msgs, max_tokens=9, max_completion_tokens=3, temperature=0),
    )
    assert r.json()["usage"]["completion_tokens"] <= 3  # OpenAI's newer name wins
    for body, param in [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"parallel_tool_calls": False, "functions": [{"name": "f"}]}, "functions"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
    ]:
        r = app_client.post("/v1/chat/completions", json=dict(messages=msgs, max_tokens=2, **body))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_auto_tool_choice_needs_the_flags(pipe):
    app = create_app(AsyncEngine(pipe), "m", pipe.tokenizer, QWEN3_TEMPLATE)
    with TestClient(app) as c:
        msgs = [{"role": "user", "content": "hi"}]
        r = c.post(
            "/v1/chat/completions", json=dict(messages=msgs, tools=TOOLS, tool_choice="auto")
        )
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        # tools without a choice: plain text, as vLLM without the flag
        r = c.post("/v1/chat/completions", json=dict(messages=msgs, tools=TOOLS, max_tokens=3))
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_sampled_constrained_dflash_is_distributed_as_the_target_alone(pipe):
    """T = 1 under a small grammar: the outputs of DFlash and of the target alone (independent
    seeds) come from one distribution (chi-square test of homogeneity). The second character
    is decided in a verify row, its proposal kept, replaced or cut by the grammar."""
    from scipy.stats import chi2_contingency

    spec = {"type": "choice", "choice": ["ab", "ac", "ad", "ba", "bb", "bd", "ca", "cd"]}
    n, prompt = 400, "x = "
    runs = {}
    for mode, fn, base in (("dflash", pipe.generate, 0), ("target", pipe.generate_baseline, 10**6)):
        res = fn(
            [prompt] * n, 8, temperature=1.0, seed=list(range(base, base + n)), response_format=spec
        )
        runs[mode] = [pipe.tokenizer.decode(r.tokens, skip_special_tokens=True) for r in res]
        assert set(runs[mode]) <= set(spec["choice"]), runs[mode]
    keys = sorted(set(runs["dflash"]) | set(runs["target"]))
    table = np.array([[runs[m].count(k) for k in keys] for m in ("dflash", "target")])
    common = table[:, table.sum(0) >= 10]  # categories too rare for the test are left out
    assert common.shape[1] >= 3, table
    p = chi2_contingency(common).pvalue
    assert p > 1e-3, (keys, table, p)


def test_the_option_adds_one_input_and_no_specialization(default_artifacts, cb_artifacts):
    """Without --structured-output the target has no bitmask input (its program is byte for
    byte the one before the option existed, docs/DESIGN.md); with it, one int32 input
    [batch, seq_len, ⌈V/32⌉] and the same specializations."""
    import onnx

    def inputs(d):
        m = onnx.load(str(d / "target" / "target.onnx"), load_external_data=False)
        return {i.name: i for i in m.graph.input}

    assert contract.TOKEN_BITMASK not in inputs(default_artifacts)
    x = inputs(cb_artifacts)[contract.TOKEN_BITMASK]
    assert x.type.tensor_type.elem_type == onnx.TensorProto.INT32
    dims = [d.dim_param or d.dim_value for d in x.type.tensor_type.shape.dim]
    assert dims == [contract.BATCH, contract.SEQ, contract.bitmask_words(258)]
    m = read_manifest(cb_artifacts)
    assert (
        m.target.io.token_bitmask and not read_manifest(default_artifacts).target.io.token_bitmask
    )
    assert list(m.target.specializations) == contract.target_specializations(m.plan)


@pytest.mark.slow
def test_dflash2_draft_under_a_grammar(tmp_path):
    """The DFlash-2 draft (q-aware verification) under a grammar: T = 0 equals the target
    alone; sampled outputs that stop validate."""
    from dflash_qaic.exporter.cli import main

    out = tmp_path / "d2"
    assert main(["--recipe", "default-dflash2", "--out", str(out), "--no-compile", "--quiet",
                 "--ctx-len", "1024", "--structured-output"]) == 0  # fmt: skip
    pipe = dflash_qaic.load(out, threads=1)
    spec = FORMATS["person"]
    res = pipe.generate(PROMPT, 80, response_format=spec)
    assert res.tokens == pipe.generate_baseline(PROMPT, 80, response_format=spec).tokens
    for seed in range(3):
        res = pipe.generate(PROMPT, 80, temperature=1.0, seed=seed, response_format=spec)
        if res.stop_reason == "stop_token":
            assert valid(spec, pipe.tokenizer.decode(res.tokens, skip_special_tokens=True))
