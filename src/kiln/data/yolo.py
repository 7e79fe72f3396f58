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

import logging
import os
import time
from pathlib import Path

from kiln.config.data import YoloConfig
from kiln.data.bad_inputs import BadInputLog
from kiln.data.detection_files import (
    ANNOTATION_REASONS,
    BAD_LINE,
    IMAGE_REASONS,
    LABEL_FILE,
    MISSING_IMAGE,
    PIXEL_UNITS,
    Annotation,
    BadInput,
    BoxLimit,
    DetectionDataError,
    DetectionSplit,
    ImageEntry,
    check_entries,
    detection_bundle,
)
from kiln.data.spec import DataBundle
from kiln.preprocessing.file_tree import TOO_LARGE, FileAccessError, inside, open_regular
from kiln.preprocessing.image_files import is_image_name, read_oriented_size
from kiln.sorting import natural_key

log = logging.getLogger(__name__)

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


def read_small_text(path: Path, max_bytes: int, key: str) -> str:
    """A names file's text, refused unread past `max_bytes` (data.max_label_file_bytes) or when
    not a regular file."""
    try:
        with open_regular(path, max_bytes=max_bytes) as f:
            return f.read().decode("utf-8", errors="replace")
    except FileAccessError as err:
        fix = "; raise data.max_label_file_bytes if it is real" if err.reason == TOO_LARGE else ""
        raise DetectionDataError(f"{path}: {err.detail} (data.{key}){fix}") from None


