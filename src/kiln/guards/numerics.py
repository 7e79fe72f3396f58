"""Non-finite values: input checks that name the tensor, statistics of an offending batch, and
the probes' own check (numerics): every output and loss a probe meets is finite, or the run
stops naming the probe and the first module whose output is not. Also what finds the first
operation that made NaN/Inf out of finite inputs (FirstNonFinite, a TorchDispatchMode), which the
fp16 probe and `kiln triage`'s replay use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import get_total_norm
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.guards.rules import NUMERICS, ProbeFailure
from kiln.guards.trace import ModuleCalls
from kiln.guards.tree import iter_tensors


class NonFiniteInputError(ValueError):
    """A batch holds NaN or Inf; the message names the tensor and counts."""


class NumericsError(ProbeFailure):
    """A probe met a NaN or Inf (or a value its dtype cannot hold); names the probe and module."""

    what = "numerics"


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


def nonfinite_grads(model: nn.Module) -> list[str]:
    """The parameters whose gradient holds a NaN or Inf, by name: one fused max-abs over every
    gradient and one host read when all are finite (a mask per gradient was 3% of a zoo case);
    NaN and Inf carry through a max, where a sum of squares could overflow to Inf. A sparse
    gradient's stored values are read."""
    grads = [
        (name, p.grad._values() if p.grad.is_sparse else p.grad)
        for name, p in model.named_parameters()
        if p.grad is not None
    ]
    grads = [(name, g) for name, g in grads if g.numel()]  # a max of nothing is an error
    if not grads or get_total_norm([g for _, g in grads], float("inf"), foreach=True).isfinite():
        return []
    return [name for name, g in grads if not g.isfinite().all()]


def first_nonfinite_module(model: nn.Module, run: Callable[[], Any]) -> tuple[str, str] | None:
    """(path, class name) of the first module, in the order forwards finish (innermost first),
    whose output holds a NaN or Inf while `run()` calls the model; None when none does."""
    with ModuleStack(model) as modules:
        run()
    return modules.first_bad


def nonfinite_inputs(batch: Any) -> dict[str, str]:
    """{tensor path: "N NaN, M Inf"} for the floating tensors of a batch that hold any."""
    found = {}
    for path, t in iter_tensors(batch):
        if t.is_floating_point() and not t.is_nested and not torch.isfinite(t).all():
            found[path] = f"{int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} Inf"
    return found


def check_finite(
    model: nn.Module, output: Any, *, probe: str, batch: Any, rerun: Callable[[], Any]
) -> None:
    """Raises NumericsError when `output` (of `probe`: "batch 1 in train mode", ...) holds NaN
    or Inf, naming the batch's own non-finite tensors when it has any (the data, not the model),
    else the first module whose output is non-finite (`rerun()` repeats the forward)."""
    bad = nonfinite_count(output)
    if not bad:
        return
    name = type(model).__name__
    inputs = nonfinite_inputs(batch)
    if inputs:
        shown = "; ".join(f"{path}: {counts}" for path, counts in inputs.items())
        raise NumericsError(
            f"{NUMERICS}: {name}: the probe batch itself holds non-finite values ({shown}), so "
            f"{probe} gives {bad} NaN/Inf output values: fix the data (the probes take the "
            "training set's first items; trainer.check_inputs=true names each bad batch)"
        )
    found = first_nonfinite_module(model, rerun)
    where = f"{found[0] or '<model>'} ({found[1]})" if found else f"{name}.forward itself"
    raise NumericsError(
        f"{NUMERICS}: {name}: {probe} gives {bad} NaN/Inf output values from a finite batch; "
        f"the first module whose output is non-finite: {where}. Look for a division by a value "
        "that can be 0, a log or sqrt of a value that can be <= 0, or a constant beyond the "
        "dtype's range",
        module=found[0] if found else "",
    )


OVERFLOW_MARKERS = ("without overflow", "value cannot be converted to type")


def is_overflow(err: BaseException) -> bool:
    """A value too large for the tensor's dtype (masked_fill(-1e9) on a float16 tensor...)."""
    return isinstance(err, RuntimeError) and any(m in str(err) for m in OVERFLOW_MARKERS)


def tensor_summary(t: torch.Tensor) -> dict:
    """shape, dtype, min, max, abs max, zeros and non-finite count of a tensor, as plain data."""
    t = t.detach()
    stats: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if t.numel() and (t.is_floating_point() or not t.dtype.is_complex):
        f = t.float()
        finite = f[torch.isfinite(f)]
        if finite.numel():
            stats.update(min=float(finite.min()), max=float(finite.max()))
            stats["abs_max"] = float(finite.abs().max())
        stats["zeros"] = int((f == 0).sum())
        stats["nonfinite"] = int((~torch.isfinite(f)).sum())
    return stats


class ModuleStack(ModuleCalls):
    """Which module is running (`current`: (path, class), for the ops traced inside it), and
    the first module whose output is non-finite (`first_bad`)."""

    def __init__(self, model: nn.Module):
        self.first_bad: tuple[str, str] | None = None
        super().__init__(model, leave=self._left)

    def _left(self, call, caller, args, kwargs, output) -> None:
        if self.first_bad is None and nonfinite_count(output):
            self.first_bad = (call.path, call.kind)

    @property
    def current(self) -> tuple[str, str]:
        call = self.open[-1] if self.open else None
        return (call.path, call.kind) if call is not None else ("", "")


@dataclass
class FirstOp:
    """The first operation that made NaN/Inf out of finite inputs."""

    op: str  # aten name: "div.Tensor", "log.default", "mul.Tensor", ...
    module: str  # the module path it ran in ("" outside any module: the criterion)
    kind: str  # that module's class name
    dtype: str  # of its output
    inputs: list[dict]  # per tensor input: shape, dtype, min, max, abs max, zeros
    backward: bool = False  # found in the backward pass

    @property
    def where(self) -> str:
        if self.module:
            return f"{self.module} ({self.kind})"
        return f"{self.kind}.forward" if self.kind else "the criterion (outside the model)"


class FirstNonFinite(TorchDispatchMode):
    """Records the first op whose floating output holds NaN/Inf while its inputs hold none."""

    def __init__(self, modules: ModuleStack | None = None):
        super().__init__()
        self.modules, self.found, self.backward = modules, None, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.found is None:
            outputs = [t for _, t in iter_tensors(out) if t.is_floating_point()]
            if any(not torch.isfinite(t).all() for t in outputs if t.numel()):
                inputs = [t for _, t in iter_tensors((args, kwargs or {})) if t.is_floating_point()]
                if all(torch.isfinite(t).all() for t in inputs if t.numel()):
                    path, kind = self.modules.current if self.modules else ("", "")
                    self.found = FirstOp(
                        op=str(func).removeprefix("aten."),
                        module="" if self.backward else path,
                        kind="" if self.backward else kind,
                        dtype=str(outputs[0].dtype).removeprefix("torch."),
                        inputs=[tensor_summary(t) for _, t in iter_tensors((args, kwargs or {}))][
                            :4
                        ],
                        backward=self.backward,
                    )
        return out
