"""`dflash-serve-replicas`: one `dflash-serve` per device group, `vllm-router` in front.

    dflash-serve-replicas artifacts/default --device-ids 0 --device-ids 1
    dflash-serve-replicas artifacts/default --prefill-device-ids 0 --decode-device-ids 1
    dflash-serve-replicas ARTIFACTS (--replicas N | --device-ids IDS [--device-ids IDS ...]
                          | --prefill-device-ids IDS [...] --decode-device-ids IDS [...])
                          [--host 127.0.0.1] [--port 8000] [--policy round_robin]
                          [--serve-args "--threads 1 --max-num-seqs 4"] [--router-args "..."]
                          [--router-metrics-port N] [--log-dir DIR] [--startup-timeout S]

Each replica is a `dflash-serve ARTIFACTS --device-ids IDS` on 127.0.0.1 and a free port, with
the --serve-args given (the same for all); `--replicas N` gives replica i the i-th block of as
many consecutive devices as the artifacts' compile profile uses (0, 1, … for a one-SoC profile).
When every replica answers /health, `vllm-router` (the vLLM project's router, `pip install
'dflash-qaic[replicas]'`) starts on --host:--port with the replicas as its workers: health checks
every 2 s, retries, --policy (default round_robin), its Prometheus metrics on 127.0.0.1:
--router-metrics-port (default: a free port); --router-args adds or overrides router flags. The
line "dflash-serve-replicas: routing ... on URL" on stdout says where clients go.

With --prefill-device-ids and --decode-device-ids (each given once per replica) the replicas
are `dflash-serve --role prefill` and `--role decode` servers (xPyD) and the router runs in its
P/D mode (`--vllm-pd-disaggregation --prefill URL ... --decode URL ...`): each request is
prefilled on a prefill replica, whose payload the decode replica pulls (serve/pd.py). The router
sends its own `Authorization: Bearer $OPENAI_API_KEY` upstream in that mode: the launcher sets
it to the replicas' API key.

A replica that exits is started again on its port and devices (the router's health checks take
it back when it answers). SIGTERM or Ctrl-C stops the router, then the replicas (each drains
its requests for its --shutdown-timeout), each by its process id, and exits 0. Logs: one file
per replica and one for the router in --log-dir (default: a new temporary directory).
An API key (VLLM_API_KEY in the environment, or --api-key in --serve-args) is every replica's;
the router passes clients' `Authorization` on. vllm-router's own endpoints (/workers,
/add_worker, /remove_worker) need no key: keep --host on loopback or firewall the port.
docs/DESIGN.md, Replicas; docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_qaic.commands import doc_parser

log = logging.getLogger("dflash_qaic.serve.replicas")

POLICIES = ("round_robin", "power_of_two", "random", "cache_aware", "consistent_hash")
#: dflash-serve flags the launcher sets itself
_OWN_FLAGS = ("--host", "--port", "--device-ids")
#: router flags the launcher sets (after them, --router-args may override any)
ROUTER_DEFAULTS = (
    "--health-check-interval-secs",
    "2",
    "--worker-startup-check-interval",
    "1",
    # a replica's /health is 503 once its engine is gone and its restart is healthy at once: the
    # health checks decide; a circuit breaker would keep a restarted replica out for its timeout
    "--disable-circuit-breaker",
)


class ReplicasError(RuntimeError):
    """The replicas or the router cannot be started as asked."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local: no proxy
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.read() if r.status == 200 else None
    except OSError:
        return None


def router_command() -> list[str]:
    """How to run vllm-router with this interpreter (MissingExtraError when not installed)."""
    from dflash_qaic.extras import require

    require("replicas", "dflash-serve-replicas")
    return [sys.executable, "-m", "vllm_router.launch_router"]


def device_groups(artifacts, replicas: int | None, groups: list[list[int]] | None):
    """One device-id list per replica: `groups` as given, or `replicas` consecutive blocks of
    the devices one replica uses (from the artifacts' compile profile); checked for overlap."""
    if groups:
        if replicas is not None and replicas != len(groups):
            raise ReplicasError(
                f"--replicas {replicas} but {len(groups)} --device-ids: give one --device-ids "
                "per replica, or --replicas alone"
            )
    else:
        if replicas is None:
            raise ReplicasError("give --replicas N, or one --device-ids per replica")
        if replicas < 1:
            raise ReplicasError(f"--replicas must be ≥ 1 (got {replicas})")
        from dflash_qaic.artifacts.manifest import read_manifest
        from dflash_qaic.runtime.devices import profile_placement

        k = len(profile_placement(read_manifest(Path(artifacts), check_files="none")).devices)
        groups = [list(range(i * k, (i + 1) * k)) for i in range(replicas)]
    owner: dict[int, int] = {}
    for i, group in enumerate(groups):
        for d in group:
            if d in owner and owner[d] != i:
                raise ReplicasError(
                    f"device {d} is in the groups of replicas {owner[d]} and {i}: each device "
                    "belongs to one replica (its cores and memory are not shared)"
                )
            owner[d] = i
    return [list(g) for g in groups]


