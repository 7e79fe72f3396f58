"""Schedule sanity, at start-up, once the planned optimizer steps are known: the run's own
schedule (any scheduler=<option>, a plugin's included) is read at sampled steps on a stand-in
optimizer whose lr is 1, so each value is the share of optimizer.lr that step trains at. A
warm-up longer than the run (val 0.58 where the control reached 0.95, with only a warning), an
lr at 0 for most of the run, or early stopping whose patience can end the run before the
warm-up does: one error line with the numbers, before anything trains."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR

from kiln.errors import UserError

SAMPLES = 512  # steps read of a schedule with a closed form (LambdaLR, OneCycleLR)
SIMULATED = 20_000  # steps stepped through for a schedule without one; beyond: not checked
PEAK = 0.99  # a warm-up has ended where the lr reaches this share of its peak
OFF = 1e-3  # an lr below this share of optimizer.lr trains nothing
MOSTLY = 0.5  # "most of the run"


class ScheduleError(UserError, ValueError):
    """The learning-rate schedule does not fit the run. A check's error (kiln.findings)."""

    what = "schedule"
    kind = "schedule"
    module = ""

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.fix = fix


@dataclass
class Curve:
    """The lr a run's steps train at, as shares of optimizer.lr: (step index, share), sampled."""

    points: list[tuple[int, float]]
    steps: int

    @property
    def peak(self) -> float:
        return max(share for _, share in self.points)

    @property
    def warmup_end(self) -> int:
        """The first step (1-based) at which the lr reaches PEAK of its highest value."""
        top = self.peak
        return next(step for step, share in self.points if share >= PEAK * top) + 1

    def share_off(self) -> float:
        """The share of the steps whose lr is below OFF of optimizer.lr."""
        off = sum(1 for _, share in self.points if share < OFF)
        return off / len(self.points)


def lr_curve(build, steps: int) -> Curve | None:
    """The schedule `build(optimizer, steps)` makes (None: a constant lr), read on a stand-in
    optimizer with lr 1; None where it is constant or too long to step through."""
    from kiln.engine.optim import SGD  # torch's own imports torch._dynamo when built: 2-4 s

    optimizer = SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "get_lr() outside step", "step() before optimizer"
        scheduler = build(optimizer, steps)
        if scheduler is None or steps < 2:
            return None
        if isinstance(scheduler, LambdaLR | OneCycleLR):  # closed forms: read where sampled
            points = []
            for step in sorted({round(i * (steps - 1) / (SAMPLES - 1)) for i in range(SAMPLES)}):
                scheduler.last_epoch = step
                points.append((step, float(scheduler.get_lr()[0])))
            return Curve(points, steps)
        if steps > SIMULATED:
            return None
        points = [(0, float(optimizer.param_groups[0]["lr"]))]
        for step in range(1, steps):
            optimizer.step()
            scheduler.step()
            points.append((step, float(optimizer.param_groups[0]["lr"])))
        return Curve(points, steps)


def check_schedule(
    curve: Curve | None,
    *,
    scheduler: str,
    lr: float,
    steps_per_epoch: int,
    patience: int | None,
    patience_set: bool,
) -> None:
    """ScheduleError when the warm-up outlasts the run, the lr is off for most of it, or
    early stopping (`patience` epochs, set by the user: `patience_set`) can stop the run
    before the warm-up ends."""
    if curve is None:
        return
    where = f"scheduler={scheduler}, {curve.steps} planned optimizer steps"
    last_step, last = curve.points[-1]
    if last >= curve.peak and last < PEAK and curve.points[0][1] < last:
        raise ScheduleError(
            f"the learning-rate warm-up is longer than the run ({where}): the lr is still "
            f"rising at the last step, {last:.2g} of optimizer.lr={lr:g} ({lr * last:.3g}); the "
            "run never trains at the lr it was given: shorten the warm-up (scheduler."
            "warmup_steps / warmup_fraction / pct_start) or plan more steps (trainer.max_epochs)",
            fix="a warm-up shorter than the planned steps (scheduler.warmup_steps), or more "
            "steps (trainer.max_epochs)",
        )
    off = curve.share_off()
    if off > MOSTLY:
        raise ScheduleError(
            f"the learning rate is below {OFF:g} of optimizer.lr={lr:g} for {off:.0%} of the "
            f"run ({where}): most steps would train at almost nothing; fit the schedule's "
            "decay to the planned steps",
            fix="a schedule that decays over the planned steps (scheduler=<option> options)",
        )
    warmup_end = curve.warmup_end
    if patience is None or not patience_set or warmup_end <= 1:
        return
    earliest = (1 + patience) * steps_per_epoch  # best at epoch 1, then `patience` epochs
    if earliest < warmup_end:
        epochs = math.ceil(warmup_end / max(steps_per_epoch, 1))
        raise ScheduleError(
            f"trainer.early_stopping={patience} can end the run after epoch {1 + patience} "
            f"(step {earliest}), before the learning-rate warm-up ends at step {warmup_end} "
            f"(epoch {epochs}; {where}): a run stopped there never trained at its lr; set "
            f"trainer.early_stopping={max(patience, epochs)} or more, or a shorter warm-up",
            fix=f"trainer.early_stopping={max(patience, epochs)}",
        )
