"""Counting a step's FLOPs with torch's formulas, without importing torch._dynamo or triton."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.errors import attempt


def _formulas() -> dict:
    """torch.utils.flop_counter's formulas. That module imports triton at its top (0.1 s of a
    quiet start-up, 0.3 s of a busy one) only to know triton kernels, which FlopCount never
    counts (a higher-order op: NotImplemented). Unless triton is loaded already, it is hidden
    for that import (None in sys.modules: the import fails at once, as without triton) and
    restored after; only registering a flop formula for a triton kernel is then refused."""
    if "torch.utils.flop_counter" in sys.modules or "triton" in sys.modules:
        from torch.utils.flop_counter import flop_registry

        return flop_registry
    said = logging.getLogger("torch.utils.flop_counter")  # "triton not found" on CUDA builds
    sys.modules["triton"] = None
    said.disabled = True
    try:
        from torch.utils.flop_counter import flop_registry
    finally:
        del sys.modules["triton"]
        said.disabled = False
    return flop_registry


flop_registry = _formulas()


class FlopCount(TorchDispatchMode):
    """The FLOPs of the aten ops run under it, by torch.utils.flop_counter's formulas, summed:
    torch's FlopCounterMode less its per-module table. Unlike it, not kept out of torch.compile
    (a mode never is compiled here), so its first op does not import torch._dynamo (1.0-1.3 s
    of a run's start-up: torch wraps every dispatch mode's __torch_dispatch__ to keep dynamo
    out, and the wrapper imports it)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return NotImplemented  # (flex attention, cond): not counted, the caller says so
        # As FlopCounterMode: an op without a formula is counted by what it decomposes into.
        if func is not torch.ops.prim.device.default:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def count_flops(step: Callable[..., Any], prepare: Callable[[], tuple] = tuple) -> int | None:
    """The FLOPs of `step(*prepare())` (prepare's own ops not counted); None, said in the log,
    when either raises: a count is a nicety, never the reason a run or a prediction fails."""
    total, err = attempt(_counted, step, prepare)
    if err is not None:  # whatever the model raises: not counted
        logging.getLogger(__name__).info("model FLOPs not counted: %s: %s", type(err).__name__, err)
        return None
    return total or None


def _counted(step: Callable[..., Any], prepare: Callable[[], tuple]) -> int:
    args = prepare()
    with FlopCount() as counter:
        step(*args)
    return counter.total
