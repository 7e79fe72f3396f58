"""torchrun with 2 CPU processes (gloo) against one process on the same global batch."""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch

from kiln.checkpoint import load_checkpoint
from kiln.cli.paths import REPO_ROOT
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
    """Two ranks, half the batch each, end where one process with the whole batch ends; they
    share one run directory, named by Hydra (no hydra.run.dir). One torchrun run checked for
    both: each costs three fresh processes on the 2-core CI machine."""
    single_dir = tmp_path / "single"
    train_in_process(single_dir, *SAME_RUN, "data.batch_size=32")  # the process is torchrun's
    ddp = run_train(
        tmp_path / "unused",
        *SAME_RUN,
        "trainer=ddp",
        "data.batch_size=16",
        launcher=TORCHRUN,
        cwd=tmp_path,
        explicit_run_dir=False,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    run_dirs = [p.parent for p in (tmp_path / "outputs").glob("**/summary.json")]
    assert len(run_dirs) == 1 and "-ddp-" in run_dirs[0].name, run_dirs
    assert len(list((tmp_path / "outputs").glob("**/.hydra"))) == 1
    (ddp_dir,) = run_dirs

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


SLOW_REPORT = """
import time
import kiln.cli.train as train
_record = train.record_failure
def record_slowly(*args, **kwargs):
    time.sleep(4)  # the main rank reports late: the other rank, already done, must wait for it
    return _record(*args, **kwargs)
train.record_failure = record_slowly
"""


def test_nonfinite_loss_stops_every_rank_and_they_wait_for_the_main_ranks_fail_line(tmp_path):
    """A non-finite loss under DDP stops every rank with one [FAIL] line. torchrun stops every
    worker once one exits non-zero: rank 1 used to exit at once and cut rank 0's [FAIL] line and
    summary whenever rank 0 was slower to report (here, 4 s slower)."""
    (tmp_path / "slow_report.py").write_text(SLOW_REPORT)
    run_dir = tmp_path / "run"
    result = run_train(
        run_dir,
        "trainer=ddp",
        *DIVERGING,
        "plugins=[slow_report]",
        "env.progress_bar=false",
        f"output_root={tmp_path}/outputs",
        launcher=TORCHRUN,
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode != 0
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


# ---------------------------------------------------------------------------------------------
# Parameters used only in some steps, and ranks that stop: one [FAIL] line, summary.json and
# failures.log however it happens (the main rank may be stuck in a collective; a rank that
# gloo aborts in C++ says nothing).

PLUGIN = '''
import math, os
import pytest
import torch
from torch import nn
from kiln.config.model import MlpConfig
from kiln.registry import register_model

RANK = int(os.environ.get("RANK", 0))


class RankRefine(nn.Module):
    """Uses `refine` in every training step, except on rank 1 from its 4th one with grad."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.body = nn.Linear(spec.channels * math.prod(spec.image_size), 32)
        self.refine = nn.Linear(32, 32)
        self.head = nn.Linear(32, spec.num_classes)
        self.calls = 0

    def forward(self, x):
        h = self.body(x.flatten(1)).relu()
        if self.training and torch.is_grad_enabled():
            self.calls += 1
        if not (RANK == 1 and self.calls > 3):
            h = h + self.refine(h)
        return self.head(h)


class AbortsOnRank1(nn.Module):
    """Rank 1's process dies in C++ (as gloo's abort on a collective mismatch kills it) at its
    3rd training step."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(spec.channels * math.prod(spec.image_size), spec.num_classes)
        self.calls = 0

    def forward(self, x):
        if self.training and torch.is_grad_enabled() and x.shape[0] == 16:  # a training batch
            self.calls += 1
            if RANK == 1 and self.calls == 3:
                os.abort()
        return self.fc(x.flatten(1))


register_model("rank_refine", config=MlpConfig)(RankRefine)
register_model("aborts_on_rank1", config=MlpConfig)(AbortsOnRank1)
'''


def ddp_run(tmp_path, *overrides, timeout=300):
    (tmp_path / "ddp_models.py").write_text(PLUGIN)
    run_dir = tmp_path / "run"
    result = run_train(
        run_dir,
        "trainer=ddp",
        "plugins=[ddp_models]",
        "data.batch_size=16",
        "env.progress_bar=false",
        "logger=none",
        f"output_root={tmp_path}/outputs",
        *overrides,
        launcher=TORCHRUN,
        cwd=tmp_path,
        timeout=timeout,
    )
    fails = [line for line in result.stderr.splitlines() if line.startswith("[FAIL]")]
    logged = (tmp_path / "outputs" / "failures.log").read_text().splitlines()
    return result, run_dir, fails, logged


def test_parameters_used_in_some_steps_stop_a_ddp_run_before_step_1(tmp_path):
    """The data decides whether `refine` runs (`if bright.any()`): the probe's per-sample
    backward finds it on every rank, and DDP without find_unused_parameters stops there."""
    from .broken_models import BROKEN

    (tmp_path / "conditional.py").write_text(
        "from kiln.config.model import MlpConfig\nfrom kiln.registry import register_model\n"
        "from tests.broken_models import ConditionalRefine\n"
        "register_model('conditional_refine', config=MlpConfig)(ConditionalRefine)\n"
    )
    run_dir = tmp_path / "run"
    result = run_train(
        run_dir,
        "trainer=ddp",
        "plugins=[conditional]",
        "model=mlp",
        "model.name=conditional_refine",
        "env.progress_bar=false",
        "logger=none",
        f"output_root={tmp_path}/outputs",
        launcher=TORCHRUN,
        cwd=tmp_path,
        timeout=300,
        env_overrides={"PYTHONPATH": str(REPO_ROOT)},
    )
    fails = [line for line in result.stderr.splitlines() if line.startswith("[FAIL]")]
    assert fails == [
        "[FAIL] digits-conditional_refine | DDP | amp=False | dead gradients @ step 0"
    ], result.stderr[-3000:]
    needle = next(b.needle for b in BROKEN if b.name == "conditional_refine")
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and needle in summary["error"]
    check = summary["failed_check"]
    assert (check["what"], check["module"]) == ("dead gradients", "refine")
    assert check["kind"] == "conditional parameters"  # the dead-gradient check's DDP kind
    logged = (tmp_path / "outputs" / "failures.log").read_text().splitlines()
    assert logged[0] == fails[0] and "trainer.find_unused_parameters=true" in logged[1]
    from kiln.triage import triage

    _, causes = triage(run_dir)  # replayed in one process, the DDP plan's conditional check on
    assert causes[0].title == "parameters used only in some steps in refine", causes


@pytest.mark.slow  # two torchrun runs of ~1 min each on the 2-core CI machine
def test_a_rank_whose_step_leaves_a_parameter_without_gradient_ends_in_one_fail_line(tmp_path):
    """Rank 1 stops using `refine` at a later step (the probes' check is skipped here): its step
    names the parameters and stops before its next collective, telling the other ranks why;
    rank 0, stuck in the gradient reduction rank 1 never joins, has its watch report it."""
    result, run_dir, fails, logged = ddp_run(
        tmp_path,
        "model=mlp",
        "model.name=rank_refine",
        "trainer.max_steps=8",
        "trainer.skip_checks=[dead_gradients]",
    )
    assert len(fails) == 1 and "| DDP | amp=False | dead gradients @ step " in fails[0], (
        result.stderr[-3000:]
    )
    summary = read_summary(run_dir)
    assert summary["status"] == "failed"
    assert (
        "rank 1: dead gradients" in summary["error"]
        and "refine.weight, refine.bias" in (summary["error"])
    )
    assert logged[0] == fails[0] and "got no gradient at step" in logged[1]


@pytest.mark.slow
def test_a_rank_that_dies_in_cpp_still_ends_in_one_fail_line_and_a_summary(tmp_path):
    """Rank 1 dies without a word (os.abort, as gloo's collective-mismatch abort kills it).
    Rank 0's reduction fails, and torchrun's SIGTERM arrives while it reports: the report is
    written first (it used to be cut: no [FAIL] line, no summary.json, no failures.log)."""
    result, run_dir, fails, logged = ddp_run(
        tmp_path,
        "model=mlp",
        "model.name=aborts_on_rank1",
        "trainer.max_steps=8",
    )
    assert len(fails) == 1, result.stderr[-3000:]
    assert re.fullmatch(
        r"\[FAIL\] digits-aborts_on_rank1 \| DDP \| amp=False \| \S.* @ step [1-9]", fails[0]
    ), fails
    assert read_summary(run_dir)["status"] == "failed"
    assert logged[0] == fails[0]


@pytest.mark.slow  # a torchrun run of ~1 min on the 2-core CI machine
def test_a_layer_built_in_forward_is_named_on_every_rank_after_step_1(tmp_path):
    """The optimizer (and DDP's reducer) are built before any forward: a layer built in forward
    is neither stepped nor reduced (0.65 under DDP where the control reached 0.95). Every rank
    names it after step 1, before anything is saved; one [FAIL] line."""
    (tmp_path / "built_in_forward.py").write_text(
        "from kiln.config.model import MlpConfig\nfrom kiln.registry import register_model\n"
        "from tests.broken_models import BuiltInForward\n"
        "register_model('built_in_forward', config=MlpConfig)(BuiltInForward)\n"
    )
    run_dir = tmp_path / "run"
    result = run_train(
        run_dir,
        "trainer=ddp",
        "plugins=[built_in_forward]",
        "model=mlp",
        "model.name=built_in_forward",
        "env.progress_bar=false",
        "logger=none",
        f"output_root={tmp_path}/outputs",
        launcher=TORCHRUN,
        cwd=tmp_path,
        timeout=300,
        env_overrides={"PYTHONPATH": str(REPO_ROOT)},
    )
    fails = [line for line in result.stderr.splitlines() if line.startswith("[FAIL]")]
    assert fails == [
        "[FAIL] digits-built_in_forward | DDP | amp=False | optimizer coverage @ step 1"
    ], result.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["failed_check"]["kind"] == "optimizer coverage"
    assert "under DDP they are not reduced either" in summary["error"]
    assert not (run_dir / "checkpoints" / "best.pt").exists()
