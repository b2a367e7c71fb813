"""Incremental detokenisation, and Hugging Face's streamer interface over it.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas that never split a
character. A byte-level tokenizer spends one token per byte, so 'é' (two UTF-8 bytes) or '€'
(three) spans several tokens, and a step may commit only part of a character; decoding each run
of ids on its own prints replacement characters. It keeps the ids and decodes a short window:
the text of `ids[prefix:]` minus the text of `ids[prefix:read]` (already emitted) is the new text,
as in vLLM's incremental detokenizer. When it ends in U+FFFD (an incomplete character) only the
text before that is released and the window stays open until the character is complete.
Decoding the window (the last emitted run plus the new ids) rather than the whole output keeps
the cost of a step independent of the output length, and keeps tokenizers whose decode depends
on the previous token (SentencePiece's leading space) right. The deltas joined equal
`tokenizer.decode(all ids)`.

`TextStreamer` and `TextIteratorStreamer` have Hugging Face's names and interface (`put(ids)`,
`end()`; `skip_prompt`, decode kwargs such as `skip_special_tokens`), so
`pipe.generate(prompt, streamer=...)` takes these or transformers' own. As in transformers,
generate first puts the prompt's ids (shape (1, n)), then each run of committed tokens.

    from dflash_qaic.runtime.streamer import TextStreamer, iter_text
    pipe.generate("def fib(n):", 64, streamer=TextStreamer(pipe.tokenizer, skip_prompt=True))
    for delta in iter_text(pipe, "def fib(n):", max_new_tokens=64):
        print(delta, end="", flush=True)
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator

import numpy as np

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """push(ids) -> the new stable text; flush() -> whatever is held back, at the end."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # ids[_prefix:_read] is the last emitted run (decode context)
        self._read = 0  # ids[_read:] are not emitted yet
        self._held = 0  # characters of ids[_read:] already emitted (before an incomplete one)

    def _decode(self, lo: int, hi: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[lo:hi], skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._prefix, self._read)
        new = self._decode(self._prefix)[len(prefix_text) :]
        if not new and not final:  # nothing yet (e.g. a skipped special token): keep the context
            return ""
        if new.endswith(REPLACEMENT) and not final:
            # the last character is incomplete: release the text before it, keep the window
            stable = new.rstrip(REPLACEMENT)
            delta, self._held = stable[self._held :], max(self._held, len(stable))
        else:
            delta, self._held = new[self._held :], 0
            self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def push(self, ids: Iterable[int]) -> str:
        """Add newly generated ids; return the text they complete (may be empty)."""
        self.ids.extend(int(t) for t in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end decodes as U+FFFD)."""
        return self._advance(final=True)


def iter_text(
    pipe,
    prompt,
    max_new_tokens: int = 64,
    stop_token_ids: list[int] | None = None,
    *,
    skip_special_tokens: bool = False,
    **sampling,
) -> Iterator[str]:
    """Yield the generated text of `pipe.stream(...)` as non-empty deltas that never split a
    character; joined, they equal `tokenizer.decode(tokens)` (= `pipe.generate(...).text`).
    sampling: temperature, top_k, top_p, seed, as `Pipeline.generate`."""
    if pipe.tokenizer is None:
        raise ValueError(
            "these artifacts have no tokenizer (the target directory had no tokenizer files): "
            "use pipe.stream(...) for token ids"
        )
    streamer = IncrementalDetokenizer(pipe.tokenizer, skip_special_tokens=skip_special_tokens)
    for token in pipe.stream(prompt, max_new_tokens, stop_token_ids, **sampling):
        delta = streamer.push((token,))
        if delta:
            yield delta
    delta = streamer.flush()
    if delta:
        yield delta


# ---------------------------------------------------------------------- Hugging Face's streamers


def token_list(value) -> list[int]:
    """The ids of one `put` (an int, a list, a numpy array or a torch tensor; shape (n,) or
    (1, n)); a batch of several rows is refused, as in transformers."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, int):
        return [value]
    value = list(value)
    if value and isinstance(value[0], (list, tuple)):
        if len(value) > 1:
            raise ValueError("a text streamer takes one sequence (batch size 1)")
        value = list(value[0])
    return [int(t) for t in value]


class TextStreamer:
    """Hugging Face's `TextStreamer`: prints the text to stdout as it is generated.

    put(ids): the prompt first (skipped with skip_prompt=True), then each run of new tokens;
    end(): flush what is held back and end the line. decode_kwargs: skip_special_tokens.
    Text is released in whole characters (`IncrementalDetokenizer`). Subclasses override
    `on_finalized_text(text, stream_end)`, as in transformers.
    """

    def __init__(self, tokenizer, skip_prompt: bool = False, **decode_kwargs):
        unknown = set(decode_kwargs) - {"skip_special_tokens"}
        if unknown:
            raise TypeError(f"unsupported decode arguments {sorted(unknown)}")
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self._detok = IncrementalDetokenizer(tokenizer, **decode_kwargs)
        self.next_tokens_are_prompt = True

    def __getattr__(self, name):
        if name in ("push", "flush"):
            raise AttributeError(
                "TextStreamer has Hugging Face's interface (put / end); the push / flush "
                "detokenizer is dflash_qaic.runtime.streamer.IncrementalDetokenizer"
            )
        raise AttributeError(name)

    def put(self, value) -> None:
        ids = token_list(value)
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.next_tokens_are_prompt = False
        text = self._detok.push(ids)
        if text:
            self.on_finalized_text(text)

    def end(self) -> None:
        self.on_finalized_text(self._detok.flush(), stream_end=True)
        self._detok = IncrementalDetokenizer(self.tokenizer, **self.decode_kwargs)
        self.next_tokens_are_prompt = True

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        print(text, flush=True, end="" if not stream_end else None)


class TextIteratorStreamer(TextStreamer):
    """Hugging Face's `TextIteratorStreamer`: iterate it (e.g. while generate runs in another
    thread) for the text as it is generated; `timeout` (seconds) bounds each wait."""

    def __init__(self, tokenizer, skip_prompt: bool = False, timeout=None, **decode_kwargs):
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        self.text_queue: queue.Queue = queue.Queue()
        self.stop_signal = None
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.text_queue.put(text, timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self.stop_signal, timeout=self.timeout)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is self.stop_signal:
            raise StopIteration
        return value


def prompt_array(ids: list[int]) -> np.ndarray:
    """The prompt as generate puts it first: shape (1, n), int64 (transformers' input_ids)."""
    return np.asarray([ids], dtype=np.int64)
