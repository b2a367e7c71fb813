"""Structured output under hostile and real-world input (docs/DESIGN.md, Structured output):
grammar compiles bounded, off the tokenizing threads and cancelled when their client leaves;
every JSON-Schema keyword either enforced (random walks through the compiled grammar validate
with jsonschema) or refused with a 400 naming it."""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import numpy as np
import pytest
from fastapi.testclient import TestClient

import dflash_qaic
from dflash_qaic import contract
from dflash_qaic.runtime.grammar import MAX_ALTERNATIVES
from dflash_qaic.runtime.pipeline import GenerationError
from dflash_qaic.serve.app import WARNING_HEADER, ClientGone, GrammarLimits, create_app
from dflash_qaic.serve.engine import AsyncEngine

WAIT = 120  # a guard against a hang only: nothing below asserts on a duration


@pytest.fixture(scope="module")
def pipe(cb_artifacts):
    return dflash_qaic.load(cb_artifacts, threads=1)


@pytest.fixture(scope="module")
def app(pipe):
    app = create_app(AsyncEngine(pipe), "m", pipe.tokenizer)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield app, c


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


# ---------------------------------------------------------------------- keywords

#: one schema per keyword xgrammar enforces (checked by walks through its grammar)
ENFORCED = {
    "type": {"type": ["integer", "null"]},
    "enum": {"enum": [1, "a", None, {"x": 1}]},
    "const": {"const": {"a": [1, "x"]}},
    "properties+required": {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "string", "maxLength": 2}},
        "required": ["x"],
        "additionalProperties": False,
    },
    "additionalProperties": {"type": "object", "additionalProperties": {"type": "boolean"}},
    "patternProperties": {
        "type": "object",
        "patternProperties": {"^a": {"type": "integer"}},
        "additionalProperties": False,
    },
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^a"}, "maxProperties": 2},
    "minProperties/maxProperties": {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "minProperties": 1,
        "maxProperties": 2,
    },
    "unevaluatedProperties": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "unevaluatedProperties": False,
    },
    "items/minItems/maxItems": {
        "type": "array",
        "items": {"type": "integer"},
        "minItems": 2,
        "maxItems": 3,
    },
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
    "unevaluatedItems": {
        "type": "array",
        "prefixItems": [{"type": "boolean"}],
        "unevaluatedItems": False,
    },
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 3},
    "pattern": {"type": "string", "pattern": "^a+b$"},
    "format": {"type": "string", "format": "date"},
    "minimum/maximum": {"type": "integer", "minimum": -3, "maximum": 12},
    "exclusiveMinimum/exclusiveMaximum": {
        "type": "number",
        "exclusiveMinimum": 2,
        "exclusiveMaximum": 3,
    },
    "multipleOf": {"type": "integer", "multipleOf": 7},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]},
    "oneOf (disjoint types)": {"oneOf": [{"type": "boolean"}, {"type": "string"}]},
    "allOf (one schema)": {"allOf": [{"type": "integer", "minimum": 3, "maximum": 5}]},
    "$ref/$defs": {"$defs": {"a": {"type": "integer", "minimum": 5}}, "$ref": "#/$defs/a"},
    "uniqueItems false": {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
}

#: one schema per keyword xgrammar accepts but does not enforce, and the keyword named
REFUSED = [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "required": ["x"], "additionalProperties": False}, "required"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "string", "if": {"maxLength": 1}, "then": {"const": "a"}}, "if"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies"),
    ({"type": "array", "contains": {"const": 7}}, "contains"),
    ({"type": "array", "contains": {"const": 7}, "minContains": 2}, "contains"),
    ({"type": "object", "properties": {"x": {"not": {"const": 1}}}}, "not"),  # nested
    ({"$defs": {"a": {"uniqueItems": True}}, "$ref": "#/$defs/a"}, "uniqueItems"),
]


def walk(grammar, rng, eos: set[int], most: int = 120) -> list[int] | None:
    """A random token path a sequence under the grammar may take to its end, through its
    Constraint's masks as the step reads them (None: longer than `most`). It writes text as a
    model does: ASCII tokens where the grammar allows one (xgrammar's JSON strings also admit
    UTF-8 byte runs of surrogate code points, which no text holds: docs/DESIGN.md)."""
    c, words = grammar.constraint(), contract.bitmask_words(grammar.grammars.vocab_size)
    row, ids = np.zeros(words, np.int32), []
    vocab = grammar.grammars.info.decoded_vocab
    ascii_ = np.array([bool(t) and max(t) < 0x80 for t in vocab[: grammar.grammars.vocab_size]])
    for _ in range(most):
        if c.terminated:
            return ids
        c.mask(row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: grammar.grammars.vocab_size])
        stops = [t for t in allowed.tolist() if t in eos]
        text = allowed[ascii_[allowed]]
        t = (
            stops[0]
            if stops and rng.random() < 0.5
            else int(rng.choice(text if len(text) else allowed))
        )
        c.advance([t])
        if t not in eos:
            ids.append(t)
    return None


@pytest.mark.parametrize("name", list(ENFORCED))
def test_enforced_keywords_hold_on_every_walk(pipe, name):
    """Every complete path through the compiled grammar is JSON that validates."""
    schema = ENFORCED[name]
    grammar = pipe.grammar(schema_format(schema))
    rng, done = np.random.default_rng(0), 0
    for _ in range(150):
        ids = walk(grammar, rng, set(pipe.eos))
        if ids is None:
            continue
        text = pipe.tokenizer.decode(ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)
        done += 1
    assert done >= 20, name  # enough walks ended to mean something


