"""The hand-off's transfer (docs/DESIGN.md, Disaggregated prefill): where a prefill side keeps
its payloads until a decode side pulls them, and the decode side's pull over HTTP. Both P/D
front ends use it: dflash-serve's roles (serve/pd.py) and the vLLM connector
(vllm/connector.py).

    prefill   Leases: payload -> key, held until taken or `lease_s` passed; in memory, or
              (shm_dir) in a mode-0600 file of a tmpfs that a decode side on the same host
              reads and removes itself
    decode    handshake(base, ...) once per prefill engine: GET base/v1/dflash/kv answers
              {"version", "engine_id", "fingerprint"} and must match this side's; then
              pull(base, key, ...) = GET base/v1/dflash/kv/{key}, at most max_bytes, whole

Every failure of the transfer is a TransferError naming its cause (status 502: the prefill
side could not give the payload); the front ends turn it into their own error.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from dflash_qaic.runtime import handoff

LEASE_S = 60.0
MAX_PAYLOAD = 1 << 30  # bytes one hand-off may take (--kv-max-bytes)
PULL_TIMEOUT_S = 30.0
KV_PATH = "/v1/dflash/kv"
SHM_PREFIX = "dflash-kv-"


class TransferError(RuntimeError):
    """The payload could not be had from the prefill side (`status`: the HTTP status a server
    answers its request with)."""

    def __init__(self, message: str, status: int = 502, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class Leases:
    """Payloads waiting for their decode side: id -> (bytes, deadline), swept on each use.
    shm_dir (the shared-memory transport): each payload lives in a file `dflash-kv-{id}` of
    that tmpfs directory instead of this process's memory (mode 0600), which a decode server
    on the same host reads and removes itself; the lease then holds only the path."""

    def __init__(self, lease_s: float = LEASE_S, clock=time.monotonic, shm_dir=None):
        self.lease_s, self._clock, self.shm_dir = lease_s, clock, shm_dir
        self._lock, self._ids = threading.Lock(), itertools.count()
        self._held: dict[str, tuple[bytes | Path, float]] = {}
        self._tag = uuid.uuid4().hex[:12]

    def put(self, payload: bytes, key: str | None = None) -> str:
        """Hold `payload` under `key` (a new key unless given); returns the key."""
        with self._lock:
            self._sweep()
            key = f"h{next(self._ids)}-{self._tag}" if key is None else key
            held: bytes | Path = payload
            if self.shm_dir is not None:
                held = Path(self.shm_dir) / f"{SHM_PREFIX}{key}"
                fd = os.open(held, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(payload)
            self._held[key] = (held, self._clock() + self.lease_s)
            return key

    def take(self, key: str) -> bytes | None:
        """The payload under `key`, its lease ended; None when unknown, expired or (shared
        memory) already read by a decode server on this host."""
        with self._lock:
            self._sweep()
            held = self._held.pop(key, None)
        if held is None or isinstance(held[0], bytes):
            return None if held is None else held[0]
        return take_file(held[0])

    def __len__(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._held)

    def close(self) -> None:
        """Every lease ended (the server stops): shared-memory files removed."""
        with self._lock:
            for held, _ in self._held.values():
                if isinstance(held, Path):
                    held.unlink(missing_ok=True)
            self._held.clear()

    def _sweep(self) -> None:
        now = self._clock()
        for k in [k for k, (_, t) in self._held.items() if t <= now]:
            held = self._held.pop(k)[0]
            if isinstance(held, Path):
                held.unlink(missing_ok=True)


def take_file(path: Path) -> bytes | None:
    """A shared-memory payload's bytes, the file removed (None when gone already)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    path.unlink(missing_ok=True)
    return data


def hello(engine_id: str, fingerprint: dict) -> dict:
    """A prefill side's answer to the handshake (GET /v1/dflash/kv)."""
    return {"version": handoff.VERSION, "engine_id": engine_id, "fingerprint": fingerprint}


def open_url(url: str, api_key: str | None):
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # direct
    try:
        return opener.open(urllib.request.Request(url, headers=headers), timeout=PULL_TIMEOUT_S)
    except urllib.error.HTTPError as e:
        detail = e.read(2000).decode("utf-8", "replace")
        raise TransferError(f"the prefill server refused the hand-off ({e.code}): {detail}") from e
    except (OSError, urllib.error.URLError, http.client.HTTPException) as e:
        raise TransferError(f"the prefill server at {url} is unreachable: {e}") from e


def read_body(resp, url: str, max_bytes: int) -> bytes:
    """The body of `resp`, at most max_bytes (refused from its Content-Length when it says
    more), whole (a server gone mid-body is an error, not a short payload)."""
    size = resp.headers.get("Content-Length")
    if size is not None and int(size) > max_bytes:
        raise TransferError(
            f"the hand-off payload of {size} bytes exceeds --kv-max-bytes {max_bytes}"
        )
    try:
        data = resp.read(max_bytes + 1)
    except (OSError, http.client.HTTPException) as e:
        raise TransferError(f"the prefill server at {url} ended the transfer early: {e}") from e
    if len(data) > max_bytes:
        raise TransferError(f"the hand-off payload exceeds --kv-max-bytes {max_bytes}")
    if size is not None and len(data) != int(size):
        raise TransferError(
            f"the prefill server at {url} ended the transfer early ({len(data)} of {size} bytes)"
        )
    return data


def handshake(base: str, api_key: str | None, mine: dict, engine_id) -> None:
    """The first contact with a prefill engine: refused (naming what differs) unless it reads
    the same payload version and loads the same programs and state specs."""
    with open_url(base + KV_PATH, api_key) as r:
        try:
            answer = json.loads(read_body(r, base, 1 << 20))
        except ValueError as e:
            raise TransferError(f"{base} answered the hand-off handshake with no JSON") from e
    if answer.get("version") != handoff.VERSION:
        raise TransferError(
            f"the prefill server at {base} writes hand-off version {answer.get('version')!r}; "
            f"this decode server reads version {handoff.VERSION}: run the same dflash-qaic"
        )
    theirs = answer.get("fingerprint") or {}
    differ = [k for k in mine if theirs.get(k) != mine[k]]
    if differ:
        raise TransferError(
            f"the prefill server at {base} loads other artifacts ({', '.join(differ)} differ): "
            "prefill and decode must load the same artifacts directory (same export)"
        )
    if engine_id is not None and answer.get("engine_id") != engine_id:
        raise TransferError(f"{base} is no longer the prefill engine {engine_id} (restarted?)")


def fetch(kv: dict, api_key, mine: dict, handshaken: set, max_bytes: int, local=None):
    """A decode side's hand-off for the params `kv` of a prefill answer: the handshake once
    per prefill engine (remembered in `handshaken`), then the payload and the transport it
    came by: `local(key)` first when given ("shm": its bytes, or None), else over HTTP."""
    host, port, key = kv.get("remote_host"), kv.get("remote_port"), kv.get("remote_handoff_id")
    if not (isinstance(host, str) and isinstance(port, int) and isinstance(key, str)):
        raise TransferError(
            "do_remote_prefill needs remote_host, remote_port and remote_handoff_id (the "
            "prefill answer's kv_transfer_params)",
            400,
            "kv_transfer_params",
        )
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    engine_id = kv.get("remote_engine_id")
    if (base, engine_id) not in handshaken:
        handshake(base, api_key, mine, engine_id)
        handshaken.add((base, engine_id))
    data = local(key) if local is not None else None
    if data is not None:
        return data, "shm"
    with open_url(f"{base}{KV_PATH}/{key}", api_key) as r:
        return read_body(r, base, max_bytes), "http"
