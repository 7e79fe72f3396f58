"""What pretrained weights expect of their inputs (timm's pretrained_cfg, torchvision's
weights.transforms()): resolved from the model config alone, before the data is built and without
loading the weights, so data.normalize=auto and the default input size can follow them. It is
recorded with the checkpoint (in the image recipe) so inference repeats it."""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from typing import Any

from kiln.registry import MODELS


@dataclass(frozen=True)
class PretrainedInput:
    source: str  # what the numbers come from, e.g. "torchvision ResNet18_Weights.IMAGENET1K_V1"
    mean: tuple[float, ...]  # per channel (RGB), of pixels in [0, 1]
    std: tuple[float, ...]
    image_size: int | None = None  # the side the weights were trained at (the crop)
    crop_pct: float | None = None  # eval resize = image_size / crop_pct, then center crop
    interpolation: str = "bilinear"  # bilinear | bicubic | nearest
    fixed_input_size: bool = False  # the architecture takes only image_size (a ViT's positions)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PretrainedInput:
        """What `to_dict` wrote (a checkpoint's recipe.pretrained): to rebuild a run's data
        exactly, e.g. build_data(cfg.data, pretrained=PretrainedInput.from_dict(...))."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def pretrained_input(model_cfg: Any) -> PretrainedInput | None:
    """What the model's weights expect, from the `preprocessing` function its registry entry
    declares (zoo models), or None. That function also checks the model's architecture and
    weights (names, files, caches) against its library: call it at start-up, before the data."""
    target = MODELS.entry(model_cfg.name).meta.get("preprocessing")
    if target is None:
        return None
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)(model_cfg)
