"""`data=coco`: object detection from COCO `instances` JSON (what Label Studio, CVAT and Roboflow
export) and the folder its `file_name`s are relative to:

    python train.py data=coco model=detector \\
        data.train_json=ann/train.json data.train_images=images/train [data.val_json=...]

- `bbox` [x, y, w, h] pixels -> (x1, y1, x2, y2); a box partly outside its image is clipped
  (listed in data_report.json), one with nothing inside it or of zero area dropped;
- category ids (any integers) -> labels 1..C in id order, from the training file's
  `categories` (their names go into the checkpoint); a val/test file's categories must agree;
- `iscrowd: 1` boxes are not trained on (torchvision's reference leaves them out too); in a
  validation or test split they are crowd regions, scored as COCO's evaluation scores them: a
  detection on one is neither right nor wrong, and the region is never a miss (counted per
  split in the report's `iscrowd`);
- an image without annotations is a negative, kept;
- left out and listed (data.bad_rows=drop; error stops): an image file missing or unreadable
  (and its annotations), a repeated image id, an annotation of an unknown image or category."""

from __future__ import annotations

import io
import json
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from kiln.config.data import CocoConfig
from kiln.data.bad_inputs import BadInputLog
from kiln.data.detection_files import (
    ANNOTATION_REASONS,
    DUPLICATE_IMAGE,
    IMAGE_REASONS,
    UNKNOWN_IMAGE,
    Annotation,
    BadInput,
    BoxLimit,
    DetectionDataError,
    DetectionSplit,
    ImageEntry,
    check_entries,
    detection_bundle,
)
from kiln.data.json_stream import JsonStream, JsonStreamError
from kiln.data.spec import DataBundle
from kiln.preprocessing.file_tree import FileAccessError, open_regular

REQUIRED = ("images", "annotations", "categories")
EXPECTED = (
    '{"images": [{"id", "file_name", ...}], "annotations": [{"id", "image_id", "category_id", '
    '"bbox": [x, y, w, h]}], "categories": [{"id", "name"}]}'
)
# One element of the file (an image, an annotation with its segmentation): a longer one is an
# error. The largest of COCO 2017 (an RLE crowd mask) is under 100 KB.
MAX_ELEMENT_CHARS = 64 * 2**20


@dataclass
class CocoFile:
    """What data=coco reads of an instances file: its categories, images and annotations (the
    boxes as columns: a segmentation or any other key is never kept)."""

    path: Path
    categories: dict[int, str] = field(default_factory=dict)  # id -> name, in id order
    images: list[tuple[int, str]] = field(default_factory=list)  # (id, file_name) in file order
    annotation_ids: list = field(default_factory=list)  # each one's "id" (its position if none)
    image_ids: array = field(default_factory=lambda: array("q"))
    category_ids: array = field(default_factory=lambda: array("q"))
    boxes: array = field(default_factory=lambda: array("d"))  # x, y, w, h of each, flat
    crowd: bytearray = field(default_factory=bytearray)  # 1: an iscrowd region


