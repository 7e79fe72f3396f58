"""A detection dataset of your own format: one CSV line per box, `file,x1,y1,x2,y2,class` (an
image without boxes: `file,,,,,`). kiln's shared detection machinery does the rest: each image
checked once, boxes clipped or dropped and reported in data_report.json, the split, the items
its detectors (and yours) train on.

cd examples/detection_plugin
python ../../train.py 'plugins=[box_csv,tiny_detector]' data=box_csv model=tiny_detector
"""

import csv
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kiln.config.data import DetectionFilesConfig
from kiln.data.bad_inputs import BadInputLog
from kiln.data.detection_files import (
    ANNOTATION_REASONS,
    IMAGE_REASONS,
    Annotation,
    BadInput,
    ImageEntry,
    check_entries,
    detection_bundle,
)
from kiln.registry import register_config_dir, register_dataset

register_config_dir(Path(__file__).parent / "conf")  # where data=box_csv's YAML is


@dataclass(frozen=True, kw_only=True)
class BoxCsvConfig(DetectionFilesConfig):
    """Boxes listed in a CSV file, images in a folder."""

    PATH_KEYS: ClassVar[tuple[str, ...]] = ("csv", "images", "cache_dir")

    csv: str = "boxes.csv"  # file,x1,y1,x2,y2,class per box
    images: str = "../detection/coco/images/train"  # the folder its files are in


def example(folder: Path) -> list[str]:
    """A small example of this dataset's input, for kiln's registry-wide tests (run from any
    folder): the overrides that read it. The files this folder ships with are the example."""
    here = Path(__file__).parent
    return [f"data.csv={here / 'boxes.csv'}", f"data.images={here / BoxCsvConfig.images}"]


@register_dataset("box_csv", config=BoxCsvConfig, provides="image_list", example=example)
def build_box_csv(cfg):
    started = time.perf_counter()
    with open(cfg.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    names = sorted({row["class"] for row in rows if row["class"]})
    label_of = {name: label for label, name in enumerate(names, start=1)}  # 0: background
    entries: dict[str, ImageEntry] = {}
    for line, row in enumerate(rows, start=2):
        entry = entries.setdefault(row["file"], ImageEntry(Path(cfg.images) / row["file"]))
        if row["class"]:
            box = tuple(float(row[k]) for k in ("x1", "y1", "x2", "y2"))
            entry.annotations.append(Annotation(box, label_of[row["class"]], {"line": line}))
    images_log = BadInputLog(cfg.csv, unit="images", reasons=IMAGE_REASONS)
    boxes_log = BadInputLog(cfg.csv, unit="annotations", reasons=ANNOTATION_REASONS)
    bad = BadInput(str(cfg.bad_rows), images_log, boxes_log)
    bad.annotations_log.read = sum(len(e.annotations) for e in entries.values())
    split = check_entries(list(entries.values()), bad, num_classes=len(names),
                          images_root=Path(cfg.images), cfg=cfg)  # fmt: skip
    return detection_bundle(cfg, names, {"train": split}, val_key="csv", started=started,
                            extra_report={"format": "box_csv"})  # fmt: skip
