"""The references the sampling-parameter tests compare the programs with, on Hugging Face's own
model (docs/sampling.md): log_softmax of its logits for logprobs, and a greedy loop over its
logits adjusted as vLLM and OpenAI define the rest (HF `generate` with repetition_penalty:
test_conformance.hf_greedy). Shared by the built-in pair's tests (test_logprobs.py,
test_sampling_params.py, test_draft_penalties.py) and every family's
(test_sampling_families.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

#: logprobs against HF's log_softmax (fp32 ONNX Runtime)
TOL = 2e-3


def hf_logprobs(model, ids: list[int], temperature: float = 1.0) -> np.ndarray:
    """log_softmax of the target's logits at every position of `ids` [len(ids), V] (fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, -1).numpy()


def check_against_hf(res, prompt_ids, ref, k: int) -> None:
    """res.logprobs (each generated token's log p and its top k) equal `ref`'s rows."""
    P = len(prompt_ids)
    gen = res.logprobs
    assert gen.token_ids == res.tokens and len(gen.logprobs) == len(res.tokens)
    for i, t in enumerate(res.tokens):  # token i was chosen at position P - 1 + i
        row = ref[P - 1 + i]
        assert abs(gen.logprobs[i] - row[t]) < TOL, (i, gen.logprobs[i], row[t])
        top_ids = [j for j, _ in gen.top[i]]
        assert len(top_ids) == k
        np.testing.assert_allclose([v for _, v in gen.top[i]], row[top_ids], atol=TOL)
        np.testing.assert_allclose(sorted(row, reverse=True)[:k], row[top_ids], atol=TOL)


def check_prompt_logprobs(pl, ids: list[int], ref, k: int) -> None:
    """Prompt logprobs `pl` of `ids`: token j's log p given the tokens before it (the first's
    None) and its top k, equal `ref`'s rows, the most likely first."""
    assert pl.token_ids == ids and pl.logprobs[0] is None and pl.top[0] == []
    want = [ref[j - 1][ids[j]] for j in range(1, len(ids))]
    np.testing.assert_allclose(pl.logprobs[1:], want, atol=TOL)
    for j in range(1, len(ids)):
        top = [t for t, _ in pl.top[j]]
        assert len(top) == k
        np.testing.assert_allclose([v for _, v in pl.top[j]], ref[j - 1][top], atol=TOL)
        assert ref[j - 1][top[0]] >= ref[j - 1].max() - TOL  # the most likely first


def adjust(logits, prompt, output, s: dict, stop=()) -> torch.Tensor:
    """The reference adjustment of one row's logits [V] after `output` (generated tokens) as
    vLLM orders it: logit bias, repetition (HF's rule over prompt + output), frequency and
    presence (OpenAI's formula over output), then bad words and min_tokens out of reach."""
    x = logits.clone().double()
    for t, b in (s.get("logit_bias") or {}).items():
        x[int(t)] += b
    counts = Counter(output)
    r = s.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, n in counts.items():
        x[t] -= s.get("frequency_penalty", 0.0) * n + s.get("presence_penalty", 0.0)
    for word in s.get("bad_words") or ():
        *before, last = word
        if not before or output[len(output) - len(before) :] == before:
            x[last] = -torch.inf
    if len(output) < s.get("min_tokens", 0):
        x[list(stop)] = -torch.inf
    return x


def reference_greedy(model, prompt: list[int], n: int, s: dict, stop=()) -> list[int]:
    """n greedy tokens of a loop over HF's logits, each row adjusted by `adjust` (no stop)."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(adjust(logits, prompt, out, s, stop).argmax()))
    return out