def read_coco_file(path: Path, key: str, max_bytes: int) -> CocoFile:
    """The file read element by element (kiln.data.json_stream): memory holds what is kept of
    it, never the parsed document. Refused before parsing when larger than `max_bytes`
    (data.max_json_bytes); a malformed file, an element of the wrong shape or JSON nested past
    the reader's depth is one DetectionDataError naming the file, the key and where."""
    try:
        binary = open_regular(path, max_bytes=max_bytes)
    except FileAccessError as err:
        if err.reason == "too_large":
            raise DetectionDataError(
                f"{path} is {err.detail} (data.{key}): refused before parsing; raise "
                "data.max_json_bytes if the file is a real annotation file"
            ) from None
        what = f"no such file: {path}" if err.detail == "no such file" else str(err)
        raise DetectionDataError(f"{what} (data.{key}): give a COCO instances JSON file") from None
    coco, seen = CocoFile(path), set()
    with io.TextIOWrapper(binary, encoding="utf-8-sig") as text:
        stream = JsonStream(text, MAX_ELEMENT_CHARS)
        try:
            for member in stream.members():
                if member in seen and member in REQUIRED:
                    raise DetectionDataError(f"{path}: '{member}' appears twice (data.{key})")
                seen.add(member)
                if member not in REQUIRED:
                    stream.skip()
                    continue
                if not stream.next_is_array():
                    raise DetectionDataError(
                        f"{path}: '{member}' is not a list (data.{key}); expected {EXPECTED}"
                    )
                read_element = {
                    "images": _image,
                    "annotations": _annotation,
                    "categories": _category,
                }[member]
                for position, element in enumerate(stream.elements()):
                    read_element(coco, element, position)
        except JsonStreamError as err:
            raise DetectionDataError(f"{path} is not valid JSON (data.{key}): {err}") from None
        except UnicodeDecodeError as err:
            raise DetectionDataError(
                f"{path} is not UTF-8 text (data.{key}): byte {err.object[err.start]:#x}; "
                "JSON files are UTF-8"
            ) from None
        except OSError as err:
            raise DetectionDataError(f"cannot read {path} (data.{key}): {err}") from None
    missing = [k for k in REQUIRED if k not in seen]
    if missing:
        raise DetectionDataError(
            f"{path} is not COCO instances JSON (data.{key}): no {', '.join(missing)}; "
            f"expected {EXPECTED}"
        )
    if not coco.categories:
        raise DetectionDataError(f"{path}: 'categories' is empty: detection needs a class")
    coco.categories = dict(sorted(coco.categories.items()))
    return coco


def _shown(element) -> str:
    return json.dumps(element)[:120]


def _image(coco: CocoFile, image, position: int) -> None:
    try:
        coco.images.append((int(image["id"]), str(image["file_name"])))
    except (KeyError, TypeError, ValueError, OverflowError):
        raise DetectionDataError(
            f"{coco.path}: images[{position}] needs an integer 'id' and a 'file_name' "
            f"(got {_shown(image)})"
        ) from None


def _category(coco: CocoFile, category, position: int) -> None:
    try:
        coco.categories[int(category["id"])] = str(category["name"])
    except (KeyError, TypeError, ValueError, OverflowError):
        raise DetectionDataError(
            f"{coco.path}: every entry of 'categories' needs an integer 'id' and a 'name' "
            f"(categories[{position}] is {_shown(category)})"
        ) from None


def _annotation(coco: CocoFile, ann, position: int) -> None:
    try:
        ann_id, image_id = ann.get("id", position), int(ann["image_id"])
        category = int(ann["category_id"])
        x, y, w, h = (float(v) for v in ann["bbox"])
        crowd = 1 if ann.get("iscrowd", 0) else 0
        coco.image_ids.append(image_id)  # an id past int64: OverflowError (and the run stops)
        coco.category_ids.append(category)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        raise DetectionDataError(
            f"{coco.path}: annotations[{position}] needs 'image_id', 'category_id' and "
            f"'bbox': [x, y, w, h] (got {_shown(ann)})"
        ) from None
    coco.annotation_ids.append(ann_id)
    coco.boxes.extend((x, y, w, h))
    coco.crowd.append(crowd)


def image_path(images_root: Path, file_name: str) -> Path:
    """Where a file_name points. A Windows tool's `train\\x.jpg` is `train/x.jpg` when no file
    holds the backslash in its name. Whether it stays inside images_root is checked later
    (check_entries), before anything is read."""
    path = images_root / file_name
    if "\\" in file_name and not path.exists():
        path = images_root / file_name.replace("\\", "/")
    return path


