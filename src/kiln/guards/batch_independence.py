"""Batch independence: a sample's output depends on that sample alone. Before step 1 a real batch
runs in eval mode whole, reversed, and sample by sample (the first and the last alone): each
sample's output must be the same wherever it sits (tolerance: 1e-3 of the output's scale in
fp32, 5e-2 in half precision). In train mode, for models without batch-statistics layers
(BatchNorm, the declared exception), the gradient of one sample's output must be exactly zero on
every other sample: a backward from the first and the last samples' outputs (a normalisation
layer of your own declares `uses_batch_statistics = True` to be treated as BatchNorm is).

Where samples leak, the module is named from the same backward: every module's inputs and
outputs whose first dimension is the batch are recorded, and the leak sits where the gradient
stops reaching the other samples' rows (a recurrent layer fed (N, L, D) where it expects
(L, N, D), statistics over dim 0, a .view where a transpose was meant). A leak the gradient
cannot see (detached statistics, state kept on self) is named by the first module whose output
rows do not follow the reversed batch. Outputs without a batch dimension (a detector's list of
detections per image) are not compared: a detector pads a batch to its largest image."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.errors import first_few
from kiln.guards.input_sizes import select
from kiln.guards.no_trace import untouched
from kiln.guards.rules import BATCH, ProbeFailure
from kiln.guards.trace import ModuleCalls
from kiln.guards.tree import iter_tensors

Forward = Callable[[nn.Module, Any, bool], Any]
RTOL = {torch.float16: 5e-2, torch.bfloat16: 5e-2}  # else 1e-3 (fp32, fp64)
# Samples the backward takes: 5, not 8 or 16, so that a dimension of the same size elsewhere
# (8 image rows, 16 tokens) is not mistaken for the batch after a .view scrambles them.
LOCATE_SAMPLES = 5
FIX = (
    "A sample's output must depend on that sample alone (BatchNorm in train mode is the one "
    "exception): look for statistics taken over dim 0, a .view/.reshape where a transpose or "
    "permute was meant, a recurrent or attention layer fed (N, L, D) where it expects (L, N, D) "
    "(batch_first), state kept on self between calls"
)


class BatchDependenceError(ProbeFailure):
    """One sample's output depends on the other samples of its batch."""

    what = "batch dependence"


def per_sample(output: Any, n: int) -> dict[str, torch.Tensor]:
    """{path: tensor} for the floating tensors of `output` whose first dimension is the batch."""
    return {
        path: t
        for path, t in iter_tensors(output, "output")
        if t.is_floating_point() and not t.is_nested and t.dim() and t.shape[0] == n
    }


def tolerance(t: torch.Tensor) -> float:
    scale = float(t.detach().float().abs().nan_to_num(0.0).max()) if t.numel() else 0.0
    return RTOL.get(t.dtype, 1e-3) * max(1.0, scale)


