"""Logprobs of the tokens a request commits and of its prompt (docs/DESIGN.md, Logprobs).

A target exported with --logprobs K returns a few floats per row (contract.logprob_specs): the
log-probability of the row's choice, of the token `logprob_ids` names, and the K most likely
tokens with theirs. The host keeps those of the rows a step commits, never a rejected
proposal's: a verify row's choice is committed only up to the accepted count, and those rows
are the ones recorded. Work per committed token and k, never per vocabulary entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dflash_qaic import contract


@dataclass
class TokenLogprobs:
    """Log-probabilities of a run of tokens: token i's id and log p, and the `top` most likely
    tokens at its place as (id, log p), most likely first. A prompt's first token has none (its
    entry is None in `logprobs` and [] in `top`, as OpenAI's echo and vLLM's prompt_logprobs)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)

    def cut(self, n: int) -> TokenLogprobs:
        return self.span(0, n)

    def span(self, lo: int, hi: int) -> TokenLogprobs:
        """Tokens lo … hi − 1."""
        return TokenLogprobs(self.token_ids[lo:hi], self.logprobs[lo:hi], self.top[lo:hi])


class LogprobRecord:
    """One sequence's logprobs, filled as its rows are committed: `k` alternatives per generated
    token (None: none asked), `prompt_k` per prompt token (None: no prompt logprobs)."""

    def __init__(self, k: int | None, prompt_k: int | None, prompt: list[int]):
        self.k, self.prompt_k = k, prompt_k
        self.generated = TokenLogprobs()
        self.prompt = TokenLogprobs([prompt[0]], [None], [[]]) if prompt_k is not None else None

    @classmethod
    def of(cls, req) -> LogprobRecord | None:
        sp = req.sampling
        k, pk = getattr(sp, "logprobs", None), getattr(sp, "prompt_logprobs", None)
        return None if k is None and pk is None else cls(k, pk, req.ids)

    def rows(self, out: dict, r: int, lo: int, n: int) -> None:
        """Call row r's rows lo … lo+n−1 were committed (their choices, in order)."""
        if self.k is None:
            return
        g = self.generated
        g.token_ids += out[contract.NEXT_TOKENS][r, lo : lo + n].tolist()
        g.logprobs += out[contract.TOKEN_LOGPROBS][r, lo : lo + n].tolist()
        g.top += _top(out, r, lo, n, self.k)

    def prompt_rows(self, out: dict, scored: np.ndarray, n: int) -> None:
        """A prefill chunk's first n rows scored the prompt tokens after them (`scored`)."""
        if self.prompt is None or n <= 0:
            return
        p = self.prompt
        p.token_ids += scored[:n].tolist()
        p.logprobs += out[contract.SCORED_LOGPROBS][0, :n].tolist()
        p.top += _top(out, 0, 0, n, self.prompt_k)

    def span(self, lo: int, hi: int) -> TokenLogprobs | None:
        """Generated tokens lo … hi − 1's (None: no logprobs asked for them)."""
        return self.generated.span(lo, hi) if self.k is not None else None

    def result(self, n: int) -> tuple[TokenLogprobs | None, TokenLogprobs | None]:
        """(generated, prompt): the first n generated tokens' (a commit past a stop token or
        the budget recorded rows the sequence cut)."""
        return (self.generated.cut(n) if self.k is not None else None), self.prompt


def _top(out: dict, r: int, lo: int, n: int, k: int) -> list[list[tuple[int, float]]]:
    if not k:
        return [[] for _ in range(n)]
    ids = out[contract.TOP_LOGPROB_IDS][r, lo : lo + n, :k].tolist()
    lps = out[contract.TOP_LOGPROBS][r, lo : lo + n, :k].tolist()
    return [list(zip(i, v, strict=True)) for i, v in zip(ids, lps, strict=True)]