def read_coco_split(
    coco: CocoFile, images_root: Path, label_of: dict[int, int], cfg: CocoConfig
) -> tuple[DetectionSplit, int]:
    """The checked split of one COCO file, and the number of its iscrowd annotations."""
    json_path = coco.path
    images_log = BadInputLog(str(json_path), unit="images", reasons=IMAGE_REASONS)
    annotations_log = BadInputLog(str(json_path), unit="annotations", reasons=ANNOTATION_REASONS)
    bad = BadInput(str(cfg.bad_rows), images_log, annotations_log)
    entries: dict[int, ImageEntry] = {}
    for image_id, file_name in coco.images:
        if image_id in entries:
            images_log.read += 1
            first = entries[image_id].path.name
            bad.image(
                {
                    "reason": DUPLICATE_IMAGE,
                    "file": str(images_root / file_name),
                    "image_id": image_id,
                    "detail": f"id {image_id} is also {first}",
                }
            )
            continue
        entries[image_id] = ImageEntry(
            image_path(images_root, file_name), where={"image_id": image_id}
        )
    crowd = 0
    limit = BoxLimit(cfg.max_boxes_per_image, bad)
    annotations_log.read = len(coco.annotation_ids)
    for at, ann_id in enumerate(coco.annotation_ids):
        image_id, category = coco.image_ids[at], coco.category_ids[at]
        x, y, w, h = coco.boxes[4 * at : 4 * at + 4]
        entry = entries.get(image_id)
        if coco.crowd[at]:
            crowd += 1
            if entry is not None and not limit.room(entry, crowd=True):
                continue  # counted among the annotations left out (too_many_boxes)
            annotations_log.read -= 1  # not a box to train on, nor a bad one
            if entry is not None:
                entry.crowd.append(
                    Annotation(
                        (x, y, x + w, y + h), label_of.get(category, 0), {"annotation_id": ann_id}
                    )
                )
            continue
        if entry is None:
            bad.annotation({"reason": UNKNOWN_IMAGE, "annotation_id": ann_id, "image_id": image_id})
            continue
        if not limit.room(entry):
            continue
        where = {"annotation_id": ann_id, "image_id": image_id}
        if category not in label_of:
            where["category_id"] = category
        entry.annotations.append(Annotation((x, y, x + w, y + h), label_of.get(category, 0), where))
    limit.report()
    split = check_entries(
        list(entries.values()), bad, num_classes=len(label_of), images_root=images_root, cfg=cfg
    )
    return split, crowd


def build_coco(cfg: CocoConfig) -> DataBundle:
    started = time.perf_counter()
    train_json = Path(cfg.train_json)
    train = read_coco_file(train_json, "train_json", cfg.max_json_bytes)
    categories = train.categories
    label_of = {category: label for label, category in enumerate(categories, start=1)}
    splits, crowd = {}, {}
    for split, json_key, images_key in (
        ("train", "train_json", "train_images"),
        ("val", "val_json", "val_images"),
        ("test", "test_json", "test_images"),
    ):
        path = getattr(cfg, json_key)
        if path is None:
            continue
        images_root = Path(getattr(cfg, images_key) or cfg.train_images)
        if not images_root.is_dir():
            raise DetectionDataError(
                f"no such folder: {images_root} (data.{images_key}): give the folder the "
                f"file_names of {path} are relative to"
            )
        coco = (
            train if split == "train" else read_coco_file(Path(path), json_key, cfg.max_json_bytes)
        )
        if coco.categories != categories:
            raise DetectionDataError(
                f"{path} has other categories than {train_json} (data.{json_key}): "
                f"{coco.categories} vs {categories}; give files of one labelling"
            )
        splits[split], crowd[split] = read_coco_split(coco, images_root, label_of, cfg)
        train = coco = None  # the split holds what it needs of the file
    extra = {
        "format": "coco",
        "categories": {str(k): v for k, v in categories.items()},
        "iscrowd": crowd,
    }
    return detection_bundle(
        cfg,
        list(categories.values()),
        splits,
        val_key="val_json",
        started=started,
        extra_report=extra,
    )
