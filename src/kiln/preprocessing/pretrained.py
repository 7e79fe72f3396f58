"""What pretrained weights expect of their inputs (timm's pretrained_cfg, torchvision's
weights.transforms()): resolved from the model config alone, before the data is built and without
loading the weights, so data.normalize=auto and the default input size can follow them. It is
recorded with the checkpoint (in the image recipe) so inference repeats it."""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from pathlib import Path
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


@dataclass(frozen=True)
class PretrainedText:
    """What a pretrained text model (model=hf) expects of its inputs: its own tokenizer (the
    Rust tokenizer's JSON, special tokens included) and what the data must respect (its position
    limit, its padding id, whether its normalizer lower-cases). `model_config` is the model's
    config.json, so a checkpoint rebuilds the architecture without the folder it came from.
    Plain data: the server reads it with `tokenizers` alone."""

    source: str  # e.g. "hf folder /models/bert-small" or "hf hub bert-base-uncased@<commit>"
    tokenizer_json: str  # tokenizers.Tokenizer.to_str() of the model's fast tokenizer
    tokenizer_sha256: str  # what the token cache is keyed by
    special_tokens: dict[str, str]  # {"pad_token": "[PAD]", "cls_token": "[CLS]", ...}
    pad_id: int
    unk_id: int | None  # what a text that encodes to nothing becomes (None: pad_id)
    position_limit: int  # the longest sequence the model's positions take
    lowercase: bool  # the tokenizer's normalizer lower-cases (an uncased model)
    model_input_names: tuple[str, ...]  # input_ids, attention_mask, token_type_ids, ...
    model_config: dict[str, Any]  # the model's config.json
    sep_id: int | None = None  # the separator between a pair's texts: where token types turn
    kind = "text"

    def to_dict(self) -> dict[str, Any]:
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        return {"kind": self.kind, **out}


def pretrained_from_dict(data: dict[str, Any] | None) -> PretrainedInput | PretrainedText | None:
    """What a checkpoint recorded under "pretrained" (or a recipe's `pretrained`), typed."""
    if not data:
        return None
    if data.get("kind") == PretrainedText.kind:
        fields = {k: v for k, v in data.items() if k != "kind"}
        fields["model_input_names"] = tuple(fields["model_input_names"])
        return PretrainedText(**fields)
    return PretrainedInput.from_dict(data)


def recorded_pretrained(model_cfg: Any, init_from: str | None) -> PretrainedText | None:
    """init_from=<a kiln checkpoint of the same model: model.name and model.arch> whose model
    reads its own tokenizer and config.json (model=hf): those, as the checkpoint holds them, so
    the printed "train longer" command works with the model's folder (or hub cache) gone. The
    checkpoint's embedded files are checked against their hashes first. None otherwise."""
    if init_from is None or not Path(init_from).is_file():
        return None
    from kiln.checkpoint import CheckpointError, check_embedded, load_checkpoint

    try:
        ckpt = load_checkpoint(Path(init_from))
    except CheckpointError:  # not a kiln checkpoint (a plain state dict): init_from reads it
        return None
    found = pretrained_from_dict(ckpt.get("pretrained"))
    model = (ckpt.get("config") or {}).get("model") or {}
    same = (model.get("name"), model.get("arch")) == (
        model_cfg.name,
        getattr(model_cfg, "arch", None),
    )
    if not isinstance(found, PretrainedText) or not same:
        return None
    check_embedded(ckpt, init_from)
    return found


def pretrained_input(model_cfg: Any) -> PretrainedInput | PretrainedText | None:
    """What the model's weights expect, from the `preprocessing` function its registry entry
    declares (zoo models), or None. That function also checks the model's architecture and
    weights (names, files, caches) against its library: call it at start-up, before the data."""
    target = MODELS.entry(model_cfg.name).meta.get("preprocessing")
    if target is None:
        return None
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)(model_cfg)
