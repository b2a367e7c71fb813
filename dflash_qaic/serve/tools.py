"""OpenAI tool calls on /v1/chat/completions, as vLLM serves them (docs/DESIGN.md, Structured
output).

    tool_choice "none"          tools are not rendered; plain text
    tool_choice "auto"          the template renders the tools; the text is parsed for calls by
                                the --tool-call-parser (needs --enable-auto-tool-choice, as vLLM)
    tool_choice "required"      the output is constrained by grammar to a JSON array of calls
                                [{"name": …, "parameters": {…}}, …] (one item unless
                                parallel_tool_calls), whatever the parser
    a named function            the output is constrained to that function's parameters schema,
                                and is the call's arguments

Parsers (vLLM's names): `hermes` reads `<tool_call>{"name": …, "arguments": {…}}</tool_call>`
blocks (Qwen3 / Qwen3.5, Hermes); `llama3_json` reads a bare JSON object (or several joined by
`;`) `{"name": …, "parameters": {…}}` (Llama 3.1). A reply with calls has finish_reason
"tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid

from dflash_qaic.serve.protocol import APIError

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolPlan:
    """What a chat request's tools mean for its generation and its answer.

    mode: "none" | "auto" | "required" | "named"; name: the named function; constraint: the
    structured-output constraint (runtime/grammar.py) the mode imposes, or None; tools: the
    tools as the chat template takes them (None: not rendered)."""

    def __init__(self, req, enable_auto: bool, parser: str | None):
        tools = req.tools or []
        self.parser, self.name, self.constraint = parser, None, None
        choice = req.tool_choice
        if not tools:
            if choice not in (None, "none"):
                raise APIError(
                    "tool_choice needs tools: give the tools to choose from", param="tool_choice"
                )
            self.mode, self.tools = "none", None
            return
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise APIError(f"tool names must be distinct, got {names}", param="tools")
        if choice is None:  # OpenAI's default with tools; plain text when auto is not served
            choice = "auto" if enable_auto and parser else "none"
        self.tools = None if choice == "none" else [t.model_dump(exclude_none=True) for t in tools]
        if choice in ("none", "auto"):
            self.mode = choice
            if choice == "auto" and not (enable_auto and parser):
                raise APIError(
                    '"auto" tool choice requires dflash-serve --enable-auto-tool-choice and '
                    "--tool-call-parser to be set (as vLLM)",
                    param="tool_choice",
                )
            return
        if choice == "required":
            self.mode = "required"
            items = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": t.function.parameters or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not req.parallel_tool_calls:
                schema["maxItems"] = 1
            self.constraint = {"type": "json_schema", "json_schema": {"schema": schema}}
            return
        self.mode, self.name = "named", choice.function.name
        if self.name not in names:
            raise APIError(
                f"tool_choice names the function {self.name!r}, which is not among the tools "
                f"{names}",
                param="tool_choice",
            )
        params = next(t.function.parameters for t in tools if t.function.name == self.name)
        schema = params or {"type": "object"}
        self.constraint = {"type": "json_schema", "json_schema": {"schema": schema}}

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def parse(self, text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished reply's text: the streamed parser fed the whole
        text at once, its deltas assembled as a client assembles them (so a stream and a whole
        answer cannot differ)."""
        if self.mode == "none":
            return text, []
        stream = ToolStream(self, parallel)
        return assemble([stream.feed(text, final=True)])


def assemble(pieces) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) from ToolStream.feed's (content, deltas) pairs, as a client joins
    them: the content pieces, and per call index its id, name and arguments pieces."""
    content, calls = "", {}
    for text, deltas in pieces:
        content += text or ""
        for d in deltas:
            call = calls.setdefault(d["index"], {"arguments": ""})
            if "id" in d:
                call.update(id=d["id"], name=d["function"]["name"])
            call["arguments"] += d["function"]["arguments"]
    out = [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for _, c in sorted(calls.items())
    ]
    return content or None, out


_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_DECODE = json.JSONDecoder(strict=False)


def _decode_string(raw: str) -> str:
    """A JSON string's raw inside (escapes complete) decoded; the raw text when malformed."""
    try:
        return _DECODE.decode(f'"{raw}"')
    except json.JSONDecodeError:
        return raw


def _complete_escapes(text: str, i: int, stop: int) -> int:
    """The end of the longest run of text[i:stop] (inside a JSON string still being written)
    that holds no part of an escape: a backslash, a \\uXXXX or a surrogate pair cut short
    stays for the next piece."""
    while True:
        j = text.find("\\", i, stop)
        if j < 0:
            return stop
        if j + 1 >= stop:
            return j
        if text[j + 1] != "u":
            i = j + 2
            continue
        if j + 6 > stop:
            return j
        if text[j + 2 : j + 4].lower() in ("d8", "d9", "da", "db"):  # a pair's first half
            rest = text[j + 6 : min(stop, j + 8)]
            if j + 12 > stop and "\\u".startswith(rest):
                return j  # its second half may follow
            if text[j + 6 : j + 8] == "\\u":
                i = j + 12
                continue
        i = j + 6


