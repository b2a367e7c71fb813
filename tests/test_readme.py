"""Every code block of README.md and of the guides in docs/ it links (GUIDES) runs as written.

A block is fenced with its language: ```python and ```bash blocks are code, ```text blocks are
output or diagrams. A bash block whose first line is a comment starting with `# illustrative`
cannot run here (it needs the network or real checkpoints): its commands' flags are still parsed
by the real command-line parsers, so a flag that does not exist fails here too.

Fast tier: every block's language is known; every bash block is valid shell; every `dflash-*`
command in any block parses its flags, every `make` target exists; the Python blocks that need
only the default pair's artifacts run, each on its own, in a directory holding
`artifacts/default` (as after `make demo`); the fp16 check's limits the README states are the
code's.

Slow tier: the README walked top to bottom in a copy of the repository, as a user would: bash
blocks through bash (`make demo`, the exports, `dflash-run`, `make bench`), Python blocks in a
fresh interpreter each, and a `dflash-serve` started by a block serving the `curl` and `openai`
blocks after it in the same document, then stopped with SIGTERM (exit 0); then each guide the same
way, in the same copy (its blocks may use what the README's made, as a reader's would). Two
substitutions, and only these: the server listens on a free port instead of 8000 (the blocks'
URLs follow it), and `make test` is dry-run (`make -n test`), since it is the tier this walk
belongs to.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the guides in docs/ that hold the examples beyond the README's first steps: checked as it is
GUIDES = tuple(
    ROOT / "docs" / f"{name}.md"
    for name in (
        "export",
        "python-api",
        "serving",
        "structured-output",
        "vllm",
        "benchmarking",
        "testing",
    )
)
DOCS = (README, *GUIDES)
LANGUAGES = {"bash", "python", "text"}
PORT = "8000"  # the port the README's server and clients use


class Block(NamedTuple):
    lang: str
    text: str
    line: int  # 1-based line of the opening fence
    doc: Path = README

    @property
    def illustrative(self) -> bool:
        first = self.text.lstrip().splitlines()[0] if self.text.strip() else ""
        return self.lang == "bash" and first.startswith("# illustrative")

    @property
    def client(self) -> bool:
        """Talks to the server a block before it started."""
        return f"127.0.0.1:{PORT}" in self.text

    @property
    def server(self) -> bool:
        return self.lang == "bash" and any(c[0] == "dflash-serve" for c in commands(self.text))

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line} ({self.lang})"


def blocks(text: str | None = None, doc: Path = README) -> list[Block]:
    """The fenced blocks of `doc` (or of `text`, read as if it were `doc`)."""
    text = doc.read_text(encoding="utf-8") if text is None else text
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{doc.name}:{start + 1}: the block is not closed"
        out.append(Block(m.group(2).strip(), "\n".join(body) + "\n", start + 1, doc))
        i += 1
    return out


def all_blocks() -> list[Block]:
    """The blocks of the README, then of each guide."""
    return [b for doc in DOCS for b in blocks(doc=doc)]


def commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script (continuations joined, comments dropped, split at
    `&&`, `||`, `;` and `|`, leading `NAME=value` assignments dropped), each as its words."""
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in [*words, ";"]:
            if w in ("&&", "||", ";", "|"):
                out += [cmd] if cmd else []
                cmd = []
            elif cmd or not re.match(r"^[A-Za-z_]\w*=", w):
                cmd.append(w)
    return out


def scripts() -> dict[str, str]:
    """The package's console scripts: name -> "module:function"."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def needs_slow(b: Block) -> bool:
    """Python blocks the fast tier leaves to the walk: the server's clients and exports."""
    return b.client or "dflash_qaic.export(" in b.text or "AutoDFlashModel" in b.text


# ---------------------------------------------------------------------------- fast tier


