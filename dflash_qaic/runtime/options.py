"""The load options, each declared once (its default, values, check and help).

`LoadOptions` is the table, as `exporter/options.py` is for the export: one dataclass field per
option, its `LoadOption` in the field's metadata. From it come the keyword arguments of
`dflash_qaic.load(...)` (their defaults and the checks of their values: a bad value is a
`BackendError` naming the keyword) and the flags of the commands that load artifacts
(`add_arguments`: dflash-run, dflash-serve, dflash-bench, dflash-serve-replicas).

Engine options, set on a loaded pipeline with `pipe.configure(...)` rather than at load, are
declared here too when a command takes them as flags (`EngineOption`: `SPEC_POLICY`, the step
policy of runtime/policy.py); `EngineConfig`'s default is the declaration's.

`check_files` was called `verify` (`--verify`) before "verify" came to mean speculative
verification only; the old spelling is still taken, with a warning naming the new one.
"""

from __future__ import annotations

import argparse
import logging
import os
import textwrap
import warnings
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from dflash_qaic.artifacts.files import CHECK_MODES
from dflash_qaic.runtime.backends import BackendError
from dflash_qaic.runtime.policy import POLICIES

log = logging.getLogger(__name__)

BACKENDS = ("ort", "qaic", "auto", "qaic-standin")


@dataclass(frozen=True)
class LoadOption:
    """How one load option is shown on the command line: its help, the values the flag takes
    (None: any), how a flag's text becomes the value (None: as given) and whether it is a flag
    at all (`cli`)."""

    help: str
    choices: tuple | None = None
    parse: Any = None
    cli: bool = True
    metavar: str | None = None

    def flag(self, name: str) -> str:
        return "--" + name.replace("_", "-")


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"option": LoadOption(help, **kw)})