class _Object:
    """A resumable scan of one JSON object's top level, from its `{` (whitespace before it is
    skipped): each key's value as (kind, start, end) with kind "string", "nested" (object or
    array, strings inside skipped) or "scalar", end None while it is being written. state ends
    "done" after the closing brace, or "bad" at a character no JSON object has there."""

    def __init__(self, start: int):
        self.pos, self.state = start, "open"  # pos: the next character to read
        self.values: dict[str, list] = {}
        self._key_at, self._key, self._cur = 0, "", None
        self._depth, self._in_str, self._esc = 0, False, False

    def scan(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.state not in ("done", "bad"):
            if self._read(text, i):
                i += 1
        self.pos = i

    def _read(self, text: str, i: int) -> bool:
        """Take text[i] in the current state; False: read it again in the new state."""
        c, st = text[i], self.state
        if st in ("str", "key_str") or (st == "nested" and self._in_str):
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._string_end(text, i, st)
        elif st == "nested":
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._cur[2], self.state = i + 1, "after"
        elif st == "scalar":
            if c in ",}" or c.isspace():
                self._cur[2], self.state = i, "after"
                return False
        elif st == "value":
            if not c.isspace():
                self._value(c, i)
        elif not c.isspace():
            self.state = _NEXT.get((st, c), "bad")
            if self.state == "key_str":
                self._key_at = i + 1
        return True

    def _string_end(self, text: str, i: int, st: str) -> None:
        if st == "nested":
            self._in_str = False
        elif st == "key_str":
            self._key, self.state = _decode_string(text[self._key_at : i]), "colon"
        else:
            self._cur[2], self.state = i + 1, "after"

    def _value(self, c: str, i: int) -> None:
        kind = "string" if c == '"' else "nested" if c in "{[" else "scalar"
        self._cur = [kind, i, None]
        self.values.setdefault(self._key, self._cur)
        self.state = {"string": "str", "nested": "nested", "scalar": "scalar"}[kind]
        self._depth, self._in_str, self._esc = 1, False, False

    def name(self, text: str) -> str | None:
        """The value of the "name" key once it is a whole string, else None."""
        v = self.values.get("name")
        if v is None or v[0] != "string" or v[2] is None:
            return None
        return _decode_string(text[v[1] + 1 : v[2] - 1])

    def arguments(self) -> list | None:
        """The "arguments" (or "parameters") value, whichever came first."""
        found = [v for k, v in self.values.items() if k in ("arguments", "parameters")]
        return min(found, key=lambda v: v[1]) if found else None


#: (state, character) -> the next state, for the object's punctuation
_NEXT = {
    ("open", "{"): "key",
    ("key", '"'): "key_str",
    ("key", "}"): "done",
    ("colon", ":"): "value",
    ("after", ","): "key",
    ("after", "}"): "done",
}


class _Call:
    """One call object in the reply: its scan, and what of it has been streamed."""

    def __init__(self, at: int):
        self.obj, self.at = _Object(at), at  # at: the object's start (hermes: after the tag)
        self.index, self.id, self.name = None, call_id(), None
        self.sent = None  # where the arguments' streamed text has got to (None: not yet begun)
        self.empty = False  # "{}" sent for a call without arguments


class ToolStream:
    """One parser per format, incremental: a reply's text in pieces in, (content delta,
    tool-call deltas) out, as vLLM streams them. A call's first delta carries its index, id,
    type and name; its arguments follow as they are written (the JSON text of an object as
    written; a string given as the arguments, its decoded text). `ToolPlan.parse` is this
    parser fed the whole reply, so a streamed answer joins to exactly the whole one, for any
    chunking.

    A call object is read by its JSON structure, never by searching for a closing tag, so
    `</tool_call>` or `<tool_call>` inside a string is text; its keys come in any order (a
    call is announced once its "name" is a whole string and its arguments have begun, or its
    object has closed). Formats: named, the whole reply is the arguments; required, the items
    of a JSON array; auto + hermes, the object after each `<tool_call>`, the text before the
    first call being content (less trailing whitespace and a tail that could begin the tag);
    auto + llama3_json, bare objects joined by `;` or whitespace when the reply begins with
    one (after an optional `<|python_tag|>`), else the reply is content. A reply in which no
    call was found is content, whole. After a call, text outside call objects is dropped."""

    def __init__(self, plan: ToolPlan, parallel: bool = True):
        self.plan, self.parallel = plan, parallel
        self.format = plan.parser if plan.mode == "auto" else plan.mode
        self.text, self.pos, self.content_sent, self.free = "", 0, 0, 0
        self.calls: list[_Call] = []
        self.block: _Call | None = None  # the call object being read
        self.ended = False  # no more calls will be looked for
        self.as_text = False  # llama3_json: the reply is not a call

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str, final: bool = False) -> tuple[str | None, list[dict]]:
        """(content delta, tool-call deltas) for the next piece of the reply's text."""
        self.text += delta
        if self.format == "named":
            if not self.calls:
                self._announce(_Call(0), self.plan.name)
            return None, self._deltas()
        self._advance(final)
        return self._content(final), self._deltas()

    def _advance(self, final: bool) -> None:
        """Find and read call objects as far as the text goes."""
        while True:
            if self.block is None:
                at = None if self.ended else self._find(final)
                if at is None:
                    return
                self.block = _Call(at)
            b = self.block
            b.obj.scan(self.text)
            if b.index is None:
                name = b.obj.name(self.text)
                if name is not None and (b.obj.arguments() is not None or b.obj.state == "done"):
                    self._announce(b, name)
            if b.obj.state not in ("done", "bad"):
                return
            self.block, self.pos = None, b.obj.pos
            if b.index is None:  # not a call
                if self.format == "llama3_json" and not self.calls:
                    self.as_text = True
                self.ended = self.ended or self.format != "hermes"
            elif not self.parallel:
                self.ended = True

    def _find(self, final: bool) -> int | None:
        """Where the next call object starts (None: not yet, or no more)."""
        text, i = self.text, self.pos
        if self.format == "hermes":
            t = text.find(_OPEN, i)
            if self.calls:  # content ended where the first call began
                return None if t < 0 else t + len(_OPEN)
            if t < 0:
                self.free = len(text) - (0 if final else _tag_tail(text, _OPEN))
                return None
            self.free = t
            return t + len(_OPEN)
        skip = " \t\n\r" + (";" if self.format == "llama3_json" else ",[")
        if self.format == "llama3_json" and not self.calls and not self.as_text:
            j = len(text) - len(text[i:].lstrip())
            if text.startswith(_PYTHON_TAG, j):
                i = j + len(_PYTHON_TAG)
            elif _PYTHON_TAG.startswith(text[j:]) and j < len(text) and not final:
                return None
        while i < len(text) and text[i] in skip:
            i += 1
        if i < len(text) and text[i] == "{":
            return i
        if i < len(text) or final:
            self.ended = True
            self.as_text = self.as_text or (self.format == "llama3_json" and not self.calls)
        return None

    def _content(self, final: bool) -> str | None:
        """Content: before any call, text known to be outside calls (less trailing
        whitespace); the rest of a reply in which no call was found, at its end."""
        if self.calls:  # up to where the first call began
            end = self.free if self.format == "hermes" else 0
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) if self.as_text else self.free
        if self.calls or not final:
            while end > self.content_sent and self.text[end - 1].isspace():
                end -= 1
        out = self.text[self.content_sent : end]
        self.content_sent = max(self.content_sent, end)
        return out or None

    def _announce(self, call: _Call, name: str) -> None:
        call.index, call.name = len(self.calls), name
        self.calls.append(call)

    def _deltas(self) -> list[dict]:
        """Each call's first delta (id, name) and the arguments written since the last one."""
        out = []
        for c in self.calls:
            first = c.sent is None and not c.empty
            piece = self._arguments(c)
            if not first and not piece:
                continue
            delta: dict = {"index": c.index, "function": {"arguments": piece}}
            if first:
                delta.update(id=c.id, type="function")
                delta["function"]["name"] = c.name
            out.append(delta)
        return out

    def _arguments(self, c: _Call) -> str:
        """The arguments' text written since the last piece (named: the reply itself)."""
        text = self.text
        if self.format == "named":
            at, c.sent = c.sent or 0, len(text)
            return text[at:]
        v = c.obj.arguments()
        if v is None:
            if c.obj.state == "done" and not c.empty:
                c.empty = True
                return "{}"
            return ""
        kind, start, end = v
        if kind != "string":
            at, c.sent = c.sent or start, end if end is not None else c.obj.pos
            return text[at : c.sent]
        at = c.sent or start + 1
        c.sent = end - 1 if end is not None else _complete_escapes(text, at, c.obj.pos)
        return _decode_string(text[at : c.sent])


def _tag_tail(text: str, tag: str) -> int:
    """How many characters at the end of text could begin the tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
