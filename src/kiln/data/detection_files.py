"""What data=coco and data=yolo share once their files are parsed: the images checked (kiln's
image scan: header size limit, one full decode, verdicts cached), boxes checked against their
image (clipped, or dropped when nothing remains), the bad-input report, the split and the
bundle kiln's detectors train on.

An item is (image (3, H, W) float32 in [0, 1], {"boxes": (K, 4) float32 (x1, y1, x2, y2)
pixels, "labels": (K,) int64 in 1..C}), the image at the size of its file (detectors resize
internally), decoded when the item is read: as data=shapes_detection's items. A validation or
test item also carries its COCO crowd regions (`iscrowd: 1`), "crowd_boxes" (M, 4) and
"crowd_labels" (M,), which COCO's evaluation excuses detections on and never counts as missed
(kiln.engine.detection_eval.coco_targets); training items have none: crowd regions are not
trained on, as torchvision's reference leaves them out."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from kiln.config.data import DetectionFilesConfig
from kiln.data.bad_inputs import BadInputLog, changed_file
from kiln.data.image_scan import VerdictCache, default_cache_dir, verify_file
from kiln.data.shapes_detection import collate_image_list
from kiln.data.spec import DataBundle, DataSpec
from kiln.data.split import stratified_split, val_count
from kiln.errors import UserError
from kiln.preprocessing import ImageListRecipe
from kiln.preprocessing.file_tree import FileAccessError, inside
from kiln.preprocessing.image_files import read_image_file, read_oriented_size

log = logging.getLogger(__name__)

# Why an annotation (a box) is not used.
MISSING_IMAGE = "missing_image"  # its image file is missing or unreadable (or the image dropped)
UNKNOWN_IMAGE = "unknown_image_id"  # COCO: an image_id no image entry has
BOX_OUTSIDE = "box_outside_image"  # nothing of the box is inside its image
ZERO_AREA = "zero_area_box"  # width or height <= 0 (or not finite)
UNKNOWN_CATEGORY = "unknown_category"  # a category id / class index the names do not have
BAD_LINE = "bad_label_line"  # YOLO: a line that is not `class cx cy w h` numbers
DUPLICATE_IMAGE = "duplicate_image_id"  # COCO: a second image entry with an id already seen
TOO_MANY_BOXES = "too_many_boxes"  # an image's boxes past data.max_boxes_per_image
OUTSIDE_ROOT = "outside_images_root"  # a file_name (or a link) leading out of the images folder
LABEL_FILE = "label_file"  # YOLO: a label file too large, not regular or linked out: unread
PIXEL_UNITS = "pixel_units"  # YOLO: cx cy w h above 1 that fit the image as pixels
ANNOTATION_REASONS = (
    MISSING_IMAGE,
    UNKNOWN_IMAGE,
    BOX_OUTSIDE,
    ZERO_AREA,
    UNKNOWN_CATEGORY,
    BAD_LINE,
    PIXEL_UNITS,
    TOO_MANY_BOXES,
    LABEL_FILE,
)
IMAGE_REASONS = (
    MISSING_IMAGE,
    DUPLICATE_IMAGE,
    OUTSIDE_ROOT,
    "empty_file",
    "truncated",
    "unreadable",
    "too_large",
    "cannot_open",
)


class DetectionDataError(UserError, ValueError):
    """A problem with a user's detection files; the message names the file (and line or id)."""


@dataclass(slots=True)
class Annotation:
    box: tuple[float, float, float, float]  # (x1, y1, x2, y2) pixels, not yet checked
    label: int  # 1..C, 0 for unknown (checked by the caller)
    where: dict  # {"annotation_id": ..} or {"line": ..}: where the report points


@dataclass
class ImageEntry:
    """One image as the annotation file describes it."""

    path: Path
    annotations: list[Annotation] = field(default_factory=list)
    crowd: list[Annotation] = field(default_factory=list)  # COCO iscrowd regions
    where: dict = field(default_factory=dict)  # {"image_id": ..} for COCO