def _url(host: str, port: int) -> str:
    """The URL a local client reaches host:port at (an unspecified address: via loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class Router:
    """vllm-router as a child process on host:port over `workers` (urls); given `decode` urls,
    in its P/D mode (`--vllm-pd-disaggregation`): `workers` are then the prefill servers.
    api_key: what the router sends upstream (in P/D mode it sends `Authorization: Bearer
    $OPENAI_API_KEY` of its own environment, not the client's)."""

    def __init__(
        self, workers, host, port, policy, metrics_port, extra, log_path: Path, decode=None,
        api_key: str | None = None,
    ):  # fmt: skip
        self.argv = [*router_command(), "--host", host, "--port", str(port)]
        if decode:
            self.argv += ["--vllm-pd-disaggregation"]
            self.argv += [a for u in workers for a in ("--prefill", u)]
            self.argv += [a for u in decode for a in ("--decode", u)]
            self.argv += ["--policy", policy]
        else:
            self.argv += ["--worker-urls", *workers, "--policy", policy]
        self.env = {**os.environ, **({"OPENAI_API_KEY": api_key} if api_key else {})}
        self.argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        self.argv += [*ROUTER_DEFAULTS, *extra]
        self.url = _url(host, port)
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.n = len(workers) + len(decode or ())
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        deadline = time.monotonic() + timeout
        while self.healthy_workers() != self.n:
            if self.proc.poll() is not None:
                raise ReplicasError(
                    f"vllm-router exited with {self.proc.returncode}; its log: {self.log_path}\n"
                    + self.log_path.read_text("utf-8", "replace")[-3000:]
                )
            if time.monotonic() > deadline:
                raise ReplicasError(f"vllm-router not ready in {timeout} s; log: {self.log_path}")
            time.sleep(0.2)

    def healthy_workers(self) -> int | None:
        body = _get(self.url + "/readiness")
        if body is None:
            return None
        ready = json.loads(body)  # P/D mode: {"prefill": {"healthy": n, ...}, "decode": ...}
        if "healthy_workers" in ready:
            return ready["healthy_workers"]
        return sum(ready.get(k, {}).get("healthy", 0) for k in ("prefill", "decode"))

    def workers(self) -> dict[str, bool]:
        """The router's workers: url -> healthy (empty when the router does not answer)."""
        body = _get(self.url + "/workers")
        if body is None:
            return {}
        return {w["url"]: bool(w["is_healthy"]) for w in json.loads(body)["workers"]}

    def stop(self, timeout: float = 30.0) -> int | None:
        return _stop(self.proc, timeout)


def _check_roles(roles: list[str] | None, n: int) -> list[str]:
    """One role per replica: all "both", or prefill and decode ones (at least one of each)."""
    roles = list(roles or ["both"] * n)
    if len(roles) != n or not set(roles) <= {"both", "prefill", "decode"}:
        raise ReplicasError(f"give one role (both, prefill or decode) per replica: {roles}")
    if set(roles) != {"both"} and set(roles) != {"prefill", "decode"}:
        raise ReplicasError(
            "prefill/decode replicas need at least one prefill and one decode group "
            "(--prefill-device-ids and --decode-device-ids) and no other replicas"
        )
    return roles


def _api_key(serve_args: list[str]) -> str | None:
    """The replicas' API key: --api-key in their flags, else $VLLM_API_KEY."""
    key = os.environ.get("VLLM_API_KEY")
    for i, flag in enumerate(serve_args):
        if flag == "--api-key" and i + 1 < len(serve_args):
            key = serve_args[i + 1]
        elif flag.startswith("--api-key="):
            key = flag.split("=", 1)[1]
    return key


def _stop(proc: subprocess.Popen | None, timeout: float) -> int | None:
    """SIGTERM the process (by its pid), wait, SIGKILL if it will not go; its exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Replicas:
    """N dflash-serve replicas, each on its device group, behind vllm-router on host:port.

    with Replicas("artifacts/default", [[0], [1]], serve_args=["--threads", "1"]) as r:
        r.url                  # the router: what clients use
        r.replicas[0].url      # replica 0 directly (a ServerProcess)
        r.restart(0)           # start replica 0 again (same port and devices)

    roles: one dflash-serve --role per group ("prefill" | "decode"; default: every one "both"):
    the router then runs in its P/D mode over the prefill and the decode replicas (xPyD).
    """

    def __init__(
        self,
        artifacts,
        groups: list[list[int]],
        *,
        serve_args=(),
        host: str = "127.0.0.1",
        port: int = 0,
        policy: str = "round_robin",
        router_args=(),
        router_metrics_port: int = 0,
        log_dir=None,
        log_level: str = "warning",
        timeout: float = 300.0,
        roles: list[str] | None = None,
    ):
        self.roles = _check_roles(roles, len(groups))
        for flag in serve_args:
            if flag.split("=")[0] in _OWN_FLAGS:
                raise ReplicasError(
                    f"--serve-args may not set {flag.split('=')[0]}: the launcher gives each "
                    "replica its port on 127.0.0.1 and its --device-ids"
                )
        self.artifacts, self.groups = artifacts, groups
        self.serve_args, self.log_level, self.timeout = list(serve_args), log_level, timeout
        self.host, self.port, self.policy = host, port or free_port(host), policy
        self.router_args = list(router_args)
        self.router_metrics_port = router_metrics_port or free_port()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="dflash-serve-replicas-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.replicas: list = [None] * len(groups)
        self.router: Router | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return _url(self.host, self.port)

    def _replica(self, i: int, port: int = 0):
        from dflash_qaic.serve.process import ServerProcess

        args = ["--device-ids", ",".join(map(str, self.groups[i])), "--port", str(port)]
        if self.roles[i] != "both":
            args += ["--role", self.roles[i]]
        return ServerProcess(
            self.artifacts,
            *args,
            *self.serve_args,
            log_level=self.log_level,
            timeout=self.timeout,
            log_path=self.log_dir / f"replica-{i}.log",
        )

    def start(self) -> Replicas:
        try:
            with ThreadPoolExecutor(len(self.groups)) as ex:
                futures = []
                for i in range(len(self.groups)):
                    self.replicas[i] = self._replica(i)
                    futures.append(ex.submit(self.replicas[i].start))
                for f in futures:
                    f.result()  # the first failure, with that replica's log
            urls = {role: [] for role in ("both", "prefill", "decode")}
            for r, role in zip(self.replicas, self.roles):
                urls[role].append(r.url)
            self.router = Router(
                urls["both"] or urls["prefill"],
                self.host,
                self.port,
                self.policy,
                self.router_metrics_port,
                self.router_args,
                self.log_dir / "router.log",
                decode=urls["decode"],
                api_key=_api_key(self.serve_args),
            )
            self.router.start(self.timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, i: int) -> None:
        """Start replica i again on its port and devices (after it exited or was killed), and
        wait until the router counts it healthy."""
        with self._lock:
            old = self.replicas[i]
            old.close()
            port = int(old.url.rsplit(":", 1)[1])
            self.replicas[i] = self._replica(i, port)
            self.replicas[i].start()
        self.wait_routed(i)

    def wait_routed(self, i: int, timeout: float | None = None) -> None:
        """Wait until the router's health checks count replica i healthy (bounded)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self.router.workers().get(self.replicas[i].url):
            if time.monotonic() > deadline:
                raise ReplicasError(f"the router did not take replica {i} back in time")
            time.sleep(0.2)

    def dead(self) -> list[int]:
        """The replicas whose process has exited."""
        return [i for i, r in enumerate(self.replicas) if r.proc.poll() is not None]

    def stop(self) -> None:
        """The router first (no new requests), then every replica (each drains), by pid."""
        if self.router is not None:
            self.router.stop()
        with ThreadPoolExecutor(max(1, len(self.replicas))) as ex:
            list(ex.map(lambda r: r is not None and r.close(), self.replicas))

    def __enter__(self) -> Replicas:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def parser() -> argparse.ArgumentParser:
    from dflash_qaic.runtime import options

    p = doc_parser("dflash-serve-replicas", __doc__)
    p.add_argument("--replicas", type=int, default=None, help="replicas on consecutive devices")
    options.add_arguments(p, "device_ids", repeat=True)
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-device-ids",
            action="append",
            type=options._device_ids,
            default=None,
            help=f"one {role} replica's devices (dflash-serve --role {role}), given once per "
            "replica: prefill/decode disaggregation behind the router's P/D mode",
        )
    p.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port (default 8000)")
    p.add_argument("--policy", default="round_robin", choices=POLICIES, help="vllm-router policy")
    p.add_argument(
        "--serve-args",
        default="",
        help='more dflash-serve flags for every replica, one string: "--threads 1 --max-num-seqs 4"',
    )
    p.add_argument("--router-args", default="", help="more vllm-router flags, one string")
    p.add_argument(
        "--router-metrics-port",
        type=int,
        default=0,
        help="port of the router's Prometheus metrics on 127.0.0.1 (default: a free one)",
    )
    p.add_argument("--log-dir", default=None, help="replica and router logs (default: a temp dir)")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds a replica or the router may take to become healthy (default 600)",
    )
    levels = ["critical", "error", "warning", "info", "debug"]
    p.add_argument("--log-level", default="info", choices=levels, help="replicas' log level")
    return p


