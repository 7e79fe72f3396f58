"""Which module a forward pass was in when it failed, and what went into it: forward pre/post
hooks on every module keep a stack of the calls in progress and each call's inputs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

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


@contextlib.contextmanager
def traced(model: nn.Module) -> Iterator[Trace]:
    """Record every module call inside the block; the hooks are removed on exit."""
    trace = Trace()

    def pre_hook(path: str):
        def hook(module, args, kwargs):
            call = Call(
                path,
                type(module).__name__,
                describe((args, kwargs) if kwargs else args),
                _devices((args, kwargs)),
                _own_devices(module),
            )
            trace.calls.append(call)
            trace.open.append(call)

        return hook

    def post_hook(module, args, kwargs, output):
        call = trace.open.pop()
        call.output_devices = _devices(output)

    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre_hook(path), with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
    try:
        yield trace
    finally:
        for handle in handles:
            handle.remove()


def failing_call(model: nn.Module, run: Callable[[], Any]) -> tuple[BaseException | None, Trace]:
    """Run `run()` (which calls `model`) as training runs it, without hooks: hooks switch fused
    kernels off (the Transformer encoder's eval fast path among them), so a check under hooks
    would test another path. Only when it raises is it run again under a trace, to find the
    module. Returns (the exception or None, the trace: empty when nothing failed, and
    `fused_only` when the traced run went through)."""
    try:
        run()
    except Exception as err:  # the caller classifies it
        first = err
    else:
        return None, Trace()
    with traced(model) as trace:
        try:
            run()
        except Exception as err:
            return err, trace
    trace.fused_only = True
    return first, trace
