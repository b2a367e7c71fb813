"""Data flows one way and no module circles: the import contracts of pyproject.toml
([tool.importlinter]) hold, checked by import-linter on the import graph (docs/DESIGN.md,
Seams)."""

from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_kept(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0
