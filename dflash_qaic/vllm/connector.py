"""DFlashQaicConnector: vLLM's KV-connector API over our hand-off, so two `vllm serve` on the
same artifacts split prefill and decode (docs/vllm.md, Prefill/decode; docs/DESIGN.md,
Disaggregated prefill):

    DFLASH_QAIC_VLLM=1 vllm serve ARTIFACTS --kv-transfer-config \\
        '{"kv_connector": "DFlashQaicConnector", "kv_role": "kv_producer", "kv_port": 14579}'
    DFLASH_QAIC_VLLM=1 vllm serve ARTIFACTS --kv-transfer-config \\
        '{"kv_connector": "DFlashQaicConnector", "kv_role": "kv_consumer"}'

and a client (or `vllm-router --vllm-pd-disaggregation`) sends a request to the producer with
`max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true}`, then the same request to
the consumer with the producer answer's `kv_transfer_params`.

One class, two roles (vLLM's): the SCHEDULER side lives in vLLM's scheduler (engine-core
process), the WORKER side in our worker (vllm/worker.py calls `bind`, `add` and `finished`;
vLLM's layer-wise worker hooks never run, as our programs own their caches).

    producer  a request with do_remote_decode: the worker prefills the prompt's first P − 1
              positions into a payload (runtime/handoff.py: the target's rows and the draft's
              context), holds it under a lease keyed by vLLM's request id and admits the
              request with it (the engine computes the last prompt token and the one token
              the producer answers); `request_finished` answers the params that say where to
              pull it. The worker serves the lease on its side channel: an HTTP server on
              host:kv_port (127.0.0.1:14579 unless told) with GET /v1/dflash/kv (the
              handshake) and GET /v1/dflash/kv/{request id} (the payload; the lease ends)
    consumer  a request with do_remote_prefill: `get_num_new_matched_tokens` answers that
              the prompt is cached but its end; the worker pulls the payload
              (runtime/transfer.py: the handshake once per producer engine, at most
              max_bytes) and checks it against these artifacts and the prompt in a thread
              while vLLM holds the request back (an asynchronous load: the other requests
              go on stepping), then admits the request with it instead of prefilling

kv_connector_extra_config: "host" (the side channel's address, bound and advertised: 127.0.0.1
unless told), "max_bytes" (a payload's cap, 1 GiB), "lease_s" (60),
"fallback_local_prefill" (false: a hand-off that cannot be had fails its request alone; true:
the consumer prefills that prompt itself). VLLM_API_KEY (as `vllm serve --api-key` reads it),
when set, guards the side channel and is sent by the consumer's pull: both servers need it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from dflash_qaic.runtime import handoff, transfer
from dflash_qaic.vllm.platform import CONNECTOR as NAME

log = logging.getLogger("dflash_qaic.vllm")

JSON = "application/json"
EXTRA = ("host", "max_bytes", "lease_s", "fallback_local_prefill")


@dataclasses.dataclass
class DFlashMeta(KVConnectorMetadata):
    """One step's work for the worker: request id -> the consumer's kv_transfer_params and
    prompt ids to pull for (load; those in `background` are pulled off the step while vLLM
    holds the request in WAITING_FOR_REMOTE_KVS, the others in the step that schedules them),
    and the producer's request ids to export (export)."""

    load: dict[str, tuple[dict, list[int]]] = dataclasses.field(default_factory=dict)
    background: set[str] = dataclasses.field(default_factory=set)
    export: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True)
class Options:
    """kv_transfer_config as this connector reads it."""

    producer: bool
    consumer: bool
    host: str
    port: int
    engine_id: str
    max_bytes: int = transfer.MAX_PAYLOAD
    lease_s: float = transfer.LEASE_S
    fallback_local_prefill: bool = False

    @classmethod
    def of(cls, vllm_config) -> Options:
        c = vllm_config.kv_transfer_config
        extra = dict(c.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(EXTRA))
        if unknown:
            raise ValueError(
                f"{NAME}: unknown kv_connector_extra_config keys {unknown}; it reads "
                f"{', '.join(EXTRA)}"
            )
        opts = cls(
            producer=bool(c.is_kv_producer),
            consumer=bool(c.is_kv_consumer),
            host=str(extra.get("host", "127.0.0.1")),
            port=int(c.kv_port),
            engine_id=str(c.engine_id),
            max_bytes=int(extra.get("max_bytes", transfer.MAX_PAYLOAD)),
            lease_s=float(extra.get("lease_s", transfer.LEASE_S)),
            fallback_local_prefill=bool(extra.get("fallback_local_prefill", False)),
        )
        if opts.max_bytes < 1 or opts.lease_s <= 0:
            raise ValueError(f"{NAME}: max_bytes and lease_s must be > 0 (got {extra})")
        return opts


