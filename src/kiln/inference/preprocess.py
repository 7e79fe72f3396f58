"""Raw inputs -> the model's input tensor, repeating exactly the preprocessing used in training.

The recipe is the `preprocessing` dict saved in every checkpoint (see kiln.data): images are
checked against the stored (C, H, W) and value range, then standardised with the stored mean/std
by the same `normalise` the dataset used; texts go through the stored tokenizer via
`encode_texts`. Every check names the item index and what was expected."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kiln.data.csv_text import encode_texts
from kiln.data.digits import normalise
from kiln.inference.errors import InputError


def describe_shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


class ImagePreprocessor:
    """Raw pixel arrays (C, H, W) -- or (H, W) for one-channel data -- in the data's value range."""

    input_kind = "image"

    def __init__(self, preprocessing: dict[str, Any]):
        self.mean = list(preprocessing["mean"])
        self.std = list(preprocessing["std"])
        self.channels = int(preprocessing["channels"])
        height, width = preprocessing["image_size"]
        self.shape = (self.channels, int(height), int(width))
        value_range = preprocessing.get("value_range")
        self.value_range = tuple(value_range) if value_range is not None else None

    @property
    def expected(self) -> str:
        grey = f" or {describe_shape(self.shape[1:])}" if self.channels == 1 else ""
        return f"(C, H, W) = {describe_shape(self.shape)}{grey}"

    def item_array(self, item: Any, index: int) -> np.ndarray:
        """One raw item -> float32 (C, H, W); InputError naming `index` if it does not fit."""
        try:
            array = np.asarray(item, dtype=np.float32)
        except (ValueError, TypeError):
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
        return normalise(batch, self.mean, self.std)

    def example(self) -> np.ndarray:
        """A valid raw input (mid-range grey), for warm-up requests."""
        low, high = self.value_range or (0.0, 1.0)
        return np.full(self.shape, (low + high) / 2, dtype=np.float32)


class TokenPreprocessor:
    """Raw texts (str) -> token ids (N, L) padded to the longest, by the stored tokenizer."""

    input_kind = "tokens"
    expected = "a text (string)"

    def __init__(self, preprocessing: dict[str, Any]):
        self.preprocessing = preprocessing

    def validate(self, raw_inputs: Sequence[Any]) -> None:
        for index, item in enumerate(raw_inputs):
            if not isinstance(item, str):
                raise InputError(
                    f"item {index}: expected a text (string), got {type(item).__name__}", index
                )

    def __call__(self, raw_inputs: Sequence[Any]) -> torch.Tensor:
        self.validate(raw_inputs)
        return encode_texts(self.preprocessing, list(raw_inputs))

    def example(self) -> str:
        return "hello world"


Preprocessor = ImagePreprocessor | TokenPreprocessor


def build_preprocessor(preprocessing: dict[str, Any]) -> Preprocessor:
    kind = preprocessing.get("kind")
    if kind == "image":
        return ImagePreprocessor(preprocessing)
    if kind == "tokens":
        return TokenPreprocessor(preprocessing)
    raise AssertionError(f"checkpoint preprocessing of unknown kind {kind!r}")
