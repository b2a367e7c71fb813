"""dflash-serve's prefill and decode roles (docs/DESIGN.md, Disaggregated prefill), over vLLM's
`kv_transfer_params` contract, so that `vllm-router --vllm-pd-disaggregation --prefill URL
--decode URL` drives them unchanged:

    prefill  (--role prefill) a request with {"do_remote_decode": true} is prefilled up to its
             last prompt token (runtime/handoff.py); the payload waits under a lease and the
             answer's `kv_transfer_params` say where to pull it ({"do_remote_prefill": true,
             "remote_host", "remote_port", "remote_handoff_id", "remote_engine_id", ...})
    decode   (--role decode) a request with those params first checks, once per prefill
             engine, that the prefill server loads the same artifacts (the handshake,
             GET /v1/dflash/kv: its format version and programs' fingerprint), then pulls the
             payload (GET /v1/dflash/kv/{id}, with this server's --api-key, at most
             --kv-max-bytes) in a thread off the event loop and the engine thread; the engine
             admits the request with it
    both     (default) as before; kv_transfer_params asking for a hand-off are refused

Transports (--kv-transport, a prefill server's): http (default) holds the payload in the
prefill server's memory for the pull; shm also offers it in shared memory (a file of
/dev/shm, mode 0600): a decode server on the same host, running as the same user, reads it
there and removes it (its params' `remote_shm`), and one on another host pulls it over HTTP
as before; the handshake is over HTTP either way. A prefill server killed with SIGKILL leaves
its unread files behind (`dflash-kv-*` in /dev/shm).

A lease ends when pulled or after `lease_s` seconds; an unknown or expired lease is a 404 whose
message the decode side passes on. A hand-off that cannot be had (the prefill server
unreachable or gone mid-transfer, the lease ended, other artifacts, a payload over the cap)
fails its request alone with a 502 naming the cause, or, with --fallback-local-prefill, the
decode server prefills the prompt itself. A decode server refuses requests that bring no
hand-off (they would run their prefill between its decoding steps) unless
--fallback-local-prefill.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import re
import time
import uuid
from pathlib import Path

from fastapi import Request, Response

from dflash_qaic.runtime import handoff, transfer
from dflash_qaic.runtime.transfer import KV_PATH, LEASE_S, MAX_PAYLOAD, SHM_PREFIX, Leases
from dflash_qaic.serve.protocol import APIError

log = logging.getLogger("dflash_qaic.serve.pd")

__all__ = ["KV_PATH", "LEASE_S", "MAX_PAYLOAD", "SHM_PREFIX", "Config", "Leases", "setup"]

ROLES = ("both", "prefill", "decode")
TRANSPORTS = ("http", "shm")
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"dflash-kv-h[0-9]+-[0-9a-f]{12}")


@dataclasses.dataclass(frozen=True)
class Config:
    """A server's P/D settings (dflash-serve --role, --fallback-local-prefill, --kv-max-bytes)."""

    role: str = "both"
    fallback_local_prefill: bool = False
    max_bytes: int = MAX_PAYLOAD
    lease_s: float = LEASE_S
    transport: str = "http"  # a prefill server's: "shm" also offers shared memory (one host)
    shm_dir: str = SHM_DIR

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r}: one of {', '.join(ROLES)}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--kv-transport {self.transport!r}: one of {', '.join(TRANSPORTS)}")
        if self.transport == "shm" and not os.path.isdir(self.shm_dir):
            raise ValueError(
                f"--kv-transport shm needs the shared-memory directory {self.shm_dir} (a tmpfs, "
                "as Linux's /dev/shm): use --kv-transport http on this host"
            )
        if self.max_bytes < 1:
            raise ValueError(f"--kv-max-bytes must be ≥ 1 (got {self.max_bytes})")


def setup(app, engine, api_key: str | None, cfg: Config) -> None:
    """The app's P/D state; a prefill server's routes (behind the app's --api-key):
    GET /v1/dflash/kv (the handshake) and GET /v1/dflash/kv/{id} (a payload, its lease ends)."""
    app.state.pd, app.state.role, app.state.api_key = cfg, cfg.role, api_key
    shm = cfg.shm_dir if cfg.role == "prefill" and cfg.transport == "shm" else None
    app.state.leases = Leases(cfg.lease_s, shm_dir=shm)
    atexit.register(app.state.leases.close)  # shared-memory files go with the server
    app.state.engine_id = f"dflash-{uuid.uuid4().hex[:16]}"
    app.state.fingerprint = handoff.fingerprint(engine.pipe.artifacts)
    app.state.handshaken = set()  # decode side: prefill engines whose handshake passed
    engine.metrics.pd_role(cfg.role)
    if cfg.role != "prefill":
        return

    async def hello():
        return transfer.hello(app.state.engine_id, app.state.fingerprint)

    async def pull(key: str):
        payload = app.state.leases.take(key)
        if payload is None:
            raise APIError(f"hand-off {key!r} is unknown or its lease expired", 404)
        return Response(payload, media_type="application/octet-stream")

    app.add_api_route(KV_PATH, hello, methods=["GET"])
    app.add_api_route(KV_PATH + "/{key}", pull, methods=["GET"])


