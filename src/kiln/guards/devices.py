"""Device mismatches, diagnosed: re-run the failing forward with hooks that record each module's
parameter, buffer, input and output devices, and name the first module where devices mix,
including a tensor created inside a module's forward on another device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from kiln.guards.rules import DEVICES
from kiln.guards.trace import Call, traced
from kiln.guards.tree import iter_tensors

MISMATCH_MARKERS = (
    "Expected all tensors to be on the same device",
    "on different devices",
    "is not on the expected device",
)


class DeviceMismatchError(RuntimeError):
    """Tensors of one step live on different devices; the message names the module."""

    def __init__(self, message: str, module: str = ""):
        super().__init__(message)
        self.module = module  # the module path where devices first mix


def is_device_mismatch(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(m in str(err) for m in MISMATCH_MARKERS)


def _culprit(calls: list[Call], innermost: Call | None) -> tuple[Call | None, str]:
    """The first call where devices mix, and why."""
    for call in calls:
        if len(call.input_devices | call.own_devices) > 1:
            own = ", ".join(sorted(call.own_devices)) or "none"
            given = ", ".join(sorted(call.input_devices)) or "none"
            return call, f"its parameters/buffers are on {own}, its inputs on {given}"
        known = call.input_devices | call.own_devices
        if call.output_devices and known and not call.output_devices <= known:
            made = ", ".join(sorted(call.output_devices - known))
            return call, (
                f"its parameters, buffers and inputs are on {', '.join(sorted(known))} but it "
                f"returned a tensor on {made}: a tensor created inside its forward"
            )
    if innermost is not None:
        on = ", ".join(sorted(innermost.input_devices | innermost.own_devices)) or "one device"
        return innermost, (
            f"its parameters, buffers and inputs are all on {on}, so a tensor created inside its "
            "forward is on another device (create tensors with device=x.device)"
        )
    return None, "no module call mixed devices"


def diagnose(err: BaseException, model: nn.Module, run: Callable[[], Any], batch: Any):
    """A DeviceMismatchError naming the module where devices first mix. `run` repeats the
    failing forward."""
    # Always traced: the diagnosis reads every call's devices. The failure is `err`; this run
    # only records them.
    with traced(model) as trace, contextlib.suppress(Exception):
        run()
    call, why = _culprit(trace.calls, trace.innermost_open)
    batch_devices = sorted({str(t.device) for _, t in iter_tensors(batch)})
    where = call.where if call is not None else "the model"
    lines = [
        f"{DEVICES}: device mismatch in {where}: {why}.",
        f"  PyTorch said: {err}",
        f"  the batch is on {', '.join(batch_devices) or 'no device'}; "
        f"the model's parameters are on "
        f"{', '.join(sorted({str(p.device) for p in model.parameters()})) or 'no device'}.",
        "  Move the model and every tensor it creates to the training device "
        "(model.to(device); torch.zeros(..., device=x.device)).",
    ]
    return DeviceMismatchError("\n".join(lines), call.path if call is not None else "")
