"""A run directory and its process: one writer at a time, Ctrl-C as a preemption, and a full disk
ending in one line. Real processes, real signals, a real full filesystem."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from kiln.cli.paths import REPO_ROOT

from .conftest import SUBPROCESS_ENV, read_summary, run_train, start_process

QUIET = ("env.progress_bar=false", "logger=none", "trainer.log_every_n_steps=1")
LONG = ("scheduler=none", "trainer.max_epochs=1000")  # runs until the test stops it


def train_py(run_dir, *overrides):
    return [sys.executable, str(REPO_ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides]


def wait_for(predicate, timeout=180.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended early ({proc.returncode}): {err[-3000:]}")
        time.sleep(0.2)
    raise AssertionError("timed out")


def steps_logged(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]


def test_a_second_process_on_a_running_run_refuses_at_once_naming_the_first(tmp_path):
    run_dir = tmp_path / "run"
    first = start_process(train_py(run_dir, *QUIET, *LONG, "resume=auto"), cwd=tmp_path)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "last.pt").is_file(), proc=first)
        started = time.monotonic()
        second = subprocess.run(
            train_py(run_dir, *QUIET, *LONG, "resume=auto"), cwd=tmp_path, env=SUBPROCESS_ENV,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        took = time.monotonic() - started
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert second.returncode == 2, second.stderr[-2000:]
    (line,) = second.stderr.strip().splitlines()
    assert line.startswith(f"error: run directory {run_dir} is in use by process {first.pid} (")
    assert "one run directory has one writer" in line and f"kill {first.pid}" in line
    assert took < 30  # at once: before any data or model is built
    steps = steps_logged(run_dir)
    assert steps == sorted(set(steps))  # no step written twice
    assert read_summary(run_dir)["status"] == "preempted"  # the first run's own record

    # The lock went with the process: the same command now resumes.
    third = run_train(run_dir, *QUIET, "scheduler=none", "trainer.max_epochs=1", "resume=auto")
    assert third.returncode == 0, third.stderr[-2000:]