def fetch(app, kv: dict) -> tuple[bytes, str]:
    """A decode server's hand-off: the handshake (once per prefill engine), then the payload
    and the transport it came by ("shm" or "http"); runtime/transfer.py."""
    st = app.state
    try:
        return transfer.fetch(
            kv,
            st.api_key,
            st.fingerprint,
            st.handshaken,
            st.pd.max_bytes,
            lambda key: _from_shm(kv.get("remote_shm"), key, st.pd),
        )
    except transfer.TransferError as e:
        raise APIError(str(e), e.status, e.param) from e


def _from_shm(name, key: str, cfg: Config) -> bytes | None:
    """The payload from shared memory when the prefill server offered it and it is on this
    host (its file in this server's shm_dir); None otherwise (then it is pulled over HTTP)."""
    if not isinstance(name, str) or not _SHM_NAME.fullmatch(name) or name != SHM_PREFIX + key:
        return None
    path = Path(cfg.shm_dir) / name
    try:
        if path.stat().st_size > cfg.max_bytes:
            raise APIError(
                f"the hand-off payload of {path.stat().st_size} bytes exceeds --kv-max-bytes "
                f"{cfg.max_bytes}",
                502,
            )
    except FileNotFoundError:
        return None  # another host's, or its lease ended: HTTP says which
    try:
        return transfer.take_file(path)
    except PermissionError:
        return None  # another user's: the lease's GET reads it for us


async def prepare(fe, request: Request, req, params, ids: list[int]):
    """`params` with the request's hand-off: export only (a prefill role's do_remote_decode),
    or the pulled payload, checked against these artifacts and the prompt `ids` (a decode
    role's do_remote_prefill); the pull and the check run off the event loop and the engine
    thread, which then only writes the rows."""
    kv = req.kv_transfer_params or {}
    app = request.app
    cfg: Config = app.state.pd
    if kv.get("do_remote_decode"):
        _need_role(cfg, "prefill", "do_remote_decode")
        if getattr(req, "stream", False):
            raise APIError(
                "do_remote_decode answers with kv_transfer_params in one body: set stream false",
                param="stream",
            )
        return dataclasses.replace(params, export_only=True)
    if kv.get("do_remote_prefill"):
        _need_role(cfg, "decode", "do_remote_prefill")
        t0 = time.monotonic()
        try:
            payload, transport = await asyncio.to_thread(fetch, app, kv)
            state = await asyncio.to_thread(_checked, fe, ids, payload)
        except APIError as e:
            if not cfg.fallback_local_prefill or e.status != 502:
                raise
            log.warning("hand-off failed, prefilling locally (--fallback-local-prefill): %s", e)
            fe.engine.metrics.kv_fallback()
            return params
        fe.engine.metrics.kv_pulled(len(payload), time.monotonic() - t0, transport)
        return dataclasses.replace(params, handoff=state)
    if cfg.role == "decode" and not cfg.fallback_local_prefill:
        raise APIError(
            "this server runs --role decode: a request needs the kv_transfer_params of a "
            "prefill server's answer (send it through vllm-router --vllm-pd-disaggregation), "
            "or start it with --fallback-local-prefill to prefill requests that bring none",
            param="kv_transfer_params",
        )
    return params


def _checked(fe, ids: list[int], payload: bytes):
    """The payload's slot state for this prompt (a 502 naming what differs)."""
    try:
        return handoff.parse(fe.engine.pipe.artifacts, ids, payload)
    except handoff.HandoffError as e:
        raise APIError(f"the hand-off payload was refused: {e}", 502) from e


def _need_role(cfg: Config, role: str, what: str) -> None:
    if cfg.role != role:
        raise APIError(
            f"{what} needs a server started with --role {role} (this one: {cfg.role})",
            param="kv_transfer_params",
        )


def transfer_params(request: Request, payload: bytes) -> dict:
    """The prefill answer's kv_transfer_params: where the decode side pulls `payload`."""
    app = request.app
    cap = app.state.pd.max_bytes
    if len(payload) > cap:
        raise APIError(
            f"the hand-off payload of {len(payload)} bytes exceeds --kv-max-bytes {cap}: "
            "raise it on both servers or send shorter prompts",
            413,
        )
    host, port = request.scope.get("server") or ("127.0.0.1", 0)
    key = app.state.leases.put(payload)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": host,
        "remote_port": port,
        "remote_handoff_id": key,
        "remote_engine_id": app.state.engine_id,
        "remote_block_ids": None,
        "payload_bytes": len(payload),
        **({"remote_shm": SHM_PREFIX + key} if app.state.leases.shm_dir else {}),
    }
