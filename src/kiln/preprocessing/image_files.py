"""Encoded image files (JPEG, PNG, ... any format Pillow reads) -> the tensors a model takes: the
decoding and the eval transform that the image-folder dataset, `infer.py` and the server share,
so a photo is prepared the same way everywhere (one function, not three copies of it).

Decoding: `torchvision.io.decode_image` for JPEG and still WEBP, Pillow for the rest (PNG, GIF,
BMP, TIFF, ...; see _TORCHVISION_FORMATS for why not PNG). Every image comes out uint8 (C, H, W)
with C = `channels`:
grayscale is repeated to RGB, palette images expanded, an alpha channel dropped (not composited:
as PIL's convert("RGB") and torchvision's ImageFolder do), CMYK converted, 16-bit PNG/TIFF scaled
to 8 bits (`to_dtype(scale=True)`), and the EXIF orientation applied (phone photos stand up).

Size before decode: every decode first reads the file's header (`read_image_header`: PNG, JPEG,
GIF, WEBP, BMP and TIFF parsed here, any other format by Pillow's lazy open) and refuses an image
of more than `max_pixels` pixels (default Pillow's MAX_IMAGE_PIXELS, about 89.5 million) as
`too_large` before a byte of it is decompressed: a 100 KB PNG can ask for 900 million pixels. An
animated image (GIF, APNG, animated WEBP) counts every frame it holds (frames x canvas: what a
decoder of all frames would allocate) but only its first frame is decoded.

Eval transform: resize the shorter side to `resize_size` (= round(image_size / crop_pct)), then
center crop to `image_size`, on uint8 pixels; `to_unit` scales them to float32 in [0, 1]."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import struct
import warnings
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch

INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
DEFAULT_CROP_PCT = 0.875  # timm's and torchvision's: 224 / 256
DEFAULT_IMAGE_SIZE = 224

EMPTY, TRUNCATED, UNREADABLE = "empty_file", "truncated", "unreadable"
TOO_LARGE = "too_large"
BAD_IMAGE_REASONS = (EMPTY, TRUNCATED, UNREADABLE, TOO_LARGE)
# Pillow's Image.MAX_IMAGE_PIXELS (1024**3 // 4 // 3: a 24-bit image of 256 MiB), above which
# Pillow itself warns of a decompression bomb.
DEFAULT_MAX_PIXELS = 89_478_485

# What decoders say about a file that ends early (libjpeg, libpng, Pillow).
_TRUNCATION = re.compile(r"truncated|incomplete|premature end|out of bound read", re.IGNORECASE)
# torchvision prefixes its C++ errors with "<function>, <file>.cpp:<line>, " (the function may
# be "operator()"); any other source location left in a message goes too.
_CPP_PREFIX = re.compile(r"^[^,\n]*, \S+\.(?:cpp|cc|h|cu):\d+, ")
_SOURCE_PATH = re.compile(r"\S*/\S+\.(?:cpp|cc|h|cu):\d+,?\s*")
_UNSUPPORTED = "Unsupported image file"


class ImageDecodeError(ValueError):
    """A file that is not a decodable image. `reason`: empty_file | truncated | unreadable."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason.replace('_', ' ')}: {detail}")
        self.reason, self.detail = reason, detail


class ImageTooLargeError(ImageDecodeError):
    """An image whose header asks for more than `max_pixels` pixels (reason too_large); never
    decoded. `pixels`: what the header asks for (every frame of an animated image)."""

    def __init__(self, detail: str, pixels: int, max_pixels: int, header: ImageHeader | None):
        super().__init__(TOO_LARGE, detail)
        self.pixels, self.max_pixels, self.header = pixels, max_pixels, header


@dataclass(frozen=True)
class ImageHeader:
    """What an image file's header says, read without decoding a pixel."""

    format: str  # PNG, JPEG, GIF, WEBP, BMP, TIFF, or the name Pillow gives another format
    width: int
    height: int  # of the canvas (a GIF's logical screen, grown to hold every frame)
    frames: int = 1  # animated GIF / APNG / WEBP: every frame the file holds

    @property
    def pixels(self) -> int:
        return self.width * self.height * self.frames

    def describe(self) -> str:
        """ "30000x30000 = 900,000,000 pixels", "4000x4000 x 240 frames = ... pixels"."""
        frames = f" x {self.frames} frames" if self.frames > 1 else ""
        return f"{self.width}x{self.height}{frames} = {self.pixels:,} pixels"


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


# ---------------------------------------------------------------------------------------------
# The header: size before decode


class _Truncated(Exception):
    """The data ended inside the header."""


