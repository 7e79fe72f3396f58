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

import json
import time
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
    DetectionDataError,
    DetectionSplit,
    ImageEntry,
    check_entries,
    detection_bundle,
)
from kiln.data.spec import DataBundle

REQUIRED = ("images", "annotations", "categories")


def read_json(path: Path, key: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DetectionDataError(
            f"no such file: {path} (data.{key}): give a COCO instances JSON file"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise DetectionDataError(f"cannot read {path} (data.{key}): {err}") from None
    except json.JSONDecodeError as err:
        raise DetectionDataError(
            f"{path} is not JSON (data.{key}): {err.msg} at line {err.lineno} column {err.colno}"
        ) from None
    missing = [k for k in REQUIRED if not isinstance(data, dict) or k not in data]
    if missing:
        raise DetectionDataError(
            f"{path} is not COCO instances JSON (data.{key}): no {', '.join(missing)}; expected "
            '{"images": [{"id", "file_name", ...}], "annotations": [{"id", "image_id", '
            '"category_id", "bbox": [x, y, w, h]}], "categories": [{"id", "name"}]}'
        )
    return data


def categories_of(data: dict, path: Path) -> dict[int, str]:
    """{category id: name} in id order."""
    try:
        found = {int(c["id"]): str(c["name"]) for c in data["categories"]}
    except (KeyError, TypeError, ValueError):
        raise DetectionDataError(
            f"{path}: every entry of 'categories' needs an integer 'id' and a 'name'"
        ) from None
    if not found:
        raise DetectionDataError(f"{path}: 'categories' is empty: detection needs a class")
    return dict(sorted(found.items()))


def read_coco_split(
    json_path: Path, images_root: Path, label_of: dict[int, int], cfg: CocoConfig, key: str
) -> tuple[DetectionSplit, int]:
    """The checked split of one COCO file, and the number of its iscrowd annotations."""
    data = read_json(json_path, key)
    images_log = BadInputLog(str(json_path), unit="images", reasons=IMAGE_REASONS)
    annotations_log = BadInputLog(str(json_path), unit="annotations", reasons=ANNOTATION_REASONS)
    bad = BadInput(str(cfg.bad_rows), images_log, annotations_log)
    entries: dict[int, ImageEntry] = {}
    for position, image in enumerate(data["images"]):
        try:
            image_id, file_name = int(image["id"]), str(image["file_name"])
        except (KeyError, TypeError, ValueError):
            raise DetectionDataError(
                f"{json_path}: images[{position}] needs an integer 'id' and a 'file_name' "
                f"(got {json.dumps(image)[:120]})"
            ) from None
        if image_id in entries:
            images_log.read += 1
            first = entries[image_id].path.name
            bad.image(
                {"reason": DUPLICATE_IMAGE, "file": str(images_root / file_name),
                 "image_id": image_id, "detail": f"id {image_id} is also {first}"}
            )  # fmt: skip
            continue
        entries[image_id] = ImageEntry(images_root / file_name, where={"image_id": image_id})
    crowd = 0
    annotations_log.read = len(data["annotations"])
    for position, ann in enumerate(data["annotations"]):
        try:
            ann_id, image_id = ann.get("id", position), int(ann["image_id"])
            category = int(ann["category_id"])
            x, y, w, h = (float(v) for v in ann["bbox"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise DetectionDataError(
                f"{json_path}: annotations[{position}] needs 'image_id', 'category_id' and "
                f"'bbox': [x, y, w, h] (got {json.dumps(ann)[:120]})"
            ) from None
        entry = entries.get(image_id)
        if ann.get("iscrowd", 0):
            crowd += 1
            annotations_log.read -= 1  # not a box to train on, nor a bad one
            if entry is not None:
                entry.crowd.append(Annotation((x, y, x + w, y + h), label_of.get(category, 0),
                                              {"annotation_id": ann_id}))  # fmt: skip
            continue
        if entry is None:
            bad.annotation({"reason": UNKNOWN_IMAGE, "annotation_id": ann_id,
                            "image_id": image_id})  # fmt: skip
            continue
        where = {"annotation_id": ann_id, "image_id": image_id}
        if category not in label_of:
            where["category_id"] = category
        entry.annotations.append(Annotation((x, y, x + w, y + h), label_of.get(category, 0), where))
    split = check_entries(list(entries.values()), bad, num_classes=len(label_of),
                          images_root=images_root, cfg=cfg)  # fmt: skip
    return split, crowd


def build_coco(cfg: CocoConfig) -> DataBundle:
    started = time.perf_counter()
    train_json = Path(cfg.train_json)
    categories = categories_of(read_json(train_json, "train_json"), train_json)
    label_of = {category: label for label, category in enumerate(categories, start=1)}
    splits, crowd = {}, {}
    for split, json_key, images_key in (("train", "train_json", "train_images"),
                                        ("val", "val_json", "val_images"),
                                        ("test", "test_json", "test_images")):  # fmt: skip
        path = getattr(cfg, json_key)
        if path is None:
            continue
        images_root = Path(getattr(cfg, images_key) or cfg.train_images)
        if not images_root.is_dir():
            raise DetectionDataError(
                f"no such folder: {images_root} (data.{images_key}): give the folder the "
                f"file_names of {path} are relative to"
            )
        if split != "train":
            others = categories_of(read_json(Path(path), json_key), Path(path))
            if others != categories:
                raise DetectionDataError(
                    f"{path} has other categories than {train_json} (data.{json_key}): "
                    f"{others} vs {categories}; give files of one labelling"
                )
        splits[split], crowd[split] = read_coco_split(Path(path), images_root, label_of, cfg,
                                                      json_key)  # fmt: skip
    extra = {"format": "coco", "categories": {str(k): v for k, v in categories.items()},
             "iscrowd": crowd}  # fmt: skip
    return detection_bundle(cfg, list(categories.values()), splits, val_key="val_json",
                            started=started, extra_report=extra)  # fmt: skip
