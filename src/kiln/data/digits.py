"""scikit-learn's bundled 8x8 digits: real handwriting, no download."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

from kiln.data.spec import DataBundle, DataSpec
from kiln.registry import register_dataset


def normalise(images: np.ndarray, mean: list[float], std: list[float]) -> torch.Tensor:
    """(N, C, H, W) float images -> standardised tensor, per channel. Inference uses this too."""
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (torch.as_tensor(images, dtype=torch.float32) - mean_t) / std_t


@register_dataset("digits")
def build_digits(cfg) -> DataBundle:
    raw = load_digits()
    images = raw.images.astype(np.float32)[:, None, :, :]  # (N, 1, 8, 8), values 0..16
    labels = raw.target.astype(np.int64)
    x_train, x_val, y_train, y_val = train_test_split(
        images, labels, test_size=cfg.val_fraction, random_state=cfg.split_seed, stratify=labels
    )
    # Statistics come from the training split only, and are stored with every checkpoint.
    mean = x_train.mean(axis=(0, 2, 3)).tolist()
    std = (x_train.std(axis=(0, 2, 3)) + 1e-6).tolist()
    class_names = tuple(str(i) for i in range(10))
    spec = DataSpec(
        task="classification",
        input_kind="image",
        num_classes=10,
        class_names=class_names,
        channels=1,
        image_size=(8, 8),
    )
    return DataBundle(
        spec=spec,
        train=TensorDataset(normalise(x_train, mean, std), torch.from_numpy(y_train)),
        val=TensorDataset(normalise(x_val, mean, std), torch.from_numpy(y_val)),
        preprocessing={
            "kind": "image",
            "mean": mean,
            "std": std,
            "value_range": [0.0, 16.0],
            "image_size": [8, 8],
            "channels": 1,
            "class_names": list(class_names),
        },
    )
