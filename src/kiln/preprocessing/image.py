"""Images: the recipe (normalisation statistics, value range, size, labels) a dataset records and
every checkpoint carries, and the transform that repeats it on raw pixel arrays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kiln.preprocessing.errors import InputError, describe_shape
from kiln.preprocessing.image_files import DEFAULT_MAX_PIXELS

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT64_MAX = float(np.finfo(np.float64).max)


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
    # Encoded image files (PNG, JPEG, ... any format Pillow reads) are accepted too when set:
    # decoded to `channels`, resized (shorter side) to resize_size with `interpolation`, center
    # cropped to image_size, scaled to [0, 1] -- the data's eval transform, exactly.
    resize_size: int | None = None  # None: inputs are pixel arrays at image_size only
    interpolation: str = "bilinear"
    pretrained: dict[str, Any] | None = None  # the weights' PretrainedInput.to_dict(), if any
    kind = "image"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **_lists(asdict(self))}

    def preprocessor(self) -> ImagePreprocessor:
        return ImagePreprocessor(self)


ENCODED = (bytes, bytearray, memoryview)


class ImagePreprocessor:
    """Raw pixel arrays (C, H, W) -- or (H, W) for one-channel data -- in the data's value range
    -> the standardised (N, C, H, W) tensor the model was trained on. With `recipe.resize_size`
    (image-folder data) an item may also be the bytes of an image file (PNG, JPEG, ... any
    format the dataset reads): decoded and eval-transformed by the dataset's own function
    (kiln.preprocessing.image_files) to float32 (C, H, W) in [0, 1]."""

    input_kind = "image"

    def __init__(self, recipe: ImageRecipe):
        self.recipe = recipe
        self.channels = recipe.channels
        self.shape = (recipe.channels, *recipe.image_size)
        self.value_range = recipe.value_range
        self.takes_files = recipe.resize_size is not None
        # Image files whose header asks for more pixels are refused before decoding (the
        # server's and infer.py's limit; None: none). Set before the first file is read.
        self.max_image_pixels: int | None = DEFAULT_MAX_PIXELS
        self._loader = None  # the decoder + eval transform, built on the first file

    @property
    def expected(self) -> str:
        grey = f" or {describe_shape(self.shape[1:])}" if self.channels == 1 else ""
        return f"(C, H, W) = {describe_shape(self.shape)}{grey}"

    def file_item(self, item: bytes | bytearray | memoryview, index: int) -> np.ndarray:
        """An encoded image file -> float32 (C, H, W) in [0, 1]; InputError naming `index`."""
        if not self.takes_files:
            raise InputError(
                f"item {index}: got the bytes of a file; this model takes pixel arrays of shape "
                f"{self.expected} (its data was not read from image files)",
                index,
            )
        from kiln.preprocessing.image_files import ImageDecodeError, ImageTooLargeError

        loader = self.file_loader(self.max_image_pixels)
        try:
            return loader(item).numpy()
        except ImageTooLargeError as err:
            raise InputError(f"item {index}: image too large: {err.detail}", index) from None
        except ImageDecodeError as err:
            raise InputError(f"item {index}: not a readable image ({err})", index) from None

    def file_loader(self, max_image_pixels: int | None):
        """The decoder + eval transform of this recipe's image files (an EncodedImageLoader),
        refusing images above `max_image_pixels`; built once per limit."""
        from kiln.preprocessing.image_files import EncodedImageLoader

        if self._loader is None or self._loader.max_pixels != max_image_pixels:
            self._loader = EncodedImageLoader.for_recipe(self.recipe, max_image_pixels)
        return self._loader

    def item_array(self, item: Any, index: int) -> np.ndarray:
        """One raw item -> float32 (C, H, W); InputError naming `index` if it does not fit."""
        if isinstance(item, ENCODED):
            return self.file_item(item, index)
        files = " (or the bytes of an image file)" if self.takes_files else ""
        array = numeric_array(item, index, f"an image of shape {self.expected}{files}")
        if self.channels == 1 and array.shape == self.shape[1:]:
            array = array[None]
        if array.shape != self.shape:
            raise InputError(
                f"item {index}: expected an image of shape {self.expected}{files}, "
                f"got {describe_shape(array.shape)}",
                index,
            )
        check_values(array, index, self.value_range)
        return array

    def validate(self, raw_inputs: Sequence[Any]) -> None:
        for index, item in enumerate(raw_inputs):
            self.item_array(item, index)

    def convert(self, raw_inputs: Sequence[Any]) -> np.ndarray:
        """Raw items, each validated on its own -> float32 (N, C, H, W) raw pixels."""
        if isinstance(raw_inputs, np.ndarray) and raw_inputs.dtype.kind in "fiu":
            with np.errstate(over="ignore"):
                return self.check_batch(raw_inputs.astype(np.float32, copy=False))
        if len(raw_inputs) == 0:
            return np.zeros((0, *self.shape), dtype=np.float32)
        return np.stack([self.item_array(item, i) for i, item in enumerate(raw_inputs)])

    def check_batch(self, array: np.ndarray) -> np.ndarray:
        """A float32 (N, C, H, W) -- or (N, H, W) for one channel -- array, validated item by
        item with array operations; the first bad item is named as `item_array` would."""
        if self.channels == 1 and array.ndim == 3:
            array = array[:, None]
        if array.ndim != 4 or tuple(array.shape[1:]) != self.shape:
            grey = f" or (N, {self.shape[1]}, {self.shape[2]})" if self.channels == 1 else ""
            raise InputError(
                f"expected a tensor of shape (N, {', '.join(map(str, self.shape))}){grey}, "
                f"got {describe_shape(array.shape)}"
            )
        if len(array) == 0:
            return array
        flat = array.reshape(len(array), -1)
        bad = ~np.isfinite(flat).all(axis=1)
        if self.value_range is not None and flat.size:
            low, high = self.value_range
            with np.errstate(invalid="ignore"):
                bad |= (flat.min(axis=1) < low) | (flat.max(axis=1) > high)
        if bad.any():
            index = int(bad.argmax())
            check_values(array[index], index, self.value_range)  # raises, naming the item
        return array

    def normalise(self, array: np.ndarray) -> torch.Tensor:
        """Validated raw pixels (N, C, H, W) -> the standardised tensor the model takes."""
        return normalise(array, list(self.recipe.mean), list(self.recipe.std))

    def __call__(self, raw_inputs: Sequence[Any] | np.ndarray) -> torch.Tensor:
        """Raw items -> standardised float32 tensor (N, C, H, W)."""
        return self.normalise(self.convert(raw_inputs))

    def example(self) -> np.ndarray:
        """A valid raw input (mid-range grey), for warm-up requests."""
        low, high = self.value_range or (0.0, 1.0)
        return np.full(self.shape, (low + high) / 2, dtype=np.float32)


def numeric_array(item: Any, index: int, expected: str) -> np.ndarray:
    """A nested list (or array) of numbers -> float32 array. Strings, booleans, None and integers
    beyond any float are refused, never coerced (numpy alone reads "1.5" and True as numbers)."""
    refusal = InputError(
        f"item {index}: expected {expected}, made of numbers (not strings, booleans or null)",
        index,
    )
    if isinstance(item, np.ndarray):
        if item.dtype.kind not in "fiu":
            raise refusal
        array = item
    else:
        try:
            array = np.asarray(item)
        except (ValueError, TypeError, OverflowError):
            raise refusal from None  # ragged nesting
        if array.dtype == object:  # integers beyond int64 (2**70) hold numpy's objects
            array = _big_integers(array, index, refusal)
        if array.dtype.kind not in "fiu" or _has_bool(item):
            raise refusal
    if array.dtype.kind == "f" and array.dtype.itemsize > 4:
        _check_float32_range(array, index)
    with np.errstate(over="ignore"):  # beyond float32: inf, which check_values refuses
        return array.astype(np.float32, copy=False)


def _big_integers(array: np.ndarray, index: int, refusal: InputError) -> np.ndarray:
    """An object array of plain numbers (some integers too large for int64) as float64, so the
    range check can say what is wrong; anything else in it is refused as not a number."""
    values = array.ravel()
    if not all(type(v) in (int, float) for v in values):
        raise refusal
    try:
        return np.asarray(values.tolist(), dtype=np.float64).reshape(array.shape)
    except OverflowError:
        big = next(v for v in values if isinstance(v, int) and abs(v) > FLOAT64_MAX)
        raise InputError(
            f"item {index}: the pixel value {_short_int(big)} is out of range (beyond float32, "
            f"|x| <= {FLOAT32_MAX:.4g})",
            index,
        ) from None


def _check_float32_range(array: np.ndarray, index: int) -> None:
    with np.errstate(invalid="ignore"):
        beyond = np.isfinite(array) & (np.abs(array) > FLOAT32_MAX)
    if beyond.any():
        raise InputError(
            f"item {index}: the pixel value {float(array[beyond][0]):.4g} is out of range "
            f"(beyond float32, |x| <= {FLOAT32_MAX:.4g})",
            index,
        )


def _short_int(value: int) -> str:
    digits = str(abs(value))
    return f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"


def _has_bool(item: Any) -> bool:
    """Whether a (nested) list holds a bool: numpy turns [1.0, True] into [1.0, 1.0]."""
    if isinstance(item, bool):
        return True
    if not isinstance(item, list | tuple) or not item:
        return False
    if isinstance(item[0], list | tuple):
        return any(_has_bool(sub) for sub in item)
    return bool in set(map(type, item))


def check_values(array: np.ndarray, index: int, value_range) -> None:
    """Finite pixels inside the training data's raw range, or InputError naming the item."""
    if not np.isfinite(array).all():
        raise InputError(
            f"item {index}: contains NaN or Inf pixel values (or numbers beyond float32)", index
        )
    if value_range is None or array.size == 0:
        return
    low, high = value_range
    seen_low, seen_high = float(array.min()), float(array.max())
    # A common mistake is sending 0..255 (or 0..1) pixels to a model trained on another range.
    if seen_low < low or seen_high > high:
        raise InputError(
            f"item {index}: pixel values span [{seen_low:g}, {seen_high:g}], outside the "
            f"training data's raw range [{low:g}, {high:g}]; send raw pixels in that range",
            index,
        )


def _lists(d: dict[str, Any]) -> dict[str, Any]:
    """Tuples as lists: plain data that survives torch.load(weights_only=True) and JSON alike."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
