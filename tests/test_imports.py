"""Data flows one way and no module circles: the import contracts of pyproject.toml
([tool.importlinter]) hold, checked by import-linter on the import graph (docs/DESIGN.md,
Seams)."""

import logging
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_kept(monkeypatch):
    monkeypatch.chdir(ROOT)
    # lint_imports configures logging with dictConfig, which disables every logger that exists
    # (the library's, once other test modules are imported): they are restored after it
    loggers = [g for g in logging.root.manager.loggerDict.values() if isinstance(g, logging.Logger)]
    disabled = {g: g.disabled for g in loggers}
    try:
        assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0
    finally:
        for g, was in disabled.items():
            g.disabled = was