def load_yaml(text: str):
    """YAML without anchors and aliases: `*ref` is refused, so a billion-laughs file (aliases of
    aliases, each doubling what a reader walks) is one error line, not gigabytes. A data.yaml
    has no use for them. PyYAML's SafeLoader, refusing an alias where it meets one."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(
                    None, None, "aliases (*name) are not read: write the value out", mark
                )
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=NoAliases)  # a SafeLoader: builds no Python objects


def read_names(path: Path, max_bytes: int = 2**20) -> list[str]:
    """Class names by index from a data.yaml (`names:` a list or {index: name}) or data.names
    (one name per line)."""
    text = read_small_text(path, max_bytes, "names_file")
    count = None  # data.yaml's nc, where it says one
    if path.suffix == ".names":
        names = [line.strip() for line in text.splitlines()]
        names = [n for n in names if n]
    else:
        import yaml

        try:
            data = load_yaml(text)
        except yaml.YAMLError as err:
            detail = " ".join(str(err).split())
            raise DetectionDataError(
                f"{path} is not YAML kiln reads (data.names_file): {detail}"
            ) from None
        raw = data.get("names") if isinstance(data, dict) else None
        count = data.get("nc") if isinstance(data, dict) else None
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
    if count is not None and (not isinstance(count, int) or count != len(names)):
        raise DetectionDataError(
            f"{path}: nc: {count!r} but names lists {len(names)} class(es) "
            f"({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}) (data.names_file): "
            "nc is the number of names; make them agree"
        )
    return names


def names_without_boxes(names: list[str], splits: dict) -> list[str]:
    """The class names no box of any split has (a class the model can learn nothing of)."""
    used = {int(k) for split in splits.values() for labels in split.labels for k in labels}
    return [name for k, name in enumerate(names, start=1) if k not in used]


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
    files = sorted(
        (p for p in images.rglob("*") if p.is_file() and is_image_name(p.name)),
        key=lambda p: natural_key(str(p)),
    )
    by_stem = {p.relative_to(images).with_suffix(""): p for p in files}
    labels_root, images_root = os.path.realpath(labels), os.path.realpath(images)
    limit = BoxLimit(cfg.max_boxes_per_image, bad)
    entries = []
    for stem, path in by_stem.items():
        entry = ImageEntry(path)
        label_file = labels / stem.with_suffix(".txt")
        if label_file.is_file():
            text = _label_text(label_file, labels_root, cfg.max_label_file_bytes, entry, bad)
            if text is not None and inside(path, images_root):  # else never opened
                try:
                    with open_regular(path) as stream:  # boxes of the picture as it decodes
                        height, width = read_oriented_size(stream)
                except (OSError, ValueError):
                    width = height = 0  # an unreadable image: check_entries reports it
                _read_labels(label_file, text, width, height, entry, bad, limit)
        entries.append(entry)
    limit.report()
    if labels.is_dir():  # label files whose image is not there
        for label_file in sorted(labels.rglob("*.txt")):
            if label_file.relative_to(labels).with_suffix("") not in by_stem:
                orphan = ImageEntry(label_file, where={"label_file": str(label_file)})
                text = _label_text(label_file, labels_root, cfg.max_label_file_bytes, orphan, bad)
                count = sum(1 for line in (text or "").splitlines() if line.strip())
                annotations_log.read += count
                for number in range(count):
                    bad.annotation(
                        {"reason": MISSING_IMAGE, "file": str(label_file), "line": number + 1}
                    )
    return check_entries(entries, bad, num_classes=num_classes, images_root=images, cfg=cfg)


def _label_text(
    label_file: Path, labels_root: str, max_bytes: int, entry: ImageEntry, bad: BadInput
) -> str | None:
    """A label file's text; None (and one label_file record, its boxes unknown) for one that
    leads out of the labels folder, is not a regular file, or is larger than max_bytes
    (data.max_label_file_bytes): such a file is never read."""
    if not inside(label_file, labels_root):
        detail = f"leads out of {Path(labels_root)} (to {os.path.realpath(label_file)})"
    else:
        try:
            with open_regular(label_file, max_bytes=max_bytes) as f:
                return f.read().decode("utf-8", errors="replace")
        except FileAccessError as err:
            detail = err.detail
            if err.reason == TOO_LARGE:
                detail += " (data.max_label_file_bytes)"
    bad.annotations_log.read += 1
    bad.annotation(
        {
            "reason": LABEL_FILE,
            "file": str(entry.path),
            "label_file": str(label_file),
            "detail": f"{detail}; not read",
        }
    )
    return None


def _read_labels(
    label_file: Path,
    text: str,
    width: int,
    height: int,
    entry: ImageEntry,
    bad: BadInput,
    limit: BoxLimit,
):
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        bad.annotations_log.read += 1
        if not limit.room(entry):
            continue
        where = {"line": number, "label_file": str(label_file)}
        parsed = parse_line(line)
        if parsed is None:
            bad.annotation(
                {
                    "reason": BAD_LINE,
                    "file": str(entry.path),
                    **where,
                    "text": line.strip()[:80],
                    "detail": "expected `class cx cy w h`: an integer and four numbers in 0..1",
                }
            )
            continue
        klass, cx, cy, w, h = parsed
        if max(cx, cy, w, h) > 1 and cx <= width and cy <= height and w <= width and h <= height:
            bad.annotation(
                {
                    "reason": PIXEL_UNITS,
                    "file": str(entry.path),
                    **where,
                    "text": line.strip()[:80],
                    "detail": "values > 1: these look like pixels, YOLO wants 0..1 "
                    "(cx and w divided by the image's width, cy and h by "
                    f"its height: {width}x{height})",
                }
            )
            continue
        box = (
            (cx - w / 2) * width,
            (cy - h / 2) * height,
            (cx + w / 2) * width,
            (cy + h / 2) * height,
        )
        entry.annotations.append(Annotation(box, klass + 1, where))


def build_yolo(cfg: YoloConfig) -> DataBundle:
    started = time.perf_counter()
    train = Path(cfg.train_dir)
    names_file = find_names_file(train, cfg.names_file)
    names = read_names(names_file, cfg.max_label_file_bytes)
    splits = {}
    for split, key in (("train", "train_dir"), ("val", "val_dir"), ("test", "test_dir")):
        if getattr(cfg, key) is not None:
            splits[split] = read_yolo_split(Path(getattr(cfg, key)), len(names), cfg, key)
    unused = names_without_boxes(names, splits)
    if unused:
        log.warning(
            "data: %s names %d class(es) no label uses: %s; each is a class the model learns "
            "nothing of (remove it from names, or label its objects)",
            names_file,
            len(unused),
            ", ".join(unused),
        )
    extra = {"format": "yolo", "names_file": str(names_file), "names_without_boxes": unused}
    return detection_bundle(
        cfg, names, splits, val_key="val_dir", started=started, extra_report=extra
    )
