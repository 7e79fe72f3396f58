"""Exact resume after a real SIGKILL, preemption by SIGTERM, and the [FAIL] line, each through the
real train.py in a subprocess."""

from __future__ import annotations

import logging
import re
import signal
import sys
import time

import pytest
import torch

from kiln.checkpoint import load_checkpoint
from kiln.cli.paths import REPO_ROOT
from kiln.engine.checkpointer import ResumeError

from .conftest import (
    DIVERGING,
    read_metrics,
    read_summary,
    run_train,
    start_process,
    train_in_process,
    train_main_here,
)

# Small batches make long epochs, so a kill right after the first step checkpoint lands
# mid-epoch; dropout stays on so the RNG state must be restored too.
RESUMABLE = (
    "trainer.deterministic=true",
    "trainer.max_epochs=2",
    "trainer.checkpoint_every_n_steps=10",
    "trainer.log_every_n_steps=1",
    "data.batch_size=8",
    "model.dropout=0.2",
    "env.progress_bar=false",
)


def start_train(run_dir, *overrides):
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
    return start_process(cmd, run_dir.parent)


def wait_for(path, proc, timeout=180.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"run ended before {path.name} appeared: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.005)


def final_weights(run_dir):
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]


def test_sigkill_mid_epoch_then_resume_matches_an_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"  # in this process: the processes are the other two
    train_in_process(reference, *RESUMABLE)

    interrupted = tmp_path / "interrupted"
    proc = start_train(interrupted, *RESUMABLE)
    wait_for(interrupted / "checkpoints" / "last.pt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    saved = load_checkpoint(interrupted / "checkpoints" / "last.pt")["state"]
    assert saved["epoch"] == 0 and saved["batch_in_epoch"] > 0  # killed mid-epoch

    resumed = run_train(interrupted, *RESUMABLE, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (interrupted / "train.log").read_text()
    assert f"at epoch 0, step {saved['global_step']} (batch {saved['batch_in_epoch']}" in log

    expected, actual = final_weights(reference), final_weights(interrupted)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs after resume"
    assert read_summary(interrupted)["steps"] == read_summary(reference)["steps"]
    # The resumed run continued at the next step, not at the start of the epoch.
    steps = [m["step"] for m in read_metrics(interrupted) if "loss" in m]
    assert steps.count(saved["global_step"] + 1) >= 1


def test_truncated_last_checkpoint_is_reported_and_an_older_one_used(tmp_path, caplog):
    run_dir = tmp_path / "run"
    settings = ("trainer.max_epochs=2", "env.progress_bar=false", "logger=none")
    train_in_process(run_dir, *settings)
    last = run_dir / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    with caplog.at_level(logging.INFO):
        summary = train_in_process(run_dir, *settings, "resume=auto")
    assert "last.pt is truncated or corrupt" in caplog.text
    assert "resumed from" in caplog.text and "epoch-2.pt" in caplog.text
    assert summary["epochs"] == 2


@pytest.mark.parametrize("scheduler", ["onecycle", "cosine"])
def test_resume_with_a_different_schedule_length_is_refused(tmp_path, scheduler):
    run_dir = tmp_path / "run"
    settings = (f"scheduler={scheduler}", "env.progress_bar=false", "logger=none")
    train_in_process(run_dir, *settings, "trainer.max_epochs=1")
    expected = (
        f"trainer.max_epochs: 1 -> 3 (<planned optimizer steps>: the {scheduler} schedule would "
        "span 69 optimizer steps, not 23)"
    )
    with pytest.raises(ResumeError, match=re.escape(expected)):
        train_in_process(run_dir, *settings, "trainer.max_epochs=3", "resume=auto")


def test_sigterm_checkpoints_at_a_step_boundary_and_exits_75(tmp_path):
    run_dir = tmp_path / "run"
    settings = (
        "trainer.max_epochs=50",
        "data.batch_size=8",
        "env.progress_bar=false",
        "trainer.checkpoint_every_n_steps=10",
    )
    proc = start_train(run_dir, *settings)
    wait_for(run_dir / "checkpoints" / "last.pt", proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert proc.returncode == 75
    summary = read_summary(run_dir)
    assert summary["status"] == "preempted" and "resume=auto" in summary["error"]
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")["state"]
    assert state["global_step"] == summary["steps"] > 0


def test_nonfinite_loss_fails_with_one_greppable_line(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(
        run_dir,
        *DIVERGING,
        "trainer.max_epochs=1",
        "env.progress_bar=false",
        f"output_root={tmp_path}/outputs",
    )
    assert result.returncode == 1
    pattern = r"^\[FAIL\] digits-mlp \| single \| amp=False \| loss (NaN|Inf) @ step (\d+)$"
    lines = [line for line in result.stderr.splitlines() if line.startswith("[FAIL]")]
    assert len(lines) == 1 and re.match(pattern, lines[0]), result.stderr[-2000:]
    logged = (tmp_path / "outputs" / "failures.log").read_text().splitlines()
    assert logged[0] == lines[0] and logged[1].startswith("  non-finite terms: main")
    after = result.stderr.split(lines[0], 1)[1].splitlines()
    assert after[1].startswith("  non-finite terms:")
    assert after[2] == "run directory: run"  # relative to the working directory
    assert "Traceback" in (run_dir / "train.log").read_text()  # the detail goes to the log
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and "@ step" in summary["error"]
    stats = (run_dir / "nan_batch_stats.json").read_text()
    assert '"batch[0]"' in stats and '"nan"' in stats
    assert len(list((tmp_path / "outputs" / "failures").glob("*.json"))) == 1


def test_nan_policy_skip_finishes_and_counts_without_logging_a_zero_loss(tmp_path):
    run_dir = tmp_path / "run"
    summary = train_in_process(
        run_dir,
        *DIVERGING,
        "trainer.nan_policy=skip",
        "trainer.max_skipped_steps=-1",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1",
        "env.progress_bar=false",
        f"output_root={tmp_path}/outputs",
    )
    # Every step skipped: the run learned nothing, and says so.
    assert summary["status"] == "at_chance" and summary["nonfinite_skipped"] > 0
    assert not (tmp_path / "outputs" / "failures.log").exists()
    losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    assert 0.0 not in losses  # a skipped step has no loss: logged as NaN, never as 0.0


def test_nan_policy_skip_fails_past_max_skipped_steps_with_its_own_line(tmp_path, capfd):
    run_dir = tmp_path / "run"
    code, stderr = train_main_here(
        capfd,
        f"hydra.run.dir={run_dir}",
        *DIVERGING,
        "trainer.nan_policy=skip",
        "trainer.max_skipped_steps=5",
        "trainer.max_epochs=1",
        "env.progress_bar=false",
        f"output_root={tmp_path}/outputs",
    )
    assert code == 1, stderr[-2000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith("[FAIL]")]
    assert re.match(
        r"^\[FAIL\] digits-mlp \| single \| amp=False \| \d+ non-finite steps skipped "
        r"\(limit 5\) @ step \d+$",
        line,
    ), line
    assert int(line.split(" | ")[3].split()[0]) > 5
    assert read_summary(run_dir)["status"] == "failed"


def make_run(outputs, rel, name, checkpoint_age_s):
    import os

    run_dir = outputs / rel
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(f"name: {name}\n")
    (run_dir / "checkpoints").mkdir()
    last = run_dir / "checkpoints" / "last.pt"
    last.write_bytes(b"x")
    stamp = time.time() - checkpoint_age_s
    os.utime(last, (stamp, stamp))
    return run_dir


def test_resume_auto_picks_the_newest_run_of_the_same_experiment(tmp_path):
    from kiln.cli.resume import with_resume_run_dir

    outputs = tmp_path / "outputs"
    make_run(outputs, "2026-11-01/10-00-00", "digits-mlp", checkpoint_age_s=300)
    newest = make_run(outputs, "2026-11-02/09-00-00", "digits-mlp", checkpoint_age_s=60)
    make_run(outputs, "2026-11-03/09-00-00", "digits-resnet18", checkpoint_age_s=1)
    argv = with_resume_run_dir(["resume=auto"], "digits-mlp", outputs=outputs)
    assert argv == ["resume=auto", f"hydra.run.dir={newest}"]
    resnet = with_resume_run_dir(["resume=auto"], "digits-resnet18", outputs=outputs)
    assert resnet[-1].endswith("2026-11-03/09-00-00")
    assert with_resume_run_dir(["resume=auto"], "digits-resnet50", outputs=outputs) == [
        "resume=auto"
    ]  # no earlier run: start fresh
    assert with_resume_run_dir(["model=mlp"], "digits-mlp", outputs=outputs) == ["model=mlp"]