@pytest.mark.parametrize("schema, keyword", REFUSED, ids=[k for _, k in REFUSED])
def test_unenforced_keywords_are_refused_by_name(pipe, app, schema, keyword):
    with pytest.raises(GenerationError, match=f"keyword '{keyword}'"):
        pipe.grammar(schema_format(schema))
    _, client = app
    body = {"prompt": "ab", "max_tokens": 2, "response_format": schema_format(schema)}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert f"'{keyword}'" in err["message"] and "--structured-output-lenient" in err["message"]
    assert err["param"] == "response_format"


def test_lenient_accepts_with_a_warning_header(pipe):
    app = create_app(
        AsyncEngine(pipe), "m", pipe.tokenizer, grammar_limits=GrammarLimits(lenient=True)
    )
    schema = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3, "uniqueItems": True}
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"prompt": "ab", "max_tokens": 8, "temperature": 0}
        r = client.post("/v1/completions", json={**body, "response_format": schema_format(schema)})
        assert r.status_code == 200, r.text
        assert "uniqueItems" in r.headers[WARNING_HEADER]
        assert WARNING_HEADER not in client.post("/v1/completions", json=body).headers


# ---------------------------------------------------------------------- compile bounds


def test_a_huge_enum_is_refused_before_compiling(pipe, app):
    """The 60,000-value enum (under the 1 MiB body limit) is a 400 naming the limit and how
    to raise it, without compiling; a limit of the server's own is honoured."""
    schema = {"enum": [f"value-{i:06d}" for i in range(60_000)]}
    _, client = app
    body = {"prompt": "ab", "max_tokens": 2, "response_format": schema_format(schema)}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "60000 alternatives" in msg and "--max-grammar-alternatives" in msg
    assert f"{MAX_ALTERNATIVES}" in msg
    with pytest.raises(GenerationError, match="3 alternatives.*more than the 2"):
        pipe.grammar({"type": "choice", "choice": ["a", "b", "c"]}, max_alternatives=2)


class Gate:
    """pipe.grammar that holds every compile of a hostile spec (a choice of "hostile-…")
    until released, and records which started: a compile as slow as we like, no clock."""

    def __init__(self, pipe, monkeypatch):
        self.real, self.started, self.release = pipe.grammar, [], threading.Event()
        self.first = threading.Event()
        monkeypatch.setattr(pipe, "grammar", self)

    def __call__(self, constraint, **limits):
        if str(constraint.get("choice", [""])[0]).startswith("hostile"):
            self.started.append(constraint["choice"][0])
            self.first.set()
            assert self.release.wait(WAIT)
        return self.real(constraint, **limits)


def hostile(n: int) -> dict:
    return {"type": "choice", "choice": [f"hostile-{n}", "x"]}


def hostile_body(n: int) -> dict:
    return {
        "prompt": "ab",
        "max_tokens": 2,
        "temperature": 0,
        "guided_choice": hostile(n)["choice"],
    }


def test_hostile_compiles_do_not_stall_a_plain_completion(pipe, app, monkeypatch):
    """Two requests whose grammars never finish compiling are in flight; a plain request's
    prompt is tokenized meanwhile (on the tokenizing threads, which the compiles used to
    share). The compiles run one at a time on their own thread: the second has not even
    started."""
    fe = app[0].state.frontend
    gate = Gate(pipe, monkeypatch)

    async def scenario():
        compiles = [
            asyncio.ensure_future(fe.grammar(hostile(n), "response_format")) for n in (1, 2)
        ]
        await asyncio.get_running_loop().run_in_executor(None, gate.first.wait, WAIT)
        ids = await fe.prompt_ids("ab")
        started = list(gate.started)
        gate.release.set()
        return ids, started, await asyncio.gather(*compiles)

    try:
        ids, started, grammars = asyncio.run(scenario())
    finally:
        gate.release.set()
    assert ids == pipe.tokenizer("ab")["input_ids"]
    assert started == ["hostile-1"]  # the other hostile compile waited its turn
    assert all(g is not None for g in grammars)


def test_a_compile_over_its_budget_is_a_400_naming_the_limit(pipe, app, monkeypatch):
    fe_app, client = app
    fe = fe_app.state.frontend
    gate = Gate(pipe, monkeypatch)
    monkeypatch.setattr(fe, "grammar_limits", GrammarLimits(compile_s=0.01))
    try:
        r = client.post("/v1/completions", json=hostile_body(3))
    finally:
        gate.release.set()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "--max-grammar-compile-s" in err["message"] and err["param"] == "response_format"


def test_a_queued_compile_is_cancelled_when_its_client_leaves(pipe, app, monkeypatch):
    """The compile thread is busy; a request whose client disconnects while its compile is
    queued gets no answer (499), and its compile never runs."""
    fe_app, _ = app
    fe = fe_app.state.frontend
    gate = Gate(pipe, monkeypatch)
    busy = fe.compiles.submit(gate, hostile(4))
    assert gate.first.wait(WAIT)

    class Gone:  # a request whose client has left
        async def receive(self):
            return {"type": "http.disconnect"}

    with pytest.raises(ClientGone):
        asyncio.run(fe.grammar(hostile(5), "response_format", Gone()))
    gate.release.set()
    busy.result(WAIT)
    fe.compiles.submit(lambda: None).result(WAIT)  # the thread has run all it will
    assert gate.started == ["hostile-4"]
