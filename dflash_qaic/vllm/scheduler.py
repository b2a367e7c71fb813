"""vLLM's scheduler, plus two things: a request whose program call failed ends alone, and our
engine's prefix-cache hits reach vLLM's counters.

vLLM's `ModelRunnerOutput` has no per-request error, and a worker that raises stops vLLM's
whole engine. Our worker (vllm/worker.py) instead reports the failed requests beside its output
(`dflash_failed`: request id -> why), and this scheduler finishes them with vLLM's own error
status (`FINISHED_ERROR`: the client gets an error for that request), after vLLM's usual update
of every other request (docs/DESIGN.md, vLLM platform plugin).

Prefix caching is our engine's (runtime/prefix.py; vLLM's block manager runs with it off, see
vllm/platform.py). Each scheduler output carries its new requests' `cache_salt` (`SALTS`: the
worker gets no `Request`), and the worker reports, per request admitted in the step, its prompt
tokens and the tokens our cache found (`dflash_prefix`). They are recorded as vLLM's own lookup
would record them: `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`, and the request's
prefill stats, which vLLM's answer reads for `usage.prompt_tokens_details.cached_tokens`
(docs/prefix-caching.md, under vLLM).

`reset_prefix_cache` (vLLM's `POST /reset_prefix_cache`) clears our cache: the next scheduler
output carries the reset (`RESET`), and the worker clears the pipeline's cache before it admits
that step's new requests. Requests in flight are untouched: their rows are never in the index.
"""

from __future__ import annotations

import logging

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

log = logging.getLogger("dflash_qaic.vllm")

#: the scheduler output's attribute with its new requests' cache_salt (request id -> salt)
SALTS = "dflash_salts"
#: the scheduler output's attribute, True when our prefix cache is cleared before this step
RESET = "dflash_reset_prefix"


class DFlashScheduler(Scheduler):
    _reset = False  # a prefix-cache reset the worker has not yet been sent

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Our engine's cache is cleared before the next step's admissions, whatever runs (its
        rows in flight are not in the index), so nothing is preempted. vLLM's block manager
        caches nothing here (caching off): its reset only resets the stats."""
        self._reset = True
        super().reset_prefix_cache(False, False)
        return self.reset_connector_cache() if reset_connector else True

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        setattr(out, RESET, self._reset)
        self._reset = False
        salts = {}
        for new in out.scheduled_new_reqs:
            req = self.requests.get(new.req_id)
            if req is not None and req.cache_salt is not None:
                salts[new.req_id] = req.cache_salt
        setattr(out, SALTS, salts)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        self._record_prefix_hits(getattr(model_runner_output, "dflash_prefix", None))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        failed = getattr(model_runner_output, "dflash_failed", None)
        if failed:
            for rid, why in failed.items():
                log.error("request %s failed: %s", rid, why)
            for req in self.finish_requests(failed, RequestStatus.FINISHED_ERROR):
                eco = outputs.get(req.client_index)
                if eco is None:
                    eco = outputs[req.client_index] = EngineCoreOutputs()
                eco.outputs.append(
                    EngineCoreOutput(
                        request_id=req.request_id,
                        new_token_ids=[],
                        finish_reason=req.get_finished_reason(),
                        events=req.take_events(),
                        trace_headers=req.trace_headers,
                    )
                )
        return outputs

    def _record_prefix_hits(self, found: dict | None) -> None:
        """The worker's (prompt tokens, tokens found cached) per admitted request, into vLLM's
        prefix-cache stats and each request's prefill stats (read before vLLM's update takes
        them with the request's first token)."""
        if not found:
            return
        stats = self.kv_cache_manager.prefix_cache_stats  # None when vLLM logs no stats
        for rid, (prompt, hits) in found.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            if stats is not None:
                stats.record(num_tokens=prompt, num_hits=hits, preempted=False)
            pre = req.prefill_stats
            if pre is not None and not pre.num_external_cached_tokens:  # P/D: the connector's
                pre.set(
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_local_cached_tokens=hits,
                    num_external_cached_tokens=0,
                )
