"""Writes examples/photos/: a small folder of real photos in class subfolders (torchvision's
ImageFolder layout), cropped from the sample photos shipped inside installed packages, so the
example of docs/image-data.md works offline:

    examples/photos/train/<class>/*.jpg    20 per class
    examples/photos/test/<class>/*.jpg      6 per class

Classes: dahlia (scikit-learn's flower.jpg), pagoda (its china.jpg), flag and portrait
(matplotlib's grace_hopper.jpg). Each image is a random square crop of its class's region of the
photo (seeded, so the folder is the same every time), resized to 64-96 pixels, some mirrored.

    python scripts/make_example_photos.py [--out examples/photos]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import matplotlib
import numpy as np
from PIL import Image
from sklearn.datasets import load_sample_images

REPO = Path(__file__).resolve().parents[1]
SPLITS = {"train": 20, "test": 6}
# class -> (photo, (left, top, right, bottom) of the class's region in that photo)
REGIONS = {
    "dahlia": ("flower", (170, 85, 445, 360)),
    "flag": ("grace_hopper", (0, 0, 150, 330)),
    "pagoda": ("china", (70, 30, 350, 390)),
    "portrait": ("grace_hopper", (150, 20, 380, 350)),
}


def photos() -> dict[str, Image.Image]:
    china, flower = load_sample_images().images
    hopper = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    return {
        "china": Image.fromarray(china),
        "flower": Image.fromarray(flower),
        "grace_hopper": Image.open(hopper).convert("RGB"),
    }


def crop(photo: Image.Image, region: tuple[int, int, int, int], rng) -> Image.Image:
    left, top, right, bottom = region
    side = int(rng.uniform(0.45, 0.9) * min(right - left, bottom - top))
    x = int(rng.integers(left, right - side + 1))
    y = int(rng.integers(top, bottom - side + 1))
    out = int(rng.integers(64, 97))
    image = photo.crop((x, y, x + side, y + side)).resize((out, out), Image.Resampling.LANCZOS)
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else image


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "examples" / "photos"))
    out = Path(parser.parse_args(argv).out)
    shutil.rmtree(out, ignore_errors=True)
    sources = photos()
    rng = np.random.default_rng(0)
    for split, count in SPLITS.items():
        for name, (photo, region) in REGIONS.items():
            folder = out / split / name
            folder.mkdir(parents=True)
            for i in range(1, count + 1):
                image = crop(sources[photo], region, rng)
                image.save(folder / f"{name}_{i:02d}.jpg", quality=85)
    files = list(out.rglob("*.jpg"))
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} photos ({total / 1024:.0f} KB) to {out}")


if __name__ == "__main__":
    main()
