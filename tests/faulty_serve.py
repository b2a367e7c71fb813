"""dflash-serve with an injected fault, for tests/test_faults.py: the target program raises on
a batch-1 (prefill) call whose ids begin with the token ids in $FAULT_PROMPT (comma-separated);
or, with $SLOW_CALL_S, every target call takes that many seconds longer (a slow device: the
shutdown tests need requests that cannot finish within the timeout, however fast this host is);
or, with $HANG_PROMPT, such a call never returns (a device that hangs: the P/D tests kill the
server while it holds a request).

    FAULT_PROMPT=5,9,13 python tests/faulty_serve.py ARTIFACTS --port 0 ...
    SLOW_CALL_S=0.05 python tests/faulty_serve.py ARTIFACTS --port 0 ...
"""

from __future__ import annotations

import os
import sys
import threading
import time

from dflash_qaic import contract


class Faulty:
    """A program that raises on the calls `bad(feeds)` picks (an injected backend failure)
    and runs every other call as the program it wraps."""

    def __init__(self, program, bad):
        self._program, self._bad = program, bad
        self.failed: list[dict] = []  # copies of the feeds of the calls that raised

    def __getattr__(self, name):
        return getattr(self._program, name)

    def run(self, feeds):
        if self._bad(feeds):
            self.failed.append({k: v.copy() for k, v in feeds.items()})
            raise RuntimeError("injected fault")
        return self._program.run(feeds)


def prefill_of(prompt: list[int]):
    """Picks the batch-1 target calls holding the first tokens of `prompt`."""

    def bad(feeds) -> bool:
        ids = feeds[contract.INPUT_IDS]
        k = min(len(prompt), ids.shape[1])
        return ids.shape[0] == 1 and ids[0, :k].tolist() == prompt[:k]

    return bad


class Hang(Faulty):
    """A program whose calls `bad(feeds)` picks never return."""

    def run(self, feeds):
        if self._bad(feeds):
            threading.Event().wait()
        return self._program.run(feeds)


class Slow(Faulty):
    """A program whose every call takes `seconds` longer."""

    def __init__(self, program, seconds: float):
        super().__init__(program, lambda feeds: False)
        self._seconds = seconds

    def run(self, feeds):
        time.sleep(self._seconds)
        return self._program.run(feeds)


def main() -> int:
    import dflash_qaic
    from dflash_qaic.serve.cli import main as serve

    load = dflash_qaic.load
    slow = float(os.environ.get("SLOW_CALL_S", 0))
    poison = [int(t) for t in os.environ.get("FAULT_PROMPT", "").split(",") if t]
    hang = [int(t) for t in os.environ.get("HANG_PROMPT", "").split(",") if t]

    def faulty_load(*args, **kw):
        pipe = load(*args, **kw)
        if slow:
            pipe.target = Slow(pipe.target, slow)
        elif hang:
            pipe.target = Hang(pipe.target, prefill_of(hang))
        else:
            pipe.target = Faulty(pipe.target, prefill_of(poison))
        return pipe

    dflash_qaic.load = faulty_load
    return serve(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
