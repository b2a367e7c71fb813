"""The library logs through `logging.getLogger("dflash_qaic.<module>")` and prints nothing
itself; the command-line tools call `show` so that users see the messages (progress bars are
tqdm's and stay)."""

from __future__ import annotations

import contextlib
import logging
import sys

ROOT = "dflash_qaic"


class _CurrentStream(logging.StreamHandler):
    """Writes to whatever sys.stdout / sys.stderr is at the time of the message."""

    def __init__(self, which: str):
        super().__init__()
        self.which = which

    @property
    def stream(self):
        return getattr(sys, self.which)

    @stream.setter
    def stream(self, _value):  # StreamHandler.__init__ sets it; the property wins
        pass


def show(level: int = logging.INFO, prefix: str = "· ", stream: str = "stdout") -> None:
    """Print the library's messages from `level` up as `<prefix><message>` on `stream`
    ("stdout" | "stderr"); installed once per process, a second call changes its settings."""
    logger = logging.getLogger(ROOT)
    handler = next((h for h in logger.handlers if isinstance(h, _CurrentStream)), None)
    if handler is None:
        handler = _CurrentStream(stream)
        logger.addHandler(handler)
    handler.which = stream
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    handler.setLevel(level)
    logger.setLevel(min(level, logging.INFO))


class _Callback(logging.Handler):
    def __init__(self, fn):
        super().__init__(logging.INFO)
        self.fn = fn

    def emit(self, record: logging.LogRecord) -> None:
        self.fn(record.getMessage())


@contextlib.contextmanager
def listening(fn):
    """Within the block, also hand each message of the library (INFO and up) to `fn` (None:
    nothing more): for callers that collect the messages rather than configure logging."""
    if fn is None:
        yield
        return
    logger = logging.getLogger(ROOT)
    handler, level = _Callback(fn), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
