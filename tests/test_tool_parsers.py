"""Tool-call parsers (serve/tools.py): one incremental parser per format, so a streamed reply's
deltas join to exactly the whole reply's calls, whatever the chunking, the key order, the
arguments' form (an object or a JSON string) and their content (tags inside strings)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from dflash_qaic.serve.tools import ToolPlan, ToolStream, assemble

FUZZ_CASES = 1000


def plan(mode, parser=None, name=None):
    p = SimpleNamespace(mode=mode, parser=parser, name=name)
    p.parse = lambda text, parallel=True: ToolPlan.parse(p, text, parallel)
    return p


def streamed(p, text, cuts, parallel=True):
    """(content, calls) a client assembles from the deltas of the text cut at `cuts`."""
    st, pieces, last = ToolStream(p, parallel), [], 0
    for c in [*sorted(cuts), len(text)]:
        pieces.append(st.feed(text[last:c], final=c == len(text)))
        last = c
    for _, deltas in pieces:  # a call's name comes once, with its first delta
        for d in deltas:
            assert ("id" in d) == ("name" in d["function"])
    return assemble(pieces)


def same(a, b) -> bool:
    """Two (content, calls) answers alike but for the calls' random ids."""
    strip = [{k: v for k, v in c.items() if k != "id"} for c in a[1]]
    return a[0] == b[0] and strip == [{k: v for k, v in c.items() if k != "id"} for c in b[1]]


def every_chunking(p, text):
    whole = p.parse(text)
    for step in (1, 2, 3, 5, 11):
        got = streamed(p, text, range(step, len(text), step))
        assert same(got, whole), (step, text, got, whole)
    return whole


HERMES = plan("auto", "hermes")
LLAMA = plan("auto", "llama3_json")


@pytest.mark.parametrize(
    "text, name, args",
    [
        # arguments before the name (key order is not fixed)
        ('<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>', "add", {"a": 1}),
        # arguments given as a JSON string
        (
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
            "add",
            {"a": 1},
        ),
        # the closing tag inside a string argument (code that mentions it)
        (
            '<tool_call>\n{"name": "run", "arguments": {"code": "print(\'</tool_call>\')"}}\n'
            "</tool_call>",
            "run",
            {"code": "print('</tool_call>')"},
        ),
        # all three at once, the opening tag in the string too
        (
            'I will. <tool_call>{"arguments": "{\\"s\\": \\"<tool_call></tool_call>\\"}", '
            '"name": "f"}</tool_call>',
            "f",
            {"s": "<tool_call></tool_call>"},
        ),
    ],
)
def test_hermes_calls_in_any_form_stream_as_whole(text, name, args):
    content, calls = every_chunking(HERMES, text)
    assert [c["function"]["name"] for c in calls] == [name]
    assert json.loads(calls[0]["function"]["arguments"]) == args
    assert content in (None, "I will.")


