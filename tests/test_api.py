"""The Python API as plain functions, the options table they share with the CLI and the
recipes, the import graph of export / compile / artifacts, and logging instead of print."""

from __future__ import annotations

import ast
import inspect
import logging
from pathlib import Path

import pytest

import dflash_qaic
from dflash_qaic.exporter import options as table
from dflash_qaic.exporter.cli import RECIPE_KEYS, parser
from dflash_qaic.exporter.options import ExportError, ExportOptions

PKG = Path(dflash_qaic.__file__).parent
SMALL = dict(prefill_seq_len=16, ctx_len=64, fp16_check=False)


def test_export_and_compile_are_plain_functions():
    from dflash_qaic.exporter import cli  # noqa: F401

    for fn in (dflash_qaic.export, dflash_qaic.compile):
        assert inspect.isfunction(fn) and fn.__module__ == "dflash_qaic.api"
    params = inspect.signature(dflash_qaic.export).parameters
    assert list(params)[:3] == ["target", "draft", "out"]
    assert set(table.names()) <= set(params) and params["ctx_len"].default == 4096
    cparams = inspect.signature(dflash_qaic.compile).parameters
    assert {"qpc_config", "num_cores", "mxint8_kv_cache", "compile_timeout"} <= set(cparams)
    assert "ctx_len" not in cparams and "mxint8_kv_cache" in dflash_qaic.compile.__doc__


def test_one_table_for_flags_keywords_and_recipes():
    p = parser()
    dests = {a.dest for a in p._actions}
    assert set(table.names()) <= dests  # every option is a flag, under its own name
    for name in table.names():
        assert table.flag(name) in p._option_string_actions, name
    assert {"--no-compile", "--no-sampling", "--no-fp16-check", "--mxint8-kv-cache"} <= set(
        p._option_string_actions
    )
    assert "--no-mxint8-kv-cache" in p._option_string_actions
    assert set(table.RECIPE_OPTIONS) <= RECIPE_KEYS
    assert {"block_size", "prefill_seq_len", "ctx_len", "qpc_config"} <= RECIPE_KEYS
    # the same checks whichever way a value comes in
    with pytest.raises(ExportError, match=r"--ctx-len must be an integer in \[4, 262144\].*ctx_le"):
        ExportOptions(ctx_len=0)
    with pytest.raises(SystemExit):
        parser().parse_args(["--out", "x", "--ctx-len", "0"])
    with pytest.raises(ExportError, match=r"--mos must be an integer in \[1, 16\].*`mos=`"):
        ExportOptions(mos=17)
    with pytest.raises(ExportError, match="--compile-timeout must be a number of seconds"):
        ExportOptions(compile_timeout=float("inf"))
    with pytest.raises(ExportError, match="--mxint8-kv-cache must be True or False"):
        dflash_qaic.compile("anywhere", mxint8_kv_cache="yes")
    with pytest.raises(TypeError, match="unknown option.*'ctx_lenn'"):
        dflash_qaic.export("t", "d", "o", ctx_lenn=64)
    with pytest.raises(TypeError, match="unknown compile option.*'ctx_len'"):
        dflash_qaic.compile("anywhere", ctx_len=64)
    o = ExportOptions(num_speculative_tokens=7, mxint8_kv_cache=True, compile_timeout=5)
    assert o.block_size == 8 and o.compile_overrides.given == {
        "mxint8_kv_cache": True,
        "timeout_s": 5.0,
    }


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("dflash_qaic")}


#: what dflash-export's command line may run after the export, as pyproject.toml's import
#: contract lists it (the one orchestration exception beside artifacts and the compiler)
CHECK_AFTER_EXPORT = {"dflash_qaic.bench", "dflash_qaic.bench.card_numerics"}


def test_no_stage_imports_one_after_it():
    """checkpoints → modeling → export → compile → artifacts → runtime → serve/bench: each
    module imports only stages before its own (lazy imports included)."""
    later = ("dflash_qaic.api", "dflash_qaic.runtime", "dflash_qaic.serve", "dflash_qaic.bench")
    for path in [
        *PKG.glob("exporter/*.py"),
        *PKG.glob("compiler/*.py"),
        *PKG.glob("artifacts/*.py"),
    ]:
        for m in _imports(path):
            if path.name == "cli.py" and m in CHECK_AFTER_EXPORT:
                continue  # dflash-export --check-card-numerics runs the benchmark's evaluation
            assert not m.startswith(later) and m != "dflash_qaic.load", (path, m)
    for path in PKG.glob("compiler/*.py"):
        for m in _imports(path):
            assert not m.startswith(("dflash_qaic.artifacts", "dflash_qaic.exporter")), (path, m)
    for name in ("onnx_export", "target", "draft", "weights", "graph_check", "fp16_check"):
        for m in _imports(PKG / "exporter" / f"{name}.py"):  # the export proper: no later stage
            assert not m.startswith(("dflash_qaic.compiler", "dflash_qaic.artifacts")), (name, m)
    # what the runtime loads of the artifacts: no export or compile module
    for name in ("manifest", "files"):
        for m in _imports(PKG / "artifacts" / f"{name}.py"):
            assert not m.startswith(("dflash_qaic.compiler", "dflash_qaic.exporter")), (name, m)
    # the bottom: the typed state (state.py) imports nothing of the package, the contract only it
    assert _imports(PKG / "state.py") == set()
    for path in [PKG / "artifacts" / "files.py", PKG / "contract.py"]:
        assert {m for m in _imports(path) if not m.startswith("dflash_qaic.state")} <= {
            "dflash_qaic"
        }, path


def test_python_export_and_compile_log_instead_of_printing(
    tiny_pair, tmp_path, monkeypatch, caplog, capsys, no_compiler
):
    t, d = tiny_pair(family="qwen3", target_layer_ids=[1, 3])
    # a CLI run earlier in this process (logs.show) may have installed its console handler
    monkeypatch.setattr(logging.getLogger("dflash_qaic"), "handlers", [])
    caplog.set_level(logging.INFO, logger="dflash_qaic")
    m = dflash_qaic.export(t, d, tmp_path / "art", num_speculative_tokens=3, compile=False, **SMALL)
    assert m.block_size == 4 and m.options["compile"] is False
    assert any("exporting the target program" in r.getMessage() for r in caplog.records)
    caplog.clear()
    m = dflash_qaic.compile(tmp_path / "art", num_cores=8)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warned and "looked in $QAIC_COMPILER (not set)" in warned[0].getMessage()
    assert m.compile_skipped and m.qpc_config.endswith("num_cores=8")
    assert capsys.readouterr().out == ""  # the library itself prints nothing
