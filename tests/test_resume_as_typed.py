"""`python train.py resume=auto` exactly as a user types it: no hydra.run.dir, the run directory
found by the CLI itself under ./outputs, after a finished run and after a preempted one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from kiln.checkpoint import load_checkpoint
from kiln.cli.paths import REPO_ROOT

from .conftest import python_process, run_python

SMALL = ("trainer.max_epochs=1", "env.progress_bar=false")


def as_typed(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python train.py <args>` run in `cwd`, where train.py is the repository's own file."""
    return run_python([sys.executable, "train.py", *args], cwd, timeout=timeout)


def user_checkout(tmp_path: Path) -> Path:
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    (cwd / "train.py").symlink_to(REPO_ROOT / "train.py")
    return cwd


def run_dirs(cwd: Path) -> list[Path]:
    return sorted(p.parent.parent for p in (cwd / "outputs").glob("*/*/.hydra/config.yaml"))


def test_resume_auto_after_a_preempted_run_and_after_a_finished_one(tmp_path):
    """One run, stopped by SIGTERM, resumed as typed to its end, then the same command again
    (a finished run resumed trains no further step): each in the run's own directory."""
    cwd = user_checkout(tmp_path)
    settings = (
        "trainer.max_epochs=3",
        "data.batch_size=8",
        "trainer.limit_train_batches=40",
        "trainer.checkpoint_every_n_steps=5",
        "env.progress_bar=false",
    )
    proc = python_process([sys.executable, "train.py", *settings], cwd)
    deadline = time.monotonic() + 180
    while not list((cwd / "outputs").glob("*/*/checkpoints/last.pt")):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    assert "resume with resume=auto" in stdout + stderr  # what the user is told to type next
    (run_dir,) = run_dirs(cwd)
    stopped_at = load_checkpoint(run_dir / "checkpoints" / "last.pt")["state"]["global_step"]

    resumed = as_typed(cwd, *settings, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert run_dirs(cwd) == [run_dir]
    log = (run_dir / "train.log").read_text()
    assert f"step {stopped_at}" in log and log.count("resumed from") == 1
    final = load_checkpoint(run_dir / "checkpoints" / "last.pt")["state"]
    assert final["epoch"] == 3 and final["global_step"] > stopped_at

    again = as_typed(cwd, *settings, "resume=auto")  # after a finished run
    assert again.returncode == 0, again.stderr[-3000:]
    assert run_dirs(cwd) == [run_dir]  # continued in its own directory, no new one
    assert (run_dir / "train.log").read_text().count("resumed from") == 2
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["state"] == final
