"""Determinism in eval: an eval-mode forward is a function of its batch. Before step 1 the same
batch runs twice in eval mode (no grad, nothing changed in between): the outputs must be equal
(within the batch-independence tolerance, which float noise never reaches and dropout always
does). Then the model sees another batch and the first one again: the output must still be the
same, or the model carries state from one call to the next (the first of the two forwards
follows a forward of the same batch, so state alone never reads as randomness). Where they
differ, the first module call whose input or output differs between the two is named."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.guards.batch_independence import difference, first_divergent_call, recorded_run
from kiln.guards.input_sizes import select
from kiln.guards.no_trace import untouched
from kiln.guards.rules import DETERMINISM, ProbeFailure
from kiln.guards.tree import copy_batch, iter_tensors
from kiln.rng import forked

Forward = Callable[[nn.Module, Any, bool], Any]


def _on_copies(forward: Forward) -> Forward:
    """Each forward on a copy of its batch: a model that changes its batch in place is the
    purity check's finding, not a difference between two calls here."""
    return lambda model, batch, train_mode: forward(model, copy_batch(batch), train_mode)


class NondeterministicEvalError(ProbeFailure):
    """Two eval-mode forwards of the same batch disagree."""

    what = "determinism"


def check_eval_determinism(model: nn.Module, batch: Any, forward: Forward) -> None:
    """Raises NondeterministicEvalError naming what varied, what differed and the module."""
    forward = _on_copies(forward)
    n = len(batch[0])
    other = select(batch, [n - 1])  # another batch: one sample, of another size
    with untouched(model), torch.no_grad():
        model.eval()
        forward(model, batch, False)  # state kept from an earlier call is the batch's own now
        first = forward(model, batch, False)
        gap = _difference(first, forward(model, batch, False))
        if gap is not None and _random(model, batch, forward):
            where = _first_module_that_differs(model, batch, forward)
            raise NondeterministicEvalError(
                f"{DETERMINISM}: {type(model).__name__}: two eval-mode forwards of the same "
                f"batch of {n} (no grad, nothing changed between them) differ: {gap}, and agree "
                "when the random generators are reset before each: randomness is left on in "
                f"eval mode; the first module call where they part: {where[1]}. Look for "
                "F.dropout without training=self.training, noise (torch.randn_like) or sampling "
                "without a check of self.training",
                module=where[0],
            )
        if gap is not None:
            where = _first_module_that_differs(model, batch, forward)
            raise NondeterministicEvalError(
                f"{DETERMINISM}: {type(model).__name__}: two eval-mode forwards of the same "
                f"batch of {n} (no grad, the random generators reset before each) differ: {gap}; "
                f"the model changes itself on every call: the first module call where they "
                f"part: {where[1]}. State kept on self (a running value that is not a buffer, "
                "updated in forward) makes evaluation depend on how often it ran",
                module=where[0],
            )
        forward(model, other, False)
        gap = _difference(first, forward(model, batch, False))
        if gap is not None:
            where = _first_module_that_differs(model, batch, forward, between=other)
            raise NondeterministicEvalError(
                f"{DETERMINISM}: {type(model).__name__}: the same batch of {n} gives another "
                f"eval-mode output after a forward on another batch (sample {n - 1} alone): "
                f"{gap}; the first module call where they part: {where[1]}. The model carries "
                "state from one call to the next (a tensor kept on self, a cache keyed on "
                "something other than the input): evaluation then depends on what ran before",
                module=where[0],
            )


def _random(model: nn.Module, batch: Any, forward: Forward) -> bool:
    """Whether two forwards agree once the random generators start from the same state: the
    difference came from random numbers (else from state the model keeps)."""
    outputs = []
    for _ in range(2):
        with forked(seed=0):
            outputs.append(forward(model, batch, False))
    return _difference(*outputs) is None


def _difference(a: Any, b: Any) -> str | None:
    pairs = list(zip(iter_tensors(a, "output"), iter_tensors(b, "output"), strict=False))
    if len(pairs) != len(list(iter_tensors(a))) or len(pairs) != len(list(iter_tensors(b))):
        return "the outputs hold different numbers of tensors"
    for (path, x), (_, y) in pairs:
        if not x.is_floating_point() or x.is_nested:
            if x.shape != y.shape or not torch.equal(x, y):
                return f"{path} differs"
            continue
        gap = difference(y, x)
        if gap is not None:
            return f"{path} differs by up to {gap:.3g}"
    return None


def _first_module_that_differs(
    model: nn.Module, batch: Any, forward: Forward, between: Any = None
) -> tuple[str, str]:
    """(path, what) of the first module call whose input or output differs between two eval
    forwards of `batch` (with a forward of the batch `between` in between)."""
    n = len(batch[0])
    first = recorded_run(model, batch, forward, n)
    if between is not None:
        forward(model, between, False)
    found = first_divergent_call(model, first, recorded_run(model, batch, forward, n))
    return found if found is not None else ("", f"{type(model).__name__}.forward itself")
