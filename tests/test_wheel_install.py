"""The package works installed from a wheel, away from the source checkout.

Builds a wheel of this checkout, installs it (no dependencies) into a fresh virtual environment
that borrows the test environment's third-party packages, and runs `dflash-export` from an
unrelated directory: the shipped recipe, compile profiles and the default pair must all come from
the installed package, not from the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout}\n{res.stderr}"
    return res


@pytest.mark.slow
def test_wheel_install_exports_from_any_directory(tmp_path):
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(wheels), str(ROOT)]
    )
    (wheel,) = wheels.glob("dflash_qaic-*.whl")

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
    cli = [py, "-m", "dflash_qaic.export", "--out", str(out), "--no-compile", "--quiet"]
    _run(cli, cwd=cwd, env=env)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["block_size"] == 16
    assert (out / manifest["target"]["onnx"]).is_file()

    # the shipped compile profiles are there too
    listed = _run(
        [py, "-c", "from dflash_qaic.compile import profiles as p; print(p.available_profiles())"],
        cwd=cwd,
        env=env,
    ).stdout
    assert "ai100_mxfp6_mxint8" in listed
