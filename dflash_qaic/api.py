"""The Python export and compile API (QEfficient-like): `dflash_qaic.export(...)` and
`dflash_qaic.compile(...)`, plain functions whose keyword arguments are the options declared in
dflash_qaic/exporter/options.py (the same table as `dflash-export`'s flags and the recipe keys).
Progress goes to the `dflash_qaic` logger (`logging.basicConfig(level=logging.INFO)` shows it).
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any

from dflash_qaic.extras import require

if TYPE_CHECKING:  # pragma: no cover
    from dflash_qaic.artifacts.manifest import Manifest


def export(
    target: str | os.PathLike, draft: str | os.PathLike, out: str | os.PathLike, **options: Any
) -> Manifest:
    """Export a target + DFlash draft pair to an artifacts directory (`dflash-export` in Python).

    target, draft: local checkpoint directories (Hugging Face target; z-lab DFlash draft).
    out: the artifacts directory; written as a transaction (a previous good directory survives
        any failure), refused when it holds files the exporter did not write.
    options: keyword arguments named as the flags (`ctx_len=4096` is `--ctx-len 4096`,
        `compile=False` is `--no-compile`), listed below with their defaults; a wrong name is a
        TypeError, a wrong value an ExportError naming it.
    Returns the typed manifest. Raises `ExportError`, `CheckpointError`, `ProfileError` or
    `CompileError` (all with a message naming the problem and the fix); `MissingExtraError`
    without the `export` extra (pip install 'dflash-qaic[export]').
    """
    require("export", "dflash_qaic.exporter")
    from dflash_qaic.artifacts.build import build_artifacts
    from dflash_qaic.exporter.options import ExportOptions

    opts = ExportOptions.from_kwargs(options)
    return build_artifacts(target, draft, out, opts).manifest


def compile(artifacts_dir: str | os.PathLike, **options: Any) -> Manifest:  # noqa: A001
    """Compile the programs of an artifacts directory to QPCs (e.g. one exported with
    `compile=False` elsewhere and copied to an AI100 host). Options: `qpc_config` and the
    compile options of `export` (listed below); the manifest is rewritten as a transaction.
    Logs where it looked for the compiler. Returns the typed manifest; `MissingExtraError`
    without the `export` extra."""
    require("export", "dflash_qaic.compiler")
    from dflash_qaic.artifacts.build import compile_artifacts
    from dflash_qaic.exporter.options import compile_kwargs

    qpc_config, overrides = compile_kwargs(options)
    return compile_artifacts(artifacts_dir, qpc_config, overrides).manifest


def _document() -> None:
    """Give both functions the options' signature and a line per option (from the table)."""
    from dflash_qaic.exporter import options as table

    def params(names, defaults=None):
        return [
            inspect.Parameter(
                n,
                inspect.Parameter.KEYWORD_ONLY,
                default=(defaults or {}).get(n, table.default(n)),
            )
            for n in names
        ]

    def lines(names) -> str:
        out = []
        for n in names:
            meta = table._meta(n)
            out.append(f"    {n} ({meta.kind}, default {table.default(n)!r}): {meta.help}")
        return "\n".join(out)

    P = inspect.Parameter
    head = [P(n, P.POSITIONAL_OR_KEYWORD) for n in ("target", "draft", "out")]
    names = table.names()
    export.__signature__ = inspect.Signature(head + params(names))
    export.__doc__ += "\n    Options:\n" + lines(names) + "\n"
    cnames = ["qpc_config", *table.names(("compile",))]
    compile.__signature__ = inspect.Signature(
        [P("artifacts_dir", P.POSITIONAL_OR_KEYWORD)] + params(cnames, {"qpc_config": None})
    )
    compile.__doc__ += "\n    Options:\n" + lines(cnames) + "\n"
