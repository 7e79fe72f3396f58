"""Logits, not probabilities. kiln's classification criterion is cross-entropy on logits: it
applies log-softmax itself, so a model that already ends in a softmax trains silently to a worse
optimum (the gradients of a softmax of probabilities are squashed). Before step 1 a probe looks
at the outputs: rows that all lie in [0, 1] and sum to 1 stop the run, naming the module that
produced them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.guards.rules import LOGITS, ProbeFailure
from kiln.guards.trace import ModuleCalls
from kiln.models import logits_of

SUM_TOLERANCE = 2e-2  # bf16 probabilities sum to 1 within about 1e-2


class ProbabilitiesNotLogitsError(ProbeFailure):
    """A classifier returned probabilities where its criterion expects logits (`module`: the
    path that produced them, "" for the model's own forward)."""

    kind = "probabilities"

    def __init__(self, message: str, module: str, made_by: str = ""):
        what = f"probabilities, not logits, from {module or 'the forward'}"
        fix = (
            f"remove the final softmax ({made_by or module or 'the forward'}): kiln's "
            "cross-entropy applies log_softmax itself, and inference turns logits into "
            "probabilities"
        )
        super().__init__(message, module, what, fix=fix)


def looks_like_probabilities(scores: torch.Tensor) -> bool:
    """Every row in [0, 1] and summing to 1: what a softmax returns and logits never do."""
    if scores.dim() != 2 or scores.shape[0] < 2 or scores.shape[1] < 2:
        return False
    scores = scores.detach().float()
    in_range = bool(((scores >= 0) & (scores <= 1)).all())
    return in_range and bool(((scores.sum(dim=1) - 1).abs() < SUM_TOLERANCE).all())


def producer(model: nn.Module, run: Callable[[], Any], pick: Callable[[Any], Any]) -> str:
    """The innermost module whose forward returned the tensor `pick(output)`, or "" when the
    model's own forward made it (a functional softmax)."""
    finished: list[tuple[str, Any]] = []  # (path, output), innermost first

    def leave(call, caller, args, kwargs, output) -> None:
        finished.append((call.path, output))

    with ModuleCalls(model, leave=leave), torch.no_grad():
        target = pick(run())
    return next((path for path, out in finished if out is target and path), "")


def check_logits(model: nn.Module, batch: Any, forward: Callable[[nn.Module, Any, bool], Any]):
    """`forward(model, batch, train_mode)` as the criterion calls it; eval mode (no dropout, no
    statistics moved), no grad. Raises ProbabilitiesNotLogitsError."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = forward(model, batch, False)
        heads = {"logits": logits_of(output)}
        if isinstance(output, dict) and "aux_logits" in output:
            heads["aux_logits"] = output["aux_logits"]
        for name, scores in heads.items():
            if isinstance(scores, torch.Tensor) and looks_like_probabilities(scores):
                path = producer(model, lambda: forward(model, batch, False), _picker(output, name))
                made_by = _made_by(model, path)
                raise ProbabilitiesNotLogitsError(
                    _message(model, name, scores, made_by), path, made_by
                )
    finally:
        model.train(was_training)


def _picker(output: Any, name: str) -> Callable[[Any], Any]:
    return (lambda out: out[name]) if isinstance(output, dict) else (lambda out: out)


def _made_by(model: nn.Module, path: str) -> str:
    if path:
        return f"{path} ({type(model.get_submodule(path)).__name__})"
    return f"{type(model).__name__}.forward itself (a functional softmax on the output)"


def _message(model: nn.Module, head: str, scores: torch.Tensor, where: str) -> str:
    row = " ".join(f"{v:.3f}" for v in scores[0, :6].float().tolist())
    more = " ..." if scores.shape[1] > 6 else ""
    return (
        f"{LOGITS}: {type(model).__name__} returns probabilities as its {head}: every row of a "
        f"batch of {scores.shape[0]} lies in [0, 1] and sums to 1 (row 0: {row}{more}); they "
        f"come from {where}. The cross-entropy criterion expects logits and applies log_softmax "
        "itself: drop the final softmax (inference turns logits into probabilities)"
    )