def test_content_and_text_that_is_no_call():
    content, calls = every_chunking(HERMES, 'ok\n<tool_call>\n{"name": "a", "arguments": {}}')
    assert content == "ok" and calls[0]["function"] == {"name": "a", "arguments": "{}"}
    for text in ("no calls, only a <tool that never opens", "a <tool_call> not json", "x <"):
        assert every_chunking(HERMES, text) == (text, [])
    assert every_chunking(HERMES, '<tool_call>{"name": 3}</tool_call>')[1] == []
    text = 'say {"name": "a"} then'  # llama3_json: a reply that does not begin with a call
    assert every_chunking(LLAMA, text) == (text, [])
    assert every_chunking(LLAMA, '{"no": "name"}') == ('{"no": "name"}', [])
    content, calls = every_chunking(LLAMA, '<|python_tag|>{"name": "a", "parameters": {"x": 2}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": 2}
    content, calls = every_chunking(HERMES, '<tool_call>{"name": "a"}</tool_call>')
    assert calls[0]["function"]["arguments"] == "{}"  # a call without arguments


def test_required_named_and_one_call_only():
    required = '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "days": [1, 2]}}, '
    required += '{"name": "add", "parameters": {"a": 1}}]'
    content, calls = every_chunking(plan("required"), required)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Pa"ris}', "days": [1, 2]}
    one = streamed(plan("required"), required, range(3, len(required), 3), parallel=False)
    assert [c["function"]["name"] for c in one[1]] == ["get_weather"]
    named = '{"x": [1, {"y": "}"}]}'
    content, calls = every_chunking(plan("named", name="f"), named)
    assert calls[0]["function"] == {"name": "f", "arguments": named}
    two = 'a<tool_call>{"name": "x", "arguments": {}}</tool_call><tool_call>{"name": "y"}'
    assert [c["function"]["name"] for c in HERMES.parse(two, parallel=False)[1]] == ["x"]


# ---------------------------------------------------------------------- fuzz

TRICKY = ["</tool_call>", "<tool_call>", "}", "{", "]", '"', "\\", ";", "\n", "é", "😀", "\t", "<"]


def _value(rng, depth=0):
    r = rng.random()
    if depth > 2 or r < 0.3:
        return "".join(rng.choice(TRICKY + ["a", "b", " "]) for _ in range(rng.randint(0, 8)))
    if r < 0.45:
        return rng.choice([0, -3, 2.5, 1e20, True, False, None])
    if r < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}{rng.choice(TRICKY)}": _value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _dumps(rng, obj) -> str:
    return json.dumps(
        obj,
        ensure_ascii=rng.random() < 0.5,
        indent=rng.choice([None, None, 2]),
        separators=rng.choice([None, (",", ":")]),
    )


def _call_text(rng, key: str):
    """A random valid call object: (its JSON text, name, arguments)."""
    name = rng.choice(["add", "get_weather", "run_code", "f_é"])
    args = {f"a{i}": _value(rng) for i in range(rng.randint(0, 4))}
    form = _dumps(rng, args) if rng.random() < 0.3 else args  # arguments as a JSON string
    items = [("name", name), (key, form)]
    rng.shuffle(items)
    pretty = rng.random() < 0.3
    body = ", ".join(f"{json.dumps(k)}: {_dumps(rng, v)}" for k, v in items)
    text = "{\n  " + body + "\n}" if pretty else "{" + body + "}"
    return text, name, args


def _reply(rng, parser: str):
    calls = [_call_text(rng, "arguments" if parser == "hermes" else "parameters")]
    calls += [_call_text(rng, "arguments") for _ in range(rng.randint(0, 2))]
    if parser == "hermes":
        lead = rng.choice(["", "Sure.\n", "I'll call <tool> then {x}: ", "\n\n"])
        blocks = [f"<tool_call>{rng.choice(['', chr(10)])}{t}\n</tool_call>" for t, _, _ in calls]
        text = lead + rng.choice(["\n", ""]).join(blocks)
        content = lead.rstrip() or None
    else:
        text = rng.choice(["", "<|python_tag|>", " "]) + rng.choice(["; ", ";", "\n"]).join(
            t for t, _, _ in calls
        )
        content = None
    return text, content, [(n, a) for _, n, a in calls]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_fuzzed_streams_equal_whole_replies(parser):
    """Random valid calls (key order, arguments as an object or a JSON string, tags, braces,
    quotes and escapes inside strings), random chunkings: the whole reply parses to the calls
    written, and every stream's deltas join to exactly the whole answer."""
    rng, p = random.Random(48), plan("auto", parser)
    for case in range(FUZZ_CASES):
        text, content, want = _reply(rng, parser)
        whole = p.parse(text)
        assert whole[0] == content, (case, text)
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole[1]]
        assert got == want, (case, text)
        cuts = rng.sample(range(1, max(len(text), 2)), min(rng.randint(0, 12), len(text) - 1))
        assert same(streamed(p, text, cuts), whole), (case, text, cuts)
