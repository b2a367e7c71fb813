"""The vLLM worker that runs our engine's step (docs/DESIGN.md, vLLM platform plugin).

It implements vLLM's worker interface (`WorkerBase`) directly: vLLM's engine core calls
`execute_model(scheduler_output)` once per step and `take_draft_token_ids()` after it. The
worker owns one continuous-batching engine of `dflash_qaic.load(ARTIFACTS)` (runtime/engine.py,
with `first_token_alone`) and maps each scheduler output onto one `engine.step()`:

    finished_req_ids                 engine.abort: the row is free for the next request
    scheduled_new_reqs               engine.add: the step prefills the prompt in our chunks
                                     and returns its first token
    the requests already decoding    the step's verify of [last token, drafts] and the
                                     draft call: each returns its accepted drafts and the
                                     target's token (1 … B tokens, `sampled_token_ids`)
    take_draft_token_ids             the draft call's proposals: vLLM schedules them as the
                                     next step's `scheduled_spec_decode_tokens`
    sample_tokens(grammar_output)    a step with structured-output requests: execute_model
                                     returns None, vLLM computes its grammar bitmask over
                                     each such request's scheduled drafts, and the step runs
                                     here with those rows as the requests' token bitmasks

So vLLM's scheduler sees exactly what our programs did, and counts it (`vllm:spec_decode_*`:
drafts = B − 1 per step, accepted = what our verify accepted). The tokens are chosen on the
device by our programs; vLLM's own stop checks (EOS, stop_token_ids, max_tokens, stop strings)
end requests, and the engine is given the same stop set, so it frees the row at once.

Structured output is vLLM's own: its grammar backend computes each structured request's rows
(the bonus row and one per scheduled draft, the state after the drafts before it), the target
program applies them before its token choice (`token_bitmask`, exported with
--structured-output), and vLLM's matcher accepts the tokens (a token it rejects ends the request
with an error, as in vLLM). `allowed_token_ids` is a fixed mask of ours (runtime/grammar.py).

A program call that fails fails the requests in it, not vLLM's engine: the worker reports them
in the output (`failed`), and our scheduler (vllm/scheduler.py) finishes them with vLLM's error
status; the other requests go on.

Prefix caching is our engine's (runtime/prefix.py), with vLLM's --enable-prefix-caching
(vllm/platform.py keeps it; vLLM's block manager runs with its own off): a new request's
`cache_salt` comes from our scheduler beside the scheduler output, and the step reports each
admitted request's prompt tokens and cached tokens (`dflash_prefix`), which our scheduler adds to
vLLM's prefix-cache counters and the request's prefill stats.

vLLM may cut the scheduled drafts near max_model_len; then it receives at most the scheduled
drafts + 1 tokens, which reach max_model_len, so it ends the request there.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from dflash_qaic import contract
from dflash_qaic.runtime.grammar import Constraint
from dflash_qaic.vllm import connector
from dflash_qaic.vllm.logprobs import StepLogprobs
from dflash_qaic.vllm.platform import (
    Settings,
    accepts_device_ids,
    logprob_settings,
    prefix_caching,
    sampling_check,
)
from dflash_qaic.vllm.scheduler import RESET, SALTS

log = logging.getLogger("dflash_qaic.vllm")


class DFlashWorker(WorkerBase):
    """vLLM's worker interface over our engine (module docstring)."""

    def init_device(self) -> None:
        self.device = torch.device("cpu")  # the host; the programs run on their backend

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        import dflash_qaic

        s = Settings.of(self.vllm_config)
        kw = {"backend": s.backend, "threads": s.threads}
        if s.device_ids is not None:
            if accepts_device_ids():
                kw["device_ids"] = list(s.device_ids)
            else:
                log.warning(
                    "device_ids %s: this dflash_qaic.load takes no device ids; the programs "
                    "run on the devices their manifest names",
                    list(s.device_ids),
                )
        self.pipe = dflash_qaic.load(s.artifacts, **kw)
        if s.verify_lengths is not None:
            self.pipe.configure(verify_lengths=list(s.verify_lengths))
        if s.spec_policy is not None:
            self.pipe.configure(spec_policy=s.spec_policy)
        self.max_model_len = self.model_config.max_model_len
        self.engine = self.pipe.engine(
            "dflash",
            first_token_alone=True,
            max_running=self.scheduler_config.max_num_seqs,
            **prefix_caching(self.vllm_config),  # vLLM's options, for our cache rows
        )
        self.B = self.pipe.B
        self.words = contract.bitmask_words(self.pipe.vocab)  # the programs' bitmask width
        self.top_k_logprobs = self.pipe.artifacts.target.io.logprobs  # --logprobs K (0: none)
        self.seqs: dict = {}  # vLLM request id -> our Sequence
        self._drafts = DraftTokenIds([], [])
        self._pending = None  # the scheduler output whose step waits for vLLM's bitmask
        self._failed: dict[str, str] = {}
        self._salts: dict[str, str] = {}  # this step's new requests' cache_salt (our scheduler's)
        self._admitted: dict = {}  # vLLM request id -> Sequence: admitted in this step
        self.kv = connector.for_worker(self.vllm_config, self.pipe)  # P/D (vllm/connector.py)

    # ------------------------------------------------------------------ KV cache: one row = block

    def _spec(self) -> FullAttentionSpec:
        # vLLM only counts blocks: our caches are the programs' retained state
        return FullAttentionSpec(
            block_size=self.max_model_len, num_kv_heads=1, head_size=1, dtype=torch.int8
        )

    def get_kv_cache_spec(self) -> dict:
        return {"dflash_qaic": self._spec()}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        return [layout.name for layout in get_supported_kv_cache_layouts([])]

    def determine_available_memory(self) -> int:
        return self._spec().page_size_bytes * (self.scheduler_config.max_num_seqs + 1)

    def initialize_from_config(self, kv_cache_config) -> None:
        usable = kv_cache_config.num_blocks - 1  # block 0 is vLLM's null block
        if usable < self.scheduler_config.max_num_seqs:
            raise RuntimeError(
                f"vLLM made {usable} blocks for {self.scheduler_config.max_num_seqs} sequences"
            )

    def update_max_model_len(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_model(self):
        return None

    def get_cache_block_size_bytes(self) -> int:
        return self._spec().page_size_bytes

    def get_kv_connector_handshake_metadata(self) -> None:
        return None  # the P/D handshake is the producer's side channel's (vllm/connector.py)

    def execute_dummy_batch(self) -> None:
        pass

    def add_lora(self, lora_request) -> bool:
        raise ValueError("LoRA adapters are not supported by dflash-qaic's programs")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        if self.kv is not None:
            self.kv.shutdown()
        for seq in list(self.seqs.values()):
            self.engine.abort(seq)
        self.seqs.clear()

    # ------------------------------------------------------------------ the step

    def _add(self, new) -> None:
        p = new.sampling_params
        stop = set(p.stop_token_ids or ())
        if p.eos_token_id is not None:  # None when ignore_eos (vLLM's check_stop)
            stop.add(p.eos_token_id)
        ids = new.prompt_token_ids
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len - len(ids)
        fixed = self.pipe.allowed_tokens(p.allowed_token_ids) if p.allowed_token_ids else None
        kw = sampling_check(p, None) | logprob_settings(p, self.top_k_logprobs)
        req = self.pipe.request(ids, max_tokens, sorted(stop), grammar=fixed, **kw)
        req = self._salted(req, new.req_id)
        if self.kv is None:
            seq = self.engine.add(req)
        else:  # a hand-off's request is admitted with its payload
            seq = self.kv.add(self.engine, self.pipe.artifacts, req, new.req_id)
        if p.structured_outputs is not None:  # vLLM's grammar gives its masks, step by step
            seq.constraint = VllmMasks(self.words)
        self.seqs[new.req_id] = seq

    def execute_model(self, scheduler_output) -> ModelRunnerOutput | None:
        so = scheduler_output
        for rid in so.finished_req_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self.engine.abort(seq)
        cached = so.scheduled_cached_reqs
        if cached.resumed_req_ids:
            raise RuntimeError(
                f"vLLM resumed preempted requests {sorted(cached.resumed_req_ids)}: with one "
                "block per cache row it never preempts; this is a dflash-qaic plugin bug"
            )
        self._failed = {}  # request id -> why it failed in this step
        if self.kv is not None:
            self.kv.bind(so)
        self._salts = getattr(so, SALTS, None) or {}
        if getattr(so, RESET, False) and self.engine.prefix is not None:  # /reset_prefix_cache
            self.engine.prefix.clear()  # before this step's lookups (the engine's, at admission)
        for new in so.scheduled_new_reqs:
            try:
                self._add(new)
            except Exception as e:  # this request alone: vLLM ends it with an error
                log.warning("request %s: %s: %s", new.req_id, type(e).__name__, e)
                self._failed[new.req_id] = f"{type(e).__name__}: {e}"
        self._admitted = {
            n.req_id: self.seqs[n.req_id] for n in so.scheduled_new_reqs if n.req_id in self.seqs
        }
        scheduled = so.num_scheduled_tokens
        if not scheduled:  # nothing to run (e.g. vLLM paused its scheduling): no row advances
            return self._kv_done(ModelRunnerOutput(req_ids=[], req_id_to_index={}))
        skipped = [rid for rid in self.seqs if rid not in scheduled]
        if skipped:  # a step advances every row in flight: vLLM must schedule all of them
            raise RuntimeError(
                f"vLLM's scheduler left requests {skipped} out of a step; the dflash-qaic "
                "plugin steps every request in flight (max_num_batched_tokens too small?)"
            )
        if so.has_structured_output_requests:  # the step waits for vLLM's grammar bitmask
            self._pending = so
            return None
        return self._step(so)

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        """The step of a scheduler output with structured-output requests, under vLLM's grammar
        bitmask (None: none of them needs one in this step)."""
        so, self._pending = self._pending, None
        if so is None:
            raise RuntimeError("sample_tokens without a pending step: a dflash-qaic plugin bug")
        if grammar_output is not None:
            self._constrain(so, grammar_output)
        return self._step(so)

    def _constrain(self, so, grammar_output) -> None:
        """Each structured request's rows of vLLM's bitmask (its scheduled drafts + 1, in the
        order of `structured_output_request_ids`) become its masks for this step."""
        bitmask = grammar_output.grammar_bitmask
        bitmask = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else np.asarray(bitmask)
        ok = grammar_output.num_acceptable_drafts
        spec, i = so.scheduled_spec_decode_tokens, 0
        for k, rid in enumerate(grammar_output.structured_output_request_ids):
            drafts = list(spec.get(rid, ()))
            rows = bitmask[i : i + len(drafts) + 1]
            i += len(drafts) + 1
            acceptable = len(drafts) if ok is None else ok[k]
            if acceptable < len(drafts):  # padded drafts: only under async scheduling
                raise RuntimeError(
                    f"request {rid}: vLLM padded its scheduled drafts, which the dflash-qaic "
                    "plugin's synchronous scheduling never does; this is a plugin bug"
                )
            seq = self.seqs.get(rid)
            if seq is not None and isinstance(seq.constraint, VllmMasks):
                seq.constraint.set(rows)

    def _step(self, so) -> ModelRunnerOutput:
        self.engine.step()
        scheduled = so.num_scheduled_tokens
        req_ids = list(scheduled)
        sampled, spec, failed = [], so.scheduled_spec_decode_tokens, self._failed
        lps = StepLogprobs(self.top_k_logprobs)  # the committed rows' logprobs, vLLM's shapes
        for rid in req_ids:
            seq = self.seqs.get(rid)
            if seq is None:  # failed before its step (_add)
                sampled.append([])
                continue
            if isinstance(seq.constraint, VllmMasks):
                seq.constraint.set(None)  # next step's rows come from vLLM again
            if seq.error is not None:  # this request's program call failed: it alone ends
                failed[rid] = f"{type(seq.error).__name__}: {seq.error}"
                self.seqs.pop(rid)
                sampled.append([])
                continue
            tokens = [t for run in seq.take() for t in run]
            if not tokens and not seq.finished:
                raise RuntimeError(f"request {rid} was scheduled and produced no token")
            sampled.append(tokens[: len(spec.get(rid, ())) + 1])
            why = lps.add(rid, seq, len(seq.tokens) - len(tokens), sampled[-1])
            if why is not None:
                failed[rid] = why
            if seq.finished:  # our stop agrees with vLLM's: it ends this request now too
                self.seqs.pop(rid)
        going = [rid for rid in req_ids if rid in self.seqs]
        drafts = [self.engine.proposals(self.seqs[rid]).tolist() for rid in going]
        self._drafts = DraftTokenIds(going, drafts)
        out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        lps.fill(out, req_ids)
        if failed:  # read by DFlashScheduler (vllm/scheduler.py): vLLM's output has no field
            out.dflash_failed = failed
        self._prefix_hits(out)
        return self._kv_done(out)

    def _salted(self, req, rid: str):
        """The request with its cache_salt (vLLM's request field, passed on by our scheduler):
        requests of different salts never share a cached prefix (runtime/prefix.py)."""
        salt = self._salts.get(rid)
        return req if salt is None else dataclasses.replace(req, cache_salt=salt)

    def _prefix_hits(self, out: ModelRunnerOutput) -> None:
        """Each request admitted in this step: its prompt tokens and those our prefix cache
        found (`Sequence.cached`), read by DFlashScheduler for vLLM's counters and the answer's
        cached_tokens; nothing when caching is off (vLLM's counters stay 0, as in vLLM)."""
        admitted, self._admitted = self._admitted, {}
        if self.engine.prefix is not None and admitted:
            out.dflash_prefix = {
                rid: (len(seq.req.ids), seq.cached) for rid, seq in admitted.items()
            }

    def _kv_done(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        if self.kv is not None:  # P/D: the hand-offs pulled since the last step
            out.kv_connector_output = self.kv.finished()
        return out

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        drafts, self._drafts = self._drafts, DraftTokenIds([], [])
        return drafts if drafts.req_ids else None


class VllmMasks(Constraint):
    """A structured request's token bitmasks, as vLLM's grammar computed them for this step:
    row 0 for the token after the committed ones, row i after the first i scheduled drafts
    (which are the draft's proposals). vLLM advances its own matcher with the tokens it
    accepts; nothing here holds grammar state."""

    def __init__(self, words: int):
        super().__init__(None, words)
        self.rows: np.ndarray | None = None

    def set(self, rows: np.ndarray | None) -> None:
        if rows is not None:
            have = rows.shape[1]
            if have < self.words:  # tokens past vLLM's vocabulary are never allowed
                rows = np.pad(rows, ((0, 0), (0, self.words - have)))
            rows = rows[:, : self.words]
        self.rows = rows

    def _rows(self) -> np.ndarray:
        if self.rows is None:
            raise RuntimeError(
                "a structured-output request stepped without vLLM's grammar bitmask: a "
                "dflash-qaic plugin bug"
            )
        return self.rows

    @property
    def terminated(self) -> bool:
        return False  # vLLM ends the request when its grammar ends

    def mask(self, row: np.ndarray) -> None:
        row[:] = self._rows()[0]

    def propose(self, proposals, confidence, masks, fill: bool):
        """Rows 0 … n − 1 from vLLM; proposals past its n − 1 scheduled drafts are cut (their
        rows all ones, never reached: the row before them masks its choice)."""
        rows = self._rows()
        n = min(len(rows), masks.shape[0])
        masks[:n] = rows[:n]
        masks[n:] = -1
        if n - 1 < len(proposals):
            confidence[n - 1 :] = 0.0
            self.cut += len(proposals) - (n - 1)

    def advance(self, tokens) -> None:
        pass
