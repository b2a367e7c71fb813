"""The OpenAI wire format as vLLM serves it: request models (pydantic, strict JSON types), the
error body, and the response and stream-chunk bodies.

Requests are validated in pydantic's strict JSON mode, so `"max_tokens": "5"` or `true` is a 400,
not a silent coercion. Every field OpenAI or vLLM defines for these endpoints is declared here:
honoured, or refused with a 400 naming it when set to anything but its default (`n` > 1,
penalties, `min_p`, beam search, …; `UNSUPPORTED`; logprobs need artifacts exported with them). A field neither defines
(a misspelt `temprature`) is a 400 naming it, never silently ignored.
"""

from __future__ import annotations

import difflib
import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_qaic.runtime.requests import first_set


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        # any other client error (405, 413, ...) is an invalid request, as OpenAI types it
        other = "BadRequestError" if self.status < 500 else "InternalServerError"
        err_type = self.TYPES.get(self.status, other)
        return {
            "error": {
                "message": self.message,
                "type": err_type,
                "param": self.param,
                "code": self.status,
            }
        }


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    UNSUPPORTED: ClassVar[dict] = {}

    def unsupported(self) -> str | None:
        """The first field set to a value this server cannot honour (its default is fine)."""
        return first_set(self.UNSUPPORTED, lambda name, off: getattr(self, name))


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (not served)

    UNSUPPORTED: ClassVar[dict] = {"continuous_usage_stats": False}


class JSONSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`."""

    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: text, json_object or json_schema (vLLM's structural_tag is
    refused)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    structures: Any = None  # structural_tag's
    triggers: Any = None
    format: Any = None

    UNSUPPORTED: ClassVar[dict] = {"structures": None, "triggers": None, "format": None}


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar (or json_object)."""

    json_: dict | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    UNSUPPORTED: ClassVar[dict] = {
        "structural_tag": None,
        "whitespace_pattern": None,
        "disable_additional_properties": False,
    }


class _Sampling(_Request):
    """Fields shared by both endpoints (OpenAI's, plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # None: 1 (OpenAI's default) when the program can sample
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    skip_special_tokens: bool = True  # vLLM's extension
    return_token_ids: bool = False  # vLLM's extension: token ids in each choice
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: informational
    request_id: str | None = None  # vLLM's: the response's id
    add_special_tokens: bool | None = None  # vLLM's: None = the endpoint's default
    # structured output (runtime/grammar.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields; one of them per request
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # n and the fields after the penalties: refused unless left at their defaults; the
    # penalties, min_p, logit_bias, min_tokens, bad_words and prompt_logprobs need artifacts
    # exported with them (serve/logprobs.py; docs/sampling.md)
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    use_beam_search: bool = False
    best_of: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    logits_processors: list[Any] | None = None
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    vllm_xargs: dict | None = None
    # SGLang's, which vllm-router adds to every request it forwards (at these defaults)
    no_stop_trim: bool = False
    return_hidden_states: bool = False

    UNSUPPORTED: ClassVar[dict] = {
        "no_stop_trim": False,
        "return_hidden_states": False,
        "length_penalty": 1.0,
        "use_beam_search": False,
        "include_stop_str_in_output": False,
        "spaces_between_special_tokens": True,
        "truncate_prompt_tokens": None,
        "return_tokens_as_token_ids": False,
        "logits_processors": None,
        "priority": 0,
        "vllm_xargs": None,
        "guided_decoding_backend": None,
        "guided_whitespace_pattern": None,
        "structural_tag": None,
    }

    def unsupported(self) -> str | None:
        if self.min_tokens == 1 and (self.kv_transfer_params or {}).get("do_remote_decode"):
            self.min_tokens = 0  # vllm-router's P/D prefill leg: it generates no token anyway
        name = super().unsupported()
        if name is not None:
            return name
        for sub in ("stream_options", "response_format", "structured_outputs"):
            inner = getattr(self, sub)
            bad = inner.unsupported() if inner is not None else None
            if bad is not None:
                return f"{sub}.{bad}"
        rf = self.response_format
        if rf is not None and rf.type == "structural_tag":  # vLLM's: not served
            return "response_format.type"
        return None

    def constraint(self) -> dict | None:
        """The one structured-output constraint of the request as runtime/grammar.py takes it
        (None: none); APIError when several are given or one is incomplete."""
        found: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_schema":
                js = rf.json_schema
                if js is None or js.schema_ is None:
                    raise APIError(
                        "response_format of type json_schema needs json_schema.schema",
                        param="response_format.json_schema",
                    )
                found.append(("response_format", _schema(js.schema_)))
            else:
                found.append(("response_format", {"type": "json_object"}))
        so = self.structured_outputs
        if so is not None:
            kinds = [
                (k, v)
                for k, v in (
                    ("json", so.json_),
                    ("regex", so.regex),
                    ("choice", so.choice),
                    ("grammar", so.grammar),
                )
                if v is not None
            ]
            if so.json_object:
                kinds.append(("json_object", True))
            if len(kinds) != 1:
                raise APIError(
                    "structured_outputs takes exactly one of json, regex, choice, grammar, "
                    f"json_object (got {[k for k, _ in kinds] or 'none'})",
                    param="structured_outputs",
                )
            found.append(("structured_outputs", _kind(*kinds[0])))
        for k in ("json", "regex", "choice", "grammar"):
            v = getattr(self, f"guided_{k}")
            if v is not None:
                found.append((f"guided_{k}", _kind(k, v)))
        if len(found) > 1:
            raise APIError(
                f"give one structured-output constraint per request, got {[n for n, _ in found]}",
                param=found[1][0],
            )
        return found[0][1] if found else None


def _schema(schema) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise APIError(f"the JSON schema is not valid JSON: {e}") from None
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def _kind(kind: str, value) -> dict:
    if kind == "json_object" or (kind == "json" and value is True):
        return {"type": "json_object"}
    if kind == "json":
        return _schema(value)
    return {"type": kind, kind: value}


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    prompt_embeds: str | list[str] | None = None

    UNSUPPORTED: ClassVar[dict] = {
        **_Sampling.UNSUPPORTED,
        "suffix": None,
        "prompt_embeds": None,
    }


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_call_id, ... for templates
    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        return d


class FunctionDef(_Request):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens (wins)
    add_generation_prompt: bool = True  # vLLM's extension
    continue_final_message: bool = False  # vLLM's extension
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False  # vLLM's
    # tool calls (OpenAI's): rendered by the chat template; `required` and a named function are
    # enforced by grammar, `auto` parsed (dflash-serve --enable-auto-tool-choice)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # chat template (vLLM's): another template, its variables, documents for RAG templates
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None
    # OpenAI fields this server does not implement
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    mm_processor_kwargs: dict | None = None
    # SGLang's reasoning switches, which vllm-router adds to every chat request it forwards:
    # with no reasoning parser here they change nothing, whatever their values
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True

    UNSUPPORTED: ClassVar[dict] = {
        **_Sampling.UNSUPPORTED,
        "continue_final_message": False,
        "echo": False,
        "functions": None,
        "function_call": None,
        "reasoning_effort": None,
        "modalities": None,
        "audio": None,
        "prediction": None,
        "web_search_options": None,
        "metadata": None,
        "store": None,
        "service_tier": None,
        "mm_processor_kwargs": None,
    }

    @property
    def max_new(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) over max_tokens."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


def parse(model: type[_Request], body: bytes) -> Any:
    """Validate a JSON body; any problem is one APIError naming the field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        err = _closest(e.errors())
        if err["type"] == "json_invalid":
            raise APIError(f"the request body is not valid JSON: {err['msg']}") from None
        if err["type"] == "extra_forbidden":
            raise _unknown(model, err["loc"]) from None
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        where = f"field {loc!r}" if loc else "the request body"
        hint = ""
        if err["type"] == "int_type" and isinstance(err.get("input"), float):
            hint = ": token ids and counts are JSON integers (1, not 1.0 or 1.5)"
        elif loc.split(".")[0] == "prompt":
            hint = ": a prompt is a string or a list of integer token ids"
        got = json.dumps(err.get("input"), ensure_ascii=False, default=repr)[:200]
        raise APIError(f"{where}: {err['msg']} (got {got}){hint}", param=loc or None) from None
    name = req.unsupported()
    if name is not None:
        value = req
        for part in name.split("."):
            value = getattr(value, part)
        raise APIError(
            f"{name!r} is not supported by dflash-serve (got {value!r}): leave it out",
            param=name,
        )
    return req


def _unknown(model: type[_Request], loc) -> APIError:
    """A field neither OpenAI nor vLLM defines there: named, with the closest known one."""
    where: type[BaseModel] | None = model
    for part in loc[:-1]:  # a nested object's known fields
        f = where.model_fields.get(part) if where is not None else None
        where = _model_of(f.annotation) if f is not None else None
    name = str(loc[-1])
    known = [f.alias or n for n, f in where.model_fields.items()] if where is not None else []
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    path = ".".join(str(p) for p in loc)
    return APIError(
        f"unknown field {path!r}{hint}: this server (as OpenAI and vLLM) does not define it",
        param=path,
    )


def _model_of(annotation):
    """The pydantic model inside an annotation (X | None, list[X]), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _closest(errors: list[dict]) -> dict:
    """The error to report. For a value matching none of a union's types (pydantic reports one
    error per type, the first against `str`), the type the value came closest to: the one that
    failed deepest, then furthest along the list, then with the fewest errors; e.g. for
    "prompt": [1.5, 2] the list of token ids' "prompt.0 should be a valid integer", not "prompt
    should be a valid string"."""
    first = errors[0]
    at = next((i for i, p in enumerate(first["loc"]) if _is_union_tag(p)), None)
    if at is None:
        return first
    prefix = tuple(first["loc"][:at])
    members: dict[str, list[dict]] = {}
    for e in errors:
        loc = tuple(e["loc"])
        if loc[:at] == prefix and len(loc) > at and _is_union_tag(loc[at]):
            members.setdefault(loc[at], []).append(e)

    def progress(errs):
        rest = errs[0]["loc"][at + 1 :]
        return (len(rest), [p for p in rest if isinstance(p, int)], -len(errs))

    return max(members.values(), key=progress)[0]  # ties: the first type declared


def _is_union_tag(p) -> bool:
    # pydantic names the union member in the location ("prompt.str", "prompt.list[int]")
    return isinstance(p, str) and (p in ("str", "int", "float", "bool") or p.startswith("list["))


# ---------------------------------------------------------------------- responses


def request_id(prefix: str, given: str | None = None) -> str:
    """The response id: the client's request_id when it gave one (vLLM's), else a fresh one."""
    return f"{prefix}-{given or uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with the prompt tokens found in the prefix cache (runtime/prefix.py)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(rid, model, text, reason, token_ids, use, chat: bool, tool_calls=None) -> dict:
    """The whole (non-streamed) answer. token_ids: None unless return_token_ids; tool_calls:
    the reply's calls (chat)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        if tool_calls:
            choice["message"]["tool_calls"] = tool_calls
    else:
        choice["text"] = text
    if token_ids is not None:
        choice["token_ids"] = token_ids
    obj = "chat.completion" if chat else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chunk_body(
    rid,
    model,
    created,
    chat: bool,
    text=None,
    reason=None,
    token_ids=None,
    role=None,
    tool_calls=None,
):
    """One streamed chunk. For chat, the first chunk carries the role, later ones the content
    (and tool-call deltas, each with its index)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    if chat:
        delta: dict[str, Any] = {}
        if role is not None:
            delta["role"] = role
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if token_ids is not None:
        choice["token_ids"] = token_ids
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid, model, created, chat: bool, use: dict) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, the usage."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }
