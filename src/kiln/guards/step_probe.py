"""One training step's forward, loss and backward, observed: what the purity, numerics and
live-gradient checks read (one step, not one per check). The batch is copied before and compared
after; every ReLU's units are watched; which parameters the gradients reach, and which they do
not move, is noted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.guards.trace import ModuleCalls
from kiln.guards.tree import iter_tensors

DEAD_ACTIVATIONS = (nn.ReLU, nn.ReLU6)  # exactly 0 where a unit is off


@dataclass
class Units:
    """A ReLU layer's units (channels for images, features otherwise) over the probe batch."""

    kind: str
    total: int
    alive: torch.Tensor  # bool (total,): the unit was > 0 somewhere in some call

    @property
    def dead(self) -> int:
        return int((~self.alive).sum())


@dataclass
class StepObservation:
    model: nn.Module  # the model that ran the step
    batch: Any  # the batch, as the step left it
    before: list[tuple[str, torch.Tensor]]  # its tensors, copied before the step
    loss: torch.Tensor | None = None
    terms: dict[str, torch.Tensor] = field(default_factory=dict)
    backward_error: BaseException | None = None  # the loss reaches no parameter, ...
    # Per trainable parameter: whether the backward reached it, and whether its gradient moves
    # it (a gradient of exact zeros does not). The gradients themselves are not kept: the
    # checks after this one would hold a model's worth of memory for two bits a parameter.
    reached: dict[str, bool] = field(default_factory=dict)
    zero: list[str] = field(default_factory=list)
    units: dict[str, Units] = field(default_factory=dict)  # per ReLU module path


def copied_tensors(batch: Any) -> list[tuple[str, torch.Tensor]]:
    return [(path, t.detach().clone()) for path, t in iter_tensors(batch)]


def observe_step(
    model: nn.Module, criterion: Callable[[nn.Module, Any], tuple], batch: Any, backward=True
) -> StepObservation:
    """`model`'s gradients, statistics and RNG use are the probe's own: the caller puts them back
    (kiln.guards.no_trace.untouched) and holds the run's autocast. Without `backward`, the forward
    and loss only. Returns what the step did."""
    seen = StepObservation(model=model, batch=batch, before=copied_tensors(batch))
    model.train()
    for p in model.parameters():
        p.grad = None
    with ModuleCalls(model, leave=_watch(seen.units), only=DEAD_ACTIVATIONS):
        seen.loss, seen.terms = criterion(model, batch)
    if not backward:
        return seen
    try:
        seen.loss.backward()
    except RuntimeError as err:  # "element 0 of tensors does not require grad": detached
        seen.backward_error = err
    from kiln.guards.live_gradients import moves

    for name, p in model.named_parameters():
        if p.requires_grad:
            seen.reached[name] = p.grad is not None
            if p.grad is not None and not moves(p.grad):
                seen.zero.append(name)
            p.grad = None
    return seen


def _watch(units: dict[str, Units]):
    def record(call, caller, args, kwargs, output):
        if not isinstance(output, torch.Tensor) or output.dim() < 2 or not output.numel():
            return
        unit_dim = 1 if output.dim() >= 4 else output.dim() - 1  # channels, else features
        alive = (output.detach() > 0).movedim(unit_dim, 0).flatten(1).any(dim=1)
        known = units.get(call.path)
        if known is not None and known.total == alive.numel():
            known.alive |= alive
        elif known is None:
            units[call.path] = Units(call.kind, alive.numel(), alive)

    return record


def restore_batch(seen: StepObservation) -> None:
    """Put the batch's values back (a model that changed them in place must not change the
    probes that follow, nor the dataset items they alias)."""
    with torch.no_grad():
        for (_, after), (_, before) in zip(iter_tensors(seen.batch), seen.before, strict=True):
            if after.shape == before.shape and not torch.equal(after, before):
                after.copy_(before)
