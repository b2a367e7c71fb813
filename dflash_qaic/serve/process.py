"""Run dflash-serve as a child process (for the tests and the serving benchmark).

    with ServerProcess("artifacts/default", "--threads", "1") as server:
        httpx.get(server.url + "/health")

The child is `python -m dflash_qaic.serve ARTIFACTS --port 0 ...` with the parent's
`dflash_qaic` on its path; its output goes to a log file (a pipe nobody reads would fill and
block it). Entering waits for the "serving ... on URL" line and for /health; leaving sends
SIGTERM and waits for the exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import dflash_qaic


class ServerProcess:
    def __init__(
        self,
        artifacts,
        *args: str,
        log_level: str = "warning",
        timeout: float = 180.0,
        log_path: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
    ):
        """args: more dflash-serve flags (a later --port overrides --port 0); log_path: where
        the output goes (appended to; default: a temporary file removed on leaving)."""
        self.argv = [sys.executable, "-m", "dflash_qaic.serve", str(artifacts), "--port", "0"]
        self.argv += ["--log-level", log_level, *args]
        self.timeout = timeout
        self.env = dict(env or {})  # set in the server's environment, beside this process's
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None
        if log_path is None:
            self._log = tempfile.NamedTemporaryFile("w+b", prefix="dflash-serve-", suffix=".log")
        else:
            self._log = open(log_path, "ab")  # closed by close()
        self.log_path = Path(self._log.name)
        self._log_start = self._log.tell()

    def log(self) -> str:
        """This run's output (a log file given as log_path may hold earlier runs' before it)."""
        return self.log_path.read_bytes()[self._log_start :].decode("utf-8", "replace")

    def close(self) -> None:
        """Stop the server and close (a temporary: remove) its log."""
        self.stop()
        self._log.close()

    def start(self) -> ServerProcess:
        env = dict(os.environ) | self.env
        root = str(Path(dflash_qaic.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        deadline = time.monotonic() + self.timeout
        while self.url is None or not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dflash-serve exited with {self.proc.returncode}:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise TimeoutError(
                    f"dflash-serve did not come up in {self.timeout} s:\n{self.log()}"
                )
            for line in self.log().splitlines():
                if line.startswith("dflash-serve: serving ") and " on http" in line:
                    self.url = line.split(" on ", 1)[1].split(" ", 1)[0]
            time.sleep(0.1)
        return self

    def _healthy(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local: no proxy
        try:
            with opener.open(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Signal the server and wait for it; returns its exit code (None if it would not die)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
