"""Hostile image files, made small and fast for tests: decompression bombs of every format the
header reader parses (a few KB to ~110 KB each, asking for hundreds of millions to billions of
pixels), animated images whose frames differ, and small good images.

    png_bomb()               a 1-bit grey PNG of 30000 x 30000 (valid: a decoder would allocate
                             900 M pixels), ~110 KB
    gif_bomb()               a GIF of 240 one-pixel frames on a 4000 x 4000 logical screen: every
                             frame is rendered at the screen's size (3.84 G pixels), ~5.5 KB
    patched_bomb(fmt)        a small real JPEG / WEBP / BMP / TIFF / animated WEBP whose header
                             is rewritten to claim 60000 x 60000 (or a 16000 x 16000 canvas)
    damaged_pngs()           ~100-byte PNGs libpng rejects (a bad row filter, a zlib stream that
                             fails its checksum or is no deflate, too little image data, a bit
                             depth of 7); torchvision 0.29's PNG decoder segfaults on most
"""

from __future__ import annotations

import functools
import io
import struct
import zlib

import numpy as np
from PIL import Image

BOMB_SIDE = 30_000
GIF_SCREEN, GIF_FRAMES = 4000, 240


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@functools.cache
def png_bomb(side: int = BOMB_SIDE) -> bytes:
    """A valid 1-bit grey PNG of side x side pixels, all black: zlib squeezes its
    side * (side / 8 + 1) bytes of rows ~1000:1. Compressed in slices, never held whole."""
    row = bytes(1 + (side + 7) // 8)  # filter byte 0, then the packed bits
    packer = zlib.compressobj(9)
    rows_per_slice = 1000
    parts = [
        packer.compress(row * min(rows_per_slice, side - start))
        for start in range(0, side, rows_per_slice)
    ]
    parts.append(packer.flush())
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit greyscale
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", b"".join(parts))
        + png_chunk(b"IEND", b"")
    )


def _png(header: bytes, image_data: bytes) -> bytes:
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", image_data)
        + png_chunk(b"IEND", b"")
    )


