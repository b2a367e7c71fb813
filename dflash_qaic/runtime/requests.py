"""What `Pipeline` checks of what callers pass (prompts, sampling settings, stop ids, response
formats) before a request reaches the engine: `RequestChecks`, the validating half of
runtime/pipeline.py's `Pipeline`, and the `Sampling` settings it produces."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import numpy as np

from dflash_qaic import contract
from dflash_qaic.runtime.grammar import GrammarError, Grammars, TokenSet, normalize
from dflash_qaic.runtime.sequence import Request


class GenerationError(ValueError):
    """Bad input to generate(): says what is wrong and how to fix it."""


#: The extended sampling parameters (wire names, each with its off value): honoured by a target
#: exported with --extended-sampling (docs/sampling.md), refused with the re-export otherwise.
#: (Every other sampling parameter OpenAI and vLLM define is honoured by every program.)
EXTENDED_SAMPLING: dict[str, object] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "logit_bias": None,
    "bad_words": None,
}


def first_set(offs: dict[str, object], get) -> str | None:
    """The first name of `offs` (name -> the value that turns it off) that `get(name, off)` (a
    request's value, `off` when it has none) sets to anything else, or None; for an off value
    of None, an empty dict, list or tuple is off too."""
    for name, off in offs.items():
        value = get(name, off)
        if value != off and not (off is None and value in ({}, [], ())):
            return name
    return None


def extended_settings(get) -> dict:
    """The extended sampling parameters a request sets, by name (`get` as `first_set`)."""
    found = {n: off for n, off in EXTENDED_SAMPLING.items() if first_set({n: off}, get)}
    return {n: get(n, off) for n, off in found.items()}


@dataclass(frozen=True)
class Sampling:
    """Validated sampling settings of one generation (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    # logprobs (docs/DESIGN.md, Logprobs): alternatives per generated / prompt token (None: no
    # logprobs; 0: the token's own only)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # extended sampling (docs/DESIGN.md, Extended sampling; off at these values)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    bad_words: tuple[tuple[int, ...], ...] = ()  # token-id sequences

    @classmethod
    def checked(
        cls,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=None,
        logprobs=None,
        prompt_logprobs=None,
        **extended,
    ) -> Sampling:
        def real(name, x):
            if isinstance(x, bool) or not isinstance(x, numbers.Real):
                raise GenerationError(f"{name} must be a number (got {x!r})")
            return float(x)

        def integer(name, x):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise GenerationError(f"{name} must be an integer (got {x!r})")
            return int(x)

        t = real("temperature", temperature)
        if not math.isfinite(t) or t < 0:
            raise GenerationError(
                f"temperature must be a finite number ≥ 0 (got {temperature!r}); 0 is greedy"
            )
        k = integer("top_k", top_k)
        if k < 0:
            raise GenerationError(f"top_k must be ≥ 0 (got {top_k!r}); 0 turns top-k off")
        p = real("top_p", top_p)
        if not 0.0 < p <= 1.0:  # NaN fails too
            raise GenerationError(f"top_p must be in (0, 1] (got {top_p!r}); 1 turns top-p off")
        if seed is not None and integer("seed", seed) < 0:
            raise GenerationError(f"seed must be an integer ≥ 0 or None (got {seed!r})")
        lp = {"logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
        for name, n in lp.items():
            if n is not None and not 0 <= integer(name, n) <= contract.MAX_LOGPROBS:
                raise GenerationError(
                    f"{name} must be in 0 … {contract.MAX_LOGPROBS} or None (got {n!r})"
                )
        lp = {name: None if n is None else int(n) for name, n in lp.items()}
        return cls(t, k, p, None if seed is None else int(seed), **lp, **_extended(**extended))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def extended(self) -> str | None:
        """The first extended sampling setting this asks for (None: none)."""
        return first_set(EXTENDED_SAMPLING, lambda name, off: getattr(self, name))

    @property
    def history_dependent(self) -> bool:
        """A setting that reads the generated tokens (penalties, bad words)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.bad_words
        )


def _extended(**settings) -> dict:
    """The extended settings (EXTENDED_SAMPLING's names) checked against vLLM's and OpenAI's
    ranges, as Sampling's fields; unset ones off."""
    unknown = sorted(set(settings) - set(EXTENDED_SAMPLING))
    if unknown:
        raise TypeError(f"unknown sampling setting(s) {unknown}; known: {list(EXTENDED_SAMPLING)}")
    s = {**EXTENDED_SAMPLING, **settings}
    out = {}
    for name, lo, hi in (
        ("repetition_penalty", 0.0, math.inf),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
        ("min_p", 0.0, 1.0),
    ):
        x = s[name]
        ok = isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
        if not ok or not lo <= x <= hi or (name == "repetition_penalty" and x <= 0):
            where = "> 0" if name == "repetition_penalty" else f"in [{lo:g}, {hi:g}]"
            raise GenerationError(f"{name} must be a finite number {where} (got {x!r})")
        out[name] = float(x)
    n = s["min_tokens"]
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise GenerationError(f"min_tokens must be an integer ≥ 0 (got {n!r})")
    out["min_tokens"] = int(n)
    out["logit_bias"] = _logit_bias(s["logit_bias"])
    out["bad_words"] = _bad_words(s["bad_words"])
    return out


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """{token id (int or its decimal string): bias in [-100, 100]} -> sorted pairs."""
    if not bias:
        return ()
    items = bias.items() if isinstance(bias, dict) else bias
    out = {}
    for t, v in items:
        try:
            t = int(t)
        except (TypeError, ValueError):
            raise GenerationError(f"logit_bias keys must be token ids (got {t!r})") from None
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not -100 <= v <= 100:
            raise GenerationError(f"logit_bias values must be in [-100, 100] (got {v!r})")
        out[t] = float(v)
    if len(out) > contract.MAX_LOGIT_BIAS:
        raise GenerationError(
            f"logit_bias holds {len(out)} tokens; the program takes at most "
            f"{contract.MAX_LOGIT_BIAS}"
        )
    return tuple(sorted(out.items()))


def _bad_words(words) -> tuple[tuple[int, ...], ...]:
    """Token-id sequences (each 1 … BAD_WORD_TOKENS long, at most MAX_BAD_WORDS of them)."""
    if not words:
        return ()
    out = tuple(tuple(_token_ids(w, "bad_words", None)) for w in words)
    if len(out) > contract.MAX_BAD_WORDS or any(
        not 1 <= len(w) <= contract.BAD_WORD_TOKENS for w in out
    ):
        raise GenerationError(
            f"bad_words: at most {contract.MAX_BAD_WORDS} sequences of 1 … "
            f"{contract.BAD_WORD_TOKENS} tokens each (got {[len(w) for w in out]})"
        )
    return out


def _temperature(temperature, do_sample):
    """The temperature that `temperature` and Hugging Face's `do_sample` mean together."""
    if do_sample is not None and not isinstance(do_sample, bool):
        raise GenerationError(f"do_sample must be True, False or None (got {do_sample!r})")
    if do_sample is False:
        return 0.0  # greedy, as transformers: the temperature is ignored
    if do_sample is None:
        return 0.0 if temperature is None else temperature
    if temperature is None:
        return 1.0  # transformers' default temperature
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        if temperature == 0:
            raise GenerationError(
                "do_sample=True with temperature=0: sampling needs a temperature > 0; for "
                "greedy decoding pass do_sample=False (or leave temperature at 0 without do_sample)"
            )
    return temperature


def _token_ids(value, what: str, vocab: int | None) -> list[int]:
    """A flat sequence of token ids (Python or numpy ints; a 1-D integer array), checked against
    the vocabulary when given. Floats, bools, strings and nested lists are refused, never
    converted or flattened."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise GenerationError(
                f"{what} must be a 1-D array of integer token ids (got shape {value.shape}, "
                f"dtype {value.dtype})"
            )
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, range)):
        raise GenerationError(
            f"{what} must be a list of integer token ids (got {type(value).__name__})"
        )
    bad = [t for t in value if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise GenerationError(
            f"{what} must hold integer token ids only; got {bad[0]!r} ({type(bad[0]).__name__})"
            + (" — one prompt per call, not a nested list" if isinstance(bad[0], list) else "")
        )
    ids = [int(t) for t in value]
    hi = vocab if vocab is not None else 2**63
    out_of_range = [t for t in ids if not 0 <= t < hi]
    if out_of_range:
        where = f"the vocabulary 0 … {vocab - 1}" if vocab is not None else "0 … 2^63 - 1"
        raise GenerationError(f"{what}: token ids {out_of_range[:5]} are outside {where}")
    return ids


class RequestChecks:
    """Validation of a request against the artifacts (a Pipeline's: vocab, ctx_len, B, eos,
    can_sample, max_top_k, tokenizer)."""

    def _prompt_ids(self, prompt, what: str = "the prompt") -> list[int]:
        """Token ids of one prompt: text (with a tokenizer) or a flat sequence of ints."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise GenerationError(
                    "a text prompt needs a tokenizer, and these artifacts have none (the target "
                    "directory had no tokenizer files): pass token ids instead"
                )
            prompt = self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, (list, tuple)) and not prompt and what == "the prompt":
            raise GenerationError(
                "the list of prompts is empty (an empty list is neither a prompt nor a batch): "
                "give at least one prompt, as text or token ids"
            )
        ids = _token_ids(prompt, what, self.vocab)
        if not ids:
            raise GenerationError(f"{what} is empty: give at least one token")
        return ids

    @staticmethod
    def _check_max_new(max_new_tokens) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise GenerationError(f"max_new_tokens must be an integer ≥ 1 (got {max_new_tokens!r})")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be ≥ 1 (got {max_new_tokens})")

    def _check_room(self, n: int, mode: str, what: str) -> None:
        if mode == "dflash":
            limit, who = (
                contract.max_prompt(self.ctx_len, self.B),
                "DFlash (prompt + one verify block)",
            )
        else:
            limit, who = contract.max_prompt(self.ctx_len, 1), "the target"
        if n > limit:
            raise GenerationError(
                f"{what} has {n} tokens but {who} allows at most {limit} with ctx_len "
                f"{self.ctx_len}: shorten the prompt or re-export with a larger --ctx-len"
            )

    def _stop_set(self, stop_token_ids) -> frozenset[int]:
        if stop_token_ids is None:
            return frozenset(self.eos)
        return frozenset(_token_ids(stop_token_ids, "stop_token_ids", None))

    def sampling(
        self, temperature=None, top_k=0, top_p=1.0, seed=None, do_sample=None, **more
    ) -> Sampling:
        """Validated settings this program can run; a sampling request without a seed gets
        fresh entropy (the seed used is reported in stats). do_sample as Hugging Face's: False
        is greedy whatever the temperature, True samples at `temperature` (default 1.0), None
        lets the temperature decide (default 0: greedy). more: Sampling's other fields
        (logprobs, penalties, …)."""
        temperature = _temperature(temperature, do_sample)
        sp = Sampling.checked(temperature, top_k, top_p, seed, **more)
        self.check_logprobs(sp)
        self.check_extended(sp)
        if not sp.greedy and not self.can_sample:
            raise GenerationError(
                "these artifacts' target program has no sampling inputs (exported by an older "
                "version or without sampling): use temperature=0, or re-export with dflash-export"
            )
        if sp.top_k > self.max_top_k and not sp.greedy and self.max_top_k < self.vocab:
            raise GenerationError(
                f"top_k {sp.top_k} is above the {self.max_top_k} candidates this target program "
                f"reads its top-k / top-p thresholds from: use top_k ≤ {self.max_top_k} or 0 (off)"
            )
        if not sp.greedy and sp.seed is None:
            sp = replace(sp, seed=np.random.SeedSequence().entropy)
        return sp

    def check_extended(self, sp: Sampling) -> None:
        """Penalties, min_p, logit_bias, min_tokens and bad words need a target exported with
        --extended-sampling; their token ids must be in the vocabulary."""
        name = sp.extended
        if name is None:
            return
        if not self.artifacts.target.io.extended_sampling:
            raise GenerationError(
                f"{name}: these artifacts' target program takes no extended sampling inputs: "
                "re-export with `dflash-export --extended-sampling`"
            )
        ids = [t for t, _ in sp.logit_bias] + [t for w in sp.bad_words for t in w]
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise GenerationError(
                f"logit_bias / bad_words token ids {bad[:5]} are outside the vocabulary "
                f"0 … {self.vocab - 1}"
            )

    def check_logprobs(self, sp: Sampling) -> None:
        """Logprobs need a target exported with --logprobs K, and at most K alternatives."""
        asked = {n: getattr(sp, n) for n in ("logprobs", "prompt_logprobs")}
        asked = {n: k for n, k in asked.items() if k is not None}
        if not asked:
            return
        have = self.artifacts.target.io.logprobs
        name, k = max(asked.items(), key=lambda item: item[1])
        if not have:
            raise GenerationError(
                f"{name}: these artifacts' target program returns no logprobs: re-export with "
                f"`dflash-export --logprobs {max(k, 1)}` (up to {contract.MAX_LOGPROBS})"
            )
        if k > have:
            raise GenerationError(
                f"{name} {k} is above the {have} alternatives this target program returns: ask "
                f"for at most {have}, or re-export with `dflash-export --logprobs {k}`"
            )

    @property
    def can_constrain(self) -> bool:
        """The target program takes a token bitmask (exported with --structured-output)."""
        return self.artifacts.target.io.token_bitmask

    def grammar(self, response_format, **limits):
        """The compiled grammar of a response format (runtime/grammar.py; cached per spec), or
        None for none; GenerationError saying what is wrong with it. limits: Grammars.compile's
        lenient and max_alternatives."""
        if response_format is None:
            return None
        try:
            if not self.can_constrain:
                if normalize(response_format) is None:  # {"type": "text"}: nothing to follow
                    return None
                raise GrammarError(
                    "these artifacts' target program takes no token bitmask, so it cannot "
                    "follow a response_format: re-export with `dflash-export --structured-output`"
                )
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab, self.eos)
            return self._grammars.compile(response_format, **limits)
        except GrammarError as e:
            raise GenerationError(str(e)) from None

    def allowed_tokens(self, ids):
        """The constraint of a fixed set of allowed token ids (vLLM's allowed_token_ids), as
        `grammar` returns one; GenerationError when the program cannot apply it."""
        if not self.can_constrain:
            raise GenerationError(
                "these artifacts' target program takes no token bitmask, so it cannot restrict "
                "the allowed tokens: re-export with `dflash-export --structured-output`"
            )
        try:
            return TokenSet(_token_ids(ids, "allowed_token_ids", self.vocab), self.vocab)
        except GrammarError as e:
            raise GenerationError(str(e)) from None

    def request(
        self,
        prompt,
        max_new_tokens=64,
        stop_token_ids=None,
        mode="dflash",
        what="the prompt",
        response_format=None,
        grammar=None,
        **sp,
    ) -> Request:
        """One validated request for the engine (sp: temperature, top_k, top_p, seed);
        response_format: structured output (runtime/grammar.py), or `grammar` already compiled
        (`Pipeline.grammar`)."""
        self._check_max_new(max_new_tokens)
        ids = self._prompt_ids(prompt, what)
        self._check_room(len(ids), mode, what)
        stop = self._stop_set(stop_token_ids)
        sampling = self.sampling(**sp)
        if sampling.min_tokens and len(stop) > contract.MAX_STOP_IDS:
            raise GenerationError(
                f"min_tokens with {len(stop)} stop token ids: the program holds back at most "
                f"{contract.MAX_STOP_IDS}; give fewer stop_token_ids"
            )
        if grammar is None:
            grammar = self.grammar(response_format)
        return Request(ids, int(max_new_tokens), stop, sampling, grammar)

    def _batch(self, prompts, max_new_tokens, stop_token_ids, mode, sp: dict) -> list[Request]:
        """Requests of a list of prompts: every setting is one value for all, or a list with
        one value per prompt."""
        kinds = {"text" if isinstance(p, str) else "ids" for p in prompts}
        if len(kinds) > 1:
            raise GenerationError(
                "the list of prompts mixes text and token ids: give all prompts as text or all "
                "as token-id lists"
            )
        n = len(prompts)

        def each(name, value):
            if isinstance(value, (list, tuple)) and name != "stop_token_ids":
                if len(value) != n:
                    raise GenerationError(
                        f"{name} has {len(value)} values for {n} prompts: give one value, or "
                        "one per prompt"
                    )
                return list(value)
            return [value] * n

        settings = {k: each(k, v) for k, v in sp.items()}
        new = each("max_new_tokens", max_new_tokens)
        return [
            self.request(
                p,
                new[i],
                stop_token_ids,
                mode,
                f"prompt {i}",
                **{k: v[i] for k, v in settings.items()},
            )
            for i, p in enumerate(prompts)
        ]
