"""Device mismatches, diagnosed: re-run the failing forward with hooks that record each module's
parameter, buffer, input and output devices, and name the first module where devices mix,
including a tensor created inside a module's forward on another device."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from kiln.errors import attempt
from kiln.guards.numerics import ModuleStack
from kiln.guards.rules import DEVICES, ProbeFailure
from kiln.guards.trace import Call, traced
from kiln.guards.tree import iter_tensors

MISMATCH_MARKERS = (
    "Expected all tensors to be on the same device",
    "on different devices",
    "is not on the expected device",
)


log = logging.getLogger(__name__)


class DeviceMismatchError(ProbeFailure):
    """Tensors of one step live on different devices; the message names the module (the path
    where devices first mix)."""

    kind = "device"

    def __init__(self, message: str, module: str = "", what: str | None = None):
        super().__init__(message, module, what or f"device mismatch in {module or 'the model'}")


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


# Factories that make a tensor on the default device (the CPU) unless given device=.
FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.tensor,
    torch.as_tensor,
    torch.from_numpy,
    torch.empty_strided,
}
MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type_as}  # to the named device
TO_CPU = {torch.Tensor.cpu}
INDEXING = {torch.Tensor.__getitem__}  # a CPU index into a GPU tensor is allowed


class StrayTensors(TorchFunctionMode):
    """Follows, through one forward, the tensors a GPU run would have on the CPU: made by a
    factory without device= (torch.zeros(n), torch.arange(L), torch.tensor([...])), by .cpu(),
    kept as plain attributes (which .to(device) never moves), and computed from those alone.
    The first operation that combines one (not a 0-dim scalar, which PyTorch allows) with a
    tensor on the run's device is recorded with the module it ran in and the one that made it."""

    def __init__(self, modules: ModuleStack, attributes: dict[int, tuple[torch.Tensor, str]]):
        super().__init__()
        self.modules = modules
        # id -> (tensor, how it was made): the tensor is kept, so that its id is not reused
        # meanwhile (a forward may replace an attribute: AnchorGenerator's cell_anchors)
        self.stray: dict[int, tuple[torch.Tensor, str]] = dict(attributes)
        self.found: str | None = None
        self.module = ""

    def _mark(self, out: Any, how: str) -> None:
        for _, t in iter_tensors(out):
            self.stray[id(t)] = (t, how)  # the tensor is kept: its id is not reused meanwhile

    def _is_stray(self, t: torch.Tensor) -> bool:
        return id(t) in self.stray and t.dim() > 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.found is not None:
            return out
        path, kind = self.modules.current
        where = f"{path or '<model>'} ({kind})" if kind else "the model's forward"
        name = getattr(func, "__name__", str(func))
        if func in FACTORIES:
            inherits = func is torch.as_tensor and isinstance(
                args[0] if args else None, torch.Tensor
            )
            if kwargs.get("device") is None and not inherits:
                self._mark(out, f"torch.{name}(...) without device= in {where}")
            return out
        if func in TO_CPU:
            self._mark(out, f".cpu() in {where}")
            return out
        if func in MOVES and (
            kwargs.get("device") is not None
            or any(isinstance(a, torch.device | str | torch.Tensor) for a in args[1:])
        ):
            # Moved to the run's device. On the CPU, .to("cpu") returns the tensor itself: the
            # caller gets an alias, which is not stray (on a GPU it would be a moved copy).
            return out.detach() if isinstance(out, torch.Tensor) and id(out) in self.stray else out
        tensors = [t for _, t in iter_tensors((args, kwargs)) if isinstance(t, torch.Tensor)]
        stray = [t for t in tensors if self._is_stray(t)]
        if not stray:
            return out
        placed = [t for t in tensors if id(t) not in self.stray]
        if placed and func not in INDEXING:
            made = self.stray[id(stray[0])][1]
            self.found = (
                f"{name} in {where} combines a tensor of shape {tuple(stray[0].shape)} made by "
                f"{made} (on the CPU whatever the run's device) with the run's own tensors"
            )
            self.module = path
            return out
        self._mark(out, self.stray[id(stray[0])][1])
        return out


# What every nn.Module keeps in its __dict__ (its parameter, buffer, module and hook tables).
MODULE_INTERNALS = frozenset(vars(nn.Module()))


def plain_attribute_tensors(model: nn.Module) -> dict[int, tuple[torch.Tensor, str]]:
    """Tensors kept on modules as plain attributes, alone or in a list, tuple or dict
    (torchvision's DefaultBoxGenerator keeps its anchor shapes in a list): .to(device) moves
    parameters and buffers only, so on a GPU these stay on the CPU. A list of the model's own
    parameters (nn.RNN's _flat_weights, which it re-points when moved) is not one of them."""
    registered = {id(t) for t in (*model.parameters(), *model.buffers())}
    found = {}
    for path, module in model.named_modules():
        kept = {*module._parameters, *module._buffers}
        for attr, value in vars(module).items():
            if attr in kept or attr in MODULE_INTERNALS or attr.startswith("__"):
                continue
            for inner, tensor in iter_tensors(value, attr):
                if id(tensor) in registered:
                    continue
                found[id(tensor)] = (
                    tensor,
                    f"the plain attribute {path + '.' if path else ''}{inner} of "
                    f"{type(module).__name__} (not a buffer: .to(device) never moves it)",
                )
    return found


def check_devices_follow(
    model: nn.Module, batch: Any, forward: Callable[[nn.Module, Any, bool], Any]
):
    """The device probe: one train-mode forward (no grad) watched by StrayTensors. What a GPU
    run would find at its first step (a device mismatch) is named before step 1, on any
    device, at the cost of one forward's Python overhead."""
    from kiln.guards.no_trace import untouched

    with untouched(model), torch.no_grad():
        model.train()
        modules = ModuleStack(model)
        watch = StrayTensors(modules, plain_attribute_tensors(model))

        def watched():
            with watch:
                forward(model, batch, True)

        try:
            _, err = attempt(watched)
        finally:
            modules.close()
    if err is not None:  # the other probes name a failing forward
        log.debug("device probe: the forward raised %s: not concluded", err)
        return
    if watch.found is None:
        return
    raise DeviceMismatchError(
        f"{DEVICES}: {type(model).__name__}: {watch.found}: on a GPU run that is a device "
        "mismatch at the first step. Create tensors on the input's device "
        "(torch.zeros(n, device=x.device), x.new_zeros(n), torch.arange(L, device=x.device)) and "
        "register constant tensors as buffers (self.register_buffer), which .to(device) moves",
        watch.module,
        what="device",
    )
