"""Fine-tuning parts the composition root hands to the Trainer: which parameters are frozen
until which epoch (model.freeze, trainer.unfreeze_at_epoch), the optimizer's parameter groups
(the head's learning rate, optimizer.head_lr_mult; layer-wise decay, optimizer.layer_decay; no
weight decay on biases and norm scales, optimizer.decay_bias_and_norm), and an exponential
moving average of the weights (trainer.ema_decay, timm's ModelEmaV3: foreach lerps on the
device, no host sync)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.config.base import ConfigError
from kiln.config.optim import OptimizerConfig

log = logging.getLogger(__name__)

BACKBONE = "backbone"  # model.freeze=backbone: everything but the head
EMBEDDINGS = "embeddings"  # model.freeze=embeddings: what comes before the first layer
LAYERS = "layers:"  # model.freeze=layers:K: the embeddings and the first K layers
# A numbered block of an encoder: bert.encoder.layer.3., model.layers.3., blocks.3. (timm's
# ViT), transformer.h.3. (GPT-2), encoder.layers.3. (torch's TransformerEncoder)
NUMBERED_LAYER = re.compile(r"(?:^|\.)(?:layer|layers|block|blocks|h)\.(\d+)\.")


def head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The module-name prefixes of the model's classifier head(s), as the model declares them."""
    return tuple(getattr(model, "head_prefixes", ()))


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def head_parameter_names(model: nn.Module) -> set[str]:
    prefixes = head_prefixes(model)
    return {name for name, _ in model.named_parameters() if _under(name, prefixes)}


def layer_depths(model: nn.Module, option: str, model_name: str) -> tuple[dict[str, int], int]:
    """Each parameter's depth, as layer-wise fine-tuning counts it (ELECTRA, BEiT): 0 for what
    comes before the first numbered layer (embeddings, a stem), i + 1 for layer i, L + 1 for
    what follows the last one (a pooler, a final norm) and for the head. Modules register in
    the order they run, so "before" and "after" are read from the parameters' order. A model
    without numbered layers (ALBERT shares one layer; a ResNet names its stages) is an error."""
    names = [name for name, _ in model.named_parameters()]
    head = head_parameter_names(model)
    found = {n: NUMBERED_LAYER.search(n) for n in names if n not in head}
    numbered = {n: int(m.group(1)) for n, m in found.items() if m}
    if not numbered:
        raise ConfigError(
            f"model={model_name} has no numbered layers (parameter names with layer.<i>., "
            f"layers.<i>., block.<i>., blocks.<i>. or h.<i>.), so {option} has nothing to count",
            option,
            f"its parameters start: {', '.join(names[:4])}",
        )
    count = max(numbered.values()) + 1
    first = names.index(next(n for n in names if n in numbered))
    depths = {}
    for position, name in enumerate(names):
        if name in numbered:
            depths[name] = numbered[name] + 1
        else:
            depths[name] = 0 if position < first and name not in head else count + 1
    return depths, count


def frozen_parameter_names(model: nn.Module, freeze: Any, model_name: str) -> set[str]:
    """model.freeze resolved to parameter names; a prefix that names nothing is an error."""
    if freeze is None:
        return set()
    names = [name for name, _ in model.named_parameters()]
    if freeze == EMBEDDINGS or (isinstance(freeze, str) and freeze.startswith(LAYERS)):
        below = 0 if freeze == EMBEDDINGS else int(freeze[len(LAYERS) :])
        depths, count = layer_depths(model, "model.freeze", model_name)
        if below > count:
            raise ConfigError(
                f"freeze={freeze} but model={model_name} has {count} layers",
                "model.freeze",
                f"use layers:0..layers:{count}",
            )
        return {name for name in names if depths[name] <= below}
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


def parameter_groups(model: nn.Module, cfg: OptimizerConfig, model_name: str = "") -> list:
    """The optimizer's parameter groups, split by what sets a parameter's lr and decay:
    - the head (a model that declares head_prefixes) at lr * optimizer.head_lr_mult; always its
      own group, so a resume may change the multiplier;
    - biases and norm scales (every 1-D parameter, as timm's filter_bias_and_bn and transformers'
      Trainer) without weight decay, unless optimizer.decay_bias_and_norm;
    - with optimizer.layer_decay < 1, one group per depth (layer_depths), at lr * decay ** (L + 1
      - depth): the embeddings learn slowest, the top layer at lr.
    Each group records `lr_mult` (what apply_hyperparameters needs to rebuild its lr) and
    `decay`. Frozen parameters stay in their group (their grads are None, so nothing updates
    them): unfreezing needs no new optimizer, and resume sees one layout."""
    params = list(model.named_parameters())
    head = head_parameter_names(model)
    if not head and cfg.head_lr_mult != 1.0:
        raise ConfigError(
            f"optimizer.head_lr_mult={cfg.head_lr_mult:g} but the model declares no head "
            "(head_prefixes)",
            "optimizer.head_lr_mult",
            "leave it at 1.0 for this model, or give the model a head_prefixes attribute",
        )
    depths, count = {}, 0
    if cfg.layer_decay != 1.0:
        depths, count = layer_depths(model, "optimizer.layer_decay", model_name)
    groups: dict[tuple, dict] = {}
    for name, param in params:
        in_head = name in head
        decay = cfg.decay_bias_and_norm or param.ndim > 1
        depth = depths.get(name, count + 1)
        layer_mult = cfg.layer_decay ** (count + 1 - depth)
        key = (in_head, depth, decay)
        if key not in groups:
            mult = layer_mult * (cfg.head_lr_mult if in_head else 1.0)
            groups[key] = {
                "params": [],
                "group": "head" if in_head else "backbone",
                "depth": depth,
                "decay": decay,
                "layer_mult": layer_mult,
                "lr_mult": mult,
                "lr": cfg.lr * mult,
                "weight_decay": cfg.weight_decay if decay else 0.0,
            }
        groups[key]["params"].append(param)
    if not head and len(groups) == 1:
        return [p for _, p in params]  # one plain list: the optimizer's own defaults
    # backbone before head, shallow before deep: the order resume and the logs see
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], k[1], not k[2]))]


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