@dataclass
class DetectionSplit:
    """The good images of one annotation file or folder, their boxes and its reports."""

    paths: list[str]
    boxes: list[np.ndarray]  # (K, 4) float32 per image
    labels: list[np.ndarray]  # (K,) int64 per image
    sizes: list[tuple[int, int]]  # (H, W) per image
    images_log: BadInputLog
    annotations_log: BadInputLog
    clipped: list[dict]  # boxes partly outside their image, clipped and kept
    crowd_boxes: list[np.ndarray] = field(default_factory=list)  # (M, 4) per image
    crowd_labels: list[np.ndarray] = field(default_factory=list)  # (M,) per image

    def clipped_summary(self) -> str:
        """The log's line for the boxes partly outside their image, clipped and kept."""
        return (
            f"{self.annotations_log.path}: {len(self.clipped)} box(es) partly outside their "
            "image clipped to it and kept (annotations_clipped, clipped_records in "
            "data_report.json)"
        )

    def report(self) -> dict:
        return {
            "images": self.images_log.to_dict(),
            "annotations": self.annotations_log.to_dict(),
            "annotations_clipped": len(self.clipped),
            "clipped_records": self.clipped,
        }


class BadInput:
    """data.bad_rows for detection files: drop records the input, error raises at once."""

    def __init__(self, bad_rows: str, images_log: BadInputLog, annotations_log: BadInputLog):
        self.stop = bad_rows == "error"
        self.images_log, self.annotations_log = images_log, annotations_log

    def image(self, record: dict) -> None:
        self._add(self.images_log, record)

    def annotation(self, record: dict, count: int = 1) -> None:
        """`record` drops `count` annotations (one record for many: too_many_boxes)."""
        self._add(self.annotations_log, record, count)

    def _add(self, report: BadInputLog, record: dict, count: int = 1) -> None:
        if self.stop:
            where = ", ".join(f"{k} {v}" for k, v in record.items() if k not in ("reason",))
            raise DetectionDataError(
                f"{record['reason'].replace('_', ' ')} ({report.path}: {where}): fix the "
                "annotation or the file, or set data.bad_rows=drop to leave such inputs out "
                "(listed in data_report.json)"
            )
        report.add(record, count)


class BoxLimit:
    """data.max_boxes_per_image: an image's boxes (or crowd regions) past the limit, in file
    order, are left out before any is checked or held: counted as too_many_boxes, one record
    per image in data_report.json. (A million boxes on one image hung the run for minutes: a
    detector matches every box against every anchor.)"""

    def __init__(self, limit: int, bad: BadInput):
        self.limit, self.bad = limit, bad
        self.excess: dict[int, tuple[ImageEntry, int]] = {}  # id(entry) -> (entry, left out)

    def room(self, entry: ImageEntry, crowd: bool = False) -> bool:
        """Whether one more box (crowd region) fits on `entry`; counts it when not."""
        if len(entry.crowd if crowd else entry.annotations) < self.limit:
            return True
        _, count = self.excess.get(id(entry), (entry, 0))
        self.excess[id(entry)] = (entry, count + 1)
        return False

    def report(self) -> None:
        for entry, count in self.excess.values():
            self.bad.annotation(
                {
                    "reason": TOO_MANY_BOXES,
                    "file": str(entry.path),
                    **entry.where,
                    "left_out": count,
                    "detail": f"{self.limit + count:,} boxes or more; "
                    f"data.max_boxes_per_image={self.limit:,}: the first {self.limit:,} kept",
                },
                count,
            )


def clip_box(box, height: int, width: int) -> tuple[str | None, tuple[float, ...]]:
    """(why the box is dropped or None, the box clipped to the image). A box of zero area is
    dropped as such; one with nothing left inside the image as outside it."""
    x1, y1, x2, y2 = (float(v) for v in box)
    if not all(np.isfinite([x1, y1, x2, y2])) or x2 <= x1 or y2 <= y1:
        return ZERO_AREA, (x1, y1, x2, y2)
    clipped = (
        min(max(x1, 0.0), width),
        min(max(y1, 0.0), height),
        min(max(x2, 0.0), width),
        min(max(y2, 0.0), height),
    )
    if clipped[2] <= clipped[0] or clipped[3] <= clipped[1]:
        return BOX_OUTSIDE, clipped
    return None, clipped


