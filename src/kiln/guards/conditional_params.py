"""Parameters used only in some steps (`if cond.any(): x = self.refine(x)`): one process trains
on regardless, but under DDP every rank must reduce the same parameters in every step, or the
ranks' gradient reductions stop matching (gloo aborts a few dozen steps in, NCCL hangs) unless
DDP is told to look for unused parameters (trainer.find_unused_parameters=true).

Before step 1 the probe runs each of the probe batch's samples alone (pairs where a batch of 1
cannot train: BatchNorm) and compares the parameters each one's autograd graph reaches (what a
backward would give a gradient, read without running it) with those the whole batch's backward
reached. During the run, GradientPresence records it at every step and names a change at once:
one process logs it; under DDP the step fails before its next collective."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from kiln.errors import attempt, first_few
from kiln.graph import reached_parameters
from kiln.guards.input_sizes import select
from kiln.guards.rules import DEAD, ProbeFailure

log = logging.getLogger(__name__)

SAMPLES = 8  # samples of the probe batch backpropagated one by one

DDP_ADVICE = (
    "Under DDP every rank must use the same parameters in every step, or the ranks' gradient "
    "reductions stop matching (gloo aborts, NCCL hangs): set trainer.find_unused_parameters=true "
    "(DDP then looks for unused parameters in every step, at some cost), or compute the module in "
    "every step and let the condition weight its output (x + cond * self.refine(x)) instead of "
    "branching on it"
)


class ConditionalParametersError(ProbeFailure):
    """Parameters that get a gradient in some steps and not in others (fatal under DDP)."""

    what = "dead gradients"
    kind = "conditional parameters"


def _with_gradient(model: nn.Module, criterion, batch: Any) -> frozenset[str]:
    """The trainable parameters the loss of `batch` reaches (kiln.graph: its autograd graph,
    read without a backward)."""
    loss, _ = criterion(model, batch)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return reached_parameters([loss], trainable)


def find_conditional_parameters(
    model: nn.Module, criterion, batch: Any, whole: frozenset[str]
) -> tuple[str, frozenset[str]] | None:
    """`model` in train mode (the caller puts back its buffers and RNG); `whole` the parameters
    the whole batch's backward reached. Each sample's forward and loss, its graph read for the
    parameters it reaches. Returns (what varied, the parameters that varied), or None."""
    n = len(batch[0])
    alone = [[i] for i in range(min(n, SAMPLES))]
    runs, err = attempt(_sample_runs, model, criterion, batch, alone)
    if err is not None:  # a batch of 1 cannot train (BatchNorm): pairs of samples
        pairs = [[i, i + 1] for i in range(0, min(n, SAMPLES) - 1, 2)]
        runs, err = attempt(_sample_runs, model, criterion, batch, pairs)
        if err is not None:  # the check cannot run: said, not fatal
            log.info("conditional parameters: not checked (%s: %s)", type(err).__name__, err)
            return None
    runs.append((f"the whole batch of {n}", whole))
    every = frozenset.intersection(*(used for _, used in runs))
    union = frozenset.union(*(used for _, used in runs))
    varying = [name for name, _ in model.named_parameters() if name in union - every]
    if not varying:
        return None
    used_by = _listed([label for label, used in runs if set(varying) & used])
    not_by = _listed([label for label, used in runs if not set(varying) & used])
    varied = f"{_named(model, varying)} got a gradient from {used_by} and none from {not_by}"
    return varied, frozenset(varying)


def _sample_runs(
    model: nn.Module, criterion, batch: Any, groups: list[list[int]]
) -> list[tuple[str, frozenset[str]]]:
    """(label, the parameters its loss reaches) for each group of samples, trained alone."""
    runs = []
    for group in groups:
        label = f"sample{'s' if len(group) > 1 else ''} {' and '.join(map(str, group))}"
        runs.append((label, _with_gradient(model, criterion, select(batch, group))))
    return runs


def _listed(labels: list[str]) -> str:
    """ "samples 0, 3 (each alone), the whole batch of 8" from the runs' labels."""
    alone = [label.removeprefix("sample ") for label in labels if label.startswith("sample ")]
    rest = [label for label in labels if not label.startswith("sample ")]
    parts = (
        [f"sample{'s' if len(alone) > 1 else ''} {', '.join(alone)} (each alone)"] if alone else []
    )
    return ", ".join(parts + rest)


