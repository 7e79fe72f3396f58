"""torchrun with 2 CPU processes (gloo) against one process on the same global batch."""

from __future__ import annotations

import logging
import sys

import torch

from kiln.checkpoint import load_checkpoint
from kiln.engine.distributed import teardown

from .conftest import DIVERGING, read_summary, run_train, train_in_process

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# fp32, no dropout, no shuffle-dependent padding: 5 steps stay clear of the epoch's end.
SAME_RUN = (
    "model.dropout=0.0",
    "trainer.max_steps=5",
    "trainer.log_every_n_steps=1",
    "env.progress_bar=false",
    "scheduler=none",
    "optimizer=sgd",
)


def test_two_cpu_processes_match_one_process_with_the_same_global_batch(tmp_path):
    single_dir, ddp_dir = tmp_path / "single", tmp_path / "ddp"
    single = run_train(single_dir, *SAME_RUN, "data.batch_size=32")
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = run_train(ddp_dir, *SAME_RUN, "trainer=ddp", "data.batch_size=16", launcher=TORCHRUN)
    assert ddp.returncode == 0, ddp.stderr[-3000:]

    expected = load_checkpoint(single_dir / "checkpoints" / "last.pt")["model"]
    actual = load_checkpoint(ddp_dir / "checkpoints" / "last.pt")["model"]
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5)
    assert not any(key.startswith("module.") for key in actual)  # saved unwrapped

    single_summary, ddp_summary = read_summary(single_dir), read_summary(ddp_dir)
    assert ddp_summary["steps"] == single_summary["steps"] == 5
    # Eval metrics are all-reduced over both ranks' shards of the validation set.
    assert abs(ddp_summary["val_acc"] - single_summary["val_acc"]) < 0.01
    log = (ddp_dir / "train.log").read_text()
    assert log.count("step 5 loss") == 1  # only rank 0 logs


def test_ranks_share_one_run_directory_without_hydra_run_dir(tmp_path):
    result = run_train(
        tmp_path / "unused",
        "trainer=ddp",
        "trainer.max_steps=2",
        "env.progress_bar=false",
        launcher=TORCHRUN,
        cwd=tmp_path,
        explicit_run_dir=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dirs = [p.parent for p in (tmp_path / "outputs").glob("**/summary.json")]
    assert len(run_dirs) == 1 and "-ddp-" in run_dirs[0].name
    assert len(list((tmp_path / "outputs").glob("**/.hydra"))) == 1


def test_nonfinite_loss_under_ddp_stops_every_rank_with_one_fail_line(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(
        run_dir,
        "trainer=ddp",
        *DIVERGING,
        "env.progress_bar=false",
        f"output_root={tmp_path}/outputs",
        launcher=TORCHRUN,
        timeout=240,
    )
    assert result.returncode != 0
    fails = [line for line in result.stderr.splitlines() if line.startswith("[FAIL]")]
    assert len(fails) == 1 and "| DDP | amp=False | loss" in fails[0], result.stderr[-2000:]
    assert read_summary(run_dir)["status"] == "failed"


SLOW_REPORT = """
import time
import kiln.cli.train as train
_record = train.record_failure
def record_slowly(*args, **kwargs):
    time.sleep(4)  # the main rank reports late: the other rank, already done, must wait for it
    return _record(*args, **kwargs)
train.record_failure = record_slowly
"""


def test_the_other_ranks_wait_for_the_main_ranks_fail_line_before_they_exit(tmp_path):
    """torchrun stops every worker once one exits non-zero: rank 1 used to exit at once and cut
    rank 0's [FAIL] line and summary whenever rank 0 was slower to report (here, 4 s slower)."""
    (tmp_path / "slow_report.py").write_text(SLOW_REPORT)
    run_dir = tmp_path / "run"
    result = run_train(
        run_dir, "trainer=ddp", *DIVERGING, "plugins=[slow_report]", "env.progress_bar=false",
        f"output_root={tmp_path}/outputs", launcher=TORCHRUN, cwd=tmp_path, timeout=240,
    )  # fmt: skip
    fails = [line for line in result.stderr.splitlines() if line.startswith("[FAIL]")]
    assert len(fails) == 1 and "| DDP | amp=False | loss" in fails[0], result.stderr[-2000:]
    assert read_summary(run_dir)["status"] == "failed"


def test_trainer_ddp_without_torchrun_trains_as_one_rank(tmp_path, caplog):
    """A plain `python train.py trainer=ddp` runs as a process group of one (it used to fail on a
    missing MASTER_ADDR), and says so."""
    settings = ("trainer=ddp", "trainer.max_steps=2", "env.progress_bar=false", "logger=none")
    try:
        with caplog.at_level(logging.WARNING):
            summary = train_in_process(tmp_path / "run", *settings)
    finally:
        teardown()
    assert summary["status"] == "ok" and summary["steps"] == 2
    assert "not launched by torchrun: training as one rank" in caplog.text