def difference(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """max |a - b| where it is beyond b's tolerance; None where they agree."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach().float(), b.detach().float()
    if not torch.equal(a.isnan(), b.isnan()):  # NaN in one run only: they differ
        return float("inf")
    gap = (a - b).abs().nan_to_num(0.0)
    worst = float(gap.max()) if gap.numel() else 0.0
    return worst if worst > tolerance(b) else None


def has_batch_statistics(model: nn.Module) -> bool:
    """BatchNorm layers normalise a training batch by its own statistics: the declared
    exception, as is a module of your own that says so (`uses_batch_statistics = True`)."""
    return any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) or getattr(m, "uses_batch_statistics", False)
        for m in model.modules()
    )


def check_batch_independence(model: nn.Module, batch: Any, forward: Forward) -> None:
    """Eval mode: whole, reversed and alone agree; train mode (no BatchNorm): one sample's
    gradient reaches no other sample. Raises BatchDependenceError naming the module."""
    n = len(batch[0])
    if n < 2 or isinstance(batch[0], list):
        return
    with untouched(model), torch.no_grad():
        model.eval()
        whole = per_sample(forward(model, batch, False), n)
        if not whole:
            return
        found = _eval_disagreement(model, batch, forward, whole, n)
    if found is not None:
        where = leak_origin(model, batch, forward, train_mode=False)
        raise BatchDependenceError(
            f"{BATCH}: {type(model).__name__}: in eval mode (no grad), {found}. The first module "
            f"whose per-sample outputs depend on other samples: {where.text}. {FIX}",
            module=where.module,
        )
    if not has_batch_statistics(model) and not getattr(model, "computes_own_loss", False):
        leak = leak_origin(model, batch, forward, train_mode=True, only_if_leaking=True)
        if leak is not None:
            raise BatchDependenceError(
                f"{BATCH}: {type(model).__name__}: in train mode, {leak.evidence}. The first "
                f"module whose per-sample outputs depend on other samples: {leak.text}. {FIX}",
                module=leak.module,
            )


def _eval_disagreement(model, batch, forward, whole: dict, n: int) -> str | None:
    """What differs between the batch whole, reversed and sample by sample (None: nothing)."""
    order = list(range(n))[::-1]
    reversed_ = per_sample(forward(model, select(batch, order), False), n)
    for path, t in whole.items():
        for position, sample in enumerate(order):
            gap = difference(reversed_[path][position], t[sample])
            if gap is not None:
                return (
                    f"sample {sample}'s {path} changes with its neighbours: in its batch of {n} "
                    f"vs the same batch reversed (it sits at position {position}), it differs by "
                    f"up to {gap:.3g} (tolerance {tolerance(t[sample]):.2g})"
                )
    for sample in (0, n - 1):
        alone = per_sample(forward(model, select(batch, [sample]), False), 1)
        for path, t in whole.items():
            gap = difference(alone[path][0], t[sample]) if path in alone else float("inf")
            if gap is not None:
                return (
                    f"sample {sample}'s {path} changes with its neighbours: alone (a batch of 1) "
                    f"vs in its batch of {n}, it differs by up to {gap:.3g} (tolerance "
                    f"{tolerance(t[sample]):.2g})"
                )
    return None


# --------------------------------------------------------------------------- naming the module


@dataclass
class Event:
    """A tensor whose first dimension is the batch, going into or out of a module call."""

    path: str
    kind: str
    side: str  # "input" | "output"
    caller: str  # the module open around the call ("" for the model's own forward; None: none)
    tensor: torch.Tensor

    @property
    def where(self) -> str:
        return f"{self.path or '<model>'} ({self.kind})"


@dataclass
class Leak:
    module: str  # the module path named ("" for the model itself)
    text: str  # where, for the message
    evidence: str = ""  # what the gradient showed


@contextlib.contextmanager
def recording(model: nn.Module, n: int):
    """Records every module call's batch-leading floating inputs and outputs, in time order."""
    events: list[Event] = []

    def tensors(obj):
        return [
            t
            for _, t in iter_tensors(obj)
            if t.is_floating_point() and not t.is_nested and t.dim() and t.shape[0] == n
        ]

    def enter(call, caller, args, kwargs) -> None:
        for t in tensors((args, kwargs)):
            events.append(Event(call.path, call.kind, "input", _path(caller), t))

    def leave(call, caller, args, kwargs, output) -> None:
        for t in tensors(output):
            events.append(Event(call.path, call.kind, "output", _path(caller), t))

    with ModuleCalls(model, enter, leave):
        yield events


def _path(call) -> str | None:
    return call.path if call is not None else None


def leak_origin(
    model: nn.Module,
    batch: Any,
    forward: Forward,
    *,
    train_mode: bool,
    only_if_leaking: bool = False,
) -> Leak | None:
    """The module where samples start to mix, from a backward of the first and the last
    samples' outputs. `only_if_leaking`: None when the gradient reaches no other sample."""
    if len(batch[0]) > LOCATE_SAMPLES:  # a size no other dimension is likely to have
        batch = select(batch, list(range(LOCATE_SAMPLES)))
    n = len(batch[0])
    watched = [0, n - 1] if n >= 3 else [n - 1]
    others = [j for j in range(n) if j not in watched]
    inputs = batch[0]
    with untouched(model), torch.enable_grad():
        model.train(train_mode)
        float_input = isinstance(inputs, torch.Tensor) and inputs.is_floating_point()
        if float_input:
            inputs = inputs.detach().clone().requires_grad_(True)
            batch = type(batch)((inputs, *batch[1:]))
        with recording(model, n) as events:
            output = forward(model, batch, train_mode)
        rows = [t for t in per_sample(output, n).values() if t.requires_grad]
        events = [e for e in events if e.tensor.requires_grad]
        if not rows:
            return None if only_if_leaking else _forward_break(model, batch, forward, n)
        target = sum(t[watched].float().sum() for t in rows)
        wrt = ([inputs] if float_input else []) + [e.tensor for e in events]
        grads = torch.autograd.grad(target, wrt, allow_unused=True)
    reach = [_reaches(g, others) for g in grads]
    input_reach = reach[0] if float_input else None
    reach = reach[1:] if float_input else reach
    leaky = [i for i, r in enumerate(reach) if r]
    if not leaky and not input_reach:
        return None if only_if_leaking else _forward_break(model, batch, forward, n)
    seen = (
        "the batch input" if input_reach else f"{events[leaky[0]].where}'s {events[leaky[0]].side}"
    )
    evidence = (
        f"the gradient of sample(s) {', '.join(map(str, watched))}'s output reaches samples "
        f"{_rows(input_reach or reach[leaky[0]])} of {seen} (it must be exactly zero on every "
        f"other sample; the batch: {n} samples)"
    )
    last = leaky[-1] if leaky else -1
    on_path = [i for i in range(last + 1, len(events)) if grads[i + int(float_input)] is not None]
    after = events[on_path[0]] if on_path else None
    before = events[last] if last >= 0 else None
    leak = _between(before, after, model)
    leak.evidence = evidence
    return leak


def _reaches(grad: torch.Tensor | None, others: list[int]) -> list[int]:
    """The rows of `others` where the gradient is non-zero."""
    if grad is None or not others:
        return []
    per_row = grad[others].detach().float().abs().flatten(1).amax(dim=1)
    return [others[i] for i, v in enumerate(per_row.tolist()) if v > 0]


def _rows(rows: list[int]) -> str:
    return first_few(rows)


def _between(before: Event | None, after: Event | None, model: nn.Module) -> Leak:
    """Name the module between the last tensor the other samples reach and the first on the
    path after it that they do not."""
    if after is None:
        return Leak("", f"{type(model).__name__}.forward itself")
    if before is not None and before.path == after.path and before.side == "input":
        return Leak(
            after.path,
            f"{after.where}: row i of its output depends on other rows of its input "
            f"{tuple(before.tensor.shape)} (statistics over dim 0, or it reads dim 0 as time "
            "or sequence: batch_first?)",
        )
    # An input: the code between ran in the module that calls `after`; an output: in `after`'s
    # own forward (after its children, or around modules whose tensors lost the batch first).
    parent = (after.caller or "") if after.side == "input" else after.path
    parent_kind = type(model.get_submodule(parent)).__name__ if parent else type(model).__name__
    start = f"{before.where}'s {before.side}" if before is not None else "the batch input"
    end = f"{after.where}'s {after.side}"
    inside = "" if after.side == "input" else f" (in {after.where} itself, or before it)"
    return Leak(
        parent,
        f"{parent or '<model>'} ({parent_kind}).forward, between {start} and {end}{inside}: "
        "tensors there do not keep the batch first (a .view where a transpose was meant?)",
    )


def _forward_break(model: nn.Module, batch: Any, forward: Forward, n: int) -> Leak:
    """No gradient crosses samples (detached batch statistics, state kept on self): the first
    module, in the order calls finish, whose output rows differ between the batch and the same
    samples reversed, or alone (eval mode, no grad)."""
    with untouched(model), torch.no_grad():
        model.eval()
        base = recorded_run(model, batch, forward, n)
        order = list(range(n))[::-1]
        runs = [
            ("the batch reversed", recorded_run(model, select(batch, order), forward, n), order)
        ]
        for sample in (0, n - 1):
            alone = recorded_run(model, select(batch, [sample]), forward, 1)
            runs.append((f"sample {sample} alone", alone, [sample]))
    why = "no gradient crosses samples there: detached batch statistics, state on self"
    for label, other, rows in runs:
        found = first_divergent_call(model, base, other, rows)
        if found is not None:
            return Leak(found[0], f"{found[1]} in {label} ({why})")
    return Leak("", f"{type(model).__name__}.forward (no module's output shows it)")


def first_divergent_call(
    model: nn.Module, base: list[Event], other: list[Event], rows: list[int] | None = None
) -> tuple[str, str] | None:
    """(path, what) of the first module call, in time order, whose input or output differs
    between two recorded runs (`rows`: base's rows that other's stand for). An input that
    differs first: the code before the call differs (in its caller's forward); an output: the
    module itself."""
    for a, b in zip(base, other, strict=False):
        if (a.path, a.side) != (b.path, b.side):
            continue
        if difference(b.tensor, a.tensor if rows is None else a.tensor[rows]) is None:
            continue
        if a.side == "output":
            return a.path, f"{a.where}: its output differs, its inputs do not"
        caller = a.caller or ""
        kind = type(model.get_submodule(caller)).__name__ if caller else type(model).__name__
        return caller, (
            f"{caller or '<model>'} ({kind}).forward, before it calls {a.where}: that call's "
            "input differs"
        )
    return None


def recorded_run(model: nn.Module, batch: Any, forward: Forward, n: int) -> list[Event]:
    with recording(model, n) as events:
        forward(model, batch, False)
    return events
