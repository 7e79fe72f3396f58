"""Counting a step's FLOPs with torch's formulas, without importing torch._dynamo."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


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