def _groups_and_roles(args) -> tuple[list[list[int]], list[str]]:
    """The device groups and their dflash-serve --role: all "both" (--replicas, --device-ids),
    or the prefill groups then the decode groups."""
    pre, dec = args.prefill_device_ids or [], args.decode_device_ids or []
    if not (pre or dec):
        groups = device_groups(args.artifacts, args.replicas, args.device_ids)
        return groups, ["both"] * len(groups)
    if args.replicas is not None or args.device_ids:
        raise ReplicasError(
            "--prefill-device-ids/--decode-device-ids name every replica: leave out "
            "--replicas and --device-ids"
        )
    groups = device_groups(args.artifacts, None, pre + dec)  # checked for overlap
    return groups, ["prefill"] * len(pre) + ["decode"] * len(dec)


def _supervise(reps: Replicas, stopping: threading.Event) -> int:
    """Until SIGTERM/SIGINT: restart replicas that exit; stop when the router exits."""
    backoff: dict[int, float] = {}
    while not stopping.wait(1.0):
        if reps.router.proc.poll() is not None:
            log.error("vllm-router exited with %s; stopping", reps.router.proc.returncode)
            return 1
        for i in reps.dead():
            if time.monotonic() < backoff.get(i, 0.0):
                continue
            log.warning(
                "replica %d exited with %s; starting it again", i, reps.replicas[i].proc.returncode
            )
            try:
                reps.restart(i)
                backoff.pop(i, None)
                log.warning("replica %d is back at %s", i, reps.replicas[i].url)
            except Exception as e:  # noqa: BLE001 (its log says why; try again later)
                log.error("replica %d did not come back: %s", i, e)
                backoff[i] = time.monotonic() + 30.0
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="dflash-serve-replicas: %(message)s")
    try:
        groups, roles = _groups_and_roles(args)
        reps = Replicas(
            args.artifacts,
            groups,
            serve_args=shlex.split(args.serve_args),
            host=args.host,
            port=args.port,
            policy=args.policy,
            router_args=shlex.split(args.router_args),
            router_metrics_port=args.router_metrics_port,
            log_dir=args.log_dir,
            log_level=args.log_level,
            timeout=args.startup_timeout,
            roles=roles,
        )
        router_command()
    except (ReplicasError, OSError, ValueError, ImportError) as e:
        print(f"dflash-serve-replicas: error: {e}", file=sys.stderr)
        return 2
    if not _loopback(args.host):
        log.warning(
            "the router listens on %s: anyone who can reach it can use the replicas (give them "
            "an API key: VLLM_API_KEY in the environment, or --api-key in --serve-args; the "
            "router passes Authorization on), and vllm-router's own worker endpoints "
            "(/add_worker, /remove_worker) need no key: bind 127.0.0.1 behind your own proxy, "
            "or firewall the port",
            args.host,
        )
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        reps.start()
    except (ReplicasError, RuntimeError, TimeoutError) as e:
        print(f"dflash-serve-replicas: error: {e}", file=sys.stderr)
        return 2
    try:
        for i, r in enumerate(reps.replicas):
            print(
                f"dflash-serve-replicas: replica {i} ({roles[i]}) on {r.url} (devices "
                f"{','.join(map(str, groups[i]))}, pid {r.proc.pid}, log {r.log_path})",
                flush=True,
            )
        pd = f"P/D mode {roles.count('prefill')}P{roles.count('decode')}D, "
        mode = "" if set(roles) == {"both"} else pd
        print(
            f"dflash-serve-replicas: routing {len(groups)} replicas on {reps.url} (vllm-router, "
            f"{mode}policy {args.policy}, metrics {reps.router.metrics_url}, logs "
            f"{reps.log_dir})",
            flush=True,
        )
        return _supervise(reps, stopping)
    finally:
        reps.stop()


if __name__ == "__main__":
    sys.exit(main())
