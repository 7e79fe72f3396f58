"""Bench-only environments: a peer tool (LitServe, fastText, Lightning) that kiln's install does
not hold lives in its own venv under .bench/<name>, made on first use with pinned versions and
made again when the pins change. kiln's own environment is added after the venv's packages (a
.pth file), so the peer runs against the same torch, numpy and kiln, and only what it adds is
installed (`--no-deps`).

    from bench_venv import bench_python
    python = bench_python("fasttext", ("fasttext-wheel==0.9.2", "pybind11==3.1.0"))
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / ".bench"


def bench_python(name: str, packages: tuple[str, ...], *, deps: bool = False) -> Path:
    """The python of the venv .bench/<name> holding `packages` (and kiln's environment).
    `deps=True` lets pip install their dependencies too (those kiln's environment lacks)."""
    venv = BENCH_DIR / name
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    # kiln's environment by its real path, in the stamp too: a venv made from a checkout that
    # links this .venv (the docs tests' temporary ones) named a folder gone with the test, and
    # every later bench found neither numpy nor Lightning's dependencies.
    kiln_site = str(Path(sysconfig.get_paths()["purelib"]).resolve())
    wanted = " ".join(packages) + (" +deps" if deps else "") + f" on {kiln_site}"
    if stamp.is_file() and stamp.read_text() == wanted and python.exists():
        return python
    print(f"making the bench venv {venv} ({wanted})", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # kiln's environment as a site dir (its .pth files too, so kiln's editable install works),
    # after the venv's own packages.
    Path(site, "kiln_env.pth").write_text(f"import site; site.addsitedir({kiln_site!r})\n")
    pip = [str(python), "-m", "pip", "install", "--quiet", *([] if deps else ["--no-deps"])]
    subprocess.run([*pip, *packages], check=True)
    stamp.write_text(wanted)
    return python