class DFlashQaicConnector(KVConnectorBase_V1):
    """vLLM's KV connector over dflash-qaic's hand-off (module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.opts = Options.of(vllm_config)
        self._meta = DFlashMeta()
        self._loading: set[str] = set()  # scheduler: requests waiting for their pull
        self.side: SideChannel | None = None  # the worker's, once it has its engine
        self.puller: Puller | None = None

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """For a consumer's request that brings a prefill answer's params: the payload's
        positions but one (P − 2), so that vLLM schedules the last two prompt tokens as a
        prefill step, as in the aggregated run (scheduled with one token, vLLM would pad the
        step with placeholder drafts, and its spec-decode counters would count a rejected
        draft the aggregated run never had). Our worker admits the request with the whole
        payload (P − 1 positions) either way and computes the last prompt token. The load is
        asynchronous (vLLM schedules the request once the worker reports the pull done) when
        it names any position; a prompt of 1 or 2 tokens is pulled in its step."""
        kv = request.kv_transfer_params or {}
        if not (self.opts.consumer and kv.get("do_remote_prefill")):
            return 0, False
        n = max(request.num_prompt_tokens - 2 - num_computed_tokens, 0)
        return n, n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        kv, rid = request.kv_transfer_params or {}, request.request_id
        if self.opts.consumer and kv.get("do_remote_prefill"):
            if rid in self._loading:  # vLLM's second call, after the load: nothing to do
                self._loading.discard(rid)
                return
            self._meta.load[rid] = (dict(kv), list(request.prompt_token_ids))
            if num_external_tokens > 0:
                self._meta.background.add(rid)
                self._loading.add(rid)
        elif self.opts.producer and kv.get("do_remote_decode"):
            self._meta.export.add(rid)

    def build_connector_meta(self, scheduler_output) -> DFlashMeta:
        meta, self._meta = self._meta, DFlashMeta()
        return meta

    def request_finished(self, request, block_ids):
        """The producer's answer params: where the consumer pulls this request's payload (none
        for a request that failed or was aborted, whose payload was never made or is gone)."""
        self._loading.discard(request.request_id)
        kv = request.kv_transfer_params or {}
        ok = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        )
        if not (self.opts.producer and kv.get("do_remote_decode") and ok):
            return False, None
        return False, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_host": self.opts.host,
            "remote_port": self.opts.port,
            "remote_handoff_id": request.request_id,
            "remote_engine_id": self.opts.engine_id,
            "remote_block_ids": None,
        }

    # ------------------------------------------------------------------ worker side

    def attach(self, pipe) -> None:
        """The worker's engine is loaded: a producer opens its side channel, a consumer its
        puller (both check payloads against these artifacts)."""
        m = pipe.artifacts
        api_key = os.environ.get("VLLM_API_KEY") or None
        if self.opts.producer:
            self.side = SideChannel(self.opts, handoff.fingerprint(m), api_key)
        if self.opts.consumer:
            self.puller = Puller(self.opts, m, api_key)

    def bind(self, so) -> None:
        """A step's scheduler output: its metadata bound; the background pulls it asks for
        started, and those of requests that ended forgotten once done."""
        meta = so.kv_connector_metadata
        self.bind_connector_metadata(meta)
        if self.puller is not None and isinstance(meta, DFlashMeta):
            self.puller.begin(meta, so.finished_req_ids)

    def finished(self) -> KVConnectorOutput | None:
        """The background pulls done since the last step (vLLM's finished_recving: it then
        schedules those requests)."""
        done = self.puller.done() if self.puller is not None else None
        return KVConnectorOutput(finished_recving=done) if done else None

    def add(self, engine, manifest, req, rid: str):
        """`req` onto `engine` as this step's metadata says: admitted with its pulled payload
        (consumer), exported then admitted with its own payload (producer), or added."""
        meta = self._connector_metadata
        if self.puller is not None and self.puller.expects(rid, meta):
            try:
                state = self.puller.state(rid, meta)
            except (transfer.TransferError, handoff.HandoffError) as e:
                if not self.opts.fallback_local_prefill:
                    raise RuntimeError(f"the hand-off of request {rid} failed: {e}") from e
                log.warning("request %s: hand-off failed, prefilling locally: %s", rid, e)
                return engine.add(req)
            return handoff.admit(engine, manifest, req, state)
        if isinstance(meta, DFlashMeta) and rid in meta.export and self.side is not None:
            payload = handoff.export(engine, manifest, req.ids)
            self.side.hold(rid, payload)
            return handoff.admit(engine, manifest, req, payload)
        return engine.add(req)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass  # our worker loads in `add`; vLLM's layer hooks never run here

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.puller is not None:
            self.puller.pool.shutdown(wait=False, cancel_futures=True)
        if self.side is not None:
            self.side.close()
            self.side = None


def for_worker(vllm_config, pipe) -> DFlashQaicConnector | None:
    """The worker side of the configured connector, attached to the worker's `pipe` (None
    without --kv-transfer-config); another connector is refused, as its worker hooks would
    never run over our programs."""
    c = vllm_config.kv_transfer_config
    if c is None or c.kv_connector is None:
        return None
    if c.kv_connector != NAME:
        raise ValueError(
            f"--kv-transfer-config names the connector {c.kv_connector!r}: the dflash-qaic "
            f"plugin's programs keep their own caches, so it moves them with {NAME!r} only"
        )
    conn = DFlashQaicConnector(vllm_config, KVConnectorRole.WORKER, None)
    conn.attach(pipe)
    return conn


class Puller:
    """A consumer's pulls (runtime/transfer.py), each checked against the artifacts and the
    request's prompt: in a thread pool while vLLM waits for them (`begin`, `done`), or in the
    step (a prompt of 1 or 2 tokens)."""

    def __init__(self, opts: Options, manifest, api_key: str | None):
        self.opts, self.manifest, self.api_key = opts, manifest, api_key
        self.fingerprint = handoff.fingerprint(manifest)
        self.handshaken: set = set()
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="dflash-kv")
        self.pulls: dict[str, concurrent.futures.Future] = {}
        self.reported: set[str] = set()  # done, told to vLLM, not yet admitted
        self.dropped: set[str] = set()  # ended before admission: forgotten once done

    def pull(self, kv: dict, ids: list[int]):
        payload, _ = transfer.fetch(
            kv, self.api_key, self.fingerprint, self.handshaken, self.opts.max_bytes
        )
        return handoff.parse(self.manifest, ids, payload)

    def begin(self, meta: DFlashMeta, ended) -> None:
        self.dropped.update(rid for rid in ended if rid in self.pulls)
        for rid in meta.background:
            self.pulls[rid] = self.pool.submit(self.pull, *meta.load[rid])

    def done(self) -> set[str]:
        done = {r for r, f in self.pulls.items() if f.done() and r not in self.reported}
        self.reported |= done
        for rid in self.dropped & self.reported:
            self.pulls.pop(rid)
            self.reported.discard(rid)
            self.dropped.discard(rid)
        return done

    def expects(self, rid: str, meta) -> bool:
        return rid in self.pulls or (isinstance(meta, DFlashMeta) and rid in meta.load)

    def state(self, rid: str, meta):
        """The request's checked payload state (raising why it cannot be had)."""
        future = self.pulls.pop(rid, None)
        if future is None:
            return self.pull(*meta.load[rid])
        self.reported.discard(rid)
        return future.result()


