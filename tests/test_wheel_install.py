"""The package works installed from a wheel, away from the source checkout.

Builds a wheel of this checkout and installs it (no dependencies) into fresh virtual
environments:
- one that borrows all of the test environment's third-party packages runs `dflash-export` from an
  unrelated directory: the shipped recipe, compile profiles and the default pair must all come from
  the installed package, not from the repository;
- one that sees only the core dependencies and the `serve` extra (as the wheel's metadata lists
  them, with their own dependencies: no torch, transformers or onnx) runs `dflash-run` and
  `dflash-serve` on artifacts exported here with the full install, token for token as the full
  install runs them, and `dflash-export` there says which extra to install.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    # setuptools builds in the source tree's build/: pytest-xdist workers that need the wheel
    # at once take turns (a lock in the run's temporary root, which every worker shares)
    lock = tmp_path_factory.getbasetemp().parent / "wheel-build.lock"
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        _run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
            + ["-w", str(wheels), str(ROOT)]
        )
    (whl,) = wheels.glob("dflash_qaic-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_install_exports_from_any_directory(tmp_path, wheel):

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # Third-party packages from the test environment. A plain path line in a .pth file adds the
    # directory without processing the .pth files inside it, so the editable install of this
    # checkout (an import hook installed by a .pth there) stays out of the new environment.
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), wheel])

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QAIC_COMPILER")}
    where = _run(
        [py, "-c", "import dflash_qaic; print(dflash_qaic.__file__)"], cwd=cwd, env=env
    ).stdout.strip()
    assert Path(where).is_relative_to(site), f"imported {where}, not the installed wheel"

    out = cwd / "art"
    cli = [py, "-m", "dflash_qaic.exporter", "--out", str(out), "--no-compile", "--quiet"]
    _run(cli, cwd=cwd, env=env)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["block_size"] == 16
    assert (out / manifest["target"]["onnx"]).is_file()

    # the shipped compile profiles are there too
    listed = _run(
        [py, "-c", "from dflash_qaic.compiler import profiles as p; print(p.available_profiles())"],
        cwd=cwd,
        env=env,
    ).stdout
    assert "ai100_mxfp6_mxint8" in listed


# ---------------------------------------------------------------------- the light install

HEAVY = ("torch", "transformers", "onnx", "onnxscript", "safetensors", "matplotlib", "scipy")


def _requirements(wheel: Path, extras: tuple[str, ...]) -> list[str]:
    """Distribution names the wheel's metadata requires: the core, plus the given extras."""
    import zipfile
    from email.parser import Parser

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        msg = Parser().parsestr(z.read(meta).decode())
    names = []
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
            names.append(req.name)
    return names


def _closure(names: list[str]) -> dict:
    """The installed distributions `names` need, with what they need in turn (no extras)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            seen[name] = dist = distribution(name)
        except PackageNotFoundError:
            raise AssertionError(f"{name} is required but not installed here") from None
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory, wheel) -> Path:
    """A virtual environment holding the wheel and, through a folder of symlinks into the test
    environment, exactly the distributions of the core install and the `serve` extra."""
    root = tmp_path_factory.mktemp("light")
    deps = root / "deps"
    deps.mkdir()
    needed = _closure(_requirements(wheel, ("serve",)))
    assert not {canonical for canonical in needed} & {"torch", "transformers", "onnx"}
    for dist in needed.values():
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = Path(dist.locate_file(top))
            if src.exists() and not (deps / top).exists():
                (deps / top).symlink_to(src)
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.check_output(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    (Path(site) / "zz_light_deps.pth").write_text(f"{deps}\n")
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps"]
    _run([*pip, "--no-index", str(wheel)], env=_light_env())  # no PYTHONPATH: not this checkout
    return env_dir


def _light_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QAIC_COMPILER")}
    return {**env, "OMP_NUM_THREADS": "1"}


def test_the_light_install_has_no_torch(light_venv, tmp_path):
    py = light_venv / "bin" / "python"
    for mod in ("torch", "transformers", "onnx"):
        res = subprocess.run([py, "-c", f"import {mod}"], capture_output=True, text=True)
        assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr, (mod, res.stderr)
    # exporting without the extra: one line naming it
    res = subprocess.run(
        [light_venv / "bin" / "dflash-export", "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        env=_light_env(),
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "pip install 'dflash-qaic[export]'" in res.stderr and "torch" in res.stderr
    code = "import dflash_qaic\ntry:\n    dflash_qaic.export('a', 'b', 'c')\nexcept ImportError as e:\n    print(e)"
    out = _run([py, "-c", code], env=_light_env(), cwd=tmp_path).stdout
    assert "pip install 'dflash-qaic[export]'" in out


def test_the_light_install_runs_and_serves(light_venv, default_artifacts, tmp_path):
    import httpx

    import dflash_qaic

    pipe = dflash_qaic.load(default_artifacts, threads=1)
    prompt = "def fib(n):"
    ref = pipe.generate(prompt, 24, temperature=0)
    env, py = _light_env(), light_venv / "bin" / "python"

    # the Python API: load, generate, chat template, streamer; nothing heavy imported
    code = f"""
