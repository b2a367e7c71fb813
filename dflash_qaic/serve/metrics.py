"""Prometheus metrics with vLLM's names (`/metrics`).

Speculative decoding, per verify step (a step that verified v rows and committed n tokens
accepted n − 1 of its v − 1 drafts; v is B unless the step verified a shorter head of the block,
runtime/engine.py; the first token of a request comes from prefill and belongs to no step):

    vllm:spec_decode_num_drafts_total                  steps
    vllm:spec_decode_num_draft_tokens_total            Σ (v − 1)
    vllm:spec_decode_num_accepted_tokens_total         Σ (n − 1)
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}   steps whose draft i was accepted
    dflash:spec_policy_steps_total{path="draft"|"decode"}  steps by the step policy's choice

A step the step policy decoded (`--spec-policy`, runtime/policy.py: one row, no draft) counts
under path="decode" and in none of the vllm:spec_decode series; every other step is a draft.

Requests: `vllm:request_success_total{finished_reason="stop"|"length"|"abort"}` (abort: the client
went away or the server shut down), `dflash:request_errors_total{status=...}` (requests answered
with an error), `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, the gauges
`vllm:num_requests_running` (sequences in the engine's slots) / `vllm:num_requests_waiting`
(queued for a slot), `dflash:num_requests_running_max` (the most sequences in slots at once since
the server started: > 1 only when requests really ran together), and the histograms
`vllm:time_to_first_token_seconds`, `vllm:time_per_output_token_seconds` (per request: decode time
over tokens after the first), `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`.

vLLM's current names beside those: `vllm:inter_token_latency_seconds` (as vLLM measures it: the
time between two successive outputs of a request, one observation per step; a DFlash step
commits 1 … B tokens at once, so this is the step latency a client sees, while the older
`time_per_output_token` above is a request's decode time per token), `vllm:kv_cache_usage_perc`
(a gauge in [0, 1]: the positions the sequences in the slots hold, prompt + output, over slots ×
ctx_len, updated every step), and the histogram `vllm:iteration_tokens_total` (tokens per engine
step: the tokens the step committed plus the prompt tokens of the sequences whose prefill it
finished).
Prefix caching (runtime/prefix.py): `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total`
(prompt tokens asked for and found cached, as vLLM counts them) and the gauge
`dflash:prefix_cache_host_bytes` (the host tier's bytes, never above `--kv-offloading-size`).
`dflash:device_info{backend, target_device_ids, draft_device_ids}` (value 1) says where this
replica's programs run (`--device-ids`; empty on ONNX Runtime without them), so replicas behind a
router are told apart (docs/DESIGN.md, Replicas).
Every series carries `model_name`. The registry is the server's own (not the process-global one).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (re-exported)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
_LATENCY += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_TPOT = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class Metrics:
    def __init__(self, model_name: str, block_size: int):
        self.registry = r = CollectorRegistry()
        self.drafts_per_step = block_size - 1
        m = ["model_name"]

        def counter(name, doc, labels=()):
            return Counter(name, doc, m + list(labels), registry=r)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self._drafts = counter("vllm:spec_decode_num_drafts", "Verify steps").labels(model_name)
        self._draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed"
        ).labels(model_name)
        self._accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted"
        ).labels(model_name)
        per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Steps whose draft token at this position was accepted",
            ["position"],
        )
        self._per_pos = [per_pos.labels(model_name, str(i)) for i in range(block_size - 1)]
        path = counter("dflash:spec_policy_steps", "Steps by the step policy's path", ["path"])
        self._paths = {k: path.labels(model_name, k) for k in ("draft", "decode")}
        success = counter("vllm:request_success", "Finished requests", ["finished_reason"])
        self._success = {k: success.labels(model_name, k) for k in ("stop", "length", "abort")}
        self._errors = counter(
            "dflash:request_errors", "Requests answered with an error", ["status"]
        )
        self._model = model_name
        self._prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens").labels(model_name)
        self._generation_tokens = counter("vllm:generation_tokens", "Generated tokens").labels(
            model_name
        )
        gauge = lambda name, doc: Gauge(name, doc, m, registry=r).labels(model_name)
        self.running = gauge("vllm:num_requests_running", "Requests generating")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests queued")
        self.running_max = gauge(
            "dflash:num_requests_running_max", "The most requests generating at once"
        )
        self._most = 0
        self._ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", _LATENCY)
        self._tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token", _TPOT)
        self._e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency", _LATENCY)
        self._queue = histogram("vllm:request_queue_time_seconds", "Time queued", _LATENCY)
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between successive outputs of a request (one per step)",
            _TPOT,
        )
        self.kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every slot's context is full"
        )
        kv = {  # prefill/decode hand-offs (serve/pd.py)
            "bytes": ("dflash:kv_transfer_bytes", "Hand-off payload bytes exported (prefill)"),
            "pulled": ("dflash:kv_transfer_received_bytes", "Hand-off bytes pulled (decode)"),
            "fallback": (
                "dflash:kv_transfer_fallbacks",
                "Hand-offs that failed and were prefilled locally (--fallback-local-prefill)",
            ),
        }
        self._kv = {k: counter(*v).labels(model_name) for k, v in kv.items()}
        pull = Histogram(
            "dflash:kv_transfer_seconds",
            "Time to pull one hand-off payload, handshake included (decode role)",
            [*m, "transport"],
            buckets=_LATENCY,
            registry=r,
        )
        self._kv_pull = {t: pull.labels(model_name, t) for t in ("http", "shm")}
        self._cache_queries, self._cache_hits = (
            counter(f"vllm:prefix_cache_{name}", f"Prompt tokens {what} the prefix cache").labels(
                model_name
            )
            for name, what in (("queries", "looked up in"), ("hits", "found in"))
        )
        self.prefix_host_bytes = gauge(
            "dflash:prefix_cache_host_bytes", "Bytes held by the prefix cache's host tier"
        )
        self._iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step", _ITERATION
        )

    def prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        self._cache_queries.inc(prompt_tokens)
        self._cache_hits.inc(cached_tokens)

    def kv_transfer(self, nbytes: int) -> None:
        self._kv["bytes"].inc(nbytes)

    def kv_pulled(self, nbytes: int, seconds: float, transport: str) -> None:
        self._kv["pulled"].inc(nbytes)
        self._kv_pull[transport].observe(seconds)

    def kv_fallback(self) -> None:
        self._kv["fallback"].inc()

    def pd_role(self, role: str) -> None:
        """The server's --role (serve/pd.py): dflash:role_info{role=...} 1."""
        info = Gauge("dflash:role_info", "This server's P/D role", ["model_name", "role"],
                     registry=self.registry)  # fmt: skip
        info.labels(self._model, role).set(1)

    def running_now(self, n: int) -> None:
        """`n` sequences are in the engine's slots."""
        self.running.set(n)
        if n > self._most:
            self._most = n
            self.running_max.set(n)

    def step(self, committed: int, verified: int | None = None) -> None:
        """One verify step of `verified` rows (None: B) that committed `committed` tokens; one
        row is a step that decoded."""
        if verified == 1:
            self._paths["decode"].inc()
            return
        self._paths["draft"].inc()
        accepted = committed - 1
        self._drafts.inc()
        self._draft_tokens.inc(self.drafts_per_step if verified is None else verified - 1)
        self._accepted.inc(accepted)
        for c in self._per_pos[:accepted]:
            c.inc()

    def finished(self, reason, prompt_tokens, tokens, queue_s, ttft_s, decode_s, e2e_s) -> None:
        self._success[reason].inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(tokens)
        self._queue.observe(queue_s)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        if tokens > 1:
            self._tpot.observe(decode_s / (tokens - 1))
        self._e2e.observe(e2e_s)

    def output_interval(self, seconds: float) -> None:
        """A request's output came `seconds` after its previous one."""
        self._itl.observe(seconds)

    def iteration(self, tokens: int) -> None:
        """One engine step that committed and prefilled `tokens` tokens in all."""
        self._iteration_tokens.observe(tokens)

    def device_info(self, backend: str, placement) -> None:
        """Where the programs run: `placement` (runtime.devices.Placement, or None: unplaced)."""
        ids = lambda d: ",".join(map(str, d))  # noqa: E731
        labels = ["model_name", "backend", "target_device_ids", "draft_device_ids"]
        info = Gauge("dflash:device_info", "Where the programs run", labels, registry=self.registry)
        where = ("", "") if placement is None else (ids(placement.target), ids(placement.draft))
        info.labels(self._model, backend, *where).set(1)

    def error(self, status: int) -> None:
        self._errors.labels(self._model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
