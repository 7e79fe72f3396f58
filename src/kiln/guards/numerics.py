"""Non-finite values: input checks that name the tensor, and statistics of an offending batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.guards.tree import iter_tensors


class NonFiniteInputError(ValueError):
    """A batch holds NaN or Inf; the message names the tensor and counts."""


def assert_finite_inputs(batch: Any) -> None:
    for path, tensor in iter_tensors(batch):
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            nan = int(torch.isnan(tensor).sum())
            inf = int(torch.isinf(tensor).sum())
            raise NonFiniteInputError(
                f"{path} (shape {tuple(tensor.shape)}) has {nan} NaN and {inf} Inf values; "
                "fix the data or switch trainer.check_inputs off"
            )


def tensor_stats(batch: Any) -> dict[str, dict]:
    """Per tensor: shape, dtype, min/max/mean over finite values, NaN and Inf counts."""
    stats = {}
    for path, tensor in iter_tensors(batch):
        t = tensor.detach().float().cpu() if tensor.is_floating_point() else tensor.detach().cpu()
        finite = t[torch.isfinite(t)] if t.is_floating_point() else t
        entry = {"shape": list(t.shape), "dtype": str(tensor.dtype)}
        if finite.numel():
            entry.update(
                min=float(finite.min()), max=float(finite.max()), mean=float(finite.float().mean())
            )
        if t.is_floating_point():
            entry.update(nan=int(torch.isnan(t).sum()), inf=int(torch.isinf(t).sum()))
        stats[path] = entry
    return stats


def nonfinite_count(obj: Any) -> int:
    """NaN and Inf values among the floating-point tensors of a nested output (nested tensors,
    the Transformer's ragged fast path, are skipped)."""
    return sum(
        int((~torch.isfinite(t)).sum())
        for _, t in iter_tensors(obj)
        if t.is_floating_point() and not t.is_nested
    )


def first_nonfinite_module(model: nn.Module, run: Callable[[], Any]) -> tuple[str, str] | None:
    """(path, class name) of the first module, in the order forwards finish (innermost first),
    whose output holds a NaN or Inf while `run()` calls the model; None when none does."""
    found: list[tuple[str, str]] = []

    def hook(path: str):
        def record(module, args, output):
            if not found and nonfinite_count(output):
                found.append((path, type(module).__name__))

        return record

    handles = [m.register_forward_hook(hook(path)) for path, m in model.named_modules()]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None