class SideChannel:
    """A producer's payloads under leases, served over HTTP on opts.host:opts.port from a
    thread of the worker (transfer.Leases; vLLM's request id names each)."""

    def __init__(self, opts: Options, fingerprint: dict, api_key: str | None):
        self.leases = transfer.Leases(opts.lease_s)  # keyed by vLLM's request id
        self.cap = opts.max_bytes
        self.hello = transfer.hello(opts.engine_id, fingerprint)
        self.api_key = api_key
        try:
            self.server = ThreadingHTTPServer((opts.host, opts.port), _handler(self))
        except OSError as e:
            raise RuntimeError(
                f"{NAME}: the side channel cannot listen on {opts.host}:{opts.port} ({e}): "
                'give the producer a free "kv_port" in --kv-transfer-config'
            ) from e
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="dflash-kv", daemon=True).start()

    def hold(self, rid: str, payload: bytes) -> None:
        if len(payload) > self.cap:
            raise RuntimeError(
                f"the hand-off payload of {len(payload)} bytes exceeds max_bytes {self.cap}: "
                "raise it in kv_connector_extra_config on both servers"
            )
        self.leases.put(payload, rid)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.leases.close()


def _handler(side: SideChannel):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            self._send(status, json.dumps({"error": {"message": message}}).encode(), JSON)

        def do_GET(self) -> None:
            if side.api_key and self.headers.get("Authorization") != f"Bearer {side.api_key}":
                return self._error(401, "the side channel needs this server's VLLM_API_KEY")
            path = self.path.split("?", 1)[0]
            if path == transfer.KV_PATH:
                return self._send(200, json.dumps(side.hello).encode(), JSON)
            key = urllib.parse.unquote(path.removeprefix(transfer.KV_PATH + "/"))
            if not path.startswith(transfer.KV_PATH + "/"):
                return self._error(404, f"no such path {path!r}")
            payload = side.leases.take(key)
            if payload is None:
                return self._error(404, f"hand-off {key!r} is unknown or its lease expired")
            self._send(200, payload, "application/octet-stream")

    return Handler