def check_entries(
    entries: list[ImageEntry],
    bad: BadInput,
    *,
    num_classes: int,
    images_root: Path,
    cfg: DetectionFilesConfig,
) -> DetectionSplit:
    """Each image decoded once (verdicts cached under data.cache_dir), each box checked against
    its image; what is left out goes to the report (or stops the run: data.bad_rows=error)."""
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    real_root = os.path.realpath(images_root)
    outside = {id(e) for e in entries if not inside(e.path, real_root)}  # never opened
    present = [e.path for e in entries if id(e) not in outside and e.path.is_file()]
    check = lambda path: verify_file(path, 3, cfg.max_image_pixels)  # noqa: E731
    cache = VerdictCache(cache_dir, images_root, cfg.max_image_pixels)
    verdicts = cache.verdicts(present, check)
    cache.save()
    split = DetectionSplit([], [], [], [], bad.images_log, bad.annotations_log, [])
    bad.images_log.read += len(entries)
    for entry in entries:
        error = verdicts.get(entry.path)
        reason = MISSING_IMAGE if entry.path not in verdicts else error and error.reason
        if id(entry) in outside:
            reason = OUTSIDE_ROOT
            error = FileAccessError(
                OUTSIDE_ROOT,
                entry.path,
                f"leads out of {images_root} (to {os.path.realpath(entry.path)}); not read",
            )
        if reason:
            detail = "no such file" if error is None else error.detail
            if error is None and "\\" in entry.path.name:
                detail += " (the name holds '\\': a Windows path? write it with '/')"
            bad.image({"reason": reason, "file": str(entry.path), **entry.where, "detail": detail})
            for ann in entry.annotations:
                bad.annotation({"reason": MISSING_IMAGE, "file": str(entry.path), **ann.where})
            continue
        with open(entry.path, "rb") as stream:  # the size of the picture as it decodes
            height, width = read_oriented_size(stream)
        boxes, labels = [], []
        for ann in entry.annotations:
            place = {"file": str(entry.path), **ann.where}
            if not 1 <= ann.label <= num_classes:
                bad.annotation({"reason": UNKNOWN_CATEGORY, **place})
                continue
            why, box = clip_box(ann.box, height, width)
            if why is not None:
                bad.annotation(
                    {
                        "reason": why,
                        **place,
                        "box": [round(v, 2) for v in ann.box],
                        "image_size": [width, height],
                    }
                )
                continue
            if box != tuple(float(v) for v in ann.box):
                split.clipped.append(
                    {
                        **place,
                        "box": [round(v, 2) for v in ann.box],
                        "clipped_to": [round(v, 2) for v in box],
                    }
                )
            boxes.append(box)
            labels.append(ann.label)
        # Crowd regions: clipped as boxes are; one that is not a region of the image (or of
        # an unknown category) is nothing to excuse a detection on, and goes.
        crowd = [(clip_box(c.box, height, width), c.label) for c in entry.crowd]
        crowd = [
            (box, label) for (why, box), label in crowd if why is None and 1 <= label <= num_classes
        ]
        split.paths.append(str(entry.path))
        split.boxes.append(np.asarray(boxes, dtype=np.float32).reshape(-1, 4))
        split.labels.append(np.asarray(labels, dtype=np.int64))
        split.crowd_boxes.append(np.asarray([b for b, _ in crowd], np.float32).reshape(-1, 4))
        split.crowd_labels.append(np.asarray([k for _, k in crowd], dtype=np.int64))
        split.sizes.append((height, width))
    bad.images_log.kept = len(split.paths)
    bad.annotations_log.kept = sum(len(b) for b in split.boxes)
    return split


def box_transform(augment: str, side: int):
    """The training transform of data.augment on (uint8 image, tv_tensors.BoundingBoxes,
    labels), or None for none. Boxes follow every geometric step; SanitizeBoundingBoxes drops
    the ones a crop left (almost) empty, with their labels."""
    if augment == "none":
        return None
    from torchvision.transforms import v2

    steps = {
        "hflip": [v2.RandomHorizontalFlip()],
        "hflip_scale": [
            v2.RandomHorizontalFlip(),
            v2.ScaleJitter(target_size=(side, side), scale_range=(0.5, 1.5), antialias=True),
        ],
        "ssd": [
            v2.RandomPhotometricDistort(p=1.0),
            v2.RandomZoomOut(fill={tv_image_type(): (123, 117, 104), "others": 0}),
            v2.RandomIoUCrop(),
            v2.RandomHorizontalFlip(),
        ],
    }[augment]
    return v2.Compose([*steps, v2.ClampBoundingBoxes(), v2.SanitizeBoundingBoxes()])


def tv_image_type():
    from torchvision import tv_tensors

    return tv_tensors.Image


class DetectionImages(Dataset):
    """Image files and their boxes: (image (3, H, W) float32 in [0, 1], {"boxes", "labels"}).
    With a `transform` (training, data.augment) an item's randomness is seeded from (run seed,
    epoch, index) -- the key the training sampler sends -- as image folders' items are."""

    def __init__(
        self,
        paths,
        boxes,
        labels,
        *,
        max_pixels: int | None,
        transform=None,
        crowd=None,
        sizes=None,
    ):
        self.paths, self.boxes, self.labels = list(paths), list(boxes), list(labels)
        # (H, W) per image from its header: the probes pick the data's extremes without
        # decoding every image (kiln.data.extremes)
        self.sizes = list(sizes) if sizes is not None else None
        self.crowd = crowd  # [(boxes (M, 4), labels (M,))] per image: evaluation splits only
        self.max_pixels = max_pixels
        self.transform = transform
        self.seeded_keys = transform is not None  # kiln.data.loaders: (index, seed, epoch) keys

    def __len__(self) -> int:
        return len(self.paths)

    def content_keys(self) -> list[bytes]:
        """Each file's bytes, digested (kiln.data.split_hygiene, cached by path and mtime)."""
        from kiln.data.split_hygiene import file_digests

        return file_digests(self.paths)

    def box_targets(self) -> list[tuple[np.ndarray, np.ndarray, tuple[int, int]]] | None:
        """(boxes, labels, (H, W)) per item as the files say, no image decoded (what the box
        convention check reads: kiln.data.box_conventions)."""
        if self.sizes is None:
            return None
        return list(zip(self.boxes, self.labels, self.sizes, strict=True))

    def item_sizes(self) -> list[tuple[int, int, int]] | None:
        """(height, width, boxes) of each item as its file says (before any augmentation)."""
        if self.sizes is None:
            return None
        return [(h, w, len(b)) for (h, w), b in zip(self.sizes, self.boxes, strict=True)]

    def __getitem__(self, key):
        index, seed, epoch = key if isinstance(key, tuple) else (key, 0, 0)
        if self.transform is None:
            return self._load(index)
        from torchvision import tv_tensors

        from kiln.data.image_folder import item_seed
        from kiln.rng import forked

        pixels, target = self._load(index, scale=False)
        boxes = tv_tensors.BoundingBoxes(
            target["boxes"], format="XYXY", canvas_size=tuple(pixels.shape[-2:])
        )
        sample = {"image": tv_tensors.Image(pixels), "boxes": boxes, "labels": target["labels"]}
        with forked(item_seed(seed, epoch, index), cuda=False):
            out = self.transform(sample)
        image = out["image"].as_subclass(torch.Tensor).to(torch.float32).div_(255.0)
        return image, {
            "boxes": out["boxes"].as_subclass(torch.Tensor).float(),
            "labels": out["labels"],
        }

    def _load(self, index: int, scale: bool = True):
        path = self.paths[index]
        try:
            pixels = read_image_file(path, 3, self.max_pixels)
        except (OSError, ValueError) as err:  # changed or removed since it was checked
            raise changed_file(path, err) from None
        image = pixels.to(torch.float32).div_(255.0) if scale else pixels
        target = {
            "boxes": torch.from_numpy(self.boxes[index]).clone(),
            "labels": torch.from_numpy(self.labels[index]).clone(),
        }
        if self.crowd is not None:
            crowd_boxes, crowd_labels = self.crowd[index]
            target["crowd_boxes"] = torch.from_numpy(crowd_boxes).clone()
            target["crowd_labels"] = torch.from_numpy(crowd_labels).clone()
        return image, target


def split_images(labels: Sequence[np.ndarray], val_fraction: float, seed: int, key: str):
    """(train, val) positions: stratified by each image's most frequent label (0: no box), as
    kiln's other splits (kiln.data.split), sorted."""
    main = np.array([np.bincount(y).argmax() if len(y) else 0 for y in labels], dtype=np.int64)
    num_val = val_count(len(main), val_fraction, "images", key, DetectionDataError)
    train, val = stratified_split(main, num_val, seed)
    return np.sort(train), np.sort(val)


def _subset(split: DetectionSplit, at: np.ndarray) -> dict:
    names = ("paths", "boxes", "labels", "crowd_boxes", "crowd_labels")
    return {name: [getattr(split, name)[i] for i in at] for name in names}


