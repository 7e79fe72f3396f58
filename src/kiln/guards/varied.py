"""What differed between two runs of a model that disagree (rule 1's probe and training, rule 3's
train and eval mode): the mode, the grad mode, the batch size, the input size; and the first
module whose output differs between them. Only run once a check has failed, so the hooks they
attach never touch a healthy run."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.guards.trace import ModuleCalls
from kiln.guards.tree import describe, same_container

Calls = list[tuple[str, str, Any]]  # (module path, class name, described output), as finished


def module_outputs(model: nn.Module, run: Callable[[], Any]) -> Calls:
    """Every module's output shapes while `run()` calls the model, innermost first."""
    calls: Calls = []

    def leave(call, caller, args, kwargs, output) -> None:
        calls.append((call.path, call.kind, describe(output)))

    with ModuleCalls(model, leave=leave), contextlib.suppress(Exception):
        run()  # a run that fails: the calls up to the failure are what is compared
    return calls


def _without_batch(described: Any, batch: int | None) -> Any:
    """Shapes with a leading dimension equal to the batch size written as 'N'."""
    if batch is None:
        return described
    if isinstance(described, tuple) and described and described[0] == batch:
        return ("N", *described[1:])
    if isinstance(described, dict):
        return {k: _without_batch(v, batch) for k, v in described.items()}
    if isinstance(described, list | tuple):
        return same_container(described, [_without_batch(v, batch) for v in described])
    return described


def first_divergence(
    a: Calls, b: Calls, names: tuple[str, str], batches: tuple[int | None, int | None] = (None,) * 2
) -> str | None:
    """'<path> (<class>): <a> in <names[0]> vs <b> in <names[1]>' for the first module whose
    output shapes differ (the batch dimension aside when the batch sizes differ)."""
    for (path_a, kind, out_a), (path_b, _, out_b) in zip(a, b, strict=False):
        where = f"{path_a or '<model>'} ({kind})"
        if path_a != path_b:
            return f"{where}: the {names[1]} run calls {path_b or '<model>'} there instead"
        if _without_batch(out_a, batches[0]) != _without_batch(out_b, batches[1]):
            return f"{where}: {out_a} in the {names[0]} run vs {out_b} in the {names[1]} run"
    if len(a) != len(b):
        return f"the {names[0]} run calls {len(a)} modules, the {names[1]} run {len(b)}"
    return None


def in_grad_mode(forward, model: nn.Module, batch: Any, grad: bool, train_mode: bool = True):
    def run():
        with torch.set_grad_enabled(grad):
            return forward(model, batch, train_mode)

    return run


def grad_mode_divergence(forward, model: nn.Module, batch: Any) -> str | None:
    """The first module whose output differs with grad and without, on the same batch."""
    with_grad = module_outputs(model, in_grad_mode(forward, model, batch, True))
    without = module_outputs(model, in_grad_mode(forward, model, batch, False))
    return first_divergence(with_grad, without, ("with-grad", "no-grad"))
