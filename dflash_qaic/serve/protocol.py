"""The OpenAI wire format as vLLM serves it: request models (pydantic, strict JSON types), the
error body, and the response and stream-chunk bodies.

Requests are validated in pydantic's strict JSON mode, so `"max_tokens": "5"` or `true` is a 400,
not a silent coercion. Unknown fields are ignored (as vLLM does); known OpenAI fields this server
cannot honour (`n` > 1, `logprobs`, `echo`, penalties, ...) are refused with a 400 that names them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError


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
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


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
    # OpenAI fields this server does not implement: refused unless left at their defaults
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    UNSUPPORTED: ClassVar[dict] = {
        "n": 1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logit_bias": None,
    }

    def unsupported(self) -> str | None:
        for name, default in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value != default and not (default is None and value == {}):
                return name
        return None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    UNSUPPORTED: ClassVar[dict] = {
        **_Sampling.UNSUPPORTED,
        "echo": False,
        "logprobs": None,
        "suffix": None,
        "best_of": None,
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


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    add_generation_prompt: bool = True  # vLLM's extension
    logprobs: bool = False
    top_logprobs: int | None = None

    UNSUPPORTED: ClassVar[dict] = {
        **_Sampling.UNSUPPORTED,
        "logprobs": False,
        "top_logprobs": None,
    }


def parse(model: type[_Request], body: bytes) -> Any:
    """Validate a JSON body; any problem is one APIError naming the field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        err = _closest(e.errors())
        if err["type"] == "json_invalid":
            raise APIError(f"the request body is not valid JSON: {err['msg']}") from None
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
        raise APIError(
            f"{name!r} is not supported by dflash-serve (got {getattr(req, name)!r}): leave it out",
            param=name,
        )
    return req


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


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(rid, model, text, reason, token_ids, use, chat: bool) -> dict:
    """The whole (non-streamed) answer. token_ids: None unless return_token_ids."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
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


def chunk_body(rid, model, created, chat: bool, text=None, reason=None, token_ids=None, role=None):
    """One streamed chunk. For chat, the first chunk carries the role, later ones the content."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    if chat:
        delta: dict[str, Any] = {}
        if role is not None:
            delta["role"] = role
        if text is not None:
            delta["content"] = text
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