def detection_bundle(
    cfg: DetectionFilesConfig,
    class_names: Sequence[str],
    splits: dict[str, DetectionSplit],
    *,
    val_key: str,
    started: float,
    extra_report: dict,
) -> DataBundle:
    """The bundle from the checked splits ("train", and "val"/"test" where given)."""
    train = splits["train"]
    if not train.paths:
        raise DetectionDataError(
            f"no usable training image ({train.images_log.path}): {train.images_log.summary()} "
            "(see data_report.json)"
        )
    parts = {"train": _subset(train, np.arange(len(train.paths)))}
    if "val" in splits:
        parts["val"] = _subset(splits["val"], np.arange(len(splits["val"].paths)))
        how: dict | str = f"data.{val_key}"
    else:
        train_at, val_at = split_images(
            train.labels, cfg.val_fraction, cfg.split_seed, f"data.{val_key}"
        )
        parts = {"train": _subset(train, train_at), "val": _subset(train, val_at)}
        how = {"val_fraction": cfg.val_fraction, "split_seed": cfg.split_seed}
    if "test" in splits:
        parts["test"] = _subset(splits["test"], np.arange(len(splits["test"].paths)))
    sizes = [s for split in splits.values() for s in split.sizes]
    sizes_by_path = {
        p: s for split in splits.values() for p, s in zip(split.paths, split.sizes, strict=True)
    }
    largest = (max(h for h, _ in sizes), max(w for _, w in sizes))
    side = min(cfg.image_size, max(largest))
    names = tuple(class_names)
    spec = DataSpec(
        "detection", "image_list", len(names), names, channels=3, image_size=(side, side)
    )
    recipe = ImageListRecipe(
        class_names=names, channels=3, image_size=largest, min_image_size=min(min(s) for s in sizes)
    )

    def dataset(name: str) -> DetectionImages:
        part = parts[name]
        training = name == "train"
        transform = box_transform(str(cfg.augment), side) if training else None
        crowd = (
            None if training else list(zip(part["crowd_boxes"], part["crowd_labels"], strict=True))
        )
        return DetectionImages(
            part["paths"],
            part["boxes"],
            part["labels"],
            max_pixels=cfg.max_image_pixels,
            transform=transform,
            crowd=crowd,
            sizes=[sizes_by_path[p] for p in part["paths"]],
        )

    counts = {
        name: dict(
            zip(
                names,
                np.bincount(
                    np.concatenate([np.zeros(0, np.int64), *p["labels"]]), minlength=len(names) + 1
                )[1:].tolist(),
                strict=True,
            )
        )
        for name, p in parts.items()
    }
    report = {
        **extra_report,
        **{f"{name}_files": split.report() for name, split in splits.items()},
        "summary": [
            line
            for split in splits.values()
            for line in (
                split.images_log.summary(),
                split.annotations_log.summary(),
                *([split.clipped_summary()] if split.clipped else []),
            )
        ],
        "classes": list(names),
        "images": {name: len(p["paths"]) for name, p in parts.items()},
        "images_without_boxes": {
            name: sum(len(b) == 0 for b in p["boxes"]) for name, p in parts.items()
        },
        "boxes_per_class": counts,
        "split": how,
        "input": {
            "image_size": side,
            "largest_image": list(largest),
            "augment": str(cfg.augment),
            "group_by_aspect_ratio": cfg.group_by_aspect_ratio,
        },
        "prepare_s": time.perf_counter() - started,
    }
    for split in splits.values():
        for bad_log in (split.images_log, split.annotations_log):
            dropped = bad_log.num_dropped > 0
            (log.warning if dropped else log.info)(
                "data: %s%s", bad_log.summary(), " (see data_report.json)" if dropped else ""
            )
        if split.clipped:
            log.warning("data: %s", split.clipped_summary())
    log.info(
        "data: %d classes (%s), %s images",
        len(names),
        ", ".join(names),
        " / ".join(f"{n} {split}" for split, n in report["images"].items()),
    )
    train_sizes = [sizes_by_path[p] for p in parts["train"]["paths"]]
    return DataBundle(
        spec=spec,
        train=dataset("train"),
        # kiln.data.loaders.BucketedSampler: batches of one group, 1 where wider than tall
        bucket_lengths=[int(w > h) for h, w in train_sizes] if cfg.group_by_aspect_ratio else None,
        val=dataset("val"),
        test=dataset("test") if "test" in parts else None,
        recipe=recipe,
        collate_fn=collate_image_list,
        report=report,
        sources={name: list(p["paths"]) for name, p in parts.items()},
    )
