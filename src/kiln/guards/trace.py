"""Which module did it: the one locator every check uses. `ModuleCalls` hooks every module of a
model and keeps the stack of calls in progress (`current`: the innermost), telling a check's
own `enter`/`leave` of each call with its path, class and caller; `traced` records each call's
inputs and devices with it, and `failing_call` runs a forward without hooks and only when it
raises again under a trace, to find the module. `raised` is where a check runs code kiln did not
write (the user's model, loss and builder) and keeps what it raised."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from kiln.errors import attempt
from kiln.guards.tree import describe, iter_tensors


@dataclass
class Call:
    path: str  # the module's name in the model ("" for the model itself)
    kind: str  # its class name
    inputs: Any  # described: shapes in place of tensors
    input_devices: set[str]
    own_devices: set[str]  # of its own parameters and buffers (not its children's)
    output_devices: set[str] = field(default_factory=set)

    @property
    def where(self) -> str:
        return f"{self.path or '<model>'} ({self.kind})"


@dataclass
class Trace:
    calls: list[Call] = field(default_factory=list)  # in call order
    open: list[Call] = field(default_factory=list)  # the stack of unfinished calls
    fused_only: bool = False  # the failure did not happen with hooks attached (a fused path)

    @property
    def innermost_open(self) -> Call | None:
        return self.open[-1] if self.open else None


def _devices(obj: Any) -> set[str]:
    return {str(t.device) for _, t in iter_tensors(obj)}


def _own_devices(module: nn.Module) -> set[str]:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return {str(t.device) for t in tensors}


@dataclass(frozen=True)
class Open:
    """A module call in progress."""

    path: str  # the module's name in the model ("" for the model itself)
    kind: str  # its class name
    module: nn.Module

    @property
    def where(self) -> str:
        return f"{self.path or '<model>'} ({self.kind})"


Enter = Callable[[Open, Open | None, tuple, dict], None]  # (call, caller, args, kwargs)
Leave = Callable[[Open, Open | None, tuple, dict, Any], None]  # ..., output


class ModuleCalls:
    """Hooks on every module of `model` (of the classes `only`, where given) that keep the stack
    of calls in progress and tell `enter(call, caller, args, kwargs)` before each call and
    `leave(call, caller, args, kwargs, output)` after it (`caller`: the call it runs inside,
    None at the outermost). A context manager; `close()` removes the hooks."""

    def __init__(
        self,
        model: nn.Module,
        enter: Enter | None = None,
        leave: Leave | None = None,
        only: type | tuple[type, ...] | None = None,
    ):
        self.open: list[Open] = []
        self.enter, self.leave = enter, leave
        self.handles = []
        for path, module in model.named_modules():
            if only is not None and not isinstance(module, only):
                continue
            call = Open(path, type(module).__name__, module)
            self.handles.append(module.register_forward_pre_hook(self._pre(call), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))

    @property
    def current(self) -> Open | None:
        return self.open[-1] if self.open else None

    def _pre(self, call: Open):
        def hook(module, args, kwargs):
            caller = self.open[-1] if self.open else None
            self.open.append(call)
            if self.enter is not None:
                self.enter(call, caller, args, kwargs)

        return hook

    def _post(self, module, args, kwargs, output):
        call = self.open.pop() if self.open else Open("", type(module).__name__, module)
        if self.leave is not None:
            self.leave(call, self.open[-1] if self.open else None, args, kwargs, output)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> ModuleCalls:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@contextlib.contextmanager
def traced(model: nn.Module) -> Iterator[Trace]:
    """Record every module call inside the block: its inputs (described) and the devices of its
    inputs, its own tensors and its output. The hooks are removed on exit."""
    trace = Trace()

    def enter(call: Open, caller, args, kwargs) -> None:
        record = Call(
            call.path,
            call.kind,
            describe((args, kwargs) if kwargs else args),
            _devices((args, kwargs)),
            _own_devices(call.module),
        )
        trace.calls.append(record)
        trace.open.append(record)

    def leave(call: Open, caller, args, kwargs, output) -> None:
        trace.open.pop().output_devices = _devices(output)  # calls finish innermost first

    with ModuleCalls(model, enter, leave):
        yield trace


def failing_call(model: nn.Module, run: Callable[[], Any]) -> tuple[BaseException | None, Trace]:
    """Run `run()` (which calls `model`) as training runs it, without hooks: hooks switch fused
    kernels off (the Transformer encoder's eval fast path among them), so a check under hooks
    would test another path. Only when it raises is it run again under a trace, to find the
    module. Returns (the exception or None, the trace: empty when nothing failed, and
    `fused_only` when the traced run went through)."""
    _, first = attempt(run)
    if first is None:
        return None, Trace()
    with traced(model) as trace:
        _, again = attempt(run)
    if again is not None:
        return again, trace
    trace.fused_only = True
    return first, trace
