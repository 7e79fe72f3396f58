"""A damaged copy of examples/photos for tests of data=image_folder (and the integrator's end to
end test): `make_damaged_folder(tmp_path)` copies the photos and adds, to train/, one file of
each kind of damage and one of each odd format; the returned `DamagedFolder` holds the exact
counts data_report.json must show.

    folder = make_damaged_folder(tmp_path)
    train.py data=image_folder data.train_dir={folder.train_dir} data.test_dir={folder.test_dir}

train/ (from examples/photos/train: 4 classes x 20 JPEGs), plus:
    dahlia/broken.jpg       a truncated JPEG (its first half)      -> dropped: truncated
    flag/empty.jpg          zero bytes                             -> dropped: empty_file
    pagoda/.DS_Store        a hidden file                          -> skipped: hidden
    portrait/notes.txt      a text file                            -> skipped: not_image
    empty/                  a class folder with no file            -> classes_dropped: empty
    lonely/lonely_1.jpg     a class folder with one good image     -> classes_dropped: single_image
    dahlia/grey.png         grayscale (L) PNG                      -> kept
    flag/alpha.png          RGBA PNG (alpha varies)                -> kept, alpha dropped
    pagoda/palette.png      palette (P) PNG                        -> kept
    portrait/deep.png       16-bit grayscale PNG (I;16)            -> kept, scaled to 8 bits
    dahlia/SHOUT.JPEG       upper-case extension                   -> kept
    pagoda/old.bmp          BMP (Pillow's decoder)                 -> kept
    portrait/scan.tif       TIFF (Pillow's decoder)                -> kept
test/ (from examples/photos/test: 4 classes x 6 JPEGs), plus one grayscale, one RGBA and one
palette PNG (in dahlia/, flag/, pagoda/): nothing damaged, so every file is a test image.

`add_class(folder, name, count)` adds a class folder of `count` good JPEGs (e.g. a test class
the training data lacks)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "photos"
CLASSES = ("dahlia", "flag", "pagoda", "portrait")  # natural order, as training keeps them


@dataclass(frozen=True)
class DamagedFolder:
    train_dir: Path
    test_dir: Path
    classes: tuple[str, ...]  # the classes training keeps, in natural order
    files: int  # every file under train_dir (hidden and text files included)
    hidden: int  # skipped: hidden
    not_image: int  # skipped: not_image
    truncated: tuple[str, ...]  # dropped: truncated (paths as the report writes them)
    empty_files: tuple[str, ...]  # dropped: empty_file
    empty_class: str  # classes_dropped: {"reason": "empty", "images": 0}
    single_image_class: str  # classes_dropped: {"reason": "single_image", "images": 1}
    images_kept: int  # train_dir's images in the dataset (train + val split)
    images_unused: int  # good images of dropped classes
    test_images: int  # every file of test_dir
    odd: dict[str, Path] = field(default_factory=dict)  # kind -> file in train_dir
    test_odd: dict[str, Path] = field(default_factory=dict)  # kind -> file in test_dir

    @property
    def images_read(self) -> int:
        return self.files - self.hidden - self.not_image

    @property
    def images_dropped(self) -> int:
        return len(self.truncated) + len(self.empty_files)


def _rgb(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def write_odd_files(folder: Path, source: Path, kinds: dict[str, str]) -> dict[str, Path]:
    """Files of odd formats made from the photo `source`: kind -> path under `folder`."""
    rgb = _rgb(source)
    grey = Image.fromarray(rgb).convert("L")
    alpha = np.linspace(0, 255, rgb.shape[0] * rgb.shape[1]).astype(np.uint8)
    rgba = Image.fromarray(np.dstack([rgb, alpha.reshape(rgb.shape[:2])]))
    palette = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE)
    makers = {
        "grayscale": lambda p: grey.save(p),
        "rgba": lambda p: rgba.save(p),
        "palette": lambda p: palette.save(p),
        "png16": lambda p: Image.fromarray(np.asarray(grey).astype(np.uint16) * 257).save(p),
        "upper_case": lambda p: shutil.copyfile(source, p),
        "bmp": lambda p: Image.fromarray(rgb).save(p),
        "tiff": lambda p: Image.fromarray(rgb).save(p),
    }
    made = {}
    for kind, relative in kinds.items():
        path = folder / relative
        makers[kind](path)
        made[kind] = path
    return made


def add_class(folder: Path, name: str, count: int, source: Path | None = None) -> list[Path]:
    """A class folder `name` under `folder` with `count` copies of a good JPEG."""
    source = source or next((EXAMPLES / "train" / CLASSES[0]).glob("*.jpg"))
    (folder / name).mkdir(parents=True, exist_ok=True)
    paths = [folder / name / f"{name}_{i}.jpg" for i in range(1, count + 1)]
    for path in paths:
        shutil.copyfile(source, path)
    return paths


def make_damaged_folder(dest: Path) -> DamagedFolder:
    """dest/train and dest/test as the module's docstring lists; returns what to expect."""
    train, test = dest / "train", dest / "test"
    shutil.copytree(EXAMPLES / "train", train)
    shutil.copytree(EXAMPLES / "test", test)
    originals = sum(1 for _ in train.rglob("*.jpg"))
    photo = train / "dahlia" / "dahlia_01.jpg"
    data = photo.read_bytes()
    (train / "dahlia" / "broken.jpg").write_bytes(data[: len(data) // 2])
    (train / "flag" / "empty.jpg").write_bytes(b"")
    (train / "pagoda" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(64))
    (train / "portrait" / "notes.txt").write_text("photos from the trip, sorted by subject\n")
    (train / "empty").mkdir()
    add_class(train, "lonely", 1, photo)
    odd = write_odd_files(
        train,
        photo,
        {
            "grayscale": "dahlia/grey.png",
            "rgba": "flag/alpha.png",
            "palette": "pagoda/palette.png",
            "png16": "portrait/deep.png",
            "upper_case": "dahlia/SHOUT.JPEG",
            "bmp": "pagoda/old.bmp",
            "tiff": "portrait/scan.tif",
        },
    )
    test_odd = write_odd_files(
        test,
        test / "dahlia" / "dahlia_01.jpg",
        {"grayscale": "dahlia/grey.png", "rgba": "flag/alpha.png", "palette": "pagoda/palette.png"},
    )
    return DamagedFolder(
        train_dir=train,
        test_dir=test,
        classes=CLASSES,
        files=originals + 2 + 2 + 1 + len(odd),  # + damaged, hidden and text, lonely's, odd
        hidden=1,
        not_image=1,
        truncated=(str(train / "dahlia" / "broken.jpg"),),
        empty_files=(str(train / "flag" / "empty.jpg"),),
        empty_class="empty",
        single_image_class="lonely",
        images_kept=originals + len(odd),
        images_unused=1,
        test_images=sum(1 for p in test.rglob("*") if p.is_file()),
        odd=odd,
        test_odd=test_odd,
    )
