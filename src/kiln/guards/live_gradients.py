"""Live gradients: after the first backward (the probe step, before step 1) every trainable
parameter has a gradient that moves it. One without a gradient is rule 2's (a branch nothing
trains); one whose gradient is exactly zero is the same fault in disguise (an output multiplied
by zero, a path through a detached tensor, a layer of ReLUs that never fire); a loss that
reaches no parameter at all means the output is detached from the graph. A ReLU layer whose
units are all off on the probe batch is named with it; one with more than half of its units off
is reported in the log (dead units that get no gradient never come back)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from kiln.errors import first_few
from kiln.guards.branches import no_gradient_error
from kiln.guards.rules import DEAD, ProbeFailure
from kiln.guards.step_probe import StepObservation

log = logging.getLogger(__name__)

MOSTLY_DEAD = 0.5  # more than this share of a layer's units off on every probe sample: said
# Zero gradients in fewer than this share of the trainable values are said, not fatal: a model
# run on inputs too small for it has parameters no loss reaches there (LeViT's attention biases
# over a single token at 32x32: a softmax of one value has a zero gradient).
FATAL_ZERO_SHARE = 0.01


class DeadGradientError(ProbeFailure):
    """A parameter whose gradient is exactly zero, or a loss no parameter's gradient reaches."""

    what = "dead gradients"


def moves(grad: torch.Tensor) -> bool:
    """Whether a gradient holds any non-zero value (sparse ones: their stored values)."""
    values = grad.coalesce().values() if grad.is_sparse else grad
    return bool(values.count_nonzero())


def dead_layers(seen: StepObservation) -> dict[str, str]:
    """{ReLU path: "28 of 32 units off (ReLU)"} for layers with more than half their units off
    on every sample of the probe step."""
    return {
        path: f"{u.dead} of {u.total} units off ({u.kind})"
        for path, u in seen.units.items()
        if u.total and u.dead / u.total > MOSTLY_DEAD
    }


def still_zero(seen: StepObservation, zero: list[str], optimizer, criterion) -> list[str]:
    """The parameters of `zero` whose gradient is still exactly zero after one optimizer step
    of the model on the same batch (the caller keeps its weights): a residual branch behind a
    zero-initialised scale (timm's zero_init_last, a zero-initialised head) gets gradients from
    the second step on, a branch behind a zero that never learns does not."""
    model = seen.model
    model.train()
    for step in ("first", "second"):
        optimizer.zero_grad(set_to_none=True)
        loss, _ = criterion(model, seen.batch)
        loss.backward()
        if step == "first":  # the probe step's gradients again (not kept), and its update
            optimizer.step()
    params = dict(model.named_parameters())
    still = [n for n in zero if params[n].grad is None or not moves(params[n].grad)]
    optimizer.zero_grad(set_to_none=True)
    return still


def check_live_gradients(
    seen: StepObservation,
    flag_for: Callable[[list[str]], str | None] | None = None,
    used_sometimes: frozenset[str] = frozenset(),
    second_step: Callable[[list[str]], list[str]] | None = None,
) -> dict[str, str]:
    """Raises LossBranchError (no gradient) or DeadGradientError (a zero gradient, a detached
    output, a layer all of whose units are off); returns the mostly-dead layers to report.
    `used_sometimes`: parameters some samples of the batch reach (conditional_params' finding,
    said there), not a branch nothing trains. `second_step(zero)`: the zero-gradient parameters
    still at zero after one optimizer step (still_zero); only those are dead."""
    model, name = seen.model, type(seen.model).__name__
    layers = dead_layers(seen)
    off = {p: d for p, d in layers.items() if seen.units[p].dead == seen.units[p].total}
    if seen.backward_error is not None:
        raise DeadGradientError(
            f"{DEAD}: {name}: the loss of a training step reaches no parameter "
            f"({seen.backward_error}): the model's output is detached from the graph (a "
            ".detach(), torch.no_grad(), or a trip through .item()/.numpy()/.tolist() in forward)"
            + _layers_note(off),
        )
    missing = [n for n, hit in seen.reached.items() if not hit and n not in used_sometimes]
    if missing:
        raise no_gradient_error(model, missing, flag_for, "in the probe step before step 1")
    zero = judged(model, list(seen.zero), seen.batch)
    if zero and second_step is not None:
        zero = second_step(zero)
    judge_zero(
        model,
        zero,
        list(seen.reached),
        "in the probe step before step 1, and again after one optimizer step",
        _layers_note(off),
    )
    if off:
        first = next(iter(off))
        raise DeadGradientError(
            f"{DEAD}: {name}: every unit of {first} is off on every sample of the probe batch "
            f"({off[first]}): nothing after it sees the input" + _layers_note(off),
            module=first,
        )
    for path, detail in layers.items():
        log.warning(
            "%s: %s: %s on every sample of the probe batch: units that never fire get no "
            "gradient and stay off (an initialisation that pushes pre-activations below 0?)",
            DEAD,
            path,
            detail,
        )
    return layers


def judged(model: nn.Module, zero: list[str], batch) -> list[str]:
    """The zero-gradient parameters this check can judge on `batch`: those a model declares
    this batch's loss cannot reach by design (`unreached_by_batch(zero, batch)` -> (names, why):
    SSD's anchor levels that match no object of the batch) are said, with why, and left out."""
    explain = getattr(model, "unreached_by_batch", None)
    if not zero or explain is None:
        return zero
    unreached, why = explain(zero, batch)
    if not unreached:
        return zero
    log.warning(
        "%s: not judged on the probe batch: %d parameter(s) got a gradient that is exactly zero "
        "because %s: %s",
        DEAD,
        len(unreached),
        why,
        first_few(unreached),
    )
    return [n for n in zero if n not in set(unreached)]


def judge_zero(
    model: nn.Module, zero: list[str], trainable: list[str], when: str, note: str = ""
) -> None:
    """Parameters whose gradient stayed exactly zero `when`: said when they hold under
    FATAL_ZERO_SHARE of the trainable values, else a DeadGradientError."""
    if not zero:
        return
    params = dict(model.named_parameters())
    size = sum(params[n].numel() for n in trainable)
    share = sum(params[n].numel() for n in zero) / max(size, 1)
    if share < FATAL_ZERO_SHARE:
        log.warning(
            "%s: %d parameter(s) holding %.2g%% of the trainable values got a gradient that is "
            "exactly zero %s (nothing the loss computes on these inputs reaches them): %s",
            DEAD,
            len(zero),
            100 * share,
            when,
            ", ".join(zero[:8]) + (" ..." if len(zero) > 8 else ""),
        )
        return
    modules = sorted({n.rpartition(".")[0] for n in zero})
    where = ", ".join(
        f"{m or '<model>'} ({type(model.get_submodule(m)).__name__})" for m in modules
    )
    raise DeadGradientError(
        f"{DEAD}: {type(model).__name__}: {len(zero)} trainable parameter(s) got a gradient that "
        f"is exactly zero {when}: {first_few(zero)}, in {where} ({share:.0%} of the trainable "
        "values); no step can move them (a gradient of zeros is one no loss term reaches: an "
        "output multiplied by a 0 that never learns, a branch through a detached tensor, units "
        "that never fire)" + note,
        module=modules[0],
    )


def _layers_note(off: dict[str, str]) -> str:
    if not off:
        return ""
    shown = "; ".join(f"{p}: {d}" for p, d in off.items())
    return (
        f". Layers with every unit off on the probe batch: {shown} (a bias initialisation "
        "that pushes every pre-activation below 0?)"
    )
