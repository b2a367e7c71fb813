"""Incremental detokenisation: text deltas from a growing list of token ids that never split a
character.

A byte-level tokenizer spends one token per byte, so 'é' (two UTF-8 bytes) or '€' (three) spans
several tokens, and a step may commit only part of a character; decoding each run of ids on its
own prints replacement characters. `TextStreamer` keeps the ids and decodes a short window:
the text of `ids[prefix:]` minus the text of `ids[prefix:read]` (already emitted) is the new text,
as in vLLM's incremental detokenizer. When it ends in U+FFFD (an incomplete character) only the
text before that is released and the window stays open until the character is complete. Decoding the window (the last emitted
run plus the new ids) rather than the whole output keeps the cost of a step independent of the
output length, and keeps tokenizers whose decode depends on the previous token (SentencePiece's
leading space) right. The deltas joined equal `tokenizer.decode(all ids)`.

    from dflash_qaic.runtime.streamer import iter_text
    for delta in iter_text(pipe, "def fib(n):", max_new_tokens=64):
        print(delta, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

REPLACEMENT = "\ufffd"


class TextStreamer:
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
    streamer = TextStreamer(pipe.tokenizer, skip_special_tokens=skip_special_tokens)
    for token in pipe.stream(prompt, max_new_tokens, stop_token_ids, **sampling):
        delta = streamer.push((token,))
        if delta:
            yield delta
    delta = streamer.flush()
    if delta:
        yield delta
