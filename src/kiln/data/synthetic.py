"""Synthetic images of any size, channels and classes, for benchmarks and tests. Each class shifts
the mean of one horizontal band, so the task is learnable and no shape is special."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from kiln.data.spec import DataBundle, DataSpec
from kiln.registry import register_dataset


def make_images(n: int, channels: int, size: int, num_classes: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(n, channels, size, size, generator=gen)
    labels = torch.randint(0, num_classes, (n,), generator=gen)
    band = max(1, size // num_classes)
    for cls in range(num_classes):
        rows = slice((cls * band) % size, (cls * band) % size + band)
        images[labels == cls, :, rows, :] += 1.5
    return images, labels


@register_dataset("synthetic_images")
def build_synthetic_images(cfg) -> DataBundle:
    size, channels, num_classes = cfg.image_size, cfg.channels, cfg.num_classes
    train = make_images(cfg.num_train, channels, size, num_classes, seed=cfg.split_seed)
    val = make_images(cfg.num_val, channels, size, num_classes, seed=cfg.split_seed + 1)
    class_names = tuple(f"class_{i}" for i in range(num_classes))
    spec = DataSpec(
        task="classification",
        input_kind="image",
        num_classes=num_classes,
        class_names=class_names,
        channels=channels,
        image_size=(size, size),
    )
    return DataBundle(
        spec=spec,
        train=TensorDataset(*train),
        val=TensorDataset(*val),
        preprocessing={
            "kind": "image",
            "mean": [0.0] * channels,
            "std": [1.0] * channels,
            "value_range": None,
            "image_size": [size, size],
            "channels": channels,
            "class_names": list(class_names),
        },
    )
