"""Logprobs in OpenAI's and vLLM's response shapes (docs/sampling.md): completions' `logprobs`
(tokens, token_logprobs, top_logprobs, text_offset) and `echo`, chat's `logprobs.content`
(token, logprob, bytes, top_logprobs), vLLM's `prompt_logprobs`. The values come from the
device (runtime/logprobs.py): the target's, of the committed tokens only."""

from __future__ import annotations

from dflash_qaic.serve.protocol import APIError


def settings(req, chat: bool) -> dict:
    """What a request asks for, as Pipeline.request takes it: logprobs (alternatives per
    generated token, None: none) and prompt_logprobs (per prompt token; echo with logprobs
    needs the prompt's too). APIError for a combination the server does not answer."""
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
    else:
        k = req.logprobs
    pk = req.prompt_logprobs
    echo = not chat and req.echo
    if echo and k is not None:
        pk = max(pk or 0, k)
    if req.stream and (echo or req.prompt_logprobs is not None):
        param = "echo" if echo else "prompt_logprobs"
        raise APIError(f"{param} is answered without stream only: leave out stream", param=param)
    return {"logprobs": k, "prompt_logprobs": pk}


def token_text(tok, t: int) -> str:
    """A token as OpenAI shows it: its text (vLLM's "token_id:N" without a tokenizer)."""
    return tok.decode([t]) if tok is not None else f"token_id:{t}"


def completion_logprobs(tok, gen, prompt, k: int, offset: int = 0) -> dict:
    """Completions' `logprobs` of the prompt's tokens (echo; the first one's is null) then the
    generated ones: each token's text, log p, its top k (and itself) and text offset."""
    rows = []
    for lp in (prompt, gen):
        if lp is not None:
            rows += zip(lp.token_ids, lp.logprobs, lp.top, strict=True)
    body: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, value, top in rows:
        text = token_text(tok, t)
        body["tokens"].append(text)
        body["token_logprobs"].append(value)
        body["text_offset"].append(offset)
        offset += len(text)
        if value is None:
            body["top_logprobs"].append(None)
            continue
        alts = {token_text(tok, i): v for i, v in top[:k]}
        alts.setdefault(text, value)
        body["top_logprobs"].append(alts)
    return body


def chat_logprobs(tok, gen, n: int) -> dict:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: n of the same}]}."""

    def item(t: int, value: float) -> dict:
        text = token_text(tok, t)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = [
        {**item(t, v), "top_logprobs": [item(i, w) for i, w in top[:n]]}
        for t, v, top in zip(gen.token_ids, gen.logprobs, gen.top, strict=True)
    ]
    return {"content": content}


def prompt_logprobs(tok, prompt, k: int) -> list:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {id: {logprob, rank,
    decoded_token}} of the token itself and the top k (rank: its place among them; None for
    the prompt token when it is not among them)."""
    out: list = [None]
    for t, value, top in zip(prompt.token_ids[1:], prompt.logprobs[1:], prompt.top[1:]):
        ranked = {i: r for r, (i, _) in enumerate(top[:k], 1)}
        entry = {str(t): _entry(tok, t, value, ranked.get(t))}
        for i, v in top[:k]:
            entry.setdefault(str(i), _entry(tok, i, v, ranked[i]))
        out.append(entry)
    return out


def _entry(tok, t: int, value: float, rank: int | None) -> dict:
    return {"logprob": value, "rank": rank, "decoded_token": token_text(tok, t)}


def add_to_choice(choice: dict, tok, req, chat: bool, result, prompt_text: str | None) -> None:
    """The logprob fields (and echo's prompt text) of a whole answer's choice, as asked."""
    gen = result.logprobs if result is not None else None
    prompt = result.prompt_logprobs if result is not None else None
    echo = not chat and req.echo
    if echo and prompt_text is not None:
        choice["text"] = prompt_text + choice["text"]
    if chat and req.logprobs and gen is not None:
        choice["logprobs"] = chat_logprobs(tok, gen, req.top_logprobs or 0)
    elif not chat:
        choice["logprobs"] = None
        if req.logprobs is not None and gen is not None:
            echoed = prompt if echo else None
            choice["logprobs"] = completion_logprobs(tok, gen, echoed, req.logprobs)
    if req.prompt_logprobs is not None and prompt is not None:
        choice["prompt_logprobs"] = prompt_logprobs(tok, prompt, req.prompt_logprobs)


def add_to_chunk(chunk: dict, tok, req, chat: bool, out, offset: int) -> int:
    """A streamed chunk's logprobs (its tokens'); returns the text offset after them."""
    gen = out.logprobs
    if gen is None or not gen.token_ids:
        return offset
    choice = chunk["choices"][0]
    if chat:
        choice["logprobs"] = chat_logprobs(tok, gen, req.top_logprobs or 0)
        return offset
    body = completion_logprobs(tok, gen, None, req.logprobs, offset)
    choice["logprobs"] = body
    return offset + sum(len(t) for t in body["tokens"])


def extended(req, tokenizer) -> dict:
    """The extended sampling settings a request sets (runtime/requests.py EXTENDED_SAMPLING),
    as Pipeline.request takes them: bad words as token-id sequences, each word with and
    without a leading space (vLLM's rule)."""
    from dflash_qaic.runtime.requests import extended_settings

    out = extended_settings(lambda name, off: getattr(req, name))
    if "bad_words" in out:
        if tokenizer is None:
            raise APIError("bad_words need a tokenizer", param="bad_words")
        seqs: dict[tuple[int, ...], None] = {}
        for word in out["bad_words"]:
            for text in (word.lstrip(), " " + word.lstrip()):
                seqs[tuple(tokenizer.encode(text, add_special_tokens=False))] = None
        out["bad_words"] = [list(s) for s in seqs if s]
    return out
