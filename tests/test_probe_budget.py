"""The checks before step 1 under a budget (trainer.probe_budget) and once per model
(trainer.probe_cache): what does not fit is skipped and named, the learn probe reads the first
real steps instead, a zero-initialised model's second step is step 2 of the run, and a model that
passed before is not probed again (kiln.guards.probes, kiln.guards.probe_cache)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from kiln.engine.run import train
from kiln.guards.learn_probe import CannotLearnError
from kiln.guards.live_gradients import DeadGradientError
from kiln.guards.purity import ImpureForwardError

from .broken_models import ScalesInputsInPlace, TinyLogits, ZeroGradients
from .conftest import SUBPROCESS_ENV, compose_config

QUIET = ("env.progress_bar=false", "logger=none", "trainer.log_every_n_steps=5")
# No room for anything but the observed step and what reads it for free.
NO_ROOM = ("trainer.probe_budget.min_s=0", "trainer.probe_budget.max_s=0")
# Every check run whatever the machine's load, where which checks a budget cuts is not the point
# (a loaded run saw the learn probe cut to its reference loss).
EVERY_CHECK = (*QUIET, "trainer.probe_budget.enforce=false")


def summary_of(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def logged(caplog) -> str:
    return "\n".join(record.getMessage() for record in caplog.records)


def test_a_budget_with_no_room_names_every_check_it_skips_and_the_run_still_learns(
    tmp_path, caplog
):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        summary = train(compose_config(*QUIET, "trainer.max_epochs=1", *NO_ROOM), run_dir)
    assert summary["status"] == "ok" and summary["probe_budget_s"] == 0
    skipped = set(summary["probe_skipped"])
    assert {"rule 1", "rule 3", "determinism", "batch dependence", "device"} <= skipped
    assert summary["probe_first_steps"] == ["learn probe"]  # moved, not skipped
    assert "learn probe" not in skipped
    # What reads the observed step for free still runs.
    assert {"step probe", "numerics", "loss terms"} <= set(summary["probe_times_s"])
    log = logged(caplog)
    said = [line for line in log.splitlines() if "probe budget: skipped" in line]
    assert len(said) == 1 and "rule 1 (est." in said[0] and "determinism (est." in said[0]
    assert "the learn probe read the first steps instead" in said[0]
    assert "learn probe: the probe batch's loss fell" in log


def test_the_budget_follows_the_epoch_between_its_floor_and_its_cap(tmp_path):
    """min_s allows a small run everything; a share of a long epoch is capped at max_s."""
    roomy = train(compose_config(*QUIET, "trainer.max_steps=2"), tmp_path / "roomy")
    assert roomy["probe_budget_s"] == 1.0 and not roomy["probe_skipped"]
    assert 0 < roomy["probe_epoch_estimate_s"] < 50  # digits: 1,437 samples, a small MLP
    capped = train(
        compose_config(
            *QUIET,
            "trainer.max_steps=2",
            "trainer.probe_budget.share_of_epoch=1",
            "trainer.probe_cache=false",
            "trainer.probe_budget.max_s=0.001",
            "trainer.probe_budget.min_s=0",
        ),
        tmp_path / "capped",
    )
    assert capped["probe_budget_s"] == 0.001 and capped["probe_skipped"]


def test_the_learn_probe_read_from_the_first_steps_still_stops_a_model_that_cannot_learn(
    tmp_path, temporary_model
):
    cfg = temporary_model(
        "tiny_logits_budget", TinyLogits, *QUIET, "trainer.max_epochs=2", *NO_ROOM
    )
    with pytest.raises(CannotLearnError) as info:
        train(cfg, tmp_path / "run")
    message = str(info.value)
    assert message.startswith("cannot learn (")
    assert "the run's first steps did not lower it either" in message
    assert "after step 20" in message
    summary = summary_of(tmp_path / "run")
    assert summary["status"] == "failed" and summary["steps"] == 20
    assert summary["failed_check"]["what"] == "cannot learn"


def test_a_zero_gradient_with_no_room_for_a_second_probe_step_is_confirmed_at_step_2(
    tmp_path, temporary_model
):
    cfg = temporary_model(
        "zero_gate_budget",
        ZeroGradients,
        *QUIET,
        "trainer.max_epochs=1",
        "trainer.probe_budget.min_s=0",
        "trainer.probe_budget.max_s=1e-9",
        "trainer.learn_probe=false",
    )
    with pytest.raises(DeadGradientError) as info:
        train(cfg, tmp_path / "run")
    assert "again at step 2 of the run" in str(info.value)
    assert "branch.fc.weight" in str(info.value)
    assert summary_of(tmp_path / "run")["steps"] == 1


def test_an_in_place_forward_is_stopped_even_with_no_room_for_the_purity_check(
    tmp_path, temporary_model
):
    """The observed step runs first and sees its batch change: the purity finding is in hand,
    whatever the budget (left out, x /= 16 in forward ended `ok`). The summary of a run a
    probe stopped keeps what the probes took, the failing check's time included."""
    cfg = temporary_model(
        "in_place_budget",
        ScalesInputsInPlace,
        *QUIET,
        "trainer.max_epochs=1",
        "trainer.probe_cache=false",
        *NO_ROOM,
    )
    with pytest.raises(ImpureForwardError, match="changed the batch it was given: batch"):
        train(cfg, tmp_path / "run")
    summary = summary_of(tmp_path / "run")
    assert summary["steps"] == 0 and summary["failed_check"]["kind"] == "purity"
    assert summary["probe_time_s"] > 0 and summary["probe_budget_s"] == 0
    assert {"step probe", "purity"} <= set(summary["probe_times_s"])
    assert "rule 1" in summary["probe_skipped"]  # the budget did leave the others out


