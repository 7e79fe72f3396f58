"""Can it learn (trainer.learn_probe): the "overfit one batch" habit, automatic. On the model
(stepped in place, its weights put back after: kiln.guards.no_trace.weights_kept) and a new
optimizer built as the run's (its configured learning rates, no schedule), a few steps on one
fixed batch must lower that batch's loss. The loss is measured before and after in
train mode with the same random numbers (the same dropout masks), so a change is the steps' own,
and the steps run in fp32 (no loss scaling to skip one). A loss that does not fall by 0.1% is a
failure naming what the probe saw: no gradient reaching the weights, dead layers, an update too
small to matter, or a learning rate that makes the loss rise or go non-finite at every step
(then a tenth of it is tried, and named when it works). The loss after any step counts: an
optimizer that overshoots on one batch and comes back has still shown it can lower it.

A schedule that warms up starts below optimizer.lr: a model the configured lr throws off from
cold (a detector's ResNet-50 under Adam at 3e-3) may train well after the warm-up, as
torchvision's references train it. Where the loss rises at the configured lr, the probe takes
WARM_STEPS steps at the schedule's first lr and then goes on at the configured one, as the run
will: when those later steps lower the loss, the run goes on with a finding (not fatal) that
names both readings; when they do not, the probe fails as it would without a warm-up."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.guards.no_trace import KeptWeights, weights_kept
from kiln.guards.rules import LEARN, ProbeFailure
from kiln.rng import forked

STEPS = 5  # optimizer steps on the fixed batch
MIN_DROP = 1e-3  # the loss must fall by this share of itself
MEASURE_SEED = 0  # the same dropout masks before and after
HEALTHY_UPDATE = 1e-3  # lr·|g|/|w| of a first step that neither stalls nor diverges
WARM_STEPS = 3  # steps at a warm-up's first lr before the configured lr is tried again


class CannotLearnError(ProbeFailure):
    """A few steps on one fixed batch did not lower its loss."""

    what = "cannot learn"


@dataclass
class LearnResult:
    losses: list[float]  # before, then after each step
    lr: float  # the largest learning rate of the optimizer's groups
    update: float  # |Δw|/|w| of the first step (the whole model), whatever the optimizer

    @property
    def healthy_lr(self) -> float | None:
        """The lr whose first step would move the weights by HEALTHY_UPDATE of their size (a
        step's size grows with lr, for SGD and Adam alike)."""
        return self.lr * HEALTHY_UPDATE / self.update if self.update > 0 else None

    @property
    def fell(self) -> bool:
        """Whether some step took the loss below where it started (by MIN_DROP): an optimizer
        that oscillates on one batch (Adam without warm-up) still shows it can learn."""
        first = self.losses[0]
        lowest = min((v for v in self.losses[1:] if math.isfinite(v)), default=math.inf)
        return lowest < first - MIN_DROP * abs(first)

    def fell_after(self, steps: int) -> bool:
        """Whether a loss measured after the first `steps` steps is below the first one (by
        MIN_DROP): the steps after a warm-up lowered it, not the warm-up alone."""
        first = self.losses[0]
        later = [v for v in self.losses[steps + 1 :] if math.isfinite(v)]
        return bool(later) and min(later) < first - MIN_DROP * abs(first)

    @property
    def shown(self) -> str:
        return " -> ".join(f"{v:.4g}" for v in self.losses)


def seeded_loss(model: nn.Module, criterion, batch: Any, grad: bool) -> torch.Tensor:
    """The batch's loss in train mode with the same random numbers every time (the same dropout
    masks): a change between two calls is the weights' own."""
    with torch.set_grad_enabled(grad), forked(seed=MEASURE_SEED):
        model.train()
        loss, _ = criterion(model, batch)
    return loss


def learn(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion,
    batch: Any,
    steps: int = STEPS,
    kept: KeptWeights | None = None,
    measure_update: bool = True,
    warm_steps: int = 0,
    then_scale: float = 1.0,
    until_fell: bool = False,
) -> LearnResult:
    """`steps` optimizer steps of `model` (it is trained: the caller keeps its weights) on
    `batch`. Each step's own forward, seeded alike, measures the loss the previous step left
    (one more forward measures the last): steps + 1 forwards in all. `measure_update`: the
    first step's |Δw|/|w| too, from `kept` (the weights before it, kept aside) or else from a
    copy of the weights the first step takes. `warm_steps`: after that many steps every lr is
    multiplied by `then_scale` (a warm-up, then the lr it reaches). `until_fell`: stop at the
    first loss below the first one (LearnResult.fell cannot turn false after it): a model
    that learns pays two forwards and one backward, not six and five."""
    lr = max(float(g["lr"]) for g in optimizer.param_groups)
    losses, update = [], 0.0
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = {id(p): name for name, p in model.named_parameters()}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = seeded_loss(model, criterion, batch, grad=True)
        losses.append(float(loss.detach()))
        if not loss.requires_grad or not math.isfinite(losses[-1]):
            break
        if until_fell and LearnResult(losses, lr, update).fell:
            break
        loss.backward()
        before = None
        if step == 0 and measure_update:
            before = (
                [p.detach().clone() for p in params]
                if kept is None
                else [kept.saved[names[id(p)]] for p in params]
            )
        optimizer.step()
        if step + 1 == warm_steps:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * then_scale
        if before is not None:
            update = _update_ratio(params, before)
    else:
        with torch.no_grad():
            losses.append(float(seeded_loss(model, criterion, batch, grad=False)))
    optimizer.zero_grad(set_to_none=True)
    return LearnResult(losses, lr, update)


def _update_ratio(params: list[torch.Tensor], before: list[torch.Tensor]) -> float:
    """|Δw|/|w| of a step: how far it moved the weights, relative to their size."""
    moved = math.sqrt(
        sum(
            float((p.detach().to(b.device) - b).float().pow(2).sum())
            for p, b in zip(params, before, strict=True)
        )
    )
    size = math.sqrt(sum(float(b.float().pow(2).sum()) for b in before))
    return moved / max(size, 1e-12)


def check_can_learn(
    model: nn.Module,
    optimizer_for: Callable[[nn.Module, float], torch.optim.Optimizer],
    criterion,
    batch: Any,
    *,
    steps: int = STEPS,
    dead_layers: dict[str, str] | None = None,
    warmup_start: float = 1.0,
) -> str:
    """`model` is trained in place and put back as it was (weights and buffers, bitwise);
    `optimizer_for(model, lr_scale)` builds the run's optimizer for it (lr_scale 1: as
    configured); `warmup_start`: the schedule's first lr as a share of the configured one.
    Raises CannotLearnError; returns "" or, where the configured lr lowered the loss only
    after the warm-up's steps, what was seen (for a finding that does not stop the run)."""
    with weights_kept(model) as initial:
        return _check_can_learn(
            model, optimizer_for, criterion, batch, steps, dead_layers, initial, warmup_start
        )


def _check_can_learn(
    model, optimizer_for, criterion, batch, steps, dead_layers, initial, warmup_start
) -> str:
    # The size of the first update explains a failure only: measured then, by the same steps
    # again (seeded: the same losses), so a model that learns holds no copy of its weights
    # and stops at the first step that lowered the loss, and one that the warm-up carries
    # takes no steps that only a failure would read.
    tried = learn(
        model,
        optimizer_for(model, 1.0),
        criterion,
        batch,
        steps,
        measure_update=False,
        until_fell=True,
    )
    if tried.fell:
        return ""
    name, n = type(model).__name__, len(batch[0])
    saw = f"{steps} steps on one fixed batch of {n} at lr {tried.lr:g}: its loss {tried.shown}"
    first, last = tried.losses[0], tried.losses[-1]
    rose = not math.isfinite(last) or last > first * (1 + MIN_DROP)
    if rose and warmup_start < 1.0:  # the run's own schedule: warm up, then the lr reached
        initial.restore()
        warm = learn(
            model,
            optimizer_for(model, warmup_start),
            criterion,
            batch,
            steps + 2,
            initial,
            measure_update=False,
            warm_steps=WARM_STEPS,
            then_scale=1 / warmup_start,
        )
        if warm.fell_after(WARM_STEPS):
            return (
                f"{name}: {saw}: it rose from cold at the configured lr; after {WARM_STEPS} "
                f"steps at the schedule's first lr ({warm.lr:g}, its warm-up) the configured "
                f"lr lowers it ({warm.shown}): the warm-up carries the model there (a run "
                "without one would diverge)"
            )
    initial.restore()
    result = learn(model, optimizer_for(model, 1.0), criterion, batch, steps, initial)
    if rose:
        initial.restore()
        tenth = learn(model, optimizer_for(model, 0.1), criterion, batch, steps, initial)
        went = "went non-finite" if not math.isfinite(last) else "rose"
        healthy = result.healthy_lr
        sized = (
            f"; an lr that moves the weights by {HEALTHY_UPDATE:g} of their size at the first "
            f"step would be about {healthy:.1g} (optimizer.lr)"
            if healthy is not None
            else ""
        )
        then = (
            f"at a tenth of it ({tenth.lr:g}) the loss falls ({tenth.shown}): try that lr"
            if tenth.fell
            else f"a tenth of it ({tenth.lr:g}) does not lower it either ({tenth.shown}){sized}"
        )
        if tenth.fell:
            fix = f"optimizer.lr={tenth.lr:g} (a tenth: the learn probe's steps lowered the loss)"
        elif healthy is not None:
            fix = (
                f"optimizer.lr={healthy:.1g} (what moves the weights by {HEALTHY_UPDATE:g} of "
                "their size at the first step, measured by the learn probe)"
            )
        else:
            fix = ""
        raise CannotLearnError(
            f"{LEARN}: {name}: {saw}: it {went}: the learning rate diverges on one batch; {then}",
            kind="learning rate diverges",
            fix=fix,
        )
    why = _why_flat(result, dead_layers or {})
    raise CannotLearnError(f"{LEARN}: {name}: {saw}: it does not fall (by {MIN_DROP:.1%}); {why}")


def _why_flat(result: LearnResult, dead: dict[str, str]) -> str:
    if len(result.losses) == 1 and math.isfinite(result.losses[0]):
        return "the loss needs no gradient: the output is detached from the graph"
    if result.update == 0.0:
        return "no gradient reaches the weights (zero gradients)" + _dead(dead)
    if result.update < 1e-5:
        return (
            f"the first step moves the weights by {result.update:.2g} of their size (about "
            f"{HEALTHY_UPDATE:g} is healthy): the learning rate {result.lr:g} is too small to "
            f"matter; about {result.healthy_lr:.1g} would move them by {HEALTHY_UPDATE:g}"
            + _dead(dead)
        )
    return (
        f"the weights move (|Δw|/|w| = {result.update:.2g} at the first step) but the loss does "
        "not follow: "
        "a loss that ignores the model's output, labels that do not match the inputs, or "
        "layers that do not pass the signal on" + _dead(dead)
    )


def _dead(dead: dict[str, str]) -> str:
    if not dead:
        return ""
    return "; dead layers: " + "; ".join(f"{p}: {d}" for p, d in dead.items())
