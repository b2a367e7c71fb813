"""dflash-serve's prefill and decode roles (docs/DESIGN.md, Disaggregated prefill), over vLLM's
`kv_transfer_params` contract:

    prefill  (--role prefill) a request with {"do_remote_decode": true} is prefilled up to its
             last prompt token (runtime/handoff.py); the payload waits under a lease and the
             answer's `kv_transfer_params` say where to pull it ({"do_remote_prefill": true,
             "remote_host", "remote_port", "remote_handoff_id", ...})
    decode   (--role decode) a request with those params pulls the payload over HTTP from the
             prefill server (GET /v1/dflash/kv/{id}, with this server's --api-key, bounded
             size) in a thread off the event loop and the engine thread, then the engine
             admits it with the payload
    both     (default) as before; kv_transfer_params asking for a hand-off are refused

A lease ends when pulled or after LEASE_S seconds; an unknown or expired lease is a 404 whose
message the decode side passes on to its client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
import urllib.error
import urllib.request

from fastapi import Request, Response

from dflash_qaic.serve.protocol import APIError

ROLES = ("both", "prefill", "decode")
LEASE_S = 60.0
MAX_PAYLOAD = 1 << 30  # bytes one pull may take
PULL_TIMEOUT_S = 30.0
KV_PATH = "/v1/dflash/kv/"


class Leases:
    """Payloads waiting for their decode side: id -> (bytes, deadline), swept on each use."""

    def __init__(self, lease_s: float = LEASE_S):
        self.lease_s = lease_s
        self._lock, self._ids = threading.Lock(), itertools.count()
        self._held: dict[str, tuple[bytes, float]] = {}

    def put(self, payload: bytes) -> str:
        with self._lock:
            self._sweep()
            key = f"h{next(self._ids)}-{time.monotonic_ns()}"
            self._held[key] = (payload, time.monotonic() + self.lease_s)
            return key

    def take(self, key: str) -> bytes | None:
        """The payload under `key`, its lease ended; None when unknown or expired."""
        with self._lock:
            self._sweep()
            held = self._held.pop(key, None)
        return None if held is None else held[0]

    def __len__(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._held)

    def _sweep(self) -> None:
        now = time.monotonic()
        for k in [k for k, (_, t) in self._held.items() if t < now]:
            del self._held[k]


def add_routes(app, leases: Leases) -> None:
    """GET /v1/dflash/kv/{id}: a prefill server's payloads (behind the app's --api-key)."""

    async def pull(key: str):
        payload = leases.take(key)
        if payload is None:
            raise APIError(f"hand-off {key!r} is unknown or its lease expired", 404)
        return Response(payload, media_type="application/octet-stream")

    app.add_api_route(KV_PATH + "{key}", pull, methods=["GET"])


def _pull(url: str, api_key: str | None, max_bytes: int) -> bytes:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(url, headers=headers)
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # direct
        with opener.open(req, timeout=PULL_TIMEOUT_S) as r:
            data = r.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        detail = e.read(2000).decode("utf-8", "replace")
        raise APIError(f"the prefill server refused the hand-off ({e.code}): {detail}", 502) from e
    except (OSError, urllib.error.URLError) as e:
        raise APIError(f"the prefill server at {url} is unreachable: {e}", 502) from e
    if len(data) > max_bytes:
        raise APIError(f"the hand-off payload exceeds {max_bytes} bytes", 502)
    return data


async def prepare(fe, request: Request, req, params):
    """`params` with the request's hand-off: export only (a prefill role's do_remote_decode),
    or the pulled payload (a decode role's do_remote_prefill)."""
    kv = req.kv_transfer_params or {}
    role = request.app.state.role
    if kv.get("do_remote_decode"):
        if role != "prefill":
            raise APIError(
                f"do_remote_decode needs a server started with --role prefill (this one: {role})",
                param="kv_transfer_params",
            )
        if getattr(req, "stream", False):
            raise APIError(
                "do_remote_decode answers with kv_transfer_params in one body: set stream false",
                param="stream",
            )
        return dataclasses.replace(params, export_only=True)
    if kv.get("do_remote_prefill"):
        if role != "decode":
            raise APIError(
                f"do_remote_prefill needs a server started with --role decode (this one: {role})",
                param="kv_transfer_params",
            )
        host, port, key = kv.get("remote_host"), kv.get("remote_port"), kv.get("remote_handoff_id")
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(key, str)):
            raise APIError(
                "do_remote_prefill needs remote_host, remote_port and remote_handoff_id (the "
                "prefill answer's kv_transfer_params)",
                param="kv_transfer_params",
            )
        url = f"http://{host}:{port}{KV_PATH}{key}"
        api_key = request.app.state.api_key
        payload = await asyncio.to_thread(_pull, url, api_key, MAX_PAYLOAD)
        return dataclasses.replace(params, handoff=payload)
    return params


def transfer_params(request: Request, payload: bytes) -> dict:
    """The prefill answer's kv_transfer_params: where the decode side pulls `payload`."""
    host, port = request.scope.get("server") or ("127.0.0.1", 0)
    key = request.app.state.leases.put(payload)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": host,
        "remote_port": port,
        "remote_handoff_id": key,
        "remote_engine_id": "dflash",
        "remote_block_ids": None,
        "payload_bytes": len(payload),
    }
