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


def spec_example(spec, device: Any = "cpu") -> Any:
    """One model input of the data spec's kind (zeros; a few tokens of id 1): what a dry
    forward gives a model whose layers take their sizes at the first call."""
    import torch

    if spec.input_kind == "tokens":
        return torch.ones(1, min(spec.max_length or 8, 8), dtype=torch.long, device=device)
    image = torch.zeros(spec.channels or 3, *(spec.image_size or (32, 32)), device=device)
    return [image] if spec.input_kind == "image_list" else image[None]


def has_lazy_parameters(model: nn.Module) -> bool:
    """torch's lazy layers (nn.LazyLinear, ...) not yet given their sizes by a forward."""
    from torch.nn.parameter import is_lazy

    return any(is_lazy(t) for t in [*model.parameters(), *model.buffers()])


def materialise(model: nn.Module, example: Any) -> None:
    """A dry forward (eval mode, no grad; the mode put back) that builds what a model builds at
    its first call: torch's lazy layers take their sizes (and draw their initial weights, as
    any layer's construction does)."""
    import torch

    training = model.training
    model.eval()
    with torch.no_grad():
        model(example)
    model.train(training)


def logits_of(output: Any) -> Tensor:
    """The main logits of a classifier's output (a tensor, or a dict with "logits")."""
    return output["logits"] if isinstance(output, dict) else output


__all__ = [
    "apply_init",
    "build_model",
    "has_lazy_parameters",
    "logits_of",
    "materialise",
    "spec_example",
    "without_weights",
]
