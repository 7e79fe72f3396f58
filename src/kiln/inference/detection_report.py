"""A detector's numbers for the evaluation report: torchmetrics' MeanAveragePrecision (COCO's
evaluation through pycocotools: 101-point interpolated precision, averaged over the classes that
have true boxes) -- the computation behind the training log's val_map50, so the report and the
log agree -- at COCO's ten IoU thresholds and at 0.5 alone, overall and per class; and, per
image, what it missed and what it invented (errors.csv).

Detections and targets are one dict per image: "boxes" (k, 4) as (x1, y1, x2, y2) pixels,
"labels" (k,) in 1..K (0 is the background), and "scores" (k,) for detections."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

DETECTION_SCORE_THRESHOLD = 0.5  # errors.csv: a box at this score or above counts as predicted
DETECTION_MATCH_IOU = 0.5  # ... and is right on a true box of its class at this IoU or above
ERROR_COLUMNS = [
    "source",
    "true_boxes",
    "predicted_boxes",
    "matched",
    "missed",
    "false_positives",
    "missed_classes",
    "false_classes",
]


def _undefined_as_none(value) -> float | None:
    """COCO reports -1 for "undefined" (no true box of that class anywhere)."""
    value = float(value)
    return value if value >= 0 else None


def _mean_average_precision(detections, targets, iou_thresholds) -> dict[str, Any]:
    import torch
    from torchmetrics.detection import MeanAveragePrecision

    from kiln.engine.detection_eval import coco_targets

    metric = MeanAveragePrecision(
        iou_type="bbox", iou_thresholds=iou_thresholds, class_metrics=True
    )
    metric.update(
        [{k: torch.as_tensor(d[k]) for k in ("boxes", "scores", "labels")} for d in detections],
        coco_targets(targets),  # crowd regions (data=coco's iscrowd) flagged, as COCO does
    )
    result = metric.compute()
    values = torch.atleast_1d(result["map_per_class"]).tolist()
    classes = torch.atleast_1d(result["classes"]).tolist()
    result["by_class"] = {
        int(c): _undefined_as_none(v) for c, v in zip(classes, values, strict=True)
    }
    return result


def _box_counts(items: list[dict], num_classes: int) -> np.ndarray:
    labels = [np.asarray(item["labels"], dtype=np.int64).reshape(-1) for item in items]
    return np.bincount(np.concatenate(labels or [np.zeros(0, np.int64)]), minlength=num_classes + 1)


def detection_metrics(
    detections: list[dict], targets: list[dict], class_names: Sequence[str]
) -> dict[str, Any]:
    """mAP@[.5:.95], mAP@.5, mAP@.75 and per class AP and AP@.5 (null for a class with no true
    box), with the true and predicted boxes per class."""
    coco = _mean_average_precision(detections, targets, None)  # COCO's ten IoU thresholds
    at50 = _mean_average_precision(detections, targets, [0.5])
    true_boxes = _box_counts(targets, len(class_names))
    predicted_boxes = _box_counts(detections, len(class_names))
    return {
        "map": _undefined_as_none(coco["map"]),
        "map_50": _undefined_as_none(coco["map_50"]),
        "map_75": _undefined_as_none(coco["map_75"]),
        "count": len(targets),
        "num_classes": len(class_names),
        "per_class": {
            name: {
                "ap": coco["by_class"].get(k),
                "ap50": at50["by_class"].get(k),
                "true_boxes": int(true_boxes[k]),
                "predicted_boxes": int(predicted_boxes[k]),
            }
            for k, name in enumerate(class_names, start=1)
        },
    }


def _as_boxes(boxes) -> Any:
    import torch

    return torch.as_tensor(np.asarray(boxes)).reshape(-1, 4).float()


def on_crowd(boxes, labels, truth: dict) -> np.ndarray:
    """Which boxes lie on a crowd region of their class (data=coco's iscrowd, carried as
    "crowd_boxes"/"crowd_labels"): COCO's rule, the intersection over the detection's own area
    at DETECTION_MATCH_IOU or above. COCO ignores such a detection: neither right nor wrong."""
    crowd_labels = np.asarray(truth.get("crowd_labels", []), dtype=np.int64)
    if len(labels) == 0 or len(crowd_labels) == 0:
        return np.zeros(len(labels), dtype=bool)
    found = _as_boxes(boxes).numpy()[:, None, :]
    crowd = _as_boxes(truth["crowd_boxes"]).numpy()[None, :, :]
    width = np.minimum(found[..., 2], crowd[..., 2]) - np.maximum(found[..., 0], crowd[..., 0])
    height = np.minimum(found[..., 3], crowd[..., 3]) - np.maximum(found[..., 1], crowd[..., 1])
    area = (found[..., 2] - found[..., 0]) * (found[..., 3] - found[..., 1])
    ioa = np.clip(width, 0, None) * np.clip(height, 0, None) / np.maximum(area, 1e-9)
    same_class = np.asarray(labels)[:, None] == crowd_labels[None, :]
    return ((ioa >= DETECTION_MATCH_IOU) & same_class).any(axis=1)


def match_image(found: dict, truth: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(predicted labels kept, which of them matched, which true boxes were found): boxes at
    score >= DETECTION_SCORE_THRESHOLD, matched greedily, highest score first, to the unmatched
    true box of their class with the largest IoU >= DETECTION_MATCH_IOU. A box left unmatched
    on a crowd region of its class is not kept (COCO ignores it)."""
    from torchvision.ops import box_iou

    order = np.argsort(-np.asarray(found["scores"]), kind="stable")
    keep = order[np.asarray(found["scores"])[order] >= DETECTION_SCORE_THRESHOLD]
    labels = np.asarray(found["labels"])[keep]
    boxes = np.asarray(found["boxes"]).reshape(-1, 4)[keep]
    true_labels = np.asarray(truth["labels"])
    ious = box_iou(_as_boxes(boxes), _as_boxes(truth["boxes"])).numpy()
    found_true = np.zeros(len(true_labels), dtype=bool)
    matched = np.zeros(len(labels), dtype=bool)
    for i, label in enumerate(labels):
        fits = (true_labels == label) & ~found_true & (ious[i] >= DETECTION_MATCH_IOU)
        if fits.any():
            found_true[int(np.argmax(np.where(fits, ious[i], -1.0)))] = True
            matched[i] = True
    counted = matched | ~on_crowd(boxes, labels, truth)
    return labels[counted], matched[counted], found_true


def detection_errors(detections, targets, sources, class_names, limit: int):
    """One row per image with a mistake (a missed true box or a false one), most mistakes first,
    ties in the images' order: ERROR_COLUMNS."""
    import pandas as pd

    names = list(class_names)
    rows = []
    for index, (found, truth) in enumerate(zip(detections, targets, strict=True)):
        labels, matched, found_true = match_image(found, truth)
        missed = [names[int(k) - 1] for k in np.asarray(truth["labels"])[~found_true]]
        false = [names[int(k) - 1] for k in labels[~matched]]
        if missed or false:
            rows.append(
                [
                    sources[index],
                    len(found_true),
                    len(labels),
                    int(matched.sum()),
                    len(missed),
                    len(false),
                    " ".join(missed),
                    " ".join(false),
                ]
            )
    frame = pd.DataFrame(rows, columns=ERROR_COLUMNS)
    mistakes = (frame["missed"] + frame["false_positives"]).to_numpy()
    return frame.iloc[np.argsort(-mistakes, kind="stable")][:limit]
