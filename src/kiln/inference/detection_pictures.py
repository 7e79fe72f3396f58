"""The detection report's pictures (eval/):

boxes.png         a grid of evaluated images, the true boxes (green, dashed) under what the
                  model found (red: class and score, boxes at DETECTION_SCORE_THRESHOLD or
                  above), so a glance shows what it finds and what it misses
ap_per_class.png  AP (COCO's mAP@[.5:.95]) and AP@.5 per class, a bar each; a class with no
                  true box has no bar (its AP is undefined)"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kiln.atomic import atomic_file

BOXES_FILE, AP_FILE = "boxes.png", "ap_per_class.png"
MAX_GRID_IMAGES = 16
TILE_INCHES = 3.0
DPI = 100


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> None:
    with atomic_file(path) as f:  # a viewer never sees half a file
        figure.savefig(f, format="png", dpi=DPI)
    _pyplot().close(figure)


def write_boxes_grid(
    images: Sequence[np.ndarray],
    detections: Sequence[dict],
    targets: Sequence[dict],
    sources: Sequence[str],
    class_names: Sequence[str],
    path: Path,
    score_threshold: float,
) -> None:
    """`images`: (3, H, W) in [0, 1], the first of the evaluated ones (at most
    MAX_GRID_IMAGES drawn), with their detections and targets in the same order."""
    from matplotlib.patches import Rectangle

    plt = _pyplot()
    count = min(len(images), MAX_GRID_IMAGES)
    columns = min(4, count)
    rows = math.ceil(count / columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(TILE_INCHES * columns, TILE_INCHES * rows), squeeze=False
    )
    for ax in axes.flat:
        ax.axis("off")
    for i in range(count):
        ax = axes.flat[i]
        ax.imshow(np.clip(np.transpose(np.asarray(images[i]), (1, 2, 0)), 0, 1))
        ax.set_title(Path(str(sources[i])).name, fontsize=8)
        for x1, y1, x2, y2 in np.asarray(targets[i]["boxes"]).reshape(-1, 4):
            ax.add_patch(
                Rectangle(
                    (x1, y1),
                    x2 - x1,
                    y2 - y1,
                    fill=False,
                    edgecolor="lime",
                    linewidth=1.5,
                    linestyle="--",
                )
            )
        found = detections[i]
        scores = np.asarray(found["scores"]).reshape(-1)
        boxes = np.asarray(found["boxes"]).reshape(-1, 4)
        labels = np.asarray(found["labels"]).reshape(-1)
        for (x1, y1, x2, y2), label, score in zip(boxes, labels, scores, strict=True):
            if score < score_threshold:
                continue
            ax.add_patch(
                Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, edgecolor="red", linewidth=1.5)
            )
            ax.text(
                x1,
                y1,
                f"{class_names[int(label) - 1]} {score:.2f}",
                fontsize=7,
                color="white",
                va="bottom",
                bbox={"facecolor": "red", "alpha": 0.7, "pad": 1, "linewidth": 0},
            )
    figure.suptitle(
        f"true boxes (green, dashed) and detections at score >= {score_threshold} (red)", fontsize=9
    )
    figure.tight_layout()
    _save(figure, path)


def write_ap_bars(per_class: dict[str, dict], path: Path, title: str) -> None:
    plt = _pyplot()
    names = list(per_class)
    ap = [per_class[n]["ap"] for n in names]
    ap50 = [per_class[n]["ap50"] for n in names]
    x = np.arange(len(names))
    figure, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(names) + 2), 4))
    ax.bar(x - 0.2, [np.nan if v is None else v for v in ap], 0.4, label="AP@[.5:.95]")
    ax.bar(x + 0.2, [np.nan if v is None else v for v in ap50], 0.4, label="AP@.5")
    ax.set_xticks(
        x, names, rotation=45 if len(names) > 6 else 0, ha="right" if len(names) > 6 else "center"
    )
    ax.set_ylim(0, 1)
    ax.set_ylabel("average precision")
    ax.set_title(title, fontsize=10)
    ax.legend()
    figure.tight_layout()
    _save(figure, path)


def draw_detections_csv(
    csv_path: Path, files: Sequence, out_dir: Path, *, max_pixels: int | None
) -> int:
    """`infer.py draw=true`: each predicted image file (`files`: the NamedFiles the CSV's
    `index` column counts) written to `out_dir` as <index>_<name>.png with the CSV's boxes
    scoring DETECTION_SCORE_THRESHOLD or more (class and score) drawn on it, as boxes.png
    draws them. Returns the number of pictures written."""
    import csv

    from PIL import Image, ImageDraw

    from kiln.inference.detection_report import DETECTION_SCORE_THRESHOLD
    from kiln.preprocessing.image_files import read_image_file

    boxes: dict[int, list] = {}
    with open(csv_path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            index = int(row["index"])
            if row["error"]:
                continue
            listed = boxes.setdefault(index, [])
            if row["x1"] and float(row["score"]) >= DETECTION_SCORE_THRESHOLD:
                corners = [float(row[k]) for k in ("x1", "y1", "x2", "y2")]
                listed.append((corners, row["label"], float(row["score"])))
    out_dir.mkdir(parents=True, exist_ok=True)
    for index, found in boxes.items():
        pixels = read_image_file(files[index].path, 3, max_pixels)
        picture = Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy())
        draw = ImageDraw.Draw(picture)
        for corners, label, score in found:
            draw.rectangle(corners, outline=(255, 0, 0), width=2)
            draw.text((corners[0] + 2, corners[1] + 1), f"{label} {score:.2f}", fill=(255, 0, 0))
        with atomic_file(out_dir / f"{index}_{Path(files[index].path).stem}.png") as f:
            picture.save(f, format="PNG")
    return len(boxes)