def test_every_block_has_a_known_language():
    found = all_blocks()
    assert len(found) >= 20, "the README's and the guides' blocks were not found"
    for b in found:
        assert b.lang in LANGUAGES, f"{b}: fence it as one of {sorted(LANGUAGES)}"
        assert b.text.strip(), f"{b}: empty block"
    # the README starts with the two commands of a fresh machine
    first = [c for b in blocks() if b.lang == "bash" for c in commands(b.text)][:2]
    assert first == [["make", "demo"], ["make", "test"]]


def test_the_readme_is_an_entry_point():
    """At most 300 lines; every guide linked from it; its test command what CI runs."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, "move the details into a guide under docs/"
    for guide in GUIDES:
        assert f"({guide.relative_to(ROOT)})" in text, f"the README does not link {guide.name}"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^make test$", ci, re.M), "CI no longer runs `make test`"


def test_the_parser_of_blocks():
    text = "a\n```bash\n# illustrative: x\nfoo --a \\\n  --b && bar ; K=v baz | q # c\n```\n"
    (b,) = blocks(text)
    assert b.illustrative and b.line == 2
    assert commands(b.text) == [["foo", "--a", "--b"], ["bar"], ["baz"], ["q"]]
    with pytest.raises(AssertionError, match="not closed"):
        blocks("```python\nx = 1\n")


class _Parsed(Exception):
    pass


def _parse_only(entry: str, argv: list[str], monkeypatch) -> str | None:
    """Run a console script's main on argv until its arguments are parsed: None when they
    parse, else the parser's error message."""
    module, func = entry.split(":")
    main = getattr(importlib.import_module(module), func)
    original, errors = argparse.ArgumentParser.parse_args, []

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    def error(self, message):
        errors.append(message)
        sys.exit(2)

    with monkeypatch.context() as m:
        log = logging.getLogger("dflash_qaic")  # a CLI shows the library's log: not for later tests
        m.setattr(log, "handlers", list(log.handlers))
        m.setattr(log, "level", log.level)
        m.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        m.setattr(argparse.ArgumentParser, "error", error)
        m.setattr(sys, "argv", [entry, *argv])
        try:
            main(argv) if inspect.signature(main).parameters else main()
        except _Parsed:
            return None
        except SystemExit:
            return errors[0] if errors else "exited before parsing its arguments"
    return "returned without parsing its arguments"


def test_every_command_exists_and_its_flags_parse(monkeypatch):
    entry, seen = scripts(), 0
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for b in all_blocks():
        if b.lang != "bash":
            continue
        subprocess.run(["bash", "-n", "-c", b.text], check=True, capture_output=True)
        for cmd in commands(b.text):
            if cmd[0] == "make":
                assert set(cmd[1:]) <= targets, f"{b}: no such make target in {cmd}"
            elif cmd[0].startswith("dflash-"):
                assert cmd[0] in entry, f"{b}: {cmd[0]} is not a console script of pyproject"
                err = _parse_only(entry[cmd[0]], cmd[1:], monkeypatch)
                assert err is None, f"{b}: {shlex.join(cmd)}: {err}"
                seen += 1
    assert seen >= 10


def test_python_blocks_run(default_artifacts, tmp_path, monkeypatch, capsys):
    """Each Python block on its own (no names carried over), where `artifacts/default` exists."""
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "default").symlink_to(default_artifacts)
    monkeypatch.chdir(tmp_path)
    ran = 0
    for b in all_blocks():
        if b.lang != "python" or needs_slow(b):
            continue
        exec(compile(b.text, str(b), "exec"), {"__name__": "__readme__"})
        ran += 1
    assert ran >= 3
    out = capsys.readouterr().out
    assert "× speedup" in out and "16.0 [16, 16, 16, 16]" in out  # as the blocks' comments say


def test_links_resolve():
    for doc in DOCS:
        links = re.findall(r"\]\(([^)#\s]+)[^)]*\)", doc.read_text(encoding="utf-8"))
        assert doc != README or "docs/BENCHMARKS.md" in links
        for link in links:
            ok = link.startswith("http") or (doc.parent / link).exists()
            assert ok, f"{doc.relative_to(ROOT)} links to {link}"


