"""Images of mixed sizes for detection: (3, H_i, W_i) in the data's value range, one box list
each. The model resizes and normalises internally, so preprocessing only checks each image and
turns it into a tensor. An item may also be the bytes of an image file (PNG, JPEG, ... as the
dataset reads them): decoded as the dataset decodes (three channels: grey repeated, alpha
dropped, EXIF orientation applied), its header checked against `max_image_pixels` before any
decoding, to float32 (3, H, W) in [0, 1] at its own size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kiln.preprocessing.errors import InputError, describe_shape
from kiln.preprocessing.image import ENCODED, _lists, check_values, numeric_array

MIN_SIDE = 16  # smaller images hold too few pixels for the detector's stride-16 stage
MAX_SIDE_FACTOR = 8  # sides up to 8x the training data's largest side (bounds memory per input)


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

    def preprocessor(self) -> ImageListPreprocessor:
        return ImageListPreprocessor(self)


class ImageListPreprocessor:
    """Raw images (C, H, W), each its own size, in the data's value range -> a list of float32
    tensors, the detector's input."""

    input_kind = "image_list"
    takes_files = True  # the bytes of an image file, as infer.py reads a folder of images

    def __init__(self, recipe: ImageListRecipe):
        from kiln.preprocessing.image_files import DEFAULT_MAX_PIXELS

        self.recipe = recipe
        self.channels = recipe.channels
        self.value_range = recipe.value_range
        self.max_side = MAX_SIDE_FACTOR * max(recipe.image_size)
        # Image files whose header asks for more pixels are refused before decoding (the
        # server's and infer.py's limit; None: none). Set before the first file is read.
        self.max_image_pixels: int | None = DEFAULT_MAX_PIXELS

    @property
    def expected(self) -> str:
        return f"(C, H, W) = ({self.channels}, H, W) with {MIN_SIDE} <= H, W <= {self.max_side}"

    def file_item(self, item: bytes | bytearray | memoryview, index: int) -> np.ndarray:
        """An encoded image file -> float32 (3, H, W) in [0, 1], its sides checked; InputError
        naming `index`."""
        from kiln.preprocessing.image_files import ImageDecodeError, ImageTooLargeError, decode

        try:
            pixels = decode(item, self.channels, self.max_image_pixels)
        except ImageTooLargeError as err:
            raise InputError(f"item {index}: image too large: {err.detail}", index) from None
        except ImageDecodeError as err:
            raise InputError(f"item {index}: not a readable image ({err})", index) from None
        height, width = pixels.shape[1:]
        if not all(MIN_SIDE <= side <= self.max_side for side in (height, width)):
            raise InputError(
                f"item {index}: the image is {width}x{height} px; this detector takes sides of "
                f"{MIN_SIDE} to {self.max_side} px ({MAX_SIDE_FACTOR}x the largest side it was "
                "trained on): resize it first",
                index,
            )
        array = pixels.numpy().astype(np.float32)
        array /= 255.0
        return array

    def item_array(self, item: Any, index: int) -> np.ndarray:
        if isinstance(item, ENCODED):
            return self.file_item(item, index)
        array = numeric_array(item, index, f"an image of shape {self.expected}")
        fits = array.ndim == 3 and array.shape[0] == self.channels
        if not (fits and all(MIN_SIDE <= side <= self.max_side for side in array.shape[1:])):
            raise InputError(
                f"item {index}: expected an image of shape {self.expected}, "
                f"got {describe_shape(array.shape)}",
                index,
            )
        check_values(array, index, self.value_range)
        return array

    def validate(self, raw_inputs: Sequence[Any]) -> None:
        for index, item in enumerate(raw_inputs):
            self.item_array(item, index)

    def convert(self, raw_inputs: Sequence[Any]) -> list[np.ndarray]:
        """Raw images, each validated on its own -> float32 (C, H_i, W_i) arrays."""
        return [self.item_array(item, i) for i, item in enumerate(raw_inputs)]

    def check_batch(self, array: np.ndarray) -> list[np.ndarray]:
        """A float32 (N, C, H, W) array (one size for all) -> its images, validated."""
        if array.ndim != 4:
            raise InputError(
                f"expected a tensor of shape (N, {self.channels}, H, W), "
                f"got {describe_shape(array.shape)}"
            )
        return [self.item_array(image, i) for i, image in enumerate(array)]

    def to_tensors(self, images: list[np.ndarray]) -> list[torch.Tensor]:
        return [torch.from_numpy(np.ascontiguousarray(image)) for image in images]

    def __call__(self, raw_inputs: Sequence[Any]) -> list[torch.Tensor]:
        return self.to_tensors(self.convert(raw_inputs))

    def example(self) -> np.ndarray:
        """A valid raw input (mid-range grey at the data's largest size), for warm-up."""
        low, high = self.value_range
        return np.full((self.channels, *self.recipe.image_size), (low + high) / 2, np.float32)
