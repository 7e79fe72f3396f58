"""Images of mixed sizes for detection: (3, H_i, W_i) in the data's value range, one box list
each. The model (torchvision's detector) resizes and normalises internally."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kiln.preprocessing.image import _lists


@dataclass(frozen=True)
class ImageListRecipe:
    class_names: tuple[str, ...]  # label k means class_names[k - 1]; 0 is the background
    channels: int
    image_size: tuple[int, int]  # the largest (H, W) in the data
    min_image_size: int
    value_range: tuple[float, float] = (0.0, 1.0)
    background_id: int = 0
    kind = "image_list"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **_lists(asdict(self))}

    def preprocessor(self):
        raise NotImplementedError("detection inference is not supported yet")
