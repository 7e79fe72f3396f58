"""Box conventions of detection targets, checked as data before any model is built. kiln's
detection items carry boxes as (x1, y1, x2, y2) pixels of their image and labels 1..C: every
detector reserves 0 for the background (torchvision's, and kiln's). A dataset that counts its
labels from 0 trained with one class taken for the background and the other renamed (54 of 95
boxes dropped as unknown_category, portraits predicted as "flower"); boxes in another format
(x, y, w, h or cx, cy, w, h) or normalised to [0, 1] train a detector on boxes that are not
the objects. Both halved a run's mAP without a word.

Read from what a dataset lists without decoding its images (`box_targets()`: boxes, labels and
the image's (H, W) per item, as data=coco and data=yolo list them), else item by item, at most
ITEM_LIMIT items per split."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.errors import first_few
from kiln.guards.rules import ProbeFailure

ITEM_LIMIT = 2_000  # items read one by one per split (a dataset without box_targets)
SLACK = 1.0  # pixels a box may pass its image's edge (rounding)


class BoxConventionError(ProbeFailure):
    """Detection targets in another box or label convention than kiln's detectors take."""

    what = "box convention"
    kind = "box convention"


@dataclass
class Targets:
    """One split's boxes (N, 4), labels (N,), each box's item and its image's (H, W)."""

    boxes: np.ndarray
    labels: np.ndarray
    item: np.ndarray
    heights: np.ndarray
    widths: np.ndarray
    items: int  # items read

    @classmethod
    def of(cls, listed: list[tuple[Any, Any, tuple[int, int]]]) -> Targets:
        boxes, labels, item, heights, widths = [], [], [], [], []
        for index, (b, y, (h, w)) in enumerate(listed):
            b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
            boxes.append(b)
            labels.append(np.asarray(y, dtype=np.int64).reshape(-1))
            item += [index] * len(b)
            heights += [h] * len(b)
            widths += [w] * len(b)
        return cls(
            np.concatenate(boxes) if boxes else np.zeros((0, 4)),
            np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64),
            np.asarray(item, dtype=np.int64),
            np.asarray(heights, dtype=np.float64),
            np.asarray(widths, dtype=np.float64),
            len(listed),
        )


def box_targets(dataset, limit: int = ITEM_LIMIT) -> list[tuple[Any, Any, tuple[int, int]]]:
    """(boxes, labels, (H, W)) per item: what the dataset lists, else its first `limit` items
    read."""
    own = getattr(dataset, "box_targets", None)
    listed = own() if callable(own) else None
    if listed is not None:
        return listed
    found = []
    for i in range(min(len(dataset), limit)):
        image, target = dataset[i][:2]
        found.append((target["boxes"], target["labels"], tuple(image.shape[-2:])))
    return found


def check_box_conventions(bundle, where: str, name: Callable[[str, int], str]) -> None:
    """BoxConventionError when a split's targets break kiln's convention: labels outside
    1..num_classes (labels from 0 above all), boxes with x2 <= x1 or y2 <= y1 (another format),
    boxes past their image, or every box inside [0, 1] (normalised coordinates). `name(split,
    index)` names an item for the message."""
    spec = bundle.spec
    for split, dataset in (("train", bundle.train), ("val", bundle.val)):
        targets = Targets.of(box_targets(dataset))
        if not len(targets.labels):
            continue
        problem = _labels(targets, spec.num_classes, spec.class_names) or _boxes(targets)
        if problem is not None:
            said, fix = problem
            shown = first_few(
                [name(split, i) for i in dict.fromkeys(targets.item[said[1]].tolist())], 3
            )
            raise BoxConventionError(
                f"box convention (targets: (x1, y1, x2, y2) pixels, labels 1..C): the {split} "
                f"split ({where}): {said[0]} (e.g. {shown}). {fix[0].upper()}{fix[1:]}",
                fix=fix,
            )


