"""Purity: the forward and the loss leave the batch as they found it. A model that rescales its
inputs or its targets in place changes the data it is given: the same dataset item differs the
next time it is seen (where a dataset's items alias the batch, as a detection dataset's target
dicts do without the loaders' copies), and what evaluation and the logs see is not what was
loaded. Before step 1 the probe step's batch (every input and target tensor) is compared with a
copy taken before it, and so is an eval-mode forward's; where one changed, the module is named
by running again under hooks that compare the batch after every module call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.guards.no_trace import untouched
from kiln.guards.rules import PURITY, ProbeFailure
from kiln.guards.step_probe import StepObservation, copied_tensors
from kiln.guards.trace import ModuleCalls
from kiln.guards.tree import iter_tensors

Forward = Callable[[nn.Module, Any, bool], Any]


class ImpureForwardError(ProbeFailure):
    """The forward (or the loss) changed the batch's tensors in place."""

    what = "purity"


def changed(batch: Any, before: list[tuple[str, torch.Tensor]]) -> list[str]:
    """'<path>: N of M values changed (max |change| X)' for each tensor that differs."""
    found = []
    for (path, after), (_, old) in zip(iter_tensors(batch), before, strict=True):
        if after.shape != old.shape:
            found.append(
                f"{path}: its shape changed from {tuple(old.shape)} to {tuple(after.shape)}"
            )
            continue
        same = (
            (after == old) | (after.isnan() & old.isnan())
            if old.is_floating_point()
            else after == old
        )
        if bool(same.all()):
            continue
        count = int((~same).sum())
        gap = (after.float() - old.float()).abs()[~same].max() if old.numel() else 0
        found.append(
            f"{path}: {count} of {old.numel()} values changed (max |change| {float(gap):.3g})"
        )
    return found


def check_purity(
    seen: StepObservation,
    criterion,
    forward: Forward,
    *,
    fresh: Callable[[], Any],
    step_changes: list[str] | None = None,
) -> None:
    """`seen` is the probe step; `fresh()` gives an unchanged copy of its batch (for naming the
    module and for the eval-mode forward); `step_changes`: what the step changed, where its batch
    was put back since (`changed`). Raises ImpureForwardError."""
    model = seen.model
    if step_changes is None:
        step_changes = changed(seen.batch, seen.before)
    if step_changes:
        where = _first_call_that_changes(model, fresh(), lambda m, b: criterion(m, b), True)
        raise _impure(model, "a training step's forward and loss (train mode)", step_changes, where)
    batch = fresh()
    before = copied_tensors(batch)
    with untouched(model), torch.no_grad():
        model.eval()
        forward(model, batch, False)
    eval_changes = changed(batch, before)
    if eval_changes:
        run = lambda m, b: forward(m, b, False)  # noqa: E731
        where = _first_call_that_changes(model, fresh(), run, False)
        raise _impure(model, "an eval-mode forward (no grad)", eval_changes, where)


def _impure(model: nn.Module, what: str, changes: list[str], where: tuple[str, str]):
    return ImpureForwardError(
        f"{PURITY}: {type(model).__name__}: {what} changed the batch it was given: "
        f"{'; '.join(changes[:4])}; first seen after {where[1]}. Work on copies (x = x * s, not "
        "x *= s; clone() a target before rescaling it): an in-place change of the batch changes "
        "what the loss, the metrics and the next epoch see",
        module=where[0],
    )


def _first_call_that_changes(
    model: nn.Module, batch: Any, run: Callable[[nn.Module, Any], Any], train_mode: bool
) -> tuple[str, str]:
    """(path, "path (Class)") of the first module call after which the batch differs from what
    it was; the criterion (outside every module) when only the whole run changes it."""
    before = copied_tensors(batch)
    found: list[tuple[str, str]] = []

    def enter(call, caller, args, kwargs) -> None:
        if not found and changed(batch, before):  # changed by the caller's own code
            path, kind = (caller.path, caller.kind) if caller else ("", type(model).__name__)
            where = f"{path or '<model>'} ({kind}).forward, before it calls {call.path}"
            found.append((path, where))

    def leave(call, caller, args, kwargs, output) -> None:
        if not found and changed(batch, before):
            found.append((call.path, call.where))

    with ModuleCalls(model, enter, leave), untouched(model), torch.set_grad_enabled(train_mode):
        model.train(train_mode)
        run(model, batch)
    if found:
        return found[0]
    return "", "the model's forward returned: in the loss (the criterion) or after the last call"
