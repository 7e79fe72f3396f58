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


def match_boxes(found: dict, truth: dict, min_score: float = 0.0):
    """(the predictions kept -- score >= min_score -- highest score first, the true box each
    matched (-1: none), its IoU with it (unmatched: the best IoU with a true box of its class),
    which true boxes were found): greedy, COCO's way, each to the unmatched true box of its
    class with the largest IoU >= DETECTION_MATCH_IOU."""
    from torchvision.ops import box_iou

    scores = np.asarray(found["scores"]).reshape(-1)
    order = np.argsort(-scores, kind="stable")
    keep = order[scores[order] >= min_score]
    labels = np.asarray(found["labels"]).reshape(-1)[keep]
    boxes = np.asarray(found["boxes"]).reshape(-1, 4)[keep]
    true_labels = np.asarray(truth["labels"]).reshape(-1)
    ious = box_iou(_as_boxes(boxes), _as_boxes(truth["boxes"])).numpy()
    found_true = np.zeros(len(true_labels), dtype=bool)
    truth_of = np.full(len(labels), -1, dtype=np.int64)
    iou_of = np.zeros(len(labels), dtype=np.float64)
    for i, label in enumerate(labels):
        same = true_labels == label
        fits = same & ~found_true & (ious[i] >= DETECTION_MATCH_IOU)
        if fits.any():
            truth_of[i] = int(np.argmax(np.where(fits, ious[i], -1.0)))
            found_true[truth_of[i]] = True
        iou_of[i] = ious[i, truth_of[i]] if truth_of[i] >= 0 else ious[i][same].max(initial=0.0)
    return keep, truth_of, iou_of, found_true


def match_image(found: dict, truth: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(predicted labels kept, which of them matched, which true boxes were found): boxes at
    score >= DETECTION_SCORE_THRESHOLD, matched by match_boxes. A box left unmatched on a crowd
    region of its class is not kept (COCO ignores it)."""
    keep, truth_of, _, found_true = match_boxes(found, truth, DETECTION_SCORE_THRESHOLD)
    labels = np.asarray(found["labels"]).reshape(-1)[keep]
    boxes = np.asarray(found["boxes"]).reshape(-1, 4)[keep]
    matched = truth_of >= 0
    counted = matched | ~on_crowd(boxes, labels, truth)
    return labels[counted], matched[counted], found_true


BOX_COLUMNS = [
    "image",
    "x1",
    "y1",
    "x2",
    "y2",
    "score",
    "label",
    "status",
    "truth",
    "truth_x1",
    "truth_y1",
    "truth_x2",
    "truth_y2",
    "iou",
]


def box_predictions(detections, targets, sources, class_names):
    """The per-box file of the report (BOX_COLUMNS): every box the model returned, highest
    score first within its image, with the true box it matched (match_boxes, every score) and
    their IoU -- status matched, false_positive, or crowd (unmatched on a crowd region of its
    class) -- then each true box nothing matched (status missed, its own box and label)."""
    import pandas as pd

    names = list(class_names)
    rows = []
    for index, (found, truth) in enumerate(zip(detections, targets, strict=True)):
        keep, truth_of, iou_of, found_true = match_boxes(found, truth)
        boxes = np.asarray(found["boxes"]).reshape(-1, 4)[keep]
        labels = np.asarray(found["labels"]).reshape(-1)[keep]
        scores = np.asarray(found["scores"]).reshape(-1)[keep]
        crowd = on_crowd(boxes, labels, truth)
        true_boxes = np.asarray(truth["boxes"]).reshape(-1, 4)
        for k in range(len(keep)):
            status = "matched" if truth_of[k] >= 0 else "crowd" if crowd[k] else "false_positive"
            matched = true_boxes[truth_of[k]].tolist() if truth_of[k] >= 0 else [None] * 4
            rows.append(
                [
                    sources[index],
                    *boxes[k].tolist(),
                    float(scores[k]),
                    names[int(labels[k]) - 1],
                    status,
                    int(truth_of[k]) if truth_of[k] >= 0 else None,
                    *matched,
                    round(float(iou_of[k]), 4),
                ]
            )
        true_labels = np.asarray(truth["labels"]).reshape(-1)
        for t in np.nonzero(~found_true)[0]:
            rows.append(
                [
                    sources[index],
                    *true_boxes[t].tolist(),
                    None,
                    names[int(true_labels[t]) - 1],
                    "missed",
                    int(t),
                    *true_boxes[t].tolist(),
                    None,
                ]
            )
    return pd.DataFrame(rows, columns=BOX_COLUMNS)


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