class _Malformed(Exception):
    """A header that no decoder would take."""


def _read(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) < size:
        raise _Truncated
    return data


def _png_header(stream: BinaryIO) -> ImageHeader:
    _read(stream, 8)  # the signature
    length, kind = struct.unpack(">I4s", _read(stream, 8))
    if kind != b"IHDR" or length < 8:
        raise _Malformed("its first chunk is not IHDR")
    width, height = struct.unpack(">II", _read(stream, 8))
    stream.seek(length - 8 + 4, os.SEEK_CUR)  # the rest of IHDR, its CRC
    frames = 1
    while True:  # chunks before the image data: an APNG's acTL holds its frame count
        try:
            length, kind = struct.unpack(">I4s", _read(stream, 8))
        except _Truncated:
            break  # the decoder says what is missing
        if kind in (b"IDAT", b"IEND"):
            break
        if kind == b"acTL" and length >= 8:
            frames = max(1, struct.unpack(">I", _read(stream, 4))[0])
            break
        stream.seek(length + 4, os.SEEK_CUR)
    return ImageHeader("PNG", width, height, frames)


# Start-of-frame markers (SOF0..SOF15 but DHT, JPG and DAC, which share the range).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_NO_LENGTH = frozenset([0x01, *range(0xD0, 0xD9)])  # TEM, RST0..7, SOI


def _jpeg_header(stream: BinaryIO) -> ImageHeader:
    _read(stream, 2)  # SOI
    while True:
        byte = _read(stream, 1)[0]
        if byte != 0xFF:
            continue  # stray bytes between segments: libjpeg skips them too
        marker = 0xFF
        while marker == 0xFF:  # fill bytes
            marker = _read(stream, 1)[0]
        if marker in _JPEG_NO_LENGTH or marker == 0x00:
            continue
        if marker in (0xD9, 0xDA):  # EOI, SOS
            raise _Malformed("no frame header (SOF) before its image data")
        (length,) = struct.unpack(">H", _read(stream, 2))
        if length < 2:
            raise _Malformed(f"a segment of length {length}")
        if marker in _JPEG_SOF:
            _, height, width = struct.unpack(">BHH", _read(stream, 5))
            return ImageHeader("JPEG", width, height)
        stream.seek(length - 2, os.SEEK_CUR)


def _skip_gif_blocks(stream: BinaryIO) -> None:
    """Past a chain of data sub-blocks (a length byte, that many bytes; 0 ends it)."""
    size = _read(stream, 1)[0]
    while size:
        size = _read(stream, size + 1)[-1]


def _gif_header(stream: BinaryIO) -> ImageHeader:
    """The logical screen, grown to hold every frame (Pillow grows its canvas so), and the
    number of frames: every block is walked, none is decompressed."""
    width, height, packed = struct.unpack("<HHB", _read(stream, 13)[6:11])
    if packed & 0x80:
        stream.seek(3 << ((packed & 7) + 1), os.SEEK_CUR)  # the global colour table
    frames = 0
    try:
        while True:
            block = _read(stream, 1)[0]
            if block == 0x3B:  # the trailer
                break
            if block == 0x21:  # an extension: its label, then sub-blocks
                _read(stream, 1)
                _skip_gif_blocks(stream)
            elif block == 0x2C:  # an image (a frame)
                left, top, w, h, packed = struct.unpack("<HHHHB", _read(stream, 9))
                width, height = max(width, left + w), max(height, top + h)
                frames += 1
                if packed & 0x80:
                    stream.seek(3 << ((packed & 7) + 1), os.SEEK_CUR)  # local colour table
                _read(stream, 1)  # LZW minimum code size
                _skip_gif_blocks(stream)
            else:
                break  # not a GIF block: what follows is no image; decoders stop here too
    except _Truncated:
        if not frames:
            raise
    if not frames:
        raise _Malformed("it holds no image")
    return ImageHeader("GIF", width, height, frames)


