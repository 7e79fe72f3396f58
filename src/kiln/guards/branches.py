"""Rule 2: every optional loss branch has a flag (default off), and switched on it must work: a
finite, non-zero term whose gradient reaches the model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.guards.rules import RULE_2


class LossBranchError(RuntimeError):
    """A loss term that is not finite, is exactly zero, or reaches no parameter."""


def check_loss_branches(model: nn.Module, criterion, batch: Any) -> dict[str, torch.Tensor]:
    """One train-mode forward through `criterion` with whatever branches it has switched on;
    returns the terms after checking each one and the total's gradients."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    loss, terms = criterion(model, batch)
    for name, term in terms.items():
        if not torch.isfinite(term).all():
            raise LossBranchError(f"{RULE_2}: the {name!r} term is {term.item()} (not finite)")
        if float(term) == 0.0:
            raise LossBranchError(
                f"{RULE_2}: the {name!r} term is exactly 0: switched on, it does nothing"
            )
        grads = (
            torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
            if term.requires_grad
            else []
        )
        if all(g is None or not g.any() for g in grads):
            raise LossBranchError(
                f"{RULE_2}: the {name!r} term reaches no parameter (computed from detached "
                "tensors or under no_grad?); its flag would change nothing but the logged loss"
            )
    loss.backward()
    bad = [
        n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()
    ]
    if bad:
        raise LossBranchError(f"{RULE_2}: non-finite gradients in {', '.join(bad[:5])}")
    return terms
