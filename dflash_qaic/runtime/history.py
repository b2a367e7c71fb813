"""The extended sampling inputs of a call's rows (docs/DESIGN.md, Extended sampling): each
row's settings and the summary of its request's history that the target program adjusts its
logits from (contract.extended_specs).

Set once when a sequence takes a slot (`set_row`: O(V) for its counts, O(P) for its prompt's
bitmask) and moved on per committed token (`advance`: O(1) per token), never per step over the
vocabulary. The history is the generated tokens before the anchor (the last committed token):
the program itself counts the call's own generated inputs (anchor, proposals).
"""

from __future__ import annotations

import numpy as np

from dflash_qaic import contract as c


class ExtendedRows:
    """Host buffers of the extended sampling inputs, one row per call row."""

    def __init__(self, rows: int, vocab: int):
        self.vocab = vocab
        f = lambda v: np.full(rows, v, np.float32)  # noqa: E731
        self.rep, self.presence, self.frequency, self.min_p = f(1.0), f(0.0), f(0.0), f(0.0)
        self.generated_from = np.zeros(rows, np.int64)
        self.stop_from = np.zeros(rows, np.int64)
        self.counts = np.zeros((rows, vocab), np.float32)
        self.prompt = np.zeros((rows, c.bitmask_words(vocab)), np.int32)
        self.stop_ids = np.full((rows, c.MAX_STOP_IDS), -1, np.int64)
        self.bias_ids = np.zeros((rows, c.MAX_LOGIT_BIAS), np.int64)
        self.bias = np.zeros((rows, c.MAX_LOGIT_BIAS), np.float32)
        self.bad_words = np.full((rows, c.MAX_BAD_WORDS, c.BAD_WORD_TOKENS), -1, np.int64)
        self.tail = np.full((rows, c.BAD_WORD_TOKENS - 1), c.NO_TOKEN, np.int64)
        self.on = np.zeros(rows, bool)  # the row's request uses a history-dependent setting

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            c.REPETITION_PENALTY: self.rep,
            c.PRESENCE_PENALTY: self.presence,
            c.FREQUENCY_PENALTY: self.frequency,
            c.MIN_P: self.min_p,
            c.GENERATED_FROM: self.generated_from,
            c.OUTPUT_COUNTS: self.counts,
            c.PROMPT_TOKENS: self.prompt,
            c.STOP_ALLOWED_FROM: self.stop_from,
            c.MIN_TOKENS_STOP_IDS: self.stop_ids,
            c.LOGIT_BIAS_IDS: self.bias_ids,
            c.LOGIT_BIAS: self.bias,
            c.BAD_WORDS: self.bad_words,
            c.OUTPUT_TAIL: self.tail,
        }

    def set_row(self, r: int, sp, req) -> None:
        """Row r's settings and an empty history (req: the request, None: a free row)."""
        self.rep[r] = getattr(sp, "repetition_penalty", 1.0)
        self.presence[r] = getattr(sp, "presence_penalty", 0.0)
        self.frequency[r] = getattr(sp, "frequency_penalty", 0.0)
        self.min_p[r] = getattr(sp, "min_p", 0.0)
        P = len(req.ids) if req is not None else 0
        self.generated_from[r], self.stop_from[r] = P, 0
        self.stop_ids[r] = -1
        self.bias_ids[r], self.bias[r] = 0, 0.0
        self.bad_words[r] = -1
        self.tail[r] = c.NO_TOKEN
        was_on, self.on[r] = self.on[r], sp is not None and sp.history_dependent
        if was_on or self.on[r]:  # O(V): only a row that counts, or counted before
            self.counts[r] = 0.0
        self.prompt[r] = 0
        if req is None or sp is None:
            return
        if sp.repetition_penalty != 1.0:
            ids = np.unique(np.asarray(req.ids, np.int64))
            words = np.zeros(self.prompt.shape[1], np.uint32)
            bits = (np.uint64(1) << (ids % 32).astype(np.uint64)).astype(np.uint32)
            np.bitwise_or.at(words, ids // 32, bits)  # xgrammar's layout, as token_bitmask
            self.prompt[r] = words.view(np.int32)
        if sp.min_tokens:
            self.stop_from[r] = P + sp.min_tokens
            stop = sorted(req.stop)
            self.stop_ids[r, : len(stop)] = stop
        for j, (t, v) in enumerate(sp.logit_bias):
            self.bias_ids[r, j], self.bias[r, j] = t, v
        for j, word in enumerate(sp.bad_words):
            self.bad_words[r, j, c.BAD_WORD_TOKENS - len(word) :] = word

    def advance(self, r: int, tokens: list[int], before: int) -> None:
        """Row r's sequence holds `tokens` (generated), `before` of them before this commit:
        the tokens now behind its anchor (the last one) join its history."""
        if not self.on[r] or len(tokens) < 2:
            return
        for t in tokens[max(before - 1, 0) : -1]:
            self.counts[r, t] += 1.0
        tail = tokens[-c.BAD_WORD_TOKENS : -1]
        self.tail[r, c.BAD_WORD_TOKENS - 1 - len(tail) :] = tail