def _labels(t: Targets, classes: int, names) -> tuple[tuple[str, np.ndarray], str] | None:
    zero = t.labels == 0
    over = (t.labels > classes) | (t.labels < 0)
    if zero.any():
        top = int(t.labels.max())
        said = (
            f"{int(zero.sum())} of {len(t.labels)} boxes are labelled 0 (labels "
            f"{int(t.labels.min())}..{top}), and kiln's detectors reserve 0 for the background: "
            f"they would be trained as background, and label 1 read as {names[0]!r} "
            "(class_names[0])"
        )
        fix = (
            "count labels from 1: label k means class_names[k - 1] (add 1 to every label "
            "a 0-based dataset gives)"
        )
        return (said, zero), fix
    if over.any():
        said = (
            f"{int(over.sum())} of {len(t.labels)} boxes have labels outside 1..{classes} "
            f"(up to {int(t.labels.max())}; the data names {classes} classes)"
        )
        return (said, over), "give labels 1..num_classes, one per class name"
    return None


def _boxes(t: Targets) -> tuple[tuple[str, np.ndarray], str] | None:
    b = t.boxes
    bad = ~np.isfinite(b).all(axis=1)
    if bad.any():
        return (f"{int(bad.sum())} boxes hold NaN or Inf", bad), "fix those boxes"
    inverted = (b[:, 2] <= b[:, 0]) | (b[:, 3] <= b[:, 1])
    if inverted.any():
        first = b[np.argmax(inverted)].round(2).tolist()
        said = (
            f"{int(inverted.sum())} of {len(b)} boxes have x2 <= x1 or y2 <= y1 (e.g. {first})"
            f"{_reads_as(b, t)}"
        )
        fix = (
            "give boxes as (x1, y1, x2, y2) pixels: torchvision.ops.box_convert(boxes, "
            "'xywh' (or 'cxcywh'), 'xyxy')"
        )
        return (said, inverted), fix
    big = (t.heights > 16) & (t.widths > 16)
    if big.all() and (b <= 1.0 + 1e-6).all() and (b >= 0).all() and len(b) >= 2:
        said = (
            f"every one of the {len(b)} boxes lies inside [0, 1] on images of "
            f"{int(t.widths.min())} pixels or more: normalised coordinates"
        )
        fix = "give boxes in pixels: multiply x by the image's width and y by its height"
        return (said, np.ones(len(b), dtype=bool)), fix
    outside = (
        (b[:, 0] < -SLACK)
        | (b[:, 1] < -SLACK)
        | (b[:, 2] > t.widths + SLACK)
        | (b[:, 3] > t.heights + SLACK)
    )
    if outside.any():
        i = int(np.argmax(outside))
        said = (
            f"{int(outside.sum())} of {len(b)} boxes reach outside their image (e.g. "
            f"{b[i].round(1).tolist()} on an image of {int(t.widths[i])}x{int(t.heights[i])})"
            f"{_reads_as(b, t)}"
        )
        fix = "give boxes as (x1, y1, x2, y2) pixels inside their image (clip them)"
        return (said, outside), fix
    return None


def _reads_as(b: np.ndarray, t: Targets) -> str:
    """Which other format every box reads as a valid box inside its image, if one does."""
    for fmt, converted in (("(x, y, w, h)", _from_xywh(b)), ("(cx, cy, w, h)", _from_cxcywh(b))):
        inside = (
            (converted[:, 2] > converted[:, 0])
            & (converted[:, 3] > converted[:, 1])
            & (converted[:, 0] >= -SLACK)
            & (converted[:, 1] >= -SLACK)
            & (converted[:, 2] <= t.widths + SLACK)
            & (converted[:, 3] <= t.heights + SLACK)
        )
        if inside.all():
            return f"; every box reads as a box inside its image as {fmt}"
    return ""


def _from_xywh(b: np.ndarray) -> np.ndarray:
    return np.stack([b[:, 0], b[:, 1], b[:, 0] + b[:, 2], b[:, 1] + b[:, 3]], axis=1)


def _from_cxcywh(b: np.ndarray) -> np.ndarray:
    half_w, half_h = b[:, 2] / 2, b[:, 3] / 2
    return np.stack([b[:, 0] - half_w, b[:, 1] - half_h, b[:, 0] + half_w, b[:, 1] + half_h], 1)
