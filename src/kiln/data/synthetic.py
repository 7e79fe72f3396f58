"""Synthetic images of any size, channels and classes, for benchmarks and tests. Each class shifts
the mean of one horizontal band, so the task is learnable and no shape is special."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from kiln.config.data import SyntheticImagesConfig
from kiln.data.spec import DataBundle, DataSpec, SourceNames
from kiln.preprocessing import ImageRecipe


def make_images(n: int, channels: int, size: int, num_classes: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(n, channels, size, size, generator=gen)
    labels = torch.randint(0, num_classes, (n,), generator=gen)
    band = max(1, size // num_classes)
    for cls in range(num_classes):
        rows = slice((cls * band) % size, (cls * band) % size + band)
        images[labels == cls, :, rows, :] += 1.5
    return images, labels


def build_synthetic_images(cfg: SyntheticImagesConfig) -> DataBundle:
    size, channels, num_classes = cfg.image_size, cfg.channels, cfg.num_classes
    train = make_images(cfg.num_train, channels, size, num_classes, seed=cfg.split_seed)
    val = make_images(cfg.num_val, channels, size, num_classes, seed=cfg.split_seed + 1)
    class_names = tuple(f"class_{i}" for i in range(num_classes))
    spec = DataSpec(
        "classification",
        "image",
        num_classes,
        class_names,
        channels=channels,
        image_size=(size, size),
    )
    recipe = ImageRecipe(
        mean=(0.0,) * channels,
        std=(1.0,) * channels,
        channels=channels,
        image_size=(size, size),
        class_names=class_names,
    )
    return DataBundle(
        spec,
        TensorDataset(*train),
        TensorDataset(*val),
        recipe,
        sources={"val": SourceNames("val[{}]", range(cfg.num_val))},  # regenerated from the seed
    )
