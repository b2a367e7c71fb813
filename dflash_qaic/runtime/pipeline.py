"""The public face of the runtime: `Pipeline.generate` / `stream` / `generate_baseline`.

It validates what callers pass (prompts, sampling settings, stop ids) and runs them on the one
host loop, `runtime/engine.py`: a single prompt is a batch of one; a list of prompts runs as a
continuous batch when the artifacts were exported with `--full-batch-size` (up to that many at
once, the rest queued), else one after another. How the engines run (admission policy,
concurrency, verify lengths) is one frozen `EngineConfig`, replaced by `configure`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from dflash_qaic.artifacts.manifest import Manifest
from dflash_qaic.runtime import prefix
from dflash_qaic.runtime.engine import BatchEngine, EngineConfig
from dflash_qaic.runtime.requests import GenerationError, RequestChecks, Sampling
from dflash_qaic.runtime.sequence import Request
from dflash_qaic.runtime.stats import GenerationResult, StepCosts
from dflash_qaic.runtime.streamer import prompt_array

__all__ = ["EngineConfig", "GenerationError", "GenerationResult", "Pipeline", "Sampling"]


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


class Pipeline(RequestChecks):
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
        self.prefix_cache = None  # runtime/prefix.py: made by the first engine that caches
        self._grammars = None  # structured output, made at its first use

    def configure(self, config: EngineConfig | None = None, **changes) -> EngineConfig:
        """Replace the engine config (or change some of its fields, e.g.
        `pipe.configure(verify_lengths=[pipe.B])` or `pipe.configure(spec_policy="always")`, the
        step policy: runtime/policy.py), checked against these artifacts; engines made
        afterwards use it. Returns the config it replaced."""
        new = dataclasses.replace(config or self.config, **changes)
        lengths = new.step_lengths(self.plan, self.artifacts.draft.io.confidence)  # ValueError
        new.tree_sizes(self.plan, lengths)  # if unfit
        old, self.config = self.config, new
        return old

    # read-only views of the config (assigning one is an error: use configure)
    verify_lengths = property(lambda self: self.config.verify_lengths)
    tree_budget = property(lambda self: self.config.tree_budget)
    spec_policy = property(lambda self: self.config.spec_policy)
    max_running = property(lambda self: self.config.max_running)
    prefill_chunks_per_step = property(lambda self: self.config.prefill_chunks_per_step)

    def engine(self, mode: str = "dflash", **changes) -> BatchEngine:
        """A continuous-batching engine over these programs (what dflash-serve drives), with
        the pipeline's config (and `changes` to it)."""
        m, config = self.artifacts, dataclasses.replace(self.config, mode=mode, **changes)
        return BatchEngine(
            config,
            self.plan,
            self.target,
            self.draft,
            target_io=m.target.io,
            draft_io=m.draft.io,
            mask_token_id=m.mask_token_id,
            costs=self.step_costs,
            prefix_cache=prefix.shared(self, config),  # kept across engines, as the rows are
        )

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
        logprobs: int | None | list[int | None] = None,
        prompt_logprobs: int | None | list[int | None] = None,
        **extended,
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
        logprobs, prompt_logprobs: k ≥ 0 fills `res.logprobs` (each generated token's log p and
            its k most likely alternatives) and `res.prompt_logprobs` (each prompt token's; the
            first one's is None), a runtime.logprobs.TokenLogprobs; the committed rows' only.
            Needs artifacts exported with `--logprobs K`, k ≤ K (docs/sampling.md).
        **extended: repetition_penalty, presence_penalty, frequency_penalty, min_p, min_tokens,
            logit_bias ({token id: bias}), bad_words (token-id sequences), as vLLM defines
            them, applied on the device before every row's choice, lossless under DFlash.
            Need artifacts exported with `--extended-sampling` (docs/sampling.md).
        For a list of prompts, max_new_tokens and the sampling arguments take one value for all
        or a list with one per prompt.
        """
        sp = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, do_sample=do_sample)
        sp.update(response_format=response_format, logprobs=logprobs)
        sp.update(prompt_logprobs=prompt_logprobs, **extended)
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
        logprobs: int | None | list[int | None] = None,
        prompt_logprobs: int | None | list[int | None] = None,
        **extended,
    ) -> GenerationResult | list[GenerationResult]:
        """The target alone on the decode specialization of the same program; same statistics,
        the same arguments and the same batching as generate (each decode call samples from p;
        under a response_format, from p restricted to the grammar's tokens)."""
        sp = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, do_sample=do_sample)
        sp.update(response_format=response_format, logprobs=logprobs)
        sp.update(prompt_logprobs=prompt_logprobs, **extended)
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
