"""Generated object-detection data: images of mixed sizes, each with a few coloured filled shapes
(rectangles, ellipses, ...) and their boxes. Made in code from a seed, so it works offline and
every run sees the same images.

Boxes are (x1, y1, x2, y2) in pixels, x2/y2 exclusive (the tight box of the shape's pixels).
Labels are 1..num_classes: torchvision detectors reserve 0 for the background, so label k means
class_names[k - 1]."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from kiln.config.data import ShapesDetectionConfig
from kiln.data.spec import DataBundle, DataSpec, SourceNames
from kiln.preprocessing import ImageListRecipe

SHAPE_NAMES = ("rectangle", "ellipse", "triangle", "diamond")
MAX_PLACEMENT_TRIES = 20  # attempts to place a shape without overlapping the ones already drawn


def _shape_mask(shape: str, height: int, width: int) -> np.ndarray:
    """Boolean (height, width) mask of a shape filling its box."""
    # Pixel centres in [-1, 1] across the box.
    ys = (np.arange(height) + 0.5) / height * 2 - 1
    xs = (np.arange(width) + 0.5) / width * 2 - 1
    y, x = np.meshgrid(ys, xs, indexing="ij")
    if shape == "rectangle":
        return np.ones((height, width), dtype=bool)
    if shape == "ellipse":
        return x**2 + y**2 <= 1.0
    if shape == "triangle":  # apex at the top centre, base along the bottom
        return np.abs(x) <= (y + 1) / 2
    if shape == "diamond":
        return np.abs(x) + np.abs(y) <= 1.0
    raise AssertionError(f"unknown shape {shape}")


def _overlaps(box: tuple[int, int, int, int], boxes: list[tuple[int, int, int, int]]) -> bool:
    x1, y1, x2, y2 = box
    return any(x1 < bx2 and bx1 < x2 and y1 < by2 and by1 < y2 for bx1, by1, bx2, by2 in boxes)


def _place_box(rng: np.random.Generator, height: int, width: int, taken: list):
    """A random box (x1, y1, x2, y2) clear of `taken`, or None when none was found."""
    short = min(height, width)
    low, high = max(4, short // 8), max(5, short // 2)  # object side: 1/8 to 1/2 of the image
    for _ in range(MAX_PLACEMENT_TRIES):
        box_h, box_w = rng.integers(low, high + 1, size=2)
        y1 = int(rng.integers(0, height - box_h + 1))
        x1 = int(rng.integers(0, width - box_w + 1))
        box = (x1, y1, x1 + int(box_w), y1 + int(box_h))
        if not _overlaps(box, taken):
            return box
    return None


def make_image(
    rng: np.random.Generator, height: int, width: int, *, max_objects: int, num_classes: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """One image (3, H, W) in [0, 1] and its target {"boxes": (K, 4), "labels": (K,)}."""
    # Dark noisy background, bright objects: colour alone never tells the class.
    noise = rng.standard_normal(size=(3, height, width), dtype=np.float32) * 0.03
    image = rng.uniform(0.0, 0.35, size=(3, 1, 1)).astype(np.float32) + noise
    boxes, labels = [], []
    for _ in range(int(rng.integers(1, max_objects + 1)) if max_objects else 0):
        box = _place_box(rng, height, width, boxes)
        if box is None:
            continue
        label = int(rng.integers(1, num_classes + 1))
        x1, y1, x2, y2 = box
        mask = _shape_mask(SHAPE_NAMES[label - 1], y2 - y1, x2 - x1)
        colour = rng.uniform(0.55, 1.0, size=(3, 1)).astype(np.float32)
        region = image[:, y1:y2, x1:x2]
        region[:, mask] = colour
        # The target is the tight box of the pixels actually drawn.
        rows, cols = mask.nonzero()
        boxes.append((x1 + cols.min(), y1 + rows.min(), x1 + cols.max() + 1, y1 + rows.max() + 1))
        labels.append(label)
    image_t = torch.from_numpy(np.clip(image, 0.0, 1.0))
    target = {
        "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        "labels": torch.tensor(labels, dtype=torch.long),
    }
    return image_t, target


class ShapesDataset(Dataset):
    """`num_images` images, sides drawn independently from [min_side, max_side]."""

    in_memory = True  # drawn once, at build: an item is a lookup (no DataLoader worker needed)

    def __init__(
        self,
        num_images: int,
        *,
        seed: int,
        min_side: int,
        max_side: int,
        max_objects: int,
        num_classes: int,
        num_background: int = 0,
    ):
        rng = np.random.default_rng(seed)
        self.items = []
        for i in range(num_images):
            height, width = (int(s) for s in rng.integers(min_side, max_side + 1, size=2))
            objects = 0 if i >= num_images - num_background else max_objects  # the last ones
            self.items.append(
                make_image(rng, height, width, max_objects=objects, num_classes=num_classes)
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        return self.items[index]


def collate_image_list(batch):
    """[(image (3, H_i, W_i), target)] -> (list of images, list of targets): sizes differ, so
    nothing is stacked. Each tensor is a copy: the items are the dataset's own tensors (kept in
    memory), and a model that rescaled a batch's boxes or images in place would otherwise change
    the dataset itself, every time the item is drawn (stacking copies for other kinds).
    Module-level so DataLoader workers can pickle it."""
    images, targets = zip(*batch, strict=True)
    return [image.clone() for image in images], [
        {key: value.clone() if isinstance(value, Tensor) else value for key, value in t.items()}
        for t in targets
    ]


def build_shapes_detection(cfg: ShapesDetectionConfig) -> DataBundle:
    max_side = cfg.image_size
    min_side = cfg.min_image_size or max_side  # the config checks 16 <= min_side <= max_side
    common = dict(
        min_side=min_side,
        max_side=max_side,
        max_objects=cfg.max_objects,
        num_classes=cfg.num_classes,
        num_background=cfg.num_background,
    )
    # Train and val come from different seeds, so no image is in both.
    train = ShapesDataset(cfg.num_train, seed=cfg.split_seed, **common)
    val = ShapesDataset(cfg.num_val, seed=cfg.split_seed + 1, **common)
    class_names = SHAPE_NAMES[: cfg.num_classes]
    spec = DataSpec(
        task="detection",
        input_kind="image_list",
        num_classes=cfg.num_classes,
        class_names=class_names,
        channels=3,
        image_size=(max_side, max_side),
    )
    return DataBundle(
        spec=spec,
        train=train,
        val=val,
        collate_fn=collate_image_list,
        recipe=ImageListRecipe(
            class_names=class_names,
            channels=3,
            image_size=(max_side, max_side),
            min_image_size=min_side,
        ),
        sources={"val": SourceNames("val[{}]", range(cfg.num_val))},  # regenerated from the seed
    )
