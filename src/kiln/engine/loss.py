"""What the training step minimises. Classifiers go through `ClassificationCriterion`: the main
cross-entropy plus optional branches (rule 2), each behind a flag that defaults to off, each term
returned (and logged) on its own. Models that compute their own loss (detectors, declared with
`computes_own_loss = True`) go through `OwnLossCriterion`.

A criterion also knows how the model is called in each mode (`forward`), which rule 3's check
and the evaluators reuse, so they call the model exactly as training does."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.config.run import LossConfig
from kiln.models import logits_of

BRANCHES = ("label_smoothing", "z_loss", "confidence_penalty", "aux_head")


@dataclass(frozen=True)
class LossBranches:
    label_smoothing_eps: float | None = None  # None: branch off
    z_loss_weight: float | None = None
    confidence_penalty_weight: float | None = None
    aux_head_weight: float | None = None

    @classmethod
    def from_config(cls, cfg: LossConfig) -> LossBranches:
        on = {name: cfg.force_all_branches or getattr(cfg, name) for name in BRANCHES}
        return cls(
            label_smoothing_eps=cfg.label_smoothing_eps if on["label_smoothing"] else None,
            z_loss_weight=cfg.z_loss_weight if on["z_loss"] else None,
            confidence_penalty_weight=(
                cfg.confidence_penalty_weight if on["confidence_penalty"] else None
            ),
            aux_head_weight=cfg.aux_head_weight if on["aux_head"] else None,
        )

    @property
    def wants_aux_head(self) -> bool:
        return self.aux_head_weight is not None


def classification_loss(
    output: Tensor | dict[str, Tensor], targets: Tensor, branches: LossBranches
) -> tuple[Tensor, dict[str, Tensor]]:
    """Returns (total, terms). `output` is logits (N, C) or {"logits", "aux_logits"}."""
    logits = logits_of(output).float()  # the loss in fp32 also under autocast
    terms = {"main": F.cross_entropy(logits, targets)}
    if branches.label_smoothing_eps is not None or branches.confidence_penalty_weight is not None:
        log_probs = F.log_softmax(logits, dim=-1)
    if branches.label_smoothing_eps is not None:
        # CE with smoothing eps = (1-eps)*CE + eps*CE(uniform); the branch is the difference.
        uniform_ce = -log_probs.mean(dim=-1).mean()
        terms["label_smoothing"] = branches.label_smoothing_eps * (uniform_ce - terms["main"])
    if branches.z_loss_weight is not None:
        terms["z_loss"] = branches.z_loss_weight * torch.logsumexp(logits, dim=-1).pow(2).mean()
    if branches.confidence_penalty_weight is not None:
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1).mean()
        terms["confidence_penalty"] = -branches.confidence_penalty_weight * entropy
    if branches.aux_head_weight is not None:
        aux = output.get("aux_logits") if isinstance(output, dict) else None
        if aux is None:
            warnings.warn(
                "loss.aux_head is on but the model returned no 'aux_logits'; branch ignored",
                stacklevel=2,
            )
        else:
            terms["aux_head"] = branches.aux_head_weight * F.cross_entropy(aux.float(), targets)
    total, *others = terms.values()
    for term in others:  # not sum(): its 0 + main is one more op on every step
        total = total + term
    return total, terms


def multilabel_loss(
    output: Tensor | dict[str, Tensor], targets: Tensor, branches: LossBranches
) -> tuple[Tensor, dict[str, Tensor]]:
    """Multi-label (multi-hot float targets (N, C)): binary cross-entropy with logits, one
    sigmoid per class, averaged over samples and classes; the same branches, each the binary
    form of its single-label counterpart. Returns (total, terms)."""
    logits = logits_of(output).float()
    targets = targets.float()
    terms = {"main": F.binary_cross_entropy_with_logits(logits, targets)}
    if branches.label_smoothing_eps is not None:
        # BCE against targets pulled towards 1/2 by eps; the branch is the difference.
        smoothed = targets * (1 - branches.label_smoothing_eps) + branches.label_smoothing_eps / 2
        terms["label_smoothing"] = (
            F.binary_cross_entropy_with_logits(logits, smoothed) - terms["main"]
        )
    if branches.z_loss_weight is not None:  # keeps the logits near 0, as z-loss keeps log Z
        terms["z_loss"] = branches.z_loss_weight * logits.pow(2).mean()
    if branches.confidence_penalty_weight is not None:  # each class's binary entropy
        p = torch.sigmoid(logits)
        entropy = F.binary_cross_entropy_with_logits(logits, p, reduction="mean")
        terms["confidence_penalty"] = -branches.confidence_penalty_weight * entropy
    if branches.aux_head_weight is not None:
        aux = output.get("aux_logits") if isinstance(output, dict) else None
        if aux is None:
            warnings.warn(
                "loss.aux_head is on but the model returned no 'aux_logits'; branch ignored",
                stacklevel=2,
            )
        else:
            aux_bce = F.binary_cross_entropy_with_logits(aux.float(), targets)
            terms["aux_head"] = branches.aux_head_weight * aux_bce
    total, *others = terms.values()
    for term in others:
        total = total + term
    return total, terms


class ClassificationCriterion:
    """model(inputs) in both modes; cross-entropy plus the switched-on branches."""

    expects_logits = True  # cross-entropy applies log_softmax itself (kiln.guards.outputs)

    def __init__(self, branches: LossBranches):
        self.branches = branches

    def forward(self, model: nn.Module, batch: Any, train_mode: bool) -> Any:
        return model(batch[0])

    def __call__(self, model: nn.Module, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        return classification_loss(self.forward(model, batch, True), batch[1], self.branches)


class OwnLossCriterion:
    """model(inputs, targets) returns a dict of loss terms in train mode; model(inputs) returns
    predictions in eval mode (torchvision's detection convention)."""

    def forward(self, model: nn.Module, batch: Any, train_mode: bool) -> Any:
        inputs, targets = batch
        return model(inputs, targets) if train_mode else model(inputs)

    def __call__(self, model: nn.Module, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        terms = self.forward(model, batch, True)
        return sum(terms.values()), terms


class MultiLabelCriterion(ClassificationCriterion):
    """model(inputs) in both modes; binary cross-entropy (a sigmoid per class) on multi-hot
    targets plus the switched-on branches."""

    def __call__(self, model: nn.Module, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        return multilabel_loss(self.forward(model, batch, True), batch[1], self.branches)


def build_criterion(model: nn.Module, cfg: LossConfig, multi_label: bool = False):
    """The criterion for `model`: its own loss, BCE for multi-label data, else cross-entropy."""
    if getattr(model, "computes_own_loss", False):
        return OwnLossCriterion()
    if multi_label:
        return MultiLabelCriterion(LossBranches.from_config(cfg))
    return ClassificationCriterion(LossBranches.from_config(cfg))
