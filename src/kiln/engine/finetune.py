"""Fine-tuning parts the composition root hands to the Trainer: which parameters are frozen
until which epoch (model.freeze, trainer.unfreeze_at_epoch), the head's learning rate
(optimizer.head_lr_mult), and an exponential moving average of the weights
(trainer.ema_decay, timm's ModelEmaV3: foreach lerps on the device, no host sync)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.config.base import ConfigError

log = logging.getLogger(__name__)

BACKBONE = "backbone"  # model.freeze=backbone: everything but the head


def head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The module-name prefixes of the model's classifier head(s), as the model declares them."""
    return tuple(getattr(model, "head_prefixes", ()))


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def head_parameter_names(model: nn.Module) -> set[str]:
    prefixes = head_prefixes(model)
    return {name for name, _ in model.named_parameters() if _under(name, prefixes)}


def frozen_parameter_names(model: nn.Module, freeze: Any, model_name: str) -> set[str]:
    """model.freeze resolved to parameter names; a prefix that names nothing is an error."""
    if freeze is None:
        return set()
    names = [name for name, _ in model.named_parameters()]
    if freeze == BACKBONE:
        if not head_prefixes(model):
            raise ConfigError(
                f"model={model_name} does not declare its head (head_prefixes), so 'backbone' "
                "means nothing for it",
                "model.freeze",
                "list module-name prefixes instead: model.freeze=[...]",
            )
        return set(names) - head_parameter_names(model)
    frozen = set()
    tops = sorted({name.split(".")[0] for name in names})
    for prefix in freeze:
        hit = {name for name in names if _under(name, [prefix])}
        if not hit:
            raise ConfigError(
                f"no parameter of model={model_name} is under {prefix!r}",
                "model.freeze",
                f"its top-level modules: {', '.join(tops)}",
            )
        frozen |= hit
    return frozen


@dataclass
class FreezePlan:
    """Parameters kept frozen until `unfreeze_at_epoch` (None: for the whole run). The state
    follows from the epoch alone, so a resumed run freezes exactly as the original did."""

    names: frozenset[str]
    unfreeze_at_epoch: int | None = None

    def frozen_at(self, epoch: int) -> bool:
        thawed = self.unfreeze_at_epoch is not None and epoch >= self.unfreeze_at_epoch
        return bool(self.names) and not thawed

    def apply(self, model: nn.Module, epoch: int) -> bool:
        """Sets requires_grad for `epoch`; returns whether anything changed."""
        frozen = self.frozen_at(epoch)
        changed = False
        for name, param in model.named_parameters():
            if name in self.names and param.requires_grad == frozen:
                param.requires_grad_(not frozen)
                changed = True
        return changed


def parameter_groups(model: nn.Module, lr: float, head_lr_mult: float) -> list:
    """The backbone's and the head's parameters as two groups, the head at lr * head_lr_mult,
    for a model that declares its head (always two, so a resume may change the multiplier);
    otherwise one plain list. Frozen parameters stay in their group (their grads are None, so
    nothing updates them): unfreezing needs no new optimizer, and resume sees one layout."""
    params = list(model.named_parameters())
    head = head_parameter_names(model)
    if not head:
        if head_lr_mult != 1.0:
            raise ConfigError(
                f"optimizer.head_lr_mult={head_lr_mult:g} but the model declares no head "
                "(head_prefixes)",
                "optimizer.head_lr_mult",
                "leave it at 1.0 for this model, or give the model a head_prefixes attribute",
            )
        return [p for _, p in params]
    return [
        {"params": [p for n, p in params if n not in head], "group": "backbone", "lr_mult": 1.0},
        {
            "params": [p for n, p in params if n in head],
            "group": "head",
            "lr": lr * head_lr_mult,
            "lr_mult": head_lr_mult,
        },
    ]


class WeightAverage:
    """EMA of the weights and buffers (timm's ModelEmaV3), updated after each optimizer step;
    its first update copies the weights."""

    def __init__(self, model: nn.Module, decay: float):
        from timm.utils.model_ema import ModelEmaV3

        self.decay = decay
        self.ema = ModelEmaV3(model, decay=decay)

    @property
    def module(self) -> nn.Module:
        return self.ema.module

    def update(self, model: nn.Module, step: int) -> None:
        self.ema.update(model, step=step)  # step 1: decay 0, a copy

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.ema.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.ema.module.load_state_dict(state)
