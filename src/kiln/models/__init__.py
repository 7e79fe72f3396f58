"""Models: each registered builder takes (DataSpec, its typed config, aux_head=...) and never
hard-codes a shape. Importing this package loads no model module; `build_model` imports the one
asked for.

Classification models return logits (N, num_classes), or {"logits": ..., "aux_logits": ...} when
built with an auxiliary head; `logits_of` reads either."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn

from kiln.models.init import apply_init
from kiln.registry import MODELS


def build_model(spec, cfg, *, aux_head: bool | None = None, pretrained: Any = None) -> nn.Module:
    """Build a registered model from the data spec. `aux_head` overrides cfg.aux_head.
    `pretrained`: what the model's preprocessing function returned (or a checkpoint recorded of
    it), for the entries that declare uses_pretrained (model=hf: its config.json)."""
    want_aux = getattr(cfg, "aux_head", False) if aux_head is None else aux_head
    builder = MODELS.get(cfg.name)
    if MODELS.entry(cfg.name).meta.get("uses_pretrained"):
        model = builder(spec, cfg, aux_head=want_aux, pretrained=pretrained)
    else:
        model = builder(spec, cfg, aux_head=want_aux)
    apply_init(model, str(cfg.init))
    return model


def without_weights(cfg):
    """The model config with its `weights` (a zoo model's pretrained weights) set to None: how a
    trained model is rebuilt (the checkpoint holds its weights) and how probes build fresh ones."""
    if not dataclasses.is_dataclass(cfg):
        return cfg
    # weights_backbone: a detector's ImageNet backbone (model=torchvision_detection)
    names = {f.name for f in dataclasses.fields(cfg)} & {"weights", "weights_backbone"}
    return dataclasses.replace(cfg, **dict.fromkeys(names)) if names else cfg


def logits_of(output: Any) -> Tensor:
    """The main logits of a classifier's output (a tensor, or a dict with "logits")."""
    return output["logits"] if isinstance(output, dict) else output


__all__ = ["apply_init", "build_model", "logits_of", "without_weights"]
