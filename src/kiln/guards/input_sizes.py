"""Rule 1: shapes come from inputs, never from literals in `forward`. `check_sizes_follow_inputs`
runs a model on batches of several sizes, forward and backward, and says what to fix."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kiln.guards.shape_check import describe
from kiln.guards.tree import iter_tensors


class ShapeInferenceError(RuntimeError):
    """A model failed on an input size it should handle: a shape is hard-coded somewhere."""


def _scalar_objective(output: Any) -> torch.Tensor:
    tensors = [t for _, t in iter_tensors(output, "output") if t.is_floating_point()]
    return sum(t.float().sum() for t in tensors)


def check_sizes_follow_inputs(
    build: Callable[[], nn.Module],
    cases: Iterable[tuple[str, Any]],
    call: Callable[[nn.Module, Any], Any] = lambda model, inputs: model(inputs),
) -> None:
    """`cases` are (label, inputs) pairs, e.g. ("batch 3 at 40x40", tensor). For each, a fresh
    model runs forward and backward; every parameter that takes part must get a finite grad."""
    for label, inputs in cases:
        model = build()
        model.train()
        try:
            output = call(model, inputs)
            _scalar_objective(output).backward()
        except (RuntimeError, ValueError, IndexError) as err:
            shapes = describe(inputs)
            raise ShapeInferenceError(
                f"{type(model).__name__} failed on {label} (input shapes {shapes}): {err}. "
                "Sizes must be read from the input (x.shape) or the data spec, never written "
                "as literals in forward."
            ) from err
        for name, param in model.named_parameters():
            if param.grad is not None and not torch.isfinite(param.grad).all():
                raise ShapeInferenceError(f"{label}: non-finite gradient in {name}")
