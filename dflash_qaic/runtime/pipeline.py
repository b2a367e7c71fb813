"""The public face of the runtime: `Pipeline.generate` / `stream` / `generate_baseline`.

It validates what callers pass (prompts, sampling settings, stop ids) and runs them on the one
host loop, `runtime/engine.py`: a single prompt is a batch of one; a list of prompts runs as a
continuous batch when the artifacts were exported with `--full-batch-size` (up to that many at
once, the rest queued), else one after another. How the engines run (admission policy,
concurrency, verify lengths) is one frozen `EngineConfig`, replaced by `configure`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from dflash_qaic import contract
from dflash_qaic.artifacts.manifest import Manifest
from dflash_qaic.runtime.engine import BatchEngine, EngineConfig
from dflash_qaic.runtime.grammar import GrammarError, Grammars, TokenSet, normalize
from dflash_qaic.runtime.sequence import Request
from dflash_qaic.runtime.stats import GenerationResult, StepCosts
from dflash_qaic.runtime.streamer import prompt_array

__all__ = ["EngineConfig", "GenerationError", "GenerationResult", "Pipeline", "Sampling"]


class GenerationError(ValueError):
    """Bad input to generate(): says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Sampling:
    """Validated sampling settings of one generation (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @classmethod
    def checked(cls, temperature=0.0, top_k=0, top_p=1.0, seed=None) -> Sampling:
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
        return cls(t, k, p, None if seed is None else int(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


def _check_streamer(streamer, prompt) -> None:
    if streamer is None:
        return
    if not callable(getattr(streamer, "put", None)) or not callable(getattr(streamer, "end", None)):
        raise GenerationError(
            f"streamer must have put(ids) and end() (Hugging Face's streamer interface, e.g. "
            f"dflash_qaic.runtime.streamer.TextStreamer); got {type(streamer).__name__}"
        )
    if is_batch(prompt):
        raise GenerationError(
            "a streamer takes one prompt (as in transformers): use on_tokens for a list of prompts"
        )


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


class Pipeline:
    """DFlash generation over a target program and a draft program (see `dflash_qaic.load`)."""

    def __init__(
        self,
        manifest,
        target,
        draft,
        tokenizer=None,
        backend: str = "ort",
        *,
        config: EngineConfig | None = None,
        threads: int | None = None,
        device_ids=None,
    ):
        """manifest: a `dflash_qaic.artifacts.manifest.Manifest`, or its JSON form (validated here).
        config: how its engines run (EngineConfig; `configure` changes it); threads: the
        programs' ONNX Runtime threads, for reports (None: ONNX Runtime's default);
        device_ids: where the programs run (`runtime.devices.Placement`: target and draft
        device ids), for reports (None: not placed, ONNX Runtime without device_ids)."""
        if not isinstance(manifest, Manifest):
            manifest = Manifest.from_json(manifest, "manifest", complete=False)
        self.artifacts = manifest  # the typed manifest
        self.manifest = manifest.to_json()  # its JSON form, for reports
        self.target, self.draft = target, draft
        self.tokenizer = tokenizer
        self.backend = backend
        self.threads = threads
        self.device_ids = device_ids
        m = manifest
        self.plan = m.plan  # the shapes both programs were exported for (contract.ShapePlan)
        self.B = m.block_size
        self.chunk = m.prefill_seq_len
        self.ctx_len = m.ctx_len
        self.vocab = m.vocab_size
        self.eos = list(m.eos_token_ids)
        #: sequences decoded at once (continuous batching), 1 without it
        self.full_batch_size = m.full_batch_size or 1
        # Artifacts exported before sampling existed have no sampling inputs: greedy only.
        self.can_sample = m.target.io.sampling
        # the largest top_k the program takes (its top-k/top-p candidates; all of V if unknown)
        self.max_top_k = m.target.sampling_candidates or self.vocab
        #: how engines run (admission policy, concurrency, verify lengths): frozen; the default
        #: prefills every waiting prompt before the next step (measured the better default on
        #: the default pair: a prefill chunk costs less than a step)
        self.config = EngineConfig()
        if config is not None:
            self.configure(config)
        #: timings that pick each step's verify length, kept across calls (stats.StepCosts)
        self.step_costs = StepCosts()
        self._grammars: Grammars | None = None  # structured output, made at its first use

    def configure(self, config: EngineConfig | None = None, **changes) -> EngineConfig:
        """Replace the engine config (or change some of its fields, e.g.
        `pipe.configure(verify_lengths=[pipe.B])`), checked against these artifacts; engines
        made afterwards use it. Returns the config it replaced."""
        new = dataclasses.replace(config or self.config, **changes)
        new.step_lengths(self.plan, self.artifacts.draft.io.confidence)  # ValueError if unfit
        old, self.config = self.config, new
        return old

    # read-only views of the config (assigning one is an error: use configure)
    verify_lengths = property(lambda self: self.config.verify_lengths)
    max_running = property(lambda self: self.config.max_running)
    prefill_chunks_per_step = property(lambda self: self.config.prefill_chunks_per_step)

    def engine(self, mode: str = "dflash", **changes) -> BatchEngine:
        """A continuous-batching engine over these programs (what dflash-serve drives), with
        the pipeline's config (and `changes` to it)."""
        m = self.artifacts
        return BatchEngine(
            dataclasses.replace(self.config, mode=mode, **changes),
            self.plan,
            self.target,
            self.draft,
            target_io=m.target.io,
            draft_io=m.draft.io,
            mask_token_id=m.mask_token_id,
            costs=self.step_costs,
        )

    # ------------------------------------------------------------------ inputs

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
            limit, who = self.ctx_len - 1 - self.B, "DFlash (prompt + one verify block)"
        else:
            limit, who = contract.max_positions(self.ctx_len) - 1, "the target"
        if n > limit:
            raise GenerationError(
                f"{what} has {n} tokens but {who} allows at most {limit} with ctx_len "
                f"{self.ctx_len}: shorten the prompt or re-export with a larger --ctx-len"
            )

    def _stop_set(self, stop_token_ids) -> frozenset[int]:
        if stop_token_ids is None:
            return frozenset(self.eos)
        return frozenset(_token_ids(stop_token_ids, "stop_token_ids", None))

    def sampling(self, temperature=None, top_k=0, top_p=1.0, seed=None, do_sample=None) -> Sampling:
        """Validated settings this program can run; a sampling request without a seed gets
        fresh entropy (the seed used is reported in stats). do_sample as Hugging Face's: False
        is greedy whatever the temperature, True samples at `temperature` (default 1.0), None
        lets the temperature decide (default 0: greedy)."""
        temperature = _temperature(temperature, do_sample)
        sp = Sampling.checked(temperature, top_k, top_p, seed)
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
            sp = Sampling(sp.temperature, sp.top_k, sp.top_p, np.random.SeedSequence().entropy)
        return sp

    @property
    def can_constrain(self) -> bool:
        """The target program takes a token bitmask (exported with --structured-output)."""
        return self.artifacts.target.io.token_bitmask

    def grammar(self, response_format):
        """The compiled grammar of a response format (runtime/grammar.py; cached per spec), or
        None for none; GenerationError saying what is wrong with it."""
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
            return self._grammars.compile(response_format)
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

    # ------------------------------------------------------------------ running

    def _run(self, reqs: list[Request], mode: str, raises=False) -> Iterator[tuple[int, list]]:
        """Run requests to completion on one engine; yields (request index, new tokens). A
        request whose calls fail ends with stop_reason "error" (the others run on); `raises`:
        re-raise its error instead (one prompt, no list of results to return it in)."""
        engine = self.engine(mode)
        seqs = [engine.add(r) for r in reqs]
        index = {id(s): i for i, s in enumerate(seqs)}
        while engine.busy:
            for seq in engine.step():
                for run in seq.take():
                    yield index[id(seq)], run
                if raises and seq.error is not None:
                    raise seq.error
        self._results = [s.result for s in seqs]

    def _finish(self, res: GenerationResult) -> GenerationResult:
        if self.tokenizer is not None:
            res.text = self.tokenizer.decode(res.tokens)
        return res

    def _generate(
        self, prompt, max_new_tokens, stop_token_ids, on_tokens, mode, sp: dict, streamer=None
    ):
        if on_tokens is not None and not callable(on_tokens):
            raise GenerationError(f"on_tokens must be callable or None (got {on_tokens!r})")
        _check_streamer(streamer, prompt)
        if is_batch(prompt):
            reqs = self._batch(prompt, max_new_tokens, stop_token_ids, mode, sp)
            for i, new in self._run(reqs, mode):
                if on_tokens is not None:
                    on_tokens(i, new)
            return [self._finish(r) for r in self._results]
        req = self.request(prompt, max_new_tokens, stop_token_ids, mode, **sp)
        if streamer is not None:
            streamer.put(prompt_array(req.ids))  # the prompt first, as transformers does
        try:
            for _, new in self._run([req], mode, raises=True):
                if streamer is not None:
                    streamer.put(np.asarray(new, dtype=np.int64))
                if on_tokens is not None:
                    on_tokens(new)
        finally:
            if streamer is not None:
                streamer.end()  # also on failure: an iterating consumer is never left waiting
        return self._finish(self._results[0])

    # ------------------------------------------------------------------ public

    def generate(
        self,
        prompt: list[int] | str | Sequence[list[int] | str],
        max_new_tokens: int | list[int] = 64,
        stop_token_ids: list[int] | None = None,
        on_tokens: Callable | None = None,
        *,
        temperature: float | None | list[float | None] = None,
        top_k: int | list[int] = 0,
        top_p: float | list[float] = 1.0,
        seed: int | None | list[int | None] = None,
        do_sample: bool | None | list[bool | None] = None,
        streamer=None,
        response_format: dict | None | list[dict | None] = None,
    ) -> GenerationResult | list[GenerationResult]:
        """DFlash generation. Greedy by default: token for token the target's own greedy output.

        prompt: token ids, or text when the artifacts carry a tokenizer; or a list of prompts,
            which returns one result per prompt, in order (a continuous batch of up to
            `full_batch_size` at once; the rest wait for a free slot). A prompt whose program
            calls fail gets stop_reason "error" and the message in `error` (the others are
            unaffected); for one prompt the error is raised.
        stop_token_ids: None = the target's EOS ids from the manifest; [] = never stop early.
        on_tokens: called with each run of newly committed tokens, as they are committed (for a
            list of prompts: with the prompt's index and its tokens).
        temperature, top_k, top_p: sampling from the target's distribution after temperature,
            top-k (0 = off) and top-p (1 = off) filtering; lossless (the output is distributed
            exactly as the target's own sampling); temperature 0 (the default) = greedy.
        do_sample: Hugging Face's switch: False = greedy whatever the temperature; True =
            sample at `temperature` (default 1.0, as transformers); None = the temperature says.
        streamer: Hugging Face's streamer interface (anything with put(ids) and end(), e.g.
            transformers' TextStreamer / TextIteratorStreamer or this package's,
            runtime/streamer.py): put first receives the prompt's ids (shape (1, n), as
            transformers passes them; skip_prompt=True skips them), then each run of committed
            tokens (1-D); end() comes at the end, also when generation fails. One prompt only.
        response_format: structured output, the same dicts as the server's response_format
            ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": …}},
            {"type": "regex" | "choice" | "grammar", …}; runtime/grammar.py): the target
            chooses only tokens the grammar allows, and the output equals the target alone
            under the same constraint. Needs artifacts exported with --structured-output.
        seed: seeds the host's random numbers; the same seed gives the same tokens. None draws
            fresh entropy (the value used is in `stats["seed"]`).
        For a list of prompts, max_new_tokens and the sampling arguments take one value for all
        or a list with one per prompt.
        """
        sp = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, do_sample=do_sample)
        sp["response_format"] = response_format
        return self._generate(
            prompt, max_new_tokens, stop_token_ids, on_tokens, "dflash", sp, streamer
        )

    def stream(
        self,
        prompt,
        max_new_tokens: int = 64,
        stop_token_ids=None,
        *,
        temperature: float | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        do_sample: bool | None = None,
        response_format: dict | None = None,
    ) -> Iterator[int]:
        """Yield generated tokens one by one as steps commit them (DFlash; arguments as generate,
        one prompt)."""
        if is_batch(prompt):
            raise GenerationError("stream takes one prompt: use generate for a list of prompts")
        sp = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, do_sample=do_sample)
        sp["response_format"] = response_format
        req = self.request(prompt, max_new_tokens, stop_token_ids, "dflash", **sp)
        for _, new in self._run([req], "dflash", raises=True):
            yield from new

    def generate_baseline(
        self,
        prompt: list[int] | str | Sequence[list[int] | str],
        max_new_tokens: int | list[int] = 64,
        stop_token_ids: list[int] | None = None,
        on_tokens: Callable | None = None,
        *,
        temperature: float | None | list[float | None] = None,
        top_k: int | list[int] = 0,
        top_p: float | list[float] = 1.0,
        seed: int | None | list[int | None] = None,
        do_sample: bool | None | list[bool | None] = None,
        streamer=None,
        response_format: dict | None | list[dict | None] = None,
    ) -> GenerationResult | list[GenerationResult]:
        """The target alone on the decode specialization of the same program; same statistics,
        the same arguments and the same batching as generate (each decode call samples from p;
        under a response_format, from p restricted to the grammar's tokens)."""
        sp = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, do_sample=do_sample)
        sp["response_format"] = response_format
        return self._generate(
            prompt, max_new_tokens, stop_token_ids, on_tokens, "baseline", sp, streamer
        )


def is_batch(prompt) -> bool:
    """Whether `prompt` is a list of prompts (texts, id lists or 1-D arrays) rather than one.
    A list mixing ids and lists is refused: it is neither."""
    if isinstance(prompt, (str, bytes, np.ndarray)) or not isinstance(prompt, (list, tuple)):
        return False
    nested = [isinstance(p, (str, list, tuple, np.ndarray)) for p in prompt]
    if any(nested) and not all(nested):
        raise GenerationError(
            "the prompt mixes token ids and nested lists: give one prompt as a flat list of ids, "
            "or a batch as a list of prompts"
        )
    return bool(prompt) and all(nested)
