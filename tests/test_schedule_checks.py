"""Schedule sanity at start-up (kiln.engine.schedule_check) and early stopping that waits for
learning to start: a warm-up longer than the run, an lr at 0 for most of it, or early stopping
set to fire before the warm-up ends is one error line with the numbers, before anything trains;
the schedules kiln ships, at their defaults and at the run lengths tests use, pass."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
from torch.optim.lr_scheduler import LambdaLR

from kiln.cli.train import main as train_main
from kiln.config.optim import SchedulerConfig
from kiln.engine.optim import build_scheduler
from kiln.engine.run import train
from kiln.engine.schedule_check import ScheduleError, check_schedule, lr_curve
from kiln.registry import SCHEDULERS

from .conftest import compose_config

QUIET = ("env.progress_bar=false", "logger=none")


def curve_of(*overrides: str, steps: int = 230):
    cfg = compose_config(*overrides)
    return cfg, lr_curve(lambda opt, n: build_scheduler(opt, cfg.scheduler, n), steps)


SHIPPED = {
    "onecycle": ("scheduler=onecycle",),
    "cosine": ("scheduler=cosine",),
    "linear_warmup": ("scheduler=linear_warmup",),
    "none": ("scheduler=none",),
    "cosine-warmup-100": ("scheduler=cosine", "scheduler.warmup_steps=100"),
}
LENGTHS = (2, 23, 230, 50_000)
# A warm-up of 100 steps fits the runs longer than 100 steps (shorter ones are refused, below).
FITTING = [
    (name, steps)
    for name in SHIPPED
    for steps in LENGTHS
    if name != "cosine-warmup-100" or steps > 100
]


@pytest.mark.parametrize(("name", "steps"), FITTING, ids=[f"{n}-{s}" for n, s in FITTING])
def test_the_schedules_kiln_ships_pass_at_any_length(name, steps):
    cfg, curve = curve_of(*SHIPPED[name], steps=steps)
    check_schedule(
        curve,
        scheduler=cfg.scheduler.name,
        lr=cfg.optimizer.lr,
        steps_per_epoch=max(1, steps // 10),
        patience=2,
        patience_set=False,
    )


def test_a_warm_up_longer_than_the_run_is_one_error_line_with_the_numbers(tmp_path, capsys):
    """digits, 3 epochs: 69 optimizer steps; a warm-up of 1000 never reaches optimizer.lr."""
    with pytest.raises(SystemExit) as stopped:
        train_main(
            [
                *QUIET,
                "trainer.max_epochs=3",
                "scheduler=cosine",
                "scheduler.warmup_steps=1000",
                f"hydra.run.dir={tmp_path}/run",
            ]
        )
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(
        "error: the learning-rate warm-up is longer than the run (scheduler=cosine, 69 planned "
        "optimizer steps): the lr is still rising at the last step, 0.069 of optimizer.lr=0.003"
    ), lines[0]
    (finding,) = json.loads((tmp_path / "run" / "findings.json").read_text())
    assert finding["kind"] == "schedule" and "trainer.max_epochs" in finding["fix"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["failed_check"]["kind"] == "schedule"


def test_early_stopping_set_to_fire_before_the_warm_up_ends_is_refused():
    cfg = compose_config(
        *QUIET,
        "trainer.max_epochs=10",
        "trainer.early_stopping=1",
        "scheduler=cosine",
        "scheduler.warmup_steps=100",
    )
    with pytest.raises(ScheduleError) as info:
        start_up(cfg)
    assert str(info.value).startswith(
        "trainer.early_stopping=1 can end the run after epoch 2 (step 46), before the "
        "learning-rate warm-up ends at step 99 (epoch 5"
    ), str(info.value)
    assert info.value.fix == "trainer.early_stopping=5"
    assert start_up(replaced(cfg, "trainer", early_stopping=5)) == 99  # its own fix passes


def start_up(cfg) -> int:
    """What start-up checks of the schedule (kiln.engine.run.checked_schedule) with a digits
    run's numbers: 23 batches an epoch. Returns the step the warm-up ends at."""
    from kiln.engine.optim import total_optimizer_steps
    from kiln.engine.run import checked_schedule

    batches = 23
    planned = total_optimizer_steps(batches, cfg.trainer.max_epochs, 1, cfg.trainer.max_steps)
    warmup_end, _ = checked_schedule(cfg, planned, batches, cfg.trainer.early_stopping)
    return warmup_end


def replaced(cfg, group: str, **values):
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **values)})


@dataclass(frozen=True, kw_only=True)
class DropsToZeroConfig(SchedulerConfig):
    """A plugin's schedule: the lr falls to 0 after a share of the steps (meant: of an epoch)."""

    keep: float = 0.1


def build_drops_to_zero(optimizer, cfg, total_steps):
    return LambdaLR(optimizer, lambda step: 1.0 if step < cfg.keep * total_steps else 0.0)


