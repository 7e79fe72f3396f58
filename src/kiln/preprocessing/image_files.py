"""Encoded image files (JPEG, PNG, ... any format Pillow reads) -> the tensors a model takes: the
decoding and the eval transform that the image-folder dataset, `infer.py` and the server share,
so a photo is prepared the same way everywhere (one function, not three copies of it).

Decoding: `torchvision.io.decode_image` for the formats it reads (JPEG, PNG, GIF, WEBP), Pillow
for the rest (BMP, TIFF, ...). Every image comes out uint8 (C, H, W) with C = `channels`:
grayscale is repeated to RGB, palette images expanded, an alpha channel dropped (not composited:
as PIL's convert("RGB") and torchvision's ImageFolder do), CMYK converted, 16-bit PNG/TIFF scaled
to 8 bits (`to_dtype(scale=True)`), and the EXIF orientation applied (phone photos stand up).

Eval transform: resize the shorter side to `resize_size` (= round(image_size / crop_pct)), then
center crop to `image_size`, on uint8 pixels; `to_unit` scales them to float32 in [0, 1]."""

from __future__ import annotations

import functools
import io
import re
import warnings
from typing import Any

import numpy as np
import torch

INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
DEFAULT_CROP_PCT = 0.875  # timm's and torchvision's: 224 / 256
DEFAULT_IMAGE_SIZE = 224

EMPTY, TRUNCATED, UNREADABLE = "empty_file", "truncated", "unreadable"
BAD_IMAGE_REASONS = (EMPTY, TRUNCATED, UNREADABLE)

# What decoders say about a file that ends early (libjpeg, libpng, Pillow).
_TRUNCATION = re.compile(r"truncated|incomplete|premature end|out of bound read", re.IGNORECASE)
# torchvision prefixes its C++ errors with "<function>, <file>.cpp:<line>, ".
_CPP_PREFIX = re.compile(r"^\w+, \S+\.cpp:\d+, ")
_UNSUPPORTED = "Unsupported image file"


class ImageDecodeError(ValueError):
    """A file that is not a decodable image. `reason`: empty_file | truncated | unreadable."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason.replace('_', ' ')}: {detail}")
        self.reason, self.detail = reason, detail


@functools.cache
def _quiet_torchvision_io() -> None:
    """torchvision 0.29 deprecates its image decoders in favour of TorchCodec (which has no
    stable image API yet) with a DeprecationWarning on every call: filter that one message,
    nothing else."""
    warnings.filterwarnings(
        "ignore",
        message="The image decoding and encoding capabilities of TorchVision are deprecated",
        category=DeprecationWarning,
    )


@functools.cache
def image_extensions() -> frozenset[str]:
    """Lower-case suffixes (".jpg", ".png", ".tif", ...) of every format Pillow can open."""
    from PIL import Image

    Image.init()
    return frozenset(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN)


def is_image_name(name: str) -> bool:
    """An image file by its name: not hidden (".DS_Store", "._x.jpg") and a Pillow extension,
    in any case."""
    if name.startswith("."):
        return False
    dot = name.rfind(".")
    return dot > 0 and name[dot:].lower() in image_extensions()


def decode(data: bytes | bytearray | memoryview, channels: int) -> torch.Tensor:
    """Encoded bytes -> uint8 (channels, H, W); ImageDecodeError saying why not."""
    if len(data) == 0:
        raise ImageDecodeError(EMPTY, "the file is empty (0 bytes)")
    try:
        image = _decode_torchvision(data, channels)
    except RuntimeError as err:
        message = _CPP_PREFIX.sub("", str(err).strip().splitlines()[-1])
        if _UNSUPPORTED not in message:
            raise _decode_error(message) from None
        image = _decode_pillow(data, channels)  # BMP, TIFF, ...: formats decode_image lacks
    if image.dtype != torch.uint8:  # 16-bit PNG
        from torchvision.transforms.v2.functional import to_dtype

        image = to_dtype(image, torch.uint8, scale=True)
    return image


def _decode_torchvision(data, channels: int) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image

    _quiet_torchvision_io()
    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    image = decode_image(encoded, mode=mode, apply_exif_orientation=True)
    if image.ndim == 4:  # an animated GIF: its first frame
        image = image[0]
    if image.shape[0] != channels:  # GIF and WEBP ignore GRAY and stay RGB
        from torchvision.transforms.v2.functional import rgb_to_grayscale

        image = rgb_to_grayscale(image[:3], num_output_channels=1)
    return image


def _decode_pillow(data, channels: int) -> torch.Tensor:
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            opened.load()
            image = ImageOps.exif_transpose(opened)
    except UnidentifiedImageError:
        raise ImageDecodeError(
            UNREADABLE, "not an image file Pillow or torchvision can read"
        ) from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise _decode_error(str(err)) from None
    if image.mode.startswith("I;16") or image.mode == "I":  # 16-bit (or 32-bit int) grey
        grey = np.clip(np.asarray(image), 0, 65535).astype(np.uint16)
        pixels = torch.from_numpy(grey)[None]  # scaled to 8 bits by decode()
        return pixels.expand(channels, -1, -1).contiguous() if channels == 3 else pixels
    converted = np.asarray(image.convert("RGB" if channels == 3 else "L"))
    pixels = torch.from_numpy(converted.copy())
    return pixels.permute(2, 0, 1).contiguous() if channels == 3 else pixels[None]


def _decode_error(message: str) -> ImageDecodeError:
    reason = TRUNCATED if _TRUNCATION.search(message) else UNREADABLE
    return ImageDecodeError(reason, message)


def interpolation_mode(name: str):
    from torchvision.transforms.v2 import InterpolationMode

    if name not in INTERPOLATIONS:
        raise ValueError(f"interpolation {name!r}; expected one of {', '.join(INTERPOLATIONS)}")
    return InterpolationMode(name)


def resize_size_for(image_size: int, crop_pct: float) -> int:
    """The eval resize of the shorter side: image_size / crop_pct (224 / 0.875 = 256)."""
    return round(image_size / crop_pct)


def eval_transform(image_size: int, resize_size: int, interpolation: str):
    """uint8 (C, H, W) of any size -> uint8 (C, image_size, image_size): shorter side to
    resize_size, then the center crop."""
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.Resize(resize_size, interpolation=interpolation_mode(interpolation), antialias=True),
            v2.CenterCrop(image_size),
        ]
    )


def to_unit(image: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [0, 1]."""
    from torchvision.transforms.v2.functional import to_dtype

    return to_dtype(image, torch.float32, scale=True)


class EncodedImageLoader:
    """Encoded bytes -> float32 (channels, image_size, image_size) in [0, 1], exactly as the
    dataset's eval transform makes them before normalisation. ImageDecodeError if unreadable."""

    def __init__(self, channels: int, image_size: int, resize_size: int, interpolation: str):
        self.channels = channels
        self.transform = eval_transform(image_size, resize_size, interpolation)

    def __call__(self, data: bytes | bytearray | memoryview) -> torch.Tensor:
        return to_unit(self.transform(decode(data, self.channels)))

    @classmethod
    def for_recipe(cls, recipe: Any) -> EncodedImageLoader:
        return cls(recipe.channels, recipe.image_size[0], recipe.resize_size, recipe.interpolation)
