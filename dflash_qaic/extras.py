"""What each optional part of the package needs, and the one clear error when it is missing.

The core install (numpy, onnxruntime, tokenizers, jinja2) loads, runs and serves exported
artifacts; exporting and compiling need the `export` extra, `dflash-serve` the `serve` extra,
`dflash-bench` the `bench` extra, `dflash-serve-replicas` the `replicas` extra (vllm-router), the
Ray Serve deployment the `ray` extra (pyproject.toml lists them).
"""

from __future__ import annotations

import importlib.util

# module names (as imported) of each extra's distributions
EXTRAS = {
    "export": ("torch", "transformers", "safetensors", "onnx", "onnxscript", "yaml", "tqdm"),
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
    "bench": ("matplotlib", "scipy"),
    "replicas": ("fastapi", "uvicorn", "prometheus_client", "vllm_router"),
    "ray": ("fastapi", "uvicorn", "prometheus_client", "ray"),
    "structured": ("xgrammar",),
}


class MissingExtraError(ImportError):
    """An optional feature was used without its extra installed: names the pip command."""


def missing(extra: str) -> list[str]:
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, what: str) -> None:
    """Raise MissingExtraError when `extra`'s packages are not all installed."""
    gone = missing(extra)
    if gone:
        raise MissingExtraError(
            f"{what} needs the `{extra}` extra ({', '.join(gone)} not installed): "
            f"pip install 'dflash-qaic[{extra}]'"
        )


def export_main(argv: list[str] | None = None) -> int:
    """`dflash-export`: one line naming the extra when it is not installed."""
    import sys

    try:
        require("export", "dflash-export")
    except MissingExtraError as e:
        print(f"dflash-export: error: {e}", file=sys.stderr)
        return 2
    from dflash_qaic.exporter.cli import main

    return main(argv)
