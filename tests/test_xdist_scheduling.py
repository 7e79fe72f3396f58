"""make test-all's scheduler (tests/xdist_scheduling.py) in a real pytest-xdist run of its own,
two workers, one of which dies in a test."""

from __future__ import annotations

import subprocess
import sys

from kiln.cli.paths import REPO_ROOT

CONFTEST = f"""
import sys
sys.path.insert(0, {str(REPO_ROOT)!r})
from tests.xdist_scheduling import SpreadSomeFiles

def pytest_xdist_make_scheduler(config, log):
    config.option.loadscopereorder = False
    return SpreadSomeFiles(config, log, ("test_spread.py",))
"""
TESTS = """
import os, pathlib, time

def test_0(): time.sleep(0.3)
def test_1(): time.sleep(0.3)
def test_dies():
    pathlib.Path("died").open("a").write("x")
    os._exit(1)
""" + "".join(f"def test_after_{i}(): time.sleep(0.1)\n" for i in range(8))


def test_a_worker_that_dies_costs_its_own_test_and_the_run_ends(tmp_path):
    """With xdist's own loadscope the run below waits forever once the worker is replaced."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_spread.py").write_text(TESTS)
    (tmp_path / "test_whole_file.py").write_text("def test_a(): pass\ndef test_b(): pass\n")
    args = ["-n", "2", "--dist", "loadscope", "-p", "no:cacheprovider", "-p", "no:randomly"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-q", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 failed, 12 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "died").read_text() == "x"  # not run again by the worker's replacement
