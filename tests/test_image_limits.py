"""Pixel limits in the one shared decoder (kiln.preprocessing.image_files): every image's header
is read before any decode, and one asking for more than max_pixels is refused as too_large, with
the size found and the limit; animated images are counted frame by frame and decoded to their
first frame only. Bombs are made small in tests/hostile_inputs.py."""

from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from kiln.preprocessing.file_tree import FileAccessError
from kiln.preprocessing.image_files import (
    DEFAULT_MAX_PIXELS,
    TOO_LARGE,
    EncodedImageLoader,
    ImageDecodeError,
    ImageTooLargeError,
    check_image_size,
    decode,
    read_image_file,
    read_image_header,
)
from tests.hostile_inputs import (
    BOMB_SIDE,
    CLAIMED,
    GIF_FRAMES,
    GIF_SCREEN,
    animated,
    encoded,
    gif,
    gif_bomb,
    patched_bomb,
    photo,
    png_bomb,
)


def test_the_default_limit_is_pillows():
    assert DEFAULT_MAX_PIXELS == Image.MAX_IMAGE_PIXELS


STILL = {
    "PNG": {},
    "JPEG": {},
    "progressive JPEG": {"progressive": True},
    "GIF": {},
    "WEBP": {},
    "lossless WEBP": {"lossless": True},
    "BMP": {},
    "TIFF": {},
    "BigTIFF": {"big_tiff": True},
    "JPEG-in-TIFF": {"compression": "jpeg"},
    "PPM": {},  # no parser of ours: Pillow's lazy open reads the header
    "TGA": {},
}


@pytest.mark.parametrize("kind", STILL)
def test_the_header_gives_pillows_size_without_decoding(kind):
    fmt = kind.split()[-1].replace("BigTIFF", "TIFF").replace("JPEG-in-TIFF", "TIFF")
    data = encoded(photo((53, 37)), fmt, **STILL[kind])
    header = read_image_header(data)
    with Image.open(io.BytesIO(data)) as image:
        assert (header.width, header.height) == image.size == (53, 37)
        assert header.format == image.format
    assert header.frames == 1 and header.pixels == 53 * 37
    assert decode(data, 3).shape == (3, 37, 53)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_an_animated_image_counts_every_frame_and_decodes_the_first(fmt):
    data = animated(fmt, num_frames=4, size=(30, 20))
    header = read_image_header(data)
    with Image.open(io.BytesIO(data)) as image:
        assert header.frames == image.n_frames == 4
    assert (header.width, header.height, header.pixels) == (30, 20, 4 * 600)
    rgb = decode(data, 3)
    assert rgb.shape == (3, 20, 30)  # one frame, not (4, 3, 20, 30)
    assert rgb.float().mean().item() == pytest.approx(20, abs=2)  # frame 0's grey, not frame 3's
    assert decode(data, 1).shape == (1, 20, 30)
    with pytest.raises(ImageTooLargeError, match=r"30x20 x 4 frames = 2,400 pixels"):
        decode(data, 3, max_pixels=4 * 600 - 1)


def test_a_gif_canvas_grows_to_hold_a_frame_outside_the_logical_screen():
    # Pillow enlarges its canvas for a frame reaching past the screen: counted so.
    data = gif((50, 40), [(0, 0, 50, 40), (40, 30, 30, 30)])
    header = read_image_header(data)
    assert (header.width, header.height, header.frames) == (70, 60, 2)


BOMBS = {
    "1-bit PNG 30000x30000": (png_bomb, BOMB_SIDE * BOMB_SIDE),
    "GIF 240 frames at 4000x4000": (gif_bomb, GIF_FRAMES * GIF_SCREEN * GIF_SCREEN),
    "JPEG": (lambda: patched_bomb("JPEG"), CLAIMED * CLAIMED),
    "WEBP": (lambda: patched_bomb("WEBP"), 16383 * 16383),
    "animated WEBP": (lambda: patched_bomb("animated WEBP"), 4 * 16000 * 16000),
    "BMP": (lambda: patched_bomb("BMP"), CLAIMED * CLAIMED),
    "TIFF": (lambda: patched_bomb("TIFF"), CLAIMED * CLAIMED),
}


