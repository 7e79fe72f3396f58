"""A small object-detection folder made from real photos that ship inside installed packages (no
download): objects cut from one photo (matplotlib's grace_hopper.jpg: a "portrait"; the flower
of scikit-learn's flower.jpg: a "flower") pasted at known boxes onto pieces of another
(scikit-learn's china.jpg). The same images are written as COCO (`instances` JSON + images/) and
as a YOLO tree (images/ + labels/ + data.yaml), so the two readers can be held to each other.

    python -m kiln.data.photo_boxes <folder>         # writes <folder>/coco and <folder>/yolo

`make_photo_boxes(folder, damaged=True)` adds, to the training JSON only, what a labelling
export gets wrong: an annotation whose image file is missing, a box outside its image, a box of
zero area, an unknown category id and a repeated image id (and an image without boxes, which
is no error: a negative). `PhotoBoxes` lists what the report must then say."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CATEGORIES = ({"id": 3, "name": "portrait"}, {"id": 7, "name": "flower"})  # ids not 1..C: mapped
UNKNOWN_CATEGORY_ID = 99


def _sample_photos():
    """(background, {category id: object crop}) as PIL images."""
    import matplotlib.cbook
    import sklearn.datasets
    from PIL import Image

    images_dir = Path(sklearn.datasets.__file__).parent / "images"
    china = Image.open(images_dir / "china.jpg").convert("RGB")  # 640x427
    flower = Image.open(images_dir / "flower.jpg").convert("RGB")  # 640x427
    hopper_path = matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
    hopper = Image.open(hopper_path).convert("RGB")  # 512x600
    objects = {3: hopper.crop((120, 60, 400, 380)), 7: flower.crop((150, 40, 470, 380))}
    return china, objects


def _overlaps(box, boxes) -> bool:
    x, y, w, h = box
    return any(
        x < bx + bw and bx < x + w and y < by + bh and by < y + h for bx, by, bw, bh in boxes
    )


@dataclass
class Sample:
    file_name: str
    width: int
    height: int
    boxes: list[tuple[int, int, int, int]] = field(default_factory=list)  # COCO [x, y, w, h]
    categories: list[int] = field(default_factory=list)


def _draw(rng: np.random.Generator, index: int, background, objects, *, negative: bool):
    """One image (a piece of the background photo with 0..2 objects pasted) and its boxes."""
    from PIL import Image

    width, height = (int(s) for s in rng.integers(96, 129, size=2))
    left = int(rng.integers(0, background.width - 2 * width))
    top = int(rng.integers(0, background.height - 2 * height))
    piece = background.crop((left, top, left + 2 * width, top + 2 * height))
    image = piece.resize((width, height), Image.Resampling.BILINEAR)
    sample = Sample(f"img_{index:03d}.jpg", width, height)
    for _ in range(0 if negative else int(rng.integers(1, 3))):
        category = int(rng.choice([c["id"] for c in CATEGORIES]))
        side = int(rng.integers(28, 49))
        for _try in range(20):
            box = (
                int(rng.integers(0, width - side)),
                int(rng.integers(0, height - side)),
                side,
                side,
            )
            if not _overlaps(box, sample.boxes):
                break
        else:
            continue
        image.paste(objects[category].resize((side, side), Image.Resampling.BILINEAR), box[:2])
        sample.boxes.append(box)
        sample.categories.append(category)
    return image, sample


@dataclass(frozen=True)
class PhotoBoxes:
    """Where the folder is and what its training JSON holds."""

    root: Path
    train_json: Path
    train_images: Path
    val_json: Path
    val_images: Path
    yolo_train: Path  # yolo/images/train
    yolo_val: Path
    train_samples: tuple[Sample, ...]  # the good images of the training split, in id order
    val_samples: tuple[Sample, ...]
    # damaged=True: reason -> number of training annotations (or images) dropped for it
    dropped: dict[str, int] = field(default_factory=dict)
    clipped: int = 0  # boxes partly outside their image: clipped and kept


def _coco(samples: list[Sample], first_id: int = 1) -> dict:
    images, annotations = [], []
    for image_id, sample in enumerate(samples, start=first_id):
        images.append(
            {
                "id": image_id,
                "file_name": sample.file_name,
                "width": sample.width,
                "height": sample.height,
            }
        )
        for box, category in zip(sample.boxes, sample.categories, strict=True):
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": category,
                    "bbox": list(box),
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                }
            )
    return {"images": images, "annotations": annotations, "categories": list(CATEGORIES)}


def _yolo_lines(sample: Sample) -> str:
    index = {c["id"]: i for i, c in enumerate(CATEGORIES)}
    lines = []
    for (x, y, w, h), category in zip(sample.boxes, sample.categories, strict=True):
        cx, cy = (x + w / 2) / sample.width, (y + h / 2) / sample.height
        lines.append(
            f"{index[category]} {cx:.10g} {cy:.10g} {w / sample.width:.10g} "
            f"{h / sample.height:.10g}"
        )
    return "".join(line + "\n" for line in lines)


def make_photo_boxes(
    folder: str | Path,
    *,
    num_train: int = 16,
    num_val: int = 6,
    seed: int = 0,
    damaged: bool = False,
) -> PhotoBoxes:
    """Write <folder>/coco/{train,val}.json + images/{train,val}/ and <folder>/yolo/ (the same
    images and boxes); the last training image has no box (a negative)."""
    root = Path(folder)
    background, objects = _sample_photos()
    rng = np.random.default_rng(seed)
    splits: dict[str, list[Sample]] = {}
    for split, count in (("train", num_train), ("val", num_val)):
        coco_images = root / "coco" / "images" / split
        yolo_images, yolo_labels = (
            root / "yolo" / "images" / split,
            root / "yolo" / "labels" / split,
        )
        for made in (coco_images, yolo_images, yolo_labels):
            made.mkdir(parents=True, exist_ok=True)
        samples = []
        for i in range(count):
            image, sample = _draw(rng, i, background, objects, negative=i == count - 1)
            image.save(coco_images / sample.file_name, quality=90)
            (yolo_images / sample.file_name).write_bytes(
                (coco_images / sample.file_name).read_bytes()
            )
            (yolo_labels / f"{Path(sample.file_name).stem}.txt").write_text(_yolo_lines(sample))
            samples.append(sample)
        splits[split] = samples
    names = "".join(f"  {i}: {c['name']}\n" for i, c in enumerate(CATEGORIES))
    (root / "yolo" / "data.yaml").write_text(
        f"path: .\ntrain: images/train\nval: images/val\nnames:\n{names}"
    )
    train = _coco(splits["train"])
    dropped: dict[str, int] = {}
    clipped = 0
    if damaged:
        train, dropped, clipped = _damage(train)
    for split, data in (("train", train), ("val", _coco(splits["val"]))):
        (root / "coco" / f"{split}.json").write_text(json.dumps(data, indent=1))
    return PhotoBoxes(
        root=root,
        train_json=root / "coco" / "train.json",
        train_images=root / "coco" / "images" / "train",
        val_json=root / "coco" / "val.json",
        val_images=root / "coco" / "images" / "val",
        yolo_train=root / "yolo" / "images" / "train",
        yolo_val=root / "yolo" / "images" / "val",
        train_samples=tuple(splits["train"]),
        val_samples=tuple(splits["val"]),
        dropped=dropped,
        clipped=clipped,
    )


def _damage(data: dict) -> tuple[dict, dict[str, int], int]:
    """What labelling exports get wrong, added to a good COCO dict (images 1..n kept good)."""
    first = data["images"][0]
    next_ann = len(data["annotations"]) + 1
    missing_id = max(im["id"] for im in data["images"]) + 1
    data["images"].append({"id": missing_id, "file_name": "gone.jpg", "width": 100, "height": 100})
    data["images"].append(dict(first, file_name="duplicate.jpg"))  # a second image with id 1
    w, h = first["width"], first["height"]

    def ann(offset, image_id, category, bbox):
        return {
            "id": next_ann + offset,
            "image_id": image_id,
            "category_id": category,
            "bbox": bbox,
            "area": bbox[2] * bbox[3],
            "iscrowd": 0,
        }

    data["annotations"] += [
        ann(0, missing_id, 3, [10, 10, 20, 20]),  # its image file is missing
        ann(1, first["id"], 3, [w + 5, 4, 10, 10]),  # wholly outside the image
        ann(2, first["id"], 7, [4, 4, 0, 12]),  # zero width
        ann(3, first["id"], UNKNOWN_CATEGORY_ID, [4, 4, 12, 12]),  # no such category
        ann(4, first["id"], 7, [w - 10, h - 10, 30, 30]),  # partly outside: clipped, kept
    ]
    dropped = {
        "missing_image": 1,
        "box_outside_image": 1,
        "zero_area_box": 1,
        "unknown_category": 1,
        "duplicate_image_id": 1,
    }
    return data, dropped, 1


if __name__ == "__main__":
    made = make_photo_boxes(sys.argv[1] if len(sys.argv) > 1 else "photo_boxes")
    print(f"wrote {made.train_json}, {made.val_json} and {made.yolo_train.parent.parent}")
