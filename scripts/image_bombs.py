"""Decompression bombs and large images (the bombs written byte by byte, never decoded here) for
the server's load test (scripts/loadtest_bombs.py) and its tests:

    gif_bomb()    ~1.4 KB: 90 one-pixel frames on a 4000 x 4000 logical screen. A GIF decoder
                  renders every frame at the screen's size: 1.44 G pixels, 4.3 GB as RGB.
    png_bomb()    ~110 KB: a 1-bit greyscale PNG of 30000 x 30000, all zeros: 900 M pixels,
                  2.7 GB as RGB (deflate packs the 112 MB of 1-bit rows about 1000:1).
    grey_png()    ~16 KB: an 8-bit greyscale PNG of 4000 x 4000 (16 M pixels, within the limit
                  and over the server's large-image mark): a legal file in a small body that
                  takes ~0.05-0.1 s to decode (Pillow, one quiet core; slower under load);
                  grey_png(8000): 64 M pixels, ~4x that.
    large_jpeg()  a real photo-like JPEG within Pillow's pixel limit (default 6000 x 6000, 36 M
                  pixels): allowed, and slow to decode -- the "huge but legal" input.

    python scripts/image_bombs.py --out bombs/     # writes the four files
"""

from __future__ import annotations

import argparse
import functools
import io
import struct
import zlib
from pathlib import Path

GIF_SIDE, GIF_FRAMES = 4000, 90
PNG_SIDE = 30_000
SLOW_PNG_SIDE = 4000


@functools.cache
def gif_bomb(side: int = GIF_SIDE, frames: int = GIF_FRAMES) -> bytes:
    """A GIF89a whose logical screen is side x side, holding `frames` images of one pixel."""
    header = b"GIF89a" + struct.pack("<HHBBB", side, side, 0x80, 0, 0)  # 2-colour global table
    palette = b"\x00\x00\x00\xff\xff\xff"
    # One frame: its descriptor (at 0,0, 1 x 1, no local table), LZW minimum code size 2, one
    # data sub-block holding the codes clear (4), pixel 0, end (5) at 3 bits each, LSB first.
    codes = 4 | (0 << 3) | (5 << 6)
    frame = (
        b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02" + codes.to_bytes(2, "little")
    )
    frame += b"\x00"
    return header + palette + frame * frames + b"\x3b"


@functools.cache
def png_bomb(side: int = PNG_SIDE) -> bytes:
    """A 1-bit greyscale PNG of side x side, every pixel 0."""
    return grey_png(side, bit_depth=1)


@functools.cache
def grey_png(side: int = SLOW_PNG_SIDE, bit_depth: int = 8) -> bytes:
    """A greyscale PNG of side x side, every pixel 0. At 8 bits and the default 4000 x 4000 (16 M
    pixels, within Pillow's limit) it is a legal image whose 16 KB take ~0.05-0.1 s to decode."""
    row = b"\x00" + bytes((side * bit_depth + 7) // 8)  # filter type 0, then the packed pixels
    packer = zlib.compressobj(9)
    parts = [packer.compress(row) for _ in range(side)]
    data = b"".join(parts) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, bit_depth, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data)
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


@functools.cache
def large_jpeg(side: int = 6000, quality: int = 85) -> bytes:
    """A side x side JPEG of smooth gradients and noise (encoded by Pillow)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 200, side, dtype=np.float32)
    pixels = np.empty((side, side, 3), dtype=np.uint8)
    for start in range(0, side, 500):  # in bands: a few MB at a time
        stop = min(start + 500, side)
        noise = rng.integers(0, 40, (stop - start, side, 3), dtype=np.uint8)
        band = ramp[None, :, None] + ramp[start:stop, None, None] / 4
        pixels[start:stop] = np.clip(band, 0, 215).astype(np.uint8) + noise
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in [
        ("gif_bomb.gif", gif_bomb()),
        ("png_bomb.png", png_bomb()),
        ("grey_4000.png", grey_png()),
        ("large.jpg", large_jpeg()),
    ]:
        (args.out / name).write_bytes(data)
        print(f"{args.out / name}: {len(data):,} bytes")


if __name__ == "__main__":
    main()