@pytest.fixture
def drops_to_zero():
    SCHEDULERS.register("drops_to_zero", config=DropsToZeroConfig)(build_drops_to_zero)
    yield
    del SCHEDULERS._entries["drops_to_zero"]


def test_an_lr_at_zero_for_most_of_the_run_is_refused_for_any_schedule(drops_to_zero):
    """A plugin's schedule, read on the stand-in optimizer like kiln's own."""
    for keep, refused in ((0.1, True), (1.0, False)):  # the twin keeps its lr
        schedule = DropsToZeroConfig(name="drops_to_zero", keep=keep)
        curve = lr_curve(lambda opt, n, s=schedule: build_scheduler(opt, s, n), 230)
        check = lambda c=curve: check_schedule(  # noqa: E731
            c,
            scheduler="drops_to_zero",
            lr=0.003,
            steps_per_epoch=23,
            patience=None,
            patience_set=False,
        )
        if not refused:
            check()
            continue
        with pytest.raises(ScheduleError, match=r"below 0.001 of optimizer.lr=0.003 for 90%"):
            check()


def test_early_stopping_waits_while_the_run_is_at_chance(tmp_path, caplog):
    """A run that has learned nothing yet is not stopped for failing to improve on nothing: a
    correct multi-label model stopped after its first epoch ended at_chance. (Here an lr too
    small to move any weight, the learn probe off: every epoch at chance, none better.)"""
    import logging

    cfg = compose_config(
        *QUIET,
        "trainer.max_epochs=3",
        "trainer.early_stopping=1",
        "trainer.learn_probe=false",
        "scheduler=none",
        "optimizer.lr=1e-12",
        "trainer.probe_cache=false",
    )
    with caplog.at_level(logging.INFO):
        summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "at_chance" and summary["epochs"] == 3, summary
    assert summary["stopped_early"] is False
    said = [r.getMessage() for r in caplog.records if "early stopping waits" in r.getMessage()]
    assert len(said) == 1 and "nothing was learned to stop on" in said[0]


def test_a_warm_up_does_not_excuse_an_lr_that_diverges_after_it(tmp_path):
    """The learn probe tries the schedule's warm-up where the configured lr diverges from cold:
    3 steps at its first lr (onecycle: a 25th), then the configured lr. The MLP at lr 3 still
    diverges after them: refused before step 1, as without a warm-up; the probe tried both."""
    from kiln.guards.learn_probe import CannotLearnError, check_can_learn

    cfg = compose_config(
        *QUIET, "optimizer.lr=3", "trainer.max_steps=10", f"hydra.run.dir={tmp_path}/run"
    )
    with pytest.raises(CannotLearnError) as refused:
        train(cfg, run_dir=tmp_path / "run")
    assert refused.value.kind == "learning rate diverges" and "at lr 3:" in str(refused.value)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["failed_check"]["kind"] == "learning rate diverges"

    import torch  # the same probe told the warm-up's first lr: it is what the run starts at

    _, start = curve_of(*QUIET, "optimizer.lr=3", steps=10)
    assert start.points[0][1] == pytest.approx(1 / 25)
    model = torch.nn.Sequential(torch.nn.Linear(4, 1))
    batch = (torch.randn(8, 4), torch.randn(8, 1))

    def criterion(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1]), {}

    def sgd(m, scale):
        return torch.optim.SGD(m.parameters(), lr=0.2 * scale)

    assert check_can_learn(model, sgd, criterion, batch, warmup_start=1 / 25) == ""


def test_the_learn_probe_of_a_model_the_warm_up_carries_takes_only_the_steps_it_names():
    """(w² - 1)² / 4 from w = 3 under SGD at lr 0.5: steep there (the configured lr throws w
    out, to a non-finite loss), gentle near the minima (3 warm-up steps at a 25th, then 0.5,
    lower it). The finding names both tries' readings; each reading is one forward and the
    probe takes no other (the first update's size, measured by the same steps again, explains
    only a failure). The weights are put back."""
    import torch

    from kiln.guards.learn_probe import check_can_learn

    class Quartic(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(3.0))

    forwards = []

    def criterion(m, _batch):
        forwards.append(m.w.item())
        return (m.w**2 - 1) ** 2 / 4, {}

    def sgd(m, scale):
        return torch.optim.SGD(m.parameters(), lr=0.5 * scale)

    model = Quartic()
    finding = check_can_learn(model, sgd, criterion, (torch.zeros(1, 1),), warmup_start=1 / 25)
    assert "its loss 16 -> 1600 -> " in finding and " -> inf: it rose from cold" in finding
    assert "after 3 steps at the schedule's first lr (0.02, its warm-up)" in finding
    readings = finding.count(" -> ") + 2  # two series of readings
    assert len(forwards) == readings == 13
    assert model.w.item() == 3.0