def test_a_model_that_passed_is_not_probed_again_and_a_changed_one_is(tmp_path, caplog):
    first = train(compose_config(*EVERY_CHECK, "trainer.max_steps=2"), tmp_path / "first")
    ran = set(first["probe_times_s"])
    assert {"rule 1", "determinism", "learn probe"} <= ran and not first["probe_cached"]

    with caplog.at_level(logging.INFO):
        again = train(compose_config(*EVERY_CHECK, "trainer.max_steps=2"), tmp_path / "again")
    assert {"rule 1", "determinism", "learn probe"} <= set(again["probe_cached"])
    assert not set(again["probe_times_s"]) & {"rule 1", "determinism", "learn probe"}
    log = logged(caplog)
    assert "probes: this model passed" in log and "not run again" in log
    assert str(tmp_path / "first") in log  # where it passed

    # Another learning rate: the model's checks stand, the learn probe runs for it.
    lr = train(
        compose_config(*EVERY_CHECK, "trainer.max_steps=2", "optimizer.lr=0.01"), tmp_path / "lr"
    )
    assert "learn probe" in lr["probe_times_s"] and "rule 1" in lr["probe_cached"]
    # Another model: everything again.
    wider = train(
        compose_config(*EVERY_CHECK, "trainer.max_steps=2", "model.hidden_dims=[64]"),
        tmp_path / "wider",
    )
    assert not wider["probe_cached"] and "rule 1" in wider["probe_times_s"]
    # Asked not to: everything again.
    off = train(
        compose_config(*EVERY_CHECK, "trainer.max_steps=2", "trainer.probe_cache=false"),
        tmp_path / "off",
    )
    assert not off["probe_cached"] and "determinism" in off["probe_times_s"]


def test_a_failure_is_never_kept_and_its_model_meets_the_check_again(tmp_path, temporary_model):
    cfg = temporary_model("tiny_logits_cache", TinyLogits, *QUIET, "trainer.max_epochs=1")
    for attempt in ("first", "second"):
        with pytest.raises(CannotLearnError):
            train(cfg, tmp_path / attempt)
        assert summary_of(tmp_path / attempt)["steps"] == 0  # stopped before step 1 each time


def test_a_resumed_run_is_not_probed_again(tmp_path):
    run_dir = tmp_path / "run"
    train(compose_config(*QUIET, "scheduler=none", "trainer.max_steps=3"), run_dir)
    resumed = train(
        compose_config(*QUIET, "scheduler=none", "trainer.max_steps=6", "resume=auto"), run_dir
    )
    assert resumed["steps"] == 6 and "determinism" in resumed["probe_cached"]


MEMORY = """
import sys, torch
from pathlib import Path
from kiln.config import load_config
from kiln.engine.distributed import DistInfo
from kiln.engine.run import build_run

def status(key):  # kB, from the kernel's own accounting
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1])

torch.set_num_threads(1)
cfg = load_config(sys.argv[3:])
built = build_run(cfg, Path(sys.argv[1]), DistInfo(), torch.device("cpu"), lambda *a: None)
trainer = built.trainer
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from what is resident now
before = status("VmRSS")
if sys.argv[2] == "probes":
    trainer.run_probes()
else:
    trainer.train_step(trainer.epoch_batches(), 1)
print((status("VmHWM") - before) / 1024)
"""


def test_the_probes_peak_memory_is_at_most_one_training_steps(tmp_path):
    """A model whose weights dominate its memory (4,096 x 4,096 hidden, 67 MB of them), every
    check on: the probes never copy it where it lives (the learn probe steps it in place and
    keeps the weights in a file meanwhile), so their peak stays within 1.1x of one step's."""
    model = (
        "model.hidden_dims=[4096,4096]",
        "data.batch_size=32",
        "trainer.probe_cache=false",
        "trainer.probe_budget.enforce=false",
        "logger=none",
    )
    grown = {}
    for what in ("probes", "step"):
        result = subprocess.run(
            [sys.executable, "-c", MEMORY, str(tmp_path / what), what, *model],
            capture_output=True,
            text=True,
            env=SUBPROCESS_ENV,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        grown[what] = float(result.stdout.split()[-1])
    assert grown["step"] > 150, grown  # gradients and AdamW's two moments: 3 x 67 MB
    assert grown["probes"] <= 1.1 * grown["step"], grown


def test_the_fp16_probe_traces_only_a_forward_that_overflows(monkeypatch):
    """The fp16 probe's forward runs plain; op by op (2-5 times its cost) only when it left
    Inf/NaN, with the same dropout masks, and the op is still named."""
    import torch
    from torch import nn

    from kiln.guards import fp16
    from kiln.guards.numerics import NumericsError

    traced = []
    real = fp16._traced_fp16_forward
    monkeypatch.setattr(fp16, "_traced_fp16_forward", lambda *a: traced.append(1) or real(*a))
    forward = lambda model, batch, train: model(batch)  # noqa: E731
    fp16.check_fp16(nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 2)), torch.ones(3, 4), forward)
    assert traced == []
    big = nn.Linear(4, 2)
    nn.init.constant_(big.weight, 1e4)  # 4 inputs of 10 x 1e4: beyond float16's 65504
    overflows = nn.Sequential(nn.Dropout(0.5), big)
    with pytest.raises(NumericsError, match=r"under fp16 autocast .* in 1 \(Linear\) makes Inf"):
        fp16.check_fp16(overflows, torch.full((3, 4), 10.0), forward)
    assert traced == [1]