def _threads(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _device_ids(text: str) -> list[int]:
    from dflash_qaic.runtime.devices import parse_device_ids

    try:
        return parse_device_ids(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


DEVICE_IDS_HELP = (
    "the AI100 devices of the replica, e.g. 4 or 4,5: the compile profile's devices, in "
    "increasing order, renamed to these (as many as the profile uses; default: the "
    "profile's own). ONNX Runtime records and reports them (docs/DESIGN.md, Replicas)"
)


@dataclass(frozen=True)
class LoadOptions:
    """Every option of `dflash_qaic.load` (see the module docstring)."""

    backend: str = _opt(
        "ort",
        '"ort" (ONNX Runtime, any machine), "qaic" (AI100 via QEfficient/qaicrt), "auto" (qaic '
        'when its runtime and compiled QPCs are present, else ort), or "qaic-standin" (the '
        "AI100 buffer logic over ONNX Runtime, for tests without a card)",
        choices=BACKENDS,
    )
    threads: int | None = _opt(
        None,
        "ONNX Runtime intra-op threads, 1 … 4 × cores (default: 1 for single-sequence programs "
        "up to 64 MiB, else ONNX Runtime's default, one per core)",
        parse=_threads,
    )
    tokenizer: bool = _opt(
        True,
        "load the tokenizer the artifacts carry (text prompts, `res.text`); False skips it",
        cli=False,
    )
    check_files: str = _opt(
        "fast",
        "check of the artifact files before the first token: fast (default) checks every "
        "file's size and sha256, taking the sha256 of a file unchanged since it was last "
        "checked (same inode, size, mtime and ctime) from a cache, so only new or changed "
        'files are hashed; full hashes every file now; "none" (Python only) checks only that '
        "they exist (docs/DESIGN.md, Artifacts)",
        choices=("fast", "full"),
    )
    device_ids: Any = _opt(None, DEVICE_IDS_HELP, parse=_device_ids)

    def __post_init__(self):
        check(self)


def check(o: LoadOptions) -> None:
    """A BackendError naming the keyword for a bad value (device_ids: checked by `place`)."""
    if not isinstance(o.backend, str) or o.backend not in BACKENDS:
        raise BackendError(f"unknown backend {o.backend!r}: use one of {', '.join(BACKENDS[:3])}")
    most = 4 * (os.cpu_count() or 1)
    t = o.threads
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= most):
        raise BackendError(
            f"threads must be None or an integer in [1, {most}] (4 per core), got {t!r}"
        )
    if not isinstance(o.tokenizer, bool):
        raise BackendError(f"tokenizer must be True or False, got {o.tokenizer!r}")
    if o.check_files not in CHECK_MODES:
        raise BackendError(
            f"check_files must be one of {', '.join(CHECK_MODES)}, got {o.check_files!r}"
        )


@dataclass(frozen=True)
class EngineOption:
    """An engine option a command takes as a flag: `add` declares it, `value` reads it back
    (the `EngineConfig` field of the same name, set with `pipe.configure`)."""

    name: str
    default: Any
    help: str
    choices: tuple | None = None
    type: Any = None  # how the flag's text becomes the value (bool: --X / --no-X)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def add(self, parser: argparse.ArgumentParser) -> None:
        if self.type is bool:
            action = argparse.BooleanOptionalAction
            parser.add_argument(self.flag, default=self.default, action=action, help=self.help)
            return
        parser.add_argument(
            self.flag, default=self.default, choices=self.choices, help=self.help, type=self.type
        )

    def value(self, args: argparse.Namespace) -> Any:
        return getattr(args, self.name, self.default)


SPEC_POLICY = EngineOption(
    "spec_policy",
    "auto",
    "per sequence and step, a DFlash step or plain decoding: auto, the default (draft while the "
    "measured call costs and the sequence's running acceptance say it pays, probing now and "
    "then; tokens unchanged), always (draft every step: with fixed verify lengths a run's "
    "acceptance counters are reproducible from run to run and server to server), never (the "
    "target alone); docs/DESIGN.md, Step policy",
    POLICIES,
)


PREFIX_CACHING = EngineOption(
    "enable_prefix_caching",
    True,
    "automatic prefix caching, on by default as in vLLM: a prompt extending what a cache row or "
    "the host tier holds resumes there, tokens and acceptance unchanged (docs/prefix-caching.md)",
    type=bool,
)
KV_OFFLOADING_SIZE = EngineOption(
    "kv_offloading_size",
    None,
    "GiB of host memory for evicted prefix-cache rows (vLLM's name; default: no host tier)",
    type=float,
)
#: the engine options the commands take as flags (`add_engine_arguments`, `engine_values`)
ENGINE_OPTIONS = (SPEC_POLICY, PREFIX_CACHING, KV_OFFLOADING_SIZE)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    for o in ENGINE_OPTIONS:
        o.add(parser)


def engine_values(args: argparse.Namespace) -> dict[str, Any]:
    """The `pipe.configure` keywords of the parsed engine flags."""
    return {o.name: o.value(args) for o in ENGINE_OPTIONS}


def names() -> list[str]:
    return [f.name for f in fields(LoadOptions)]


def default(name: str) -> Any:
    f = next(f for f in fields(LoadOptions) if f.name == name)
    return None if f.default is MISSING else f.default


def _meta(name: str) -> LoadOption:
    return next(f for f in fields(LoadOptions) if f.name == name).metadata["option"]


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that `old` is spelled `new` now: a DeprecationWarning and a logged warning."""
    msg = f"{old} is deprecated: use {new} (the same values)"
    warnings.warn(msg, DeprecationWarning, stacklevel=stacklevel)
    log.warning("%s", msg)


class _OldCheckFiles(argparse.Action):
    """`--verify fast|full`, the old spelling of `--check-files`."""

    def __call__(self, parser, namespace, values, option_string=None):
        deprecated("--verify", "--check-files")
        setattr(namespace, self.dest, values)


def add_arguments(parser: argparse.ArgumentParser, *which: str, repeat: bool = False) -> None:
    """The flags of the load options `which` (default: every one with a flag). repeat=True
    (dflash-serve-replicas): --device-ids is given once per replica, each one replica's group."""
    for name in which or [n for n in names() if _meta(n).cli]:
        meta = _meta(name)
        kw = dict(default=default(name), help=meta.help)
        if meta.choices:
            kw["choices"] = meta.choices
        if meta.parse:
            kw["type"] = meta.parse
        if name == "device_ids" and repeat:
            once = "one replica's devices, given once per replica: "
            kw.update(action="append", help=once + DEVICE_IDS_HELP.split(": ", 1)[1])
        parser.add_argument(meta.flag(name), **kw)
        if name == "check_files":
            parser.add_argument(
                "--verify",
                dest="check_files",
                choices=meta.choices,
                action=_OldCheckFiles,
                help=argparse.SUPPRESS,
            )


def from_args(args: argparse.Namespace, *which: str) -> dict[str, Any]:
    """The keyword arguments of `dflash_qaic.load` the parsed flags `which` give."""
    return {n: getattr(args, n) for n in which or [n for n in names() if _meta(n).cli]}


def docs() -> str:
    """One line per option, for `load`'s docstring."""
    lines = [f"{n} (default {default(n)!r}): {_meta(n).help}." for n in names()]
    return "\n".join(
        textwrap.fill(
            t, 96, initial_indent=" " * 4, subsequent_indent=" " * 8, break_on_hyphens=False
        )
        for t in lines
    )
