"""The learn probe, read from the first real steps: where the probe budget had no room for its
steps before step 1 (kiln.guards.probes), the run's own steps stand in for them. The probe
batch's loss is measured as the learn probe measures it (train mode, the same seeded dropout
masks, no grad, fp32) before step 1 and after steps 5, 10 and 20 (the run's last where it plans
fewer). Fallen by the learn probe's MIN_DROP at some reading: the model learns, and nothing more
is paid. Not fallen by the last reading (a schedule that warms up slowly, or a model that cannot
learn): the learn probe itself runs then, from the weights the steps reached, and its verdict is
the run's. A reading costs one forward of the probe batch; the run's weights, buffers, modes and
random numbers are as before it."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.guards.learn_probe import MIN_DROP, CannotLearnError, check_can_learn, seeded_loss
from kiln.guards.no_trace import untouched

log = logging.getLogger(__name__)

READ_AFTER = (5, 10, 20)  # optimizer steps after which the probe batch's loss is read


def measured_loss(model: nn.Module, criterion, batch: Any) -> float:
    with untouched(model), torch.no_grad():
        return float(seeded_loss(model, criterion, batch, grad=False))


@dataclass
class LearnReading:
    model: nn.Module
    criterion: Any
    batch: Any
    optimizer_for: Callable[[nn.Module, float], torch.optim.Optimizer]
    steps: int  # the learn probe's, should it have to run
    dead_layers: dict[str, str]
    before: float  # the probe batch's loss before step 1
    readings: list[tuple[int, float]] = field(default_factory=list)
    done: bool = False

    @classmethod
    def start(
        cls, model, criterion, batch, optimizer_for, *, steps, dead_layers, before=None
    ) -> LearnReading:
        """`before`: the probe batch's loss before step 1 where it is known already."""
        if before is None:
            before = measured_loss(model, criterion, batch)
        return cls(model, criterion, batch, optimizer_for, steps, dead_layers, before)

    def shown(self) -> str:
        read = ", ".join(f"{loss:.4g} after step {step}" for step, loss in self.readings)
        return f"{self.before:.4g} before step 1, {read}"

    def after_step(self, step: int, planned_steps: int) -> None:
        """After the run's optimizer step `step`: a reading where one is due; raises
        CannotLearnError where the learn probe, run at the last reading, says so."""
        last = min(READ_AFTER[-1], max(planned_steps, 1))
        if self.done or (step not in READ_AFTER and step != last):
            return
        loss = measured_loss(self.model, self.criterion, self.batch)
        self.readings.append((step, loss))
        if math.isfinite(loss) and loss < self.before - MIN_DROP * abs(self.before):
            self.done = True
            log.info("learn probe: the probe batch's loss fell (%s)", self.shown())
            return
        if step < last:
            return
        self.done = True
        log.info(
            "learn probe: the probe batch's loss did not fall in the first steps (%s): the learn "
            "probe runs from step %d's weights",
            self.shown(),
            step,
        )
        try:
            with untouched(self.model):
                check_can_learn(
                    self.model,
                    self.optimizer_for,
                    self.criterion,
                    self.batch,
                    steps=self.steps,
                    dead_layers=self.dead_layers,
                )
        except CannotLearnError as err:
            raise CannotLearnError(
                f"{err} (the run's first steps did not lower it either: {self.shown()})",
                module=err.module,
                kind=err.kind,
                fix=err.fix,
            ) from None
