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
        """(content, tool_calls) of a finished reply's text."""
        if self.mode == "named":
            return None, [_call(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut short (length): no complete call
            return None, [
                _call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items
            ]
        if self.mode == "auto":
            content, calls = (_hermes if self.parser == "hermes" else _llama3_json)(text)
            if not parallel:
                calls = calls[:1]
            return content, calls
        return text, []


def _call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _from_json(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _call(
        obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    )


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for m in _HERMES.finditer(text):
        try:
            call = _from_json(json.loads(m.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :]
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    i = 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        call = _from_json(obj)
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return None, calls


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_OPEN = "<tool_call>"


def _value_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON object or array that starts at text[i], or None while
    the text holds only part of it (strings and their escapes skipped)."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


class ToolStream:
    """A streamed reply's tool calls, as vLLM streams them: each call's first delta carries
    its index, id, type and name, and its arguments follow as the model writes them (the raw
    JSON text of the arguments object); content before the first call streams as content.

    named: the whole reply is the arguments. required: each item of the JSON array is a call.
    auto + hermes: text before `<tool_call>` is content (a possible start of the tag is held
    back), each block's JSON object is a call. auto + llama3_json: the reply is parsed once
    complete (a bare JSON object cannot be told from text while it starts)."""

    def __init__(self, plan: ToolPlan, parallel: bool = True):
        self.plan, self.parallel = plan, parallel
        self.text, self.pos, self.content_sent = "", 0, 0
        self.calls: list[dict] = []  # index, id, name, at (arguments' start), sent, end
        self.incremental = plan.mode in ("named", "required") or plan.parser == "hermes"

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str, final: bool = False) -> tuple[str | None, list[dict]]:
        """(content delta, tool-call deltas) for the next piece of the reply's text."""
        self.text += delta
        if not self.incremental:
            if not final:
                return None, []
            content, calls = self.plan.parse(self.text, self.parallel)
            self.calls = [dict(c, index=i) for i, c in enumerate(calls)]
            return content, [dict(c, index=i) for i, c in enumerate(calls)]
        if self.plan.mode == "named":
            if not self.calls:
                self.calls.append({"index": 0, "id": call_id(), "name": self.plan.name, "at": 0})
                self.calls[0].update(sent=0, end=None)
            return None, self._arguments()
        content = self._content(final) if self.plan.mode == "auto" else None
        deltas: list[dict] = []
        while True:  # a call that ends in this piece lets the next one start in it
            state = (len(self.calls), self.calls and self.calls[-1]["end"])
            self._find_calls()
            deltas += self._arguments()
            if (len(self.calls), self.calls and self.calls[-1]["end"]) == state:
                return content, deltas

    def _content(self, final: bool) -> str | None:
        """Text before the first tool call, less what could be the start of `<tool_call>`."""
        at = self.text.find(_OPEN)
        end = len(self.text) if at < 0 else at
        if at < 0 and not final:
            for k in range(min(len(_OPEN) - 1, end), 0, -1):
                if _OPEN.startswith(self.text[end - k :]):
                    end -= k
                    break
        out = self.text[self.content_sent : end]
        self.content_sent = max(self.content_sent, end)
        return out or None

    def _find_calls(self) -> None:
        """Calls whose name and arguments' start the text now holds (one at a time, in order)."""
        while not self.calls or self.calls[-1]["end"] is not None:
            if self.calls and not self.parallel:
                return
            start = self.pos
            if self.plan.mode == "auto":
                start = self.text.find(_OPEN, self.pos)
                if start < 0:
                    return
            obj = self.text.find("{", start)
            if obj < 0:
                return
            name, args = _NAME.search(self.text, obj), _ARGS.search(self.text, obj)
            if name is None or args is None or args.start() < name.end():
                return  # not yet (or arguments before the name: left to the last delta)
            at = args.end()
            if at >= len(self.text):
                return
            self.calls.append(
                {
                    "index": len(self.calls),
                    "id": call_id(),
                    "name": json.loads(f'"{name.group(1)}"'),
                    "at": at,
                    "sent": 0,
                    "end": None,
                }
            )

    def _arguments(self) -> list[dict]:
        """Each open call's first delta (id, name) and the arguments text since the last one."""
        out = []
        for c in self.calls:
            if "at" not in c:  # parsed whole (llama3_json)
                continue
            first = c["sent"] == 0 and not c.get("announced")
            if c["end"] is None:
                if self.plan.mode == "named":
                    end = len(self.text)
                else:
                    end = _value_end(self.text, c["at"])
                    if end is not None:
                        c["end"] = end
                        self.pos = end
                    else:
                        end = len(self.text)
            else:
                end = c["end"]
            piece = self.text[c["at"] + c["sent"] : end]
            c["sent"] += len(piece)
            if not first and not piece:
                continue
            delta: dict = {"index": c["index"], "function": {"arguments": piece}}
            if first:
                c["announced"] = True
                delta.update(id=c["id"], type="function")
                delta["function"]["name"] = c["name"]
            out.append(delta)
        return out