def damaged_pngs(width: int = 16, height: int = 8) -> dict[str, tuple[bytes, str]]:
    """name -> (a small RGB PNG whose chunks and CRCs are valid but whose image libpng
    rejects, the reason kiln gives it). torchvision 0.29's decode_png and decode_image print
    "libpng error: ..." and then kill the process (SIGSEGV) on the first four; on the last they
    raise "Internal error" (measured 2026-12-02)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    rows = b"".join(bytes([0]) + bytes(range(width * 3)) for _ in range(height))
    bad_checksum = bytearray(zlib.compress(rows))
    bad_checksum[-1] ^= 0xFF  # zlib's Adler-32 of the rows: "incorrect data check"
    filter_9 = b"".join(bytes([9]) + bytes(range(width * 3)) for _ in range(height))
    return {
        "bad row filter": (_png(header, zlib.compress(filter_9)), "unreadable"),
        "zlib checksum": (_png(header, bytes(bad_checksum)), "unreadable"),
        "not deflate": (_png(header, b"\x78\x9c" + bytes(range(200))), "unreadable"),
        "too little image data": (_png(header, zlib.compress(rows[: len(rows) // 3])), "truncated"),
        "bit depth 7": (
            _png(header[:8] + bytes([7]) + header[9:], zlib.compress(rows)),
            "unreadable",
        ),
    }


def gif(screen: tuple[int, int], frames: list[tuple[int, int, int, int]], colours=None) -> bytes:
    """A GIF89a of one-colour frames (left, top, width, height) on a logical screen, each
    frame's pixels palette index i % 2, LZW-coded by hand (code size 2: clear, the indices
    in runs, end), with a two-colour global palette."""
    colours = colours or [(0, 0, 0), (255, 255, 255)]
    out = bytearray(b"GIF89a")
    out += struct.pack("<HHBBB", *screen, 0x80, 0, 0)  # a global colour table of 2 entries
    for colour in colours[:2]:
        out += bytes(colour)
    for i, (left, top, width, height) in enumerate(frames):
        out += b"\x21\xf9\x04\x00\x00\x00\x00\x00"  # graphic control: no disposal, no delay
        out += b"\x2c" + struct.pack("<HHHHB", left, top, width, height, 0)
        out += b"\x02" + _lzw_sub_blocks(i % 2, width * height)
    out += b"\x3b"
    return bytes(out)


def _lzw_sub_blocks(index: int, count: int) -> bytes:
    """LZW (minimum code size 2) of `count` pixels of one palette index, emitted as single
    codes with a clear code every two pixels, so the table never needs 4-bit codes."""
    codes, bits, nbits, out = [4], 0, 0, bytearray()
    for n in range(count):
        if n and n % 2 == 0:
            codes.append(4)  # clear: the table never outgrows 3-bit codes
        codes.append(index)
    codes.append(5)
    for code in codes:
        bits |= code << nbits
        nbits += 3
        while nbits >= 8:
            out.append(bits & 0xFF)
            bits >>= 8
            nbits -= 8
    if nbits:
        out.append(bits & 0xFF)
    blocks = bytearray()
    for start in range(0, len(out), 255):
        piece = out[start : start + 255]
        blocks += bytes([len(piece)]) + piece
    return bytes(blocks + b"\x00")


@functools.cache
def gif_bomb() -> bytes:
    """~5.5 KB: 240 one-pixel frames on a 4000 x 4000 screen (torchvision renders every frame
    at the screen's size: 11.5 GB of RGB)."""
    return gif((GIF_SCREEN, GIF_SCREEN), [(0, 0, 1, 1)] * GIF_FRAMES)


def photo(size: tuple[int, int] = (53, 37), seed: int = 0) -> Image.Image:
    rgb = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    return Image.fromarray(rgb)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def animated(fmt: str, num_frames: int = 4, size=(30, 20)) -> bytes:
    """An animated GIF / PNG / WEBP whose frame i is filled with grey level 40 * i + 20."""
    frames = [Image.new("RGB", size, (40 * i + 20,) * 3) for i in range(num_frames)]
    out = io.BytesIO()
    frames[0].save(out, fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return out.getvalue()


CLAIMED = 60_000  # the side a patched header claims


def patched_bomb(fmt: str) -> bytes:
    """A small real file whose header claims CLAIMED x CLAIMED pixels (3.6 G), or for the
    animated WEBP a 16000 x 16000 canvas of its 4 frames."""
    if fmt == "JPEG":
        data = bytearray(encoded(photo(), "JPEG"))
        at = data.index(b"\xff\xc0") + 5  # SOF0: length(2), precision(1), height, width
        data[at : at + 4] = struct.pack(">HH", CLAIMED, CLAIMED)
    elif fmt == "WEBP":  # lossy VP8: 14-bit sides, so the most it can claim is 16383
        data = bytearray(encoded(photo(), "WEBP"))
        data[26:30] = struct.pack("<HH", 16383, 16383)
    elif fmt == "animated WEBP":
        data = bytearray(animated("WEBP"))
        at = data.index(b"VP8X") + 8 + 4
        data[at : at + 6] = (16000 - 1).to_bytes(3, "little") * 2
    elif fmt == "BMP":
        data = bytearray(encoded(photo(), "BMP"))
        data[18:26] = struct.pack("<ii", CLAIMED, -CLAIMED)  # top-down rows: height < 0
    elif fmt == "TIFF":
        data = bytearray(encoded(photo(), "TIFF"))
        (offset,) = struct.unpack("<I", data[4:8])
        (count,) = struct.unpack("<H", data[offset : offset + 2])
        for entry in range(offset + 2, offset + 2 + 12 * count, 12):
            tag, kind = struct.unpack("<HH", data[entry : entry + 4])
            if tag in (256, 257):
                value = struct.pack("<H" if kind == 3 else "<I", CLAIMED)
                data[entry + 8 : entry + 8 + len(value)] = value
    else:
        raise ValueError(fmt)
    return bytes(data)


# ---------------------------------------------------------------------------------------------
# A hostile image folder


def unreadable_file(path) -> str | None:
    """Make `path` a file that reading really fails on, even as root: chmod 000 where that
    stops us; as root (which chmod does not stop) a link to a kernel file that refuses reads
    to everyone (/proc/sys/vm/drop_caches, write-only). None when neither is possible here."""
    import os

    if os.geteuid() != 0:
        path.write_bytes(encoded(photo((8, 8)), "PNG"))
        path.chmod(0)
        return "chmod 000"
    target = "/proc/sys/vm/drop_caches"
    try:
        with open(target, "rb") as f:
            f.read(1)
    except PermissionError:
        path.symlink_to(target)
        return "a link to a file no one may read"
    except OSError:
        return None
    return None


def unlistable_folder(path) -> str | None:
    """Make `path` a folder that listing really fails on (see unreadable_file); None if not
    possible here (root on a system where every folder can be listed)."""
    import os

    if os.geteuid() != 0:
        path.mkdir()
        (path / "inside.png").write_bytes(encoded(photo((8, 8)), "PNG"))
        path.chmod(0)
        return "chmod 000"
    for target in ("/proc/1/map_files", "/proc/1/fdinfo"):
        try:
            os.listdir(target)
        except PermissionError:
            path.symlink_to(target, target_is_directory=True)
            return f"a link to {target}"
        except OSError:
            continue
    return None


def make_hostile_tree(base) -> dict:
    """base/train: three classes of small good PNGs (bird is a symlinked folder outside the
    tree) among every hostile entry the walk and the decoder must survive; returns what the
    scan must report. Unreadable entries are made only where this machine allows (see
    unreadable_file): the counts say what was made."""
    import os

    train, outside = base / "train", base / "outside_birds"
    for offset, name in enumerate(("cat", "dog")):
        (train / name).mkdir(parents=True)
        for i in range(1, 5):
            good = encoded(photo((24, 24), seed=10 * offset + i), "PNG")
            (train / name / f"{name}_{i}.png").write_bytes(good)
    outside.mkdir()
    for i in range(1, 4):
        (outside / f"bird_{i}.png").write_bytes(encoded(photo((24, 24), seed=50 + i), "PNG"))
    (train / "bird").symlink_to(outside, target_is_directory=True)  # followed: outside the tree
    cat, dog = train / "cat", train / "dog"
    (cat / "bomb.png").write_bytes(png_bomb())
    (dog / "bomb.gif").write_bytes(gif_bomb())
    (cat / "loop").symlink_to(".", target_is_directory=True)
    (dog / "up").symlink_to("..", target_is_directory=True)
    os.mkfifo(cat / "x.jpg")
    (cat / "gone.jpg").symlink_to("nowhere.jpg")
    (cat / "self1.jpg").symlink_to("self1.jpg")
    (cat / "self2.jpg").symlink_to("self2.jpg")
    (dog / "again.png").symlink_to("../cat/cat_1.png")  # cat_1.png is met first: a duplicate
    cannot_open = [cat / "gone.jpg", cat / "self1.jpg", cat / "self2.jpg"]
    how = {"file": unreadable_file(dog / "locked.png"), "folder": unlistable_folder(dog / "sub")}
    if how["file"]:
        cannot_open.append(dog / "locked.png")
    if how["folder"]:
        cannot_open.append(dog / "sub")
    return {
        "train_dir": train,
        "classes": ["bird", "cat", "dog"],
        "kept": {"bird": 3, "cat": 4, "dog": 4},
        "too_large": sorted([str(cat / "bomb.png"), str(dog / "bomb.gif")]),
        "cannot_open": sorted(map(str, cannot_open)),
        "skipped": {"link_into_tree": 2, "not_regular": 1, "duplicate": 1},
        "how": how,
        "links": 7
        + (how["file"] == "a link to a file no one may read")
        + (how["folder"] is not None and how["folder"].startswith("a link")),
    }


# ---------------------------------------------------------------------------------------------
# Hostile annotation files (data=coco, data=yolo)


def deep_json(depth: int = 100_000) -> str:
    """A COCO file whose first image is a list nested `depth` deep (json.loads: RecursionError)."""
    return '{"images": [' + "[" * depth + "]" * depth + '], "annotations": [], "categories": []}'


def yaml_bomb(levels: int = 9) -> str:
    """Billion laughs as a data.yaml: `names` is nine lists of nine aliases of the list before,
    9**9 (387 M) "lol"s for whoever walks it; 600 bytes."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels):
        refs = ", ".join([f"*a{level - 1}"] * 9)
        lines.append(f"a{level}: &a{level} [{refs}]")
    lines.append(f"names: *a{levels - 1}")
    return "\n".join(lines) + "\n"


def write_coco_like(
    path,
    num_images: int,
    boxes_per_image: int,
    polygon_points: int = 20,
    seed: int = 0,
    file_names=None,
):
    """A COCO instances file shaped like COCO 2017's (each annotation with its polygon
    segmentation, area, iscrowd; images with their licence and sizes), written element by
    element: COCO 2017 train is ~118,000 images, ~7.3 boxes each, ~40-point polygons, 448 MiB.
    `file_names`: the images' names (default img_<i>.jpg). Returns the path."""
    import json
    import random

    rng = random.Random(seed)
    names = file_names or [f"img_{i}.jpg" for i in range(num_images)]
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"info": {"description": "synthetic", "year": 2017}, "licenses": [], ')
        f.write('"images": [')
        for i in range(num_images):
            image = {
                "license": 1,
                "file_name": names[i],
                "height": 480,
                "width": 640,
                "date_captured": "2013-11-14 17:02:52",
                "id": i + 1,
            }
            f.write(("," if i else "") + json.dumps(image))
        f.write('], "annotations": [')
        ann_id = 0
        for i in range(num_images):
            for _ in range(boxes_per_image):
                x, y = rng.uniform(0, 500), rng.uniform(0, 380)
                w, h = rng.uniform(5, 140), rng.uniform(5, 100)
                polygon = [round(rng.uniform(0, 640), 2) for _ in range(2 * polygon_points)]
                ann = {
                    "segmentation": [polygon],
                    "area": round(w * h, 2),
                    "iscrowd": 0,
                    "image_id": i + 1,
                    "bbox": [round(v, 2) for v in (x, y, w, h)],
                    "category_id": 1 + ann_id % 3,
                    "id": ann_id + 1,
                }
                f.write(("," if ann_id else "") + json.dumps(ann))
                ann_id += 1
        f.write('], "categories": [')
        f.write(
            ",".join(
                json.dumps({"supercategory": "thing", "id": k, "name": f"class{k}"})
                for k in (1, 2, 3)
            )
        )
        f.write("]}")
    return path
