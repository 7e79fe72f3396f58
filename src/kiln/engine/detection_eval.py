"""Detection quality: mean average precision at one IoU threshold (mAP@0.5 by default), by
torchmetrics' COCO evaluation (pycocotools): precision is interpolated at 101 recall points and
averaged over the classes that have ground truth."""

from __future__ import annotations

import torch
from torch import Tensor


def _to_cpu(items: list[dict[str, Tensor]], keys: tuple[str, ...]) -> list[dict[str, Tensor]]:
    return [{key: item[key].detach().cpu() for key in keys} for item in items]


def coco_targets(targets: list[dict]) -> list[dict[str, Tensor]]:
    """Targets as torchmetrics' COCO evaluation takes them: the true boxes, then the image's
    crowd regions (data=coco's `iscrowd: 1`, "crowd_boxes"/"crowd_labels" where the item has
    them) flagged by `iscrowd`, so a detection on a crowd region is ignored, as is the region."""
    out = []
    for target in targets:
        boxes = torch.as_tensor(target["boxes"], dtype=torch.float32).detach().cpu()
        labels = torch.as_tensor(target["labels"], dtype=torch.int64).detach().cpu()
        crowd_boxes = torch.as_tensor(target.get("crowd_boxes", boxes[:0]), dtype=torch.float32)
        crowd_labels = torch.as_tensor(target.get("crowd_labels", labels[:0]), dtype=torch.int64)
        iscrowd = torch.cat(
            [
                torch.zeros(len(labels), dtype=torch.int64),
                torch.ones(len(crowd_labels), dtype=torch.int64),
            ]
        )
        out.append(
            {
                "boxes": torch.cat([boxes, crowd_boxes.cpu().reshape(-1, 4)]),
                "labels": torch.cat([labels, crowd_labels.cpu()]),
                "iscrowd": iscrowd,
            }
        )
    return out


def mean_average_precision(
    predictions: list[dict[str, Tensor]],
    targets: list[dict[str, Tensor]],
    iou_threshold: float = 0.5,
) -> float:
    """mAP at `iou_threshold` over a dataset.

    predictions: one dict per image with "boxes" (K, 4) as (x1, y1, x2, y2), "scores" (K,),
    "labels" (K,); targets: one dict per image with "boxes" (M, 4) and "labels" (M,).
    Returns a float in [0, 1]; 0.0 when no image has a ground-truth box (nothing to find)."""
    if len(predictions) != len(targets):
        raise ValueError(
            f"mean_average_precision needs one prediction per target image, got "
            f"{len(predictions)} predictions and {len(targets)} targets"
        )
    if not any(len(t["labels"]) for t in targets):
        return 0.0
    # Imported here: torchmetrics takes seconds to import and only detection runs need it.
    from torchmetrics.detection import MeanAveragePrecision

    metric = MeanAveragePrecision(iou_type="bbox", iou_thresholds=[iou_threshold])
    metric.update(_to_cpu(predictions, ("boxes", "scores", "labels")), coco_targets(targets))
    value = metric.compute()["map"]
    # COCO reports -1 for "undefined"; with ground truth present that cannot happen, but a
    # negative mAP must never reach a metric log.
    return max(float(torch.as_tensor(value)), 0.0)


# What the training log reports beside val_map50, from COCO's evaluation at its ten IoU
# thresholds (0.5:0.95): the log's key -> torchmetrics' key. Per size: small < 32^2 pixels of
# area < medium < 96^2 < large, as COCO defines them.
COCO_LOG_KEYS = {
    "val_map": "map",
    "val_map_75": "map_75",
    "val_map_small": "map_small",
    "val_map_medium": "map_medium",
    "val_map_large": "map_large",
    "val_mar_100": "mar_100",
}


def coco_metrics(
    predictions: list[dict[str, Tensor]], targets: list[dict[str, Tensor]]
) -> dict[str, float]:
    """COCO's mAP@[.5:.95], mAP@.75, per object size and the recall at 100 detections, keyed
    as COCO_LOG_KEYS; a value COCO leaves undefined (-1: no true box of that size) is left
    out, never logged as a number; val_map is always there (0.0 with no true box at all, as
    val_map50: it is what picks best.pt)."""
    if not any(len(t["labels"]) for t in targets):
        return {"val_map": 0.0}
    from torchmetrics.detection import MeanAveragePrecision

    metric = MeanAveragePrecision(iou_type="bbox")
    metric.update(_to_cpu(predictions, ("boxes", "scores", "labels")), coco_targets(targets))
    result = metric.compute()
    values = {log: float(torch.as_tensor(result[key])) for log, key in COCO_LOG_KEYS.items()}
    return {"val_map": 0.0} | {log: value for log, value in values.items() if value >= 0}