import json, sys
import dflash_qaic
from dflash_qaic.runtime.streamer import TextIteratorStreamer
pipe = dflash_qaic.load({str(default_artifacts)!r}, threads=1)
streamer = TextIteratorStreamer(pipe.tokenizer, skip_prompt=True)
res = pipe.generate({prompt!r}, 24, temperature=0, streamer=streamer)
chat = pipe.tokenizer.apply_chat_template(
    [{{"role": "user", "content": "hi"}}], chat_template="{{{{ messages[0].content }}}}!", tokenize=False)
heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)
print(json.dumps(dict(tokens=res.tokens, text=res.text, streamed="".join(streamer), chat=chat,
                      heavy=heavy, file=dflash_qaic.__file__, tok=type(pipe.tokenizer).__name__)))
"""
    out = json.loads(_run([py, "-c", code], env=env, cwd=tmp_path).stdout)
    assert out["tokens"] == ref.tokens and out["text"] == ref.text == out["streamed"]
    assert out["chat"] == "hi!" and out["heavy"] == [] and out["tok"] == "Tokenizer"
    assert Path(out["file"]).is_relative_to(light_venv), out["file"]

    # dflash-run
    run = [light_venv / "bin" / "dflash-run", str(default_artifacts), "--prompt", prompt]
    res = _run([*run, "--max-new-tokens", "24", "--threads", "1", "--json"], env=env, cwd=tmp_path)
    assert json.loads(res.stdout)["tokens"] == ref.tokens

    # dflash-serve: a completion over HTTP, token for token
    serve = [light_venv / "bin" / "dflash-serve", str(default_artifacts), "--port", "0"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*serve, "--threads", "1"], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp_path
        )
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            for line in log.read_text().splitlines():
                if line.startswith("dflash-serve: serving ") and " on http" in line:
                    url = line.split(" on ", 1)[1].split(" ", 1)[0]
            time.sleep(0.1)
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as c:
            for _ in range(600):
                if c.get("/health").status_code == 200:
                    break
                time.sleep(0.1)
            body = dict(prompt=prompt, max_tokens=24, temperature=0, return_token_ids=True)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == ref.tokens
            assert "vllm:generation_tokens_total" in c.get("/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()


def test_the_graph_reader_reads_what_onnx_reads(default_artifacts):
    """runtime/backends.graph_nodes (the protobuf wire format, no onnx package) gives the same
    nodes as onnx.load, for both programs."""
    import onnx

    from dflash_qaic.runtime.backends import graph_nodes

    for name in ("target", "draft"):
        (path,) = (default_artifacts / name).glob("*.onnx")
        want = onnx.load(str(path), load_external_data=False).graph.node
        got = graph_nodes(path)
        assert len(got) == len(want) > 10
        for a, b in zip(got, want):
            assert (a.op_type, a.input, a.output) == (b.op_type, list(b.input), list(b.output))
