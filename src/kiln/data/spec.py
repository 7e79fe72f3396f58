"""What a dataset tells the rest of kiln: the shapes models are built from and the preprocessing
that inference must repeat exactly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch.utils.data import Dataset


@dataclass(frozen=True)
class DataSpec:
    """Shapes and labels a model is built from. Nothing in a model hard-codes these."""

    task: str  # "classification" | "detection"
    input_kind: str  # "image" | "tokens" | "image_list"
    num_classes: int
    class_names: tuple[str, ...]
    channels: int | None = None  # images
    image_size: tuple[int, int] | None = None  # images: (H, W) the data was made at
    vocab_size: int | None = None  # tokens
    max_length: int | None = None  # tokens
    pad_id: int = 0  # tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataSpec:
        d = dict(d)
        d["class_names"] = tuple(d["class_names"])
        if d.get("image_size") is not None:
            d["image_size"] = tuple(d["image_size"])
        return cls(**d)


@dataclass
class DataBundle:
    """A built dataset: spec, splits, how to batch them, and the preprocessing to save."""

    spec: DataSpec
    train: Dataset
    val: Dataset
    collate_fn: Callable | None = None
    # Plain data (lists, numbers, strings) stored in checkpoints: normalisation statistics,
    # tokenizer JSON, label names. kiln.data.preprocess rebuilds the transform from it.
    preprocessing: dict[str, Any] = field(default_factory=dict)
