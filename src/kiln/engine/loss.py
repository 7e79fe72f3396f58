"""Rule 2: the main criterion plus optional branches, each behind a flag that defaults to off.
Every branch's term is returned (and logged) on its own; the total is their sum."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

BRANCHES = ("label_smoothing", "z_loss", "confidence_penalty", "aux_head")


@dataclass(frozen=True)
class LossBranches:
    label_smoothing_eps: float | None = None  # None: branch off
    z_loss_weight: float | None = None
    confidence_penalty_weight: float | None = None
    aux_head_weight: float | None = None

    @classmethod
    def from_config(cls, cfg) -> LossBranches:
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
    logits = output["logits"] if isinstance(output, dict) else output
    logits = logits.float()  # the loss in fp32 also under autocast
    terms = {"main": F.cross_entropy(logits, targets)}
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
    return sum(terms.values()), terms
