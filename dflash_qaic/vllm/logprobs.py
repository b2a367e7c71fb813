"""Logprobs of a step's committed tokens in vLLM's shapes (docs/sampling.md, under vLLM).

The values are the device's (runtime/logprobs.py: a target exported with --logprobs K returns,
per row, log p of its choice and its top K), of the rows a step committed only. Our worker
asks every request that wants logprobs for the whole top K; vLLM keeps each request's own k:

    ModelRunnerOutput.logprobs       LogprobsLists, one row per token the step hands vLLM:
                                     ids [n, K + 1] (column 0: the token, then the top K),
                                     log p [n, K + 1], the token's rank [n]; each request's
                                     rows from `cu_num_generated_tokens`[its index] on
    prompt_logprobs_dict[req id]     LogprobsTensors of prompt tokens 1 … P − 1 (the same
                                     columns), in the step of the request's first token

A rank is exact for a token among the top K; one outside them is reported at K + 1 (the
programs return no more: its true rank is K + 1 or beyond).
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.outputs import LogprobsLists, LogprobsTensors

#: why a request's logprobs are missing: its prompt was computed elsewhere (vllm/connector.py)
HANDOFF = (
    "its logprobs were not recorded here: a request admitted from a prefill hand-off has "
    "none (its prompt and first token were computed by the prefill server); serve requests "
    "that ask for logprobs without prefill/decode disaggregation"
)


def _rows(token_ids, logprobs, top, k: int):
    """(ids [n, k + 1], log p [n, k + 1], ranks [n]) of a TokenLogprobs' entries."""
    n = len(token_ids)
    ids = np.zeros((n, k + 1), np.int64)
    values = np.full((n, k + 1), -np.inf, np.float32)
    ranks = np.full(n, k + 1, np.int64)
    for j, (t, v, alts) in enumerate(zip(token_ids, logprobs, top, strict=True)):
        ids[j, 0], values[j, 0] = t, v
        for r, (i, w) in enumerate(alts[:k], 1):
            ids[j, r], values[j, r] = i, w
            if i == t and ranks[j] > k:
                ranks[j] = r
    return ids, values, ranks


class StepLogprobs:
    """The logprobs of one step's output, gathered request by request (`add`), then set on
    vLLM's ModelRunnerOutput (`fill`). k: the top K of the artifacts' target program."""

    def __init__(self, k: int):
        self.k = k
        self.parts: list[tuple] = []  # (ids, log p, ranks) per request with logprobs
        self.start: dict[str, int] = {}  # request id -> its first row
        self.rows = 0
        self.prompts: dict[str, LogprobsTensors] = {}

    def add(self, rid: str, seq, lo: int, tokens: list[int]) -> str | None:
        """Request `rid` hands vLLM `tokens`, its generated tokens lo … lo + len − 1. Returns
        why its logprobs cannot be answered (None: they are, or none were asked)."""
        rec = seq.logprobs
        if rec is None:
            return None
        if rec.prompt is not None and lo == 0 and tokens:  # the step of its first token
            p = rec.prompt
            if len(p.token_ids) != len(seq.req.ids):
                return HANDOFF
            ids, values, ranks = _rows(p.token_ids[1:], p.logprobs[1:], p.top[1:], self.k)
            self.prompts[rid] = LogprobsTensors(
                torch.from_numpy(ids), torch.from_numpy(values), torch.from_numpy(ranks)
            )
        span = rec.span(lo, lo + len(tokens))
        if span is None:
            return None
        if span.token_ids != tokens:
            return HANDOFF
        self.start[rid] = self.rows
        self.parts.append(_rows(span.token_ids, span.logprobs, span.top, self.k))
        self.rows += len(tokens)
        return None

    def fill(self, out, req_ids: list[str]) -> None:
        """Set `out.logprobs` (when a request of the step has any) and its prompt logprobs."""
        if self.prompts:
            out.prompt_logprobs_dict = self.prompts
        if not self.start:
            return
        ids, values, ranks = (np.concatenate(a) for a in zip(*self.parts, strict=True))
        cu = [self.start.get(rid, 0) for rid in req_ids]
        out.logprobs = LogprobsLists(ids, values, ranks, cu)
