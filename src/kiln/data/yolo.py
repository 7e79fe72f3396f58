"""`data=yolo`: object detection from a YOLO tree (Ultralytics' layout, what Roboflow and CVAT
export as "YOLO"):

    <root>/data.yaml              names: [a, b] or {0: a, 1: b}   (or <root>/data.names)
    <root>/images/train/x.jpg     data.train_dir=<root>/images/train
    <root>/labels/train/x.txt     one `class cx cy w h` line per box, normalised to 0..1

The labels folder of an images folder is found as YOLO finds it: the last `images` in its path
replaced by `labels`. An image without a label file is a negative. Boxes become (x1, y1, x2,
y2) pixels of the image; class k becomes label k + 1. Left out and listed in data_report.json
(data.bad_rows=error stops): a line that does not parse (file and line), a class the names do
not have, a box outside its image or of zero area, a label file without its image, an image
file that is unreadable."""

from __future__ import annotations

import time
from pathlib import Path

from kiln.config.data import YoloConfig
from kiln.data.bad_inputs import BadInputLog
from kiln.data.detection_files import (
    ANNOTATION_REASONS,
    BAD_LINE,
    IMAGE_REASONS,
    MISSING_IMAGE,
    Annotation,
    BadInput,
    DetectionDataError,
    DetectionSplit,
    ImageEntry,
    check_entries,
    detection_bundle,
)
from kiln.data.spec import DataBundle
from kiln.preprocessing.image_files import is_image_name, read_oriented_size
from kiln.sorting import natural_key

NAMES_FILES = ("data.yaml", "data.yml", "data.names")


def labels_dir(images: Path) -> Path:
    parts = list(images.parts)
    if "images" not in parts:
        raise DetectionDataError(
            f"{images} has no 'images' folder in its path (data.train_dir): YOLO keeps "
            "<root>/images/<split>/x.jpg beside <root>/labels/<split>/x.txt"
        )
    at = len(parts) - 1 - parts[::-1].index("images")
    parts[at] = "labels"
    return Path(*parts)


def find_names_file(images: Path, given: str | None) -> Path:
    if given is not None:
        if not Path(given).is_file():
            raise DetectionDataError(f"no such file: {given} (data.names_file)")
        return Path(given)
    for folder in [images, *images.resolve().parents][:4]:
        for name in NAMES_FILES:
            if (folder / name).is_file():
                return folder / name
    raise DetectionDataError(
        f"no data.yaml or data.names above {images} (data.names_file): give the class names "
        "file with data.names_file=<root>/data.yaml"
    )


def read_names(path: Path) -> list[str]:
    """Class names by index from a data.yaml (`names:` a list or {index: name}) or data.names
    (one name per line)."""
    if path.suffix == ".names":
        names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        names = [n for n in names if n]
    else:
        import yaml

        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise DetectionDataError(f"{path} is not YAML (data.names_file): {err}") from None
        raw = data.get("names") if isinstance(data, dict) else None
        if isinstance(raw, dict):
            try:
                ordered = sorted((int(k), str(v)) for k, v in raw.items())
            except ValueError:
                ordered = []
            names = [v for _, v in ordered]
            if [k for k, _ in ordered] != list(range(len(ordered))):
                names = []
        else:
            names = [str(n) for n in raw] if isinstance(raw, list) else []
    if not names:
        raise DetectionDataError(
            f"{path} names no classes (data.names_file): a data.yaml needs `names: [a, b]` or "
            "`names: {0: a, 1: b}`, a data.names file one name per line"
        )
    return names


def parse_line(line: str) -> tuple[int, float, float, float, float] | None:
    fields = line.split()
    if len(fields) != 5:
        return None
    try:
        klass = int(fields[0])
        cx, cy, w, h = (float(v) for v in fields[1:])
    except ValueError:
        return None
    return klass, cx, cy, w, h


def read_yolo_split(images: Path, num_classes: int, cfg: YoloConfig, key: str) -> DetectionSplit:
    if not images.is_dir():
        raise DetectionDataError(f"no such folder: {images} (data.{key})")
    labels = labels_dir(images)
    images_log = BadInputLog(str(images), unit="images", reasons=IMAGE_REASONS)
    annotations_log = BadInputLog(str(labels), unit="annotations", reasons=ANNOTATION_REASONS)
    bad = BadInput(str(cfg.bad_rows), images_log, annotations_log)
    files = sorted((p for p in images.rglob("*") if p.is_file() and is_image_name(p.name)),
                   key=lambda p: natural_key(str(p)))  # fmt: skip
    by_stem = {p.relative_to(images).with_suffix(""): p for p in files}
    entries = []
    for stem, path in by_stem.items():
        entry = ImageEntry(path)
        label_file = labels / stem.with_suffix(".txt")
        if label_file.is_file():
            try:
                with open(path, "rb") as stream:  # normalised to the picture as it decodes
                    height, width = read_oriented_size(stream)
            except (OSError, ValueError):
                width = height = 0  # an unreadable image: check_entries reports it
            _read_labels(label_file, width, height, entry, bad)
        entries.append(entry)
    if labels.is_dir():  # label files whose image is not there
        for label_file in sorted(labels.rglob("*.txt")):
            if label_file.relative_to(labels).with_suffix("") not in by_stem:
                count = sum(1 for line in label_file.read_text().splitlines() if line.strip())
                annotations_log.read += count
                for number in range(count):
                    bad.annotation({"reason": MISSING_IMAGE, "file": str(label_file),
                                    "line": number + 1})  # fmt: skip
    return check_entries(entries, bad, num_classes=num_classes, images_root=images, cfg=cfg)


def _read_labels(label_file: Path, width: int, height: int, entry: ImageEntry, bad: BadInput):
    text = label_file.read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        bad.annotations_log.read += 1
        where = {"line": number, "label_file": str(label_file)}
        parsed = parse_line(line)
        if parsed is None:
            bad.annotation({"reason": BAD_LINE, "file": str(entry.path), **where,
                            "text": line.strip()[:80],
                            "detail": "expected `class cx cy w h`: an integer and four "
                                      "numbers in 0..1"})  # fmt: skip
            continue
        klass, cx, cy, w, h = parsed
        box = ((cx - w / 2) * width, (cy - h / 2) * height,
               (cx + w / 2) * width, (cy + h / 2) * height)  # fmt: skip
        entry.annotations.append(Annotation(box, klass + 1, where))


def build_yolo(cfg: YoloConfig) -> DataBundle:
    started = time.perf_counter()
    train = Path(cfg.train_dir)
    names_file = find_names_file(train, cfg.names_file)
    names = read_names(names_file)
    splits = {}
    for split, key in (("train", "train_dir"), ("val", "val_dir"), ("test", "test_dir")):
        if getattr(cfg, key) is not None:
            splits[split] = read_yolo_split(Path(getattr(cfg, key)), len(names), cfg, key)
    extra = {"format": "yolo", "names_file": str(names_file)}
    return detection_bundle(cfg, names, splits, val_key="val_dir", started=started,
                            extra_report=extra)  # fmt: skip
