"""vLLM's scheduler, plus one thing: a request whose program call failed ends alone.

vLLM's `ModelRunnerOutput` has no per-request error, and a worker that raises stops vLLM's
whole engine. Our worker (vllm/worker.py) instead reports the failed requests beside its output
(`dflash_failed`: request id -> why), and this scheduler finishes them with vLLM's own error
status (`FINISHED_ERROR`: the client gets an error for that request), after vLLM's usual update
of every other request (docs/DESIGN.md, vLLM platform plugin).
"""

from __future__ import annotations

import logging

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

log = logging.getLogger("dflash_qaic.vllm")


class DFlashScheduler(Scheduler):
    def update_from_output(self, scheduler_output, model_runner_output):
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