def test_the_fp16_check_limits_are_the_codes():
    from dflash_qaic.exporter import fp16_check, weights

    text = " ".join(" ".join(d.read_text(encoding="utf-8").split()) for d in DOCS)
    m = re.search(r"programs up to (\d+) MiB of weights; up to (\d+) MiB", text)
    assert m, "neither the README nor a guide states the fp16 check's limits any more"
    assert int(m.group(1)) << 20 == fp16_check.FAITHFUL_MAX_BYTES
    assert int(m.group(2)) << 20 == weights.GRAPH_RUN_MAX_BYTES


# ---------------------------------------------------------------------------- slow tier


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy_repo(dst: Path) -> Path:
    skip = {
        ".git",
        ".venv",
        ".venv-vllm",
        "artifacts",
        "bench",
        "pairs",
        ".pytest_cache",
        ".ruff_cache",
    }
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for p in ROOT.iterdir():
        if p.name in skip or p.name.endswith(".egg-info"):
            continue
        if p.is_dir():
            shutil.copytree(p, dst / p.name, ignore=ignore)
        else:
            shutil.copy2(p, dst / p.name)
    return dst


def _environment(repo: Path, shims: Path) -> dict:
    """`.venv/` of the copy is this test's environment (set up by `make setup`, so make does
    not set it up again); the console scripts run this copy's code."""
    stamp = Path(sys.prefix, ".installed")
    if not stamp.is_file():
        pytest.fail(f"run the slow tier with `make test-slow` ({stamp} is missing)")
    (repo / ".venv").symlink_to(sys.prefix)
    before = stamp.stat().st_mtime - 1
    os.utime(repo / "pyproject.toml", (before, before))
    shims.mkdir()
    for name, entry in scripts().items():
        module, func = entry.split(":")
        code = (
            f"import sys; from {module} import {func} as f; sys.argv[0] = {name!r}; sys.exit(f())"
        )
        (shims / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{code}" "$@"\n')
        (shims / name).chmod(0o755)
    path = os.pathsep.join([str(shims), str(Path(sys.executable).parent), os.environ["PATH"]])
    return {**os.environ, "PATH": path, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1"}


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not become healthy in {timeout} s")


@pytest.mark.slow
def test_readme_walkthrough(tmp_path):
    (tmp_path / "repo").mkdir()
    repo = _copy_repo(tmp_path / "repo")
    env = _environment(repo, tmp_path / "shims")
    port = str(_free_port())
    servers: list[subprocess.Popen] = []

    def sub(text: str) -> str:
        return text.replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{port}")

    def run(cmd: list[str], b: Block) -> None:
        res = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=3600)
        assert res.returncode == 0, f"{b} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"

    stopped: list[subprocess.Popen] = []
    for doc in DOCS:  # a document's servers serve its own clients, then stop
        try:
            for b in blocks(doc=doc):
                if b.lang == "text" or b.illustrative:
                    continue
                if b.lang == "python":
                    run([sys.executable, "-c", sub(b.text)], b)
                elif b.server:
                    for line in b.text.strip().splitlines():
                        line = f"{line.split('#')[0].strip()} --port {port}"
                        proc = subprocess.Popen(["bash", "-c", line], cwd=repo, env=env)  # execs it
                        servers.append(proc)
                        _wait_healthy(f"http://127.0.0.1:{port}", proc)
                else:
                    script = re.sub(r"^make test\b", "make -n test", b.text, flags=re.M)
                    run(["bash", "-e", "-c", sub(script)], b)
        finally:
            while servers:
                proc = servers.pop()
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
                stopped.append(proc)
    assert stopped and all(p.returncode == 0 for p in stopped)
    assert (repo / "artifacts" / "default" / "manifest.json").is_file()
    assert (repo / "bench" / "latest" / "report.md").is_file()
