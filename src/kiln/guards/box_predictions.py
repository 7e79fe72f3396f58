"""Box predictions, read once after the first evaluation of a detection run: a detector whose
boxes are degenerate (no area, outside the image, the same box on every image), or fit their
targets far better flipped or read in another box format, learned the data's convention wrong
(boxes flipped by a dataset's transform without their image, boxes decoded as (cx, cy, w, h)
against (x1, y1, x2, y2) targets): half the control's mAP, and no word. Said as a finding (and
in the log), not fatal: one evaluation in, a detector is still learning."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.findings import Finding

BETTER = 2.0  # a reading of the boxes that fits this many times better than as they are ...
AT_LEAST = 0.3  # ... and at least this well (mean best IoU per target) is named
TOP = 3  # predictions per target compared (the highest scores)


def _flip_x(b: torch.Tensor, width: float) -> torch.Tensor:
    return torch.stack([width - b[:, 2], b[:, 1], width - b[:, 0], b[:, 3]], dim=1)


def _flip_y(b: torch.Tensor, height: float) -> torch.Tensor:
    return torch.stack([b[:, 0], height - b[:, 3], b[:, 2], height - b[:, 1]], dim=1)


def _as_cxcywh(b: torch.Tensor) -> torch.Tensor:
    """What a decoder that read (x1, y1, x2, y2) outputs as (cx, cy, w, h) would give back."""
    from torchvision.ops import box_convert

    return box_convert(b, "xyxy", "cxcywh").clamp_min(0)


def _as_xywh(b: torch.Tensor) -> torch.Tensor:
    from torchvision.ops import box_convert

    return box_convert(b, "xyxy", "xywh").clamp_min(0)


READINGS: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "as they are": lambda b, w, h: b,
    "flipped horizontally": lambda b, w, h: _flip_x(b, w),
    "flipped vertically": lambda b, w, h: _flip_y(b, h),
    "read back as (cx, cy, w, h)": lambda b, w, h: _as_cxcywh(b),
    "read back as (x, y, w, h)": lambda b, w, h: _as_xywh(b),
}


def box_findings(images: list, targets: list, outputs: list, step: int) -> list[Finding]:
    """What the predictions on one validation batch show (empty: nothing)."""
    from torchvision.ops import box_iou

    fits = dict.fromkeys(READINGS, 0.0)
    count, boxes, areas, outside = 0, [], [], 0
    for image, target, output in zip(images, targets, outputs, strict=False):
        height, width = (float(s) for s in image.shape[-2:])
        predicted = output["boxes"].detach().float().cpu()
        scores = output.get("scores")
        if scores is not None and len(scores):
            predicted = predicted[scores.detach().cpu().argsort(descending=True)]
        wanted = target["boxes"].detach().float().cpu()
        if len(predicted):
            boxes.append(predicted[0])
            sides = (predicted[:, 2:] - predicted[:, :2]).clamp_min(0)
            areas.append(sides.prod(dim=1))
            outside += int(
                (
                    (predicted[:, 0] < -1)
                    | (predicted[:, 1] < -1)
                    | (predicted[:, 2] > width + 1)
                    | (predicted[:, 3] > height + 1)
                ).sum()
            )
        if not len(wanted) or not len(predicted):
            continue
        top = predicted[: TOP * len(wanted)]
        for name, read in READINGS.items():
            fits[name] += float(box_iou(wanted, read(top, width, height)).max(dim=1).values.sum())
        count += len(wanted)
    found = []
    said = _degenerate(boxes, areas, outside)
    if said:
        found.append(said)
    if count:
        mean = {name: total / count for name, total in fits.items()}
        best = max(mean, key=mean.get)
        plain = mean["as they are"]
        if best != "as they are" and mean[best] >= AT_LEAST and mean[best] >= BETTER * plain:
            found.append(
                f"the boxes fit their targets better {best} (mean best IoU {mean[best]:.2f} "
                f"against {plain:.2f} as they are, over {count} target boxes): the dataset's "
                "transforms may move images without their boxes, or a decoder read another "
                "box format than the targets'"
            )
    return [
        Finding(
            "box predictions",
            f"after the first evaluation (step {step}): {said}",
            fatal=False,
            step=step,
        )
        for said in found
    ]


def _degenerate(boxes: list, areas: list, outside: int) -> str:
    if not areas:
        return ""
    area = torch.cat(areas)
    total = len(area)
    flat = int((area <= 0).sum())
    if flat > total / 2:
        return f"{flat} of {total} predicted boxes have no area (x2 <= x1 or y2 <= y1)"
    if outside > total / 2:
        return f"{outside} of {total} predicted boxes lie outside their image"
    if len(boxes) > 1 and all(torch.equal(boxes[0], b) for b in boxes[1:]):
        return f"every image's top box is the same, {boxes[0].round().tolist()}"
    return ""


def check_box_predictions(model, batch: Any, forward, step: int) -> list[Finding]:
    """One eval forward of a validation batch (images, targets), read for the findings above."""
    images, targets = batch[0], batch[1]
    with torch.no_grad():
        outputs = forward(model, batch, False)
    if not isinstance(outputs, list | tuple):
        return []
    return box_findings(images, targets, list(outputs), step)