def _named(model: nn.Module, names: list[str]) -> str:
    modules = sorted({n.rpartition(".")[0] for n in names})
    where = ", ".join(
        f"{m or '<model>'} ({type(model.get_submodule(m)).__name__})" for m in modules
    )
    shown = first_few(names)
    return f"{shown} (in {where})"


def conditional_error(
    model: nn.Module, varied: str, module: str = ""
) -> ConditionalParametersError:
    return ConditionalParametersError(
        f"{DEAD}: {type(model).__name__}: parameters used only in some steps: {varied}. "
        + DDP_ADVICE,
        module=module,
    )


class GradientPresence:
    """Which trainable parameters got a gradient, step by step: the first step's set is the
    expectation, and a step that differs names the parameters at once (`fatal`: raises, as under
    DDP without find_unused_parameters, before the step's next collective; else logs once per
    set). Fatal, a first step that leaves any parameter out raises too: DDP reduces every one.
    `on_fatal(message)` is told first (the ranks' shared record of why a rank stopped)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        fatal: bool,
        on_fatal: Callable[[str], None] | None = None,
    ):
        self.model = model
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.fatal, self.on_fatal = fatal, on_fatal
        self.expected: list[bool] | None = None
        self.first_step = 0
        self.said: set[tuple[str, ...]] = set()
        # Gradients exactly zero in the probe step, confirmed at the second step when the probe
        # budget left no room for the probes' own second step (kiln.guards.probes).
        self.zero_to_confirm: list[str] = []

    def check(self, step: int) -> None:
        present = [p.grad is not None for _, p in self.named]
        if self.expected is None:
            self.expected, self.first_step = present, step
            missing = [n for (n, _), now in zip(self.named, present, strict=True) if not now]
            if self.fatal and missing:  # DDP reduces every gradient in every step: another
                # rank whose first step used these is already in a reduction this one skips
                self.stop(f"{_named(self.model, missing)} got no gradient at step {step}", missing)
            return
        if self.zero_to_confirm:
            self.confirm_zero(step)
        if present == self.expected:
            return
        pairs = list(zip(self.named, present, self.expected, strict=True))
        missing = [n for (n, _), now, then in pairs if then and not now]
        extra = [n for (n, _), now, then in pairs if now and not then]
        first, parts = self.first_step, []
        if missing:
            parts.append(
                f"{_named(self.model, missing)} got no gradient at step {step} (they did at "
                f"step {first})"
            )
        if extra:
            parts.append(
                f"{_named(self.model, extra)} got one at step {step} (not at step {first})"
            )
        varied = "; ".join(parts)
        if self.fatal:
            self.stop(varied, missing or extra)
        key = tuple(missing + extra)
        if key not in self.said:
            self.said.add(key)
            log.warning("%s: parameters used only in some steps: %s. %s", DEAD, varied, DDP_ADVICE)

    def stop(self, varied: str, names: list[str]) -> None:
        """Raise (fatal mode) for the parameters `names`, the other ranks told first."""
        error = conditional_error(self.model, varied, names[0].rpartition(".")[0])
        if self.on_fatal is not None:
            self.on_fatal(str(error))
        raise error

    def confirm_zero(self, step: int) -> None:
        """The probe step's exactly-zero gradients, again at `step` (after one optimizer step):
        those still zero are dead (kiln.guards.live_gradients.judge_zero)."""
        from kiln.guards.live_gradients import judge_zero, moves

        params = dict(self.named)
        still = [
            n
            for n in self.zero_to_confirm
            if n in params and (params[n].grad is None or not moves(params[n].grad))
        ]
        self.zero_to_confirm = []
        trainable = [n for n, _ in self.named]
        when = f"in the probe step before step 1, and again at step {step} of the run"
        judge_zero(self.model, still, trainable, when)
