"""Images: the recipe (normalisation statistics, value range, size, labels) a dataset records and
every checkpoint carries, and the transform that repeats it on raw pixel arrays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kiln.preprocessing.errors import InputError, describe_shape


def normalise(images: np.ndarray | torch.Tensor, mean: list[float], std: list[float]):
    """(N, C, H, W) float images -> standardised float32 tensor, per channel."""
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (torch.as_tensor(images, dtype=torch.float32) - mean_t) / std_t


@dataclass(frozen=True)
class ImageRecipe:
    """Fixed-size images (C, H, W), standardised per channel."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: int
    image_size: tuple[int, int]  # (H, W)
    class_names: tuple[str, ...]
    value_range: tuple[float, float] | None = None  # the raw pixels' range; None: unchecked
    kind = "image"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **_lists(asdict(self))}

    def preprocessor(self) -> ImagePreprocessor:
        return ImagePreprocessor(self)


class ImagePreprocessor:
    """Raw pixel arrays (C, H, W) -- or (H, W) for one-channel data -- in the data's value range
    -> the standardised (N, C, H, W) tensor the model was trained on."""

    input_kind = "image"

    def __init__(self, recipe: ImageRecipe):
        self.recipe = recipe
        self.channels = recipe.channels
        self.shape = (recipe.channels, *recipe.image_size)
        self.value_range = recipe.value_range

    @property
    def expected(self) -> str:
        grey = f" or {describe_shape(self.shape[1:])}" if self.channels == 1 else ""
        return f"(C, H, W) = {describe_shape(self.shape)}{grey}"

    def item_array(self, item: Any, index: int) -> np.ndarray:
        """One raw item -> float32 (C, H, W); InputError naming `index` if it does not fit."""
        try:
            array = np.asarray(item, dtype=np.float32)
        except (ValueError, TypeError, OverflowError):
            raise InputError(
                f"item {index}: not a numeric array; expected an image of shape {self.expected}",
                index,
            ) from None
        if self.channels == 1 and array.shape == self.shape[1:]:
            array = array[None]
        if array.shape != self.shape:
            raise InputError(
                f"item {index}: expected an image of shape {self.expected}, "
                f"got {describe_shape(array.shape)}",
                index,
            )
        self._check_values(array, index)
        return array

    def _check_values(self, array: np.ndarray, index: int) -> None:
        if not np.isfinite(array).all():
            raise InputError(f"item {index}: contains NaN or Inf pixel values", index)
        if self.value_range is None:
            return
        low, high = self.value_range
        seen_low, seen_high = float(array.min()), float(array.max())
        # A common mistake is sending 0..255 (or 0..1) pixels to a model trained on another range.
        if seen_low < low or seen_high > high:
            raise InputError(
                f"item {index}: pixel values span [{seen_low:g}, {seen_high:g}], outside the "
                f"training data's raw range [{low:g}, {high:g}]; send raw pixels in that range",
                index,
            )

    def validate(self, raw_inputs: Sequence[Any]) -> None:
        for index, item in enumerate(raw_inputs):
            self.item_array(item, index)

    def __call__(self, raw_inputs: Sequence[Any] | np.ndarray) -> torch.Tensor:
        """Raw items -> standardised float32 tensor (N, C, H, W)."""
        if len(raw_inputs) == 0:
            return torch.zeros((0, *self.shape), dtype=torch.float32)
        batch = np.stack([self.item_array(item, i) for i, item in enumerate(raw_inputs)])
        return normalise(batch, list(self.recipe.mean), list(self.recipe.std))

    def example(self) -> np.ndarray:
        """A valid raw input (mid-range grey), for warm-up requests."""
        low, high = self.value_range or (0.0, 1.0)
        return np.full(self.shape, (low + high) / 2, dtype=np.float32)


def _lists(d: dict[str, Any]) -> dict[str, Any]:
    """Tuples as lists: plain data that survives torch.load(weights_only=True) and JSON alike."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
