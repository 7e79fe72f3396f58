"""Values a GPU's fp16 would overflow, found wherever the run is (precision=amp, which is fp16 on
CUDA, or trainer.fp16_check=true): one probe forward under fp16 autocast, traced op by op where
it leaves Inf/NaN or raises. The first operation that makes Inf/NaN out of finite inputs
(float16's largest value is 65504: an activation squared, an exp of a logit) is named with its
module, and so is a constant a float16 tensor cannot hold (masked_fill(mask, -1e9)). On a CPU
run this is the only place the fault shows before the run reaches a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.device import cpu_runs_natively
from kiln.errors import attempt
from kiln.guards.no_trace import untouched
from kiln.guards.numerics import (
    FirstNonFinite,
    ModuleStack,
    NumericsError,
    is_overflow,
    nonfinite_count,
)
from kiln.guards.rules import NUMERICS
from kiln.guards.trace import failing_call
from kiln.guards.tree import iter_tensors
from kiln.rng import forked

Forward = Callable[[nn.Module, Any, bool], Any]
FP16_MAX = 65504.0
FP16_FIX = "precision=bf16 (fp32's range, no loss scaling), or keep that module in fp32"
# On a CPU without float16 kernels (oneDNN has none for it on AVX2) an fp16 forward costs what
# tens of fp32 forwards do (measured here: convolutions x65, a transformer x2.5): the probe then
# takes the batch's first two items, the data's extremes (an overflow is an item's value), and
# the budget counts each as CPU_FP16_SLOWDOWN forwards.
CPU_FP16_ITEMS = 2
CPU_FP16_SLOWDOWN = 65


def emulated_fp16(batch: Any) -> bool:
    """Whether an fp16 forward of `batch` runs on a CPU that has no float16 kernels."""
    return _device_of(batch) == "cpu" and not cpu_runs_natively(torch.float16)


def fp16_items(batch: Any, size: int) -> int:
    """How many of the batch's `size` items the probe forwards."""
    return min(size, CPU_FP16_ITEMS) if emulated_fp16(batch) else size


def _device_of(batch: Any) -> str:
    return next((t.device.type for _, t in iter_tensors(batch)), "cpu")


def _overflow_error(model, batch, forward: Forward, device: str, err: Exception):
    """The module whose fp16 forward raised `err` (an overflow), traced, named in the error."""
    name = type(model).__name__
    _, trace = failing_call(model, lambda: _fp16_forward(model, batch, forward, device))
    call = trace.innermost_open
    where = call.where if call is not None else f"{name}.forward itself"
    return NumericsError(
        f"{NUMERICS}: {name}: under fp16 autocast (precision=amp on CUDA) {where} uses a "
        f"value float16 cannot hold ({err}): float16 spans +-65504; write the constant "
        "from the tensor's dtype (torch.finfo(x.dtype).min for a mask), or keep that "
        "module in fp32",
        module=call.path if call is not None else "",
        kind="fp16 overflow",
        fix=FP16_FIX,
    )


def check_fp16(model: nn.Module, batch: Any, forward: Forward) -> None:
    """A train-mode forward (no grad) under fp16 autocast on the batch's device. Raises
    NumericsError; a forward that is non-finite in fp32 too is the numerics probe's, not this.
    The forward runs plain first; only one that leaves Inf/NaN runs again traced op by op,
    with the same random numbers (tracing cost 2-5 times the forward: resnet18 at 32 px
    230 -> 100 ms where nothing overflows); one that raised is traced by _overflow_error."""
    device = _device_of(batch)
    name = type(model).__name__
    with untouched(model), torch.no_grad():
        model.train()
        with forked():  # the traced forward below draws the same dropout masks
            output, err = attempt(_fp16_forward, model, batch, forward, device)
        if err is not None:
            if is_overflow(err):  # only an overflow is this probe's finding
                raise _overflow_error(model, batch, forward, device, err) from err
            return  # an op without a float16 kernel here: not what this probe looks for
        if not nonfinite_count(output):
            return
        modules = ModuleStack(model)
        tracer = FirstNonFinite(modules)
        try:
            output, err = attempt(_traced_fp16_forward, model, batch, forward, device, tracer)
        finally:
            modules.close()
        if err is not None or not nonfinite_count(output) or tracer.found is None:
            return
        if nonfinite_count(forward(model, batch, True)):
            return  # non-finite in fp32 too: the numerics probe names it
    op = tracer.found
    biggest = max((t.get("abs_max", 0.0) for t in op.inputs), default=0.0)
    raise NumericsError(
        f"{NUMERICS}: {name}: under fp16 autocast (precision=amp on CUDA) {op.op} in {op.where} "
        f"makes Inf/NaN out of finite {op.dtype} inputs (up to {biggest:.3g}; float16's largest "
        f"value is {FP16_MAX:g}), and the same forward in fp32 is finite: a value beyond "
        "float16's range. precision=bf16 (fp32's range), or keep that module in fp32 "
        "(torch.autocast(..., enabled=False) around it), or scale it down",
        module=op.module,
        kind="fp16 overflow",
        fix=FP16_FIX,
    )


def _traced_fp16_forward(model: nn.Module, batch: Any, forward: Forward, device: str, tracer):
    with tracer:
        return _fp16_forward(model, batch, forward, device)


def _fp16_forward(model: nn.Module, batch: Any, forward: Forward, device: str) -> Any:
    with torch.autocast(device, dtype=torch.float16):
        return forward(model, batch, True)