def _webp_header(stream: BinaryIO) -> ImageHeader:
    _read(stream, 12)  # RIFF, size, WEBP
    kind, length = struct.unpack("<4sI", _read(stream, 8))
    if kind == b"VP8 ":
        data = _read(stream, 10)
        if data[3:6] != b"\x9d\x01\x2a":
            raise _Malformed("a VP8 frame without its start code")
        width, height = struct.unpack("<HH", data[6:10])
        return ImageHeader("WEBP", width & 0x3FFF, height & 0x3FFF)
    if kind == b"VP8L":
        data = _read(stream, 5)
        if data[0] != 0x2F:
            raise _Malformed("a VP8L image without its signature")
        bits = struct.unpack("<I", data[1:])[0]
        return ImageHeader("WEBP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if kind != b"VP8X" or length < 10:
        raise _Malformed(f"an unknown first chunk {kind!r}")
    data = _read(stream, 10)
    width = int.from_bytes(data[4:7], "little") + 1
    height = int.from_bytes(data[7:10], "little") + 1
    frames = 0
    if data[0] & 0x02:  # animated: count its ANMF chunks
        stream.seek(length - 10 + (length & 1), os.SEEK_CUR)
        while True:
            try:
                kind, length = struct.unpack("<4sI", _read(stream, 8))
            except _Truncated:
                break
            frames += kind == b"ANMF"
            stream.seek(length + (length & 1), os.SEEK_CUR)
    return ImageHeader("WEBP", width, height, max(frames, 1))


_BMP_INFO_SIZES = frozenset([16, 40, 52, 56, 64, 108, 124])


def _bmp_header(stream: BinaryIO) -> ImageHeader:
    data = _read(stream, 26)
    (info_size,) = struct.unpack("<I", data[14:18])
    if info_size == 12:  # OS/2 BITMAPCOREHEADER
        width, height = struct.unpack("<HH", data[18:22])
    elif info_size in _BMP_INFO_SIZES:
        width, height = struct.unpack("<ii", data[18:26])
    else:
        raise _Malformed(f"an unknown bitmap header of {info_size} bytes")
    return ImageHeader("BMP", abs(width), abs(height))


_TIFF_WIDTH, _TIFF_LENGTH = 256, 257
_TIFF_MAX_ENTRIES = 4096  # a real first directory holds a few dozen


def _tiff_header(stream: BinaryIO) -> ImageHeader:
    """The first page's ImageWidth and ImageLength (the page Pillow decodes); classic TIFF and
    BigTIFF."""
    head = _read(stream, 8)
    order = "<" if head[:2] == b"II" else ">"
    big = struct.unpack(order + "H", head[2:4])[0] == 43
    if big:
        (offset,) = struct.unpack(order + "Q", _read(stream, 8))
    else:
        (offset,) = struct.unpack(order + "I", head[4:8])
    stream.seek(offset)
    count_format, entry_size = (order + "Q", 20) if big else (order + "H", 12)
    (count,) = struct.unpack(count_format, _read(stream, struct.calcsize(count_format)))
    found: dict[int, int] = {}
    for _ in range(min(count, _TIFF_MAX_ENTRIES)):
        entry = _read(stream, entry_size)
        tag, kind = struct.unpack(order + "HH", entry[:4])
        if tag in (_TIFF_WIDTH, _TIFF_LENGTH):
            value = entry[12:20] if big else entry[8:12]
            formats = {3: "H", 4: "I", 16: "Q"}
            if kind not in formats:
                raise _Malformed(f"tag {tag} of type {kind}")
            size = struct.calcsize(formats[kind])
            found[tag] = struct.unpack(order + formats[kind], value[:size])[0]
        if len(found) == 2:
            return ImageHeader("TIFF", found[_TIFF_WIDTH], found[_TIFF_LENGTH])
    raise _Malformed("its first directory has no ImageWidth and ImageLength")


def _pillow_header(stream: BinaryIO) -> ImageHeader:
    """Any other format Pillow opens: its lazy open reads the header only."""
    from PIL import Image

    with pillow_errors(), warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(stream) as image:
            return ImageHeader(image.format or "unknown", *image.size)


@contextlib.contextmanager
def pillow_errors():
    """Pillow's ways of failing on a file, as kiln's decode errors (what, and why)."""
    from PIL import Image, UnidentifiedImageError

    try:
        yield
    except UnidentifiedImageError:
        raise ImageDecodeError(
            UNREADABLE, "not an image file Pillow or torchvision can read"
        ) from None
    except Image.DecompressionBombError as err:
        raise _pillow_too_large(err) from None
    except (OSError, ValueError, SyntaxError, struct.error) as err:
        raise _decode_error(str(err)) from None


def _header_reader(head: bytes):
    """The parser for the format these first bytes announce; None: ask Pillow."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return _png_header
    if head.startswith(b"\xff\xd8"):
        return _jpeg_header
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return _gif_header
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_header
    if head[:2] == b"BM":
        return _bmp_header
    if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return _tiff_header
    return None


def read_image_header(source: bytes | bytearray | memoryview | BinaryIO) -> ImageHeader:
    """The format, size and frame count of an encoded image -- its bytes, or a binary file
    opened for reading (left where it was) -- from its header alone: nothing is decoded, and of
    a file only the header is read (and a GIF's or WEBP's block lengths, to count frames).
    ImageDecodeError (empty_file, truncated, unreadable) when there is no image header."""
    stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    start = stream.tell()
    head = stream.read(16)
    if not head:
        raise ImageDecodeError(EMPTY, "the file is empty (0 bytes)")
    reader = _header_reader(head)
    stream.seek(start)
    try:
        if reader is None:
            return _pillow_header(stream)
        name = reader.__name__.split("_")[1].upper()
        try:
            return reader(stream)
        except _Truncated:
            raise ImageDecodeError(TRUNCATED, f"the file ends inside its {name} header") from None
        except (_Malformed, struct.error) as err:
            raise ImageDecodeError(UNREADABLE, f"not a valid {name} file: {err}") from None
    finally:
        stream.seek(start)


def check_image_size(
    source: bytes | bytearray | memoryview | BinaryIO, max_pixels: int | None = DEFAULT_MAX_PIXELS
) -> ImageHeader:
    """The header of an encoded image (see read_image_header) if it asks for at most
    `max_pixels` pixels (None: no limit); ImageTooLargeError (reason too_large, with the size
    found and the limit) if more, before anything is decoded."""
    header = read_image_header(source)
    if max_pixels is not None and header.pixels > max_pixels:
        raise ImageTooLargeError(
            f"{header.format} of {header.describe()}, above the limit of {max_pixels:,} pixels",
            header.pixels,
            max_pixels,
            header,
        )
    return header


def _pillow_too_large(err: Exception) -> ImageTooLargeError:
    """Pillow's own refusal (above twice Image.MAX_IMAGE_PIXELS, whatever our limit)."""
    from PIL import Image

    found = re.search(r"\((\d+) pixels\)", str(err))
    pixels = int(found.group(1)) if found else 0
    limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    return ImageTooLargeError(
        f"{pixels:,} pixels, above Pillow's own limit of {limit:,} (2 x PIL.Image."
        "MAX_IMAGE_PIXELS), which Pillow enforces whatever kiln's limit",
        pixels,
        limit,
        None,
    )


# ---------------------------------------------------------------------------------------------
# Decoding

# What torchvision's decode_image reads: JPEG and a still WEBP (it refuses animated ones, and it
# would decode every frame of a GIF). Never PNG: torchvision 0.29's libpng path (decode_png and
# decode_image alike) kills the process with SIGSEGV on a PNG whose image data libpng rejects --
# a bad row filter byte, a zlib stream failing its checksum, too little image data: a 100-byte
# file, or one flipped byte in a download -- and libpng prints its warnings on stderr at every
# decode, naming no file. Checking a PNG first would mean inflating all of it, most of a
# decode's cost. Pillow decodes PNG (and every other format, the first frame only) about as fast
# (scripts/bench_image_folder.py --format png) and raises on such a file, which is then dropped
# and named.
_TORCHVISION_FORMATS = frozenset(["JPEG", "WEBP"])


def decode(
    data: bytes | bytearray | memoryview, channels: int, max_pixels: int | None = DEFAULT_MAX_PIXELS
) -> torch.Tensor:
    """Encoded bytes -> uint8 (channels, H, W); ImageDecodeError saying why not -- reason
    too_large (ImageTooLargeError) when the header asks for more than `max_pixels`, before any
    decoding."""
    header = check_image_size(data, max_pixels)
    return _decode_checked(data, header, channels)


def read_image_file(
    path: str | os.PathLike,
    channels: int,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
) -> torch.Tensor:
    """An image file -> uint8 (channels, H, W). Only a regular file is opened (a FIFO or a
    device is refused from its stat, so nothing blocks), and its header is checked against
    `max_pixels` before the rest of it is read. FileAccessError (an OSError: not_regular,
    cannot_open) or ImageDecodeError saying why not."""
    from kiln.preprocessing.file_tree import CANNOT_OPEN, FileAccessError, open_regular, os_detail

    with open_regular(path) as stream:
        try:
            header = check_image_size(stream, max_pixels)
            data = stream.read()
        except OSError as err:
            raise FileAccessError(CANNOT_OPEN, path, os_detail(err)) from None
    return _decode_checked(data, header, channels)


# EXIF orientations that turn the picture a quarter (5: transpose, 6: 90 deg, 7: transverse,
# 8: 270 deg): the decoded image is the stored one with width and height swapped.
_QUARTER_TURNS = frozenset({5, 6, 7, 8})


def _decoder_applies_exif(header: ImageHeader) -> bool:
    """torchvision's decode applies the EXIF orientation to JPEG only (a still WEBP goes through
    it unturned); Pillow's path applies it to every other format (ImageOps.exif_transpose)."""
    still_webp = header.format == "WEBP" and header.frames == 1
    return not still_webp


def read_oriented_size(stream: BinaryIO) -> tuple[int, int]:
    """(height, width) of the image an opened file decodes to (read_image_file): the header's
    size, turned by the file's EXIF orientation where the decoder applies it -- a phone photo
    stored landscape with orientation 6 decodes standing up, and its boxes are that picture's.
    Only the header and the EXIF block are read (Pillow's lazy open); the file is left where it
    was. ImageDecodeError as read_image_header when there is no image header."""
    header = read_image_header(stream)
    if not _decoder_applies_exif(header):
        return header.height, header.width
    from PIL import Image

    start = stream.tell()
    try:
        with Image.open(stream) as opened:
            orientation = opened.getexif().get(0x0112, 1)  # ExifTags.Base.Orientation
    except Exception:  # noqa: BLE001 -- no readable EXIF: the picture as stored, as decoding does
        orientation = 1
    finally:
        stream.seek(start)
    if orientation in _QUARTER_TURNS:
        return header.width, header.height
    return header.height, header.width


def _decode_checked(data, header: ImageHeader, channels: int) -> torch.Tensor:
    animated_webp = header.format == "WEBP" and header.frames > 1
    if header.format in _TORCHVISION_FORMATS and not animated_webp:
        try:
            image = _decode_torchvision(data, channels)
        except RuntimeError as err:
            message = _SOURCE_PATH.sub("", _CPP_PREFIX.sub("", str(err).strip().splitlines()[-1]))
            if _UNSUPPORTED not in message:
                raise _decode_error(message) from None
            image = _decode_pillow(data, channels)
    else:
        image = _decode_pillow(data, channels)  # GIF, BMP, TIFF, animated WEBP, ...
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
    if image.shape[0] != channels:  # GIF and WEBP ignore GRAY and stay RGB
        from torchvision.transforms.v2.functional import rgb_to_grayscale

        image = rgb_to_grayscale(image[:3], num_output_channels=1)
    return image


def _decode_pillow(data, channels: int) -> torch.Tensor:
    from PIL import Image, ImageOps

    with pillow_errors(), Image.open(io.BytesIO(data)) as opened:
        opened.load()
        image = ImageOps.exif_transpose(opened)
    if image.mode.startswith("I;16") or image.mode == "I":  # 16-bit (or 32-bit int) grey
        grey = np.clip(np.asarray(image), 0, 65535).astype(np.uint16)
        pixels = torch.from_numpy(grey)[None]  # scaled to 8 bits by decode()
        return pixels.expand(channels, -1, -1).contiguous() if channels == 3 else pixels
    if channels == 1:
        return torch.from_numpy(np.array(image if image.mode == "L" else image.convert("L")))[None]
    if image.mode == "L":  # grey to RGB in torch: Pillow's convert("RGB") and copy cost 4x more
        grey = torch.from_numpy(np.array(image))
        return grey[:, :, None].expand(-1, -1, 3).contiguous().permute(2, 0, 1)
    # (H, W, 3) in memory seen as (3, H, W), as torchvision's decoders return it: a .contiguous()
    # here would copy it, and Resize's uint8 path is several times faster on this layout.
    pixels = torch.from_numpy(np.array(image if image.mode == "RGB" else image.convert("RGB")))
    return pixels.permute(2, 0, 1)


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
    dataset's eval transform makes them before normalisation. ImageDecodeError if unreadable,
    ImageTooLargeError (before decoding) above `max_pixels`."""

    def __init__(
        self,
        channels: int,
        image_size: int,
        resize_size: int,
        interpolation: str,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
    ):
        self.channels, self.max_pixels = channels, max_pixels
        self.transform = eval_transform(image_size, resize_size, interpolation)

    def __call__(self, data: bytes | bytearray | memoryview) -> torch.Tensor:
        return to_unit(self.transform(decode(data, self.channels, self.max_pixels)))

    def load_file(self, path: str | os.PathLike) -> torch.Tensor:
        """The same from a file (read_image_file: a regular file only, its header checked
        before the rest is read); FileAccessError as well."""
        return to_unit(self.transform(read_image_file(path, self.channels, self.max_pixels)))

    @classmethod
    def for_recipe(
        cls, recipe: Any, max_pixels: int | None = DEFAULT_MAX_PIXELS
    ) -> EncodedImageLoader:
        return cls(
            recipe.channels,
            recipe.image_size[0],
            recipe.resize_size,
            recipe.interpolation,
            max_pixels,
        )