@pytest.mark.parametrize("kind", BOMBS)
def test_a_bomb_is_refused_from_its_header_with_its_size_and_the_limit(kind, tmp_path):
    make, pixels = BOMBS[kind]
    data = make()
    assert len(data) < 120_000  # small files ...
    assert pixels > 2 * DEFAULT_MAX_PIXELS  # ... asking for gigabytes
    with pytest.raises(ImageTooLargeError) as info:
        decode(data, 3)
    err = info.value
    assert isinstance(err, ImageDecodeError) and err.reason == TOO_LARGE
    assert (err.pixels, err.max_pixels) == (pixels, DEFAULT_MAX_PIXELS)
    assert f"{pixels:,} pixels" in str(err) and f"limit of {DEFAULT_MAX_PIXELS:,}" in str(err)
    path = tmp_path / "bomb.img"
    path.write_bytes(data)
    with pytest.raises(ImageTooLargeError) as from_file:
        read_image_file(path, 3)
    assert from_file.value.pixels == pixels
    with path.open("rb") as stream:  # a file object: the header only, left where it was
        assert check_image_size(stream, None).pixels == pixels
        assert stream.tell() == 0


def test_the_limit_is_inclusive_and_none_lifts_it():
    data = encoded(photo((53, 37)), "PNG")
    assert decode(data, 3, max_pixels=53 * 37).shape == (3, 37, 53)
    assert decode(data, 3, max_pixels=None).shape == (3, 37, 53)
    with pytest.raises(ImageTooLargeError, match=r"PNG of 53x37 = 1,961 pixels, above the limit"):
        decode(data, 3, max_pixels=53 * 37 - 1)


def test_the_shared_loader_and_the_preprocessor_refuse_above_their_limit():
    data = encoded(photo((64, 48)), "JPEG")
    loader = EncodedImageLoader(3, 16, 18, "bilinear", max_pixels=64 * 48 - 1)
    with pytest.raises(ImageTooLargeError):
        loader(data)
    assert EncodedImageLoader(3, 16, 18, "bilinear")(data).shape == (3, 16, 16)
    from kiln.preprocessing import ImageRecipe, InputError

    recipe = ImageRecipe((0.5,) * 3, (0.25,) * 3, 3, (16, 16), ("a", "b"), (0.0, 1.0), 18)
    preprocess = recipe.preprocessor()
    assert preprocess.convert([data]).shape == (1, 3, 16, 16)
    preprocess.max_image_pixels = 1000
    with pytest.raises(InputError, match=r"^item 1: image too large: JPEG of 64x48 = 3,072"):
        preprocess.convert([encoded(photo((20, 20)), "JPEG"), data])
    with pytest.raises(InputError, match=r"^item 0: image too large: PNG of 30000x30000"):
        recipe.preprocessor().convert([png_bomb()])


@pytest.mark.parametrize(
    ("data", "reason", "says"),
    [
        (b"\x89PNG\r\n\x1a\n", "truncated", "ends inside its PNG header"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", "truncated", "ends inside its JPEG header"),
        (b"\xff\xd8\xff\xda\x00\x08", "unreadable", "no frame header"),
        (b"GIF89a but not really", "unreadable", "holds no image"),
        (b"BM" + bytes(12) + b"\x07" + bytes(11), "unreadable", "bitmap header of 7 bytes"),
        (b"RIFF\x00\x00\x00\x00WEBPXXXX\x00\x00\x00\x00", "unreadable", "unknown first chunk"),
        (b"II*\x00\x08\x00\x00\x00\x00\x00", "unreadable", "no ImageWidth"),
        (b"not an image at all", "unreadable", "not an image file"),
        (b"", "empty_file", "empty"),
    ],
)
def test_a_broken_header_says_why(data, reason, says):
    with pytest.raises(ImageDecodeError, match=says) as info:
        decode(data, 3)
    assert info.value.reason == reason and not isinstance(info.value, ImageTooLargeError)


def test_a_fifo_named_like_an_image_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "x.jpg"
    os.mkfifo(fifo)
    outcome = {}

    def read():
        try:
            read_image_file(fifo, 3)
        except Exception as err:  # noqa: BLE001 - the test inspects it
            outcome["error"] = err

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # unblock the reader before failing
        with open(fifo, "wb"):
            pass
        pytest.fail("reading a FIFO named x.jpg blocked")
    err = outcome["error"]
    assert isinstance(err, FileAccessError) and err.reason == "not_regular"
    assert "FIFO" in str(err) and str(fifo) in str(err)


def test_decoded_pixels_are_the_files_own(tmp_path):
    image = photo((40, 30), seed=3)
    path = tmp_path / "a.png"
    image.save(path)
    pixels = read_image_file(path, 3)
    assert torch.equal(pixels, torch.from_numpy(np.array(image)).permute(2, 0, 1))
