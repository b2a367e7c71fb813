"""Request size limits of dflash-serve: the body limit, enforced while the body is read, and the
bound that refuses a text prompt from its length alone, before any tokenization.

A text of n characters has at least ⌈n / L⌉ tokens when no token covers more than L characters
of it. `longest_token_chars` finds L once, at load: the longest string in the tokenizer's
vocabulary (a byte-level token has one character per byte, a SentencePiece token one per
character, a byte-fallback token `<0x41>` more than the one it covers), times 4 when the
normalizer composes characters (NFC / NFKC compose at most 4 code points into one). Where a
part of the tokenizer can remove text outright (a normalizer that strips or deletes, a
pre-tokenizer that drops whitespace, unknown characters fused into one token, added tokens that
swallow the whitespace beside them) there is no such bound: None, and such a prompt is only
refused once tokenized (off the event loop, still within the body limit).
"""

from __future__ import annotations

import json
import logging

from dflash_qaic.serve.protocol import APIError

log = logging.getLogger("dflash_qaic.serve")


def default_max_request_bytes(max_model_len: int) -> int:
    """64 bytes per token of context, at least 1 MiB: room for any prompt that fits (token ids
    take under 12 bytes each, text a few characters per token, up to 6 bytes per escaped
    character), while the JSON parse of the largest body accepted (on the event loop, as
    pydantic holds the GIL) stays short."""
    return max(1 << 20, 64 * max_model_len)


# normalizers that never make the text shorter, and those that shorten it by at most 4×
_KEEPS = {"NFD", "NFKD", "Lowercase", "Prepend"}
_COMPOSES = {"NFC", "NFKC"}
# pre-tokenizers that keep every character (split, isolate or map them one to one)
_PRE_KEEPS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def _normalizer_factor(spec) -> int | None:
    """How many characters of the input one character after normalization may stand for
    (None: unbounded)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _KEEPS:
        return 1
    if kind in _COMPOSES:
        return 4
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        if "String" not in pattern or not content:
            return None  # a regex, or a deletion
        return max(1, -(-len(pattern["String"]) // len(content)))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, ...: may delete characters


def _pre_tokenizer_keeps(spec) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(p) for p in spec.get("pretokenizers", []))
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    return kind in _PRE_KEEPS


def _model_keeps(model: dict, byte_level: bool) -> bool:
    """Every character ends up in some token of at most its vocabulary string's length."""
    kind = model.get("type")
    if kind == "BPE":
        if byte_level or model.get("byte_fallback"):
            return True
        return model.get("unk_token") is not None and not model.get("fuse_unk")
    if kind == "Unigram":
        return bool(model.get("byte_fallback"))  # else unknown characters fuse into one token
    return False  # WordPiece, WordLevel: one unknown token for a whole word


def longest_token_chars(tokenizer) -> int | None:
    """L such that a text of n characters has at least ⌈n / L⌉ tokens (None: no such bound)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python tokenizer: nothing to inspect
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception as e:  # an unusual backend: no bound rather than a wrong one
        log.debug("no prompt-length bound: the tokenizer does not serialize (%s)", e)
        return None
    factor = _normalizer_factor(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    byte_level = "ByteLevel" in json.dumps(pre)
    added = spec.get("added_tokens") or []
    if (
        factor is None
        or not _pre_tokenizer_keeps(pre)
        or not _model_keeps(spec.get("model") or {}, byte_level)
        or any(t.get("lstrip") or t.get("rstrip") for t in added)
    ):
        log.info("prompts are measured in tokens only: this tokenizer gives no length bound")
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    if not vocab:
        return None
    return factor * max(len(t) for t in vocab)


def too_long(n_chars: int, chars_per_token: int | None, max_tokens: int) -> int | None:
    """The fewest tokens a text of n_chars characters has, when that is already more than
    max_tokens; else None."""
    if chars_per_token is None:
        return None
    least = -(-n_chars // chars_per_token)
    return least if least > max_tokens else None


def body_too_large(limit: int) -> APIError:
    return APIError(
        f"the request body is larger than {limit} bytes: send a smaller request, or start "
        f"dflash-serve with a larger --max-request-bytes",
        413,
    )


async def read_body(request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed `limit` bytes: from
    Content-Length before reading anything, else (chunked) once the bytes read pass the limit;
    never more than the limit is held."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        parts.append(chunk)
    return b"".join(parts)
