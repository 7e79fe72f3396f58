"""scikit-learn's bundled 8x8 digits: real handwriting, no download."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

from kiln.config.data import DigitsConfig
from kiln.data.spec import DataBundle, DataSpec, SourceNames
from kiln.preprocessing import ImageRecipe, normalise


def build_digits(cfg: DigitsConfig) -> DataBundle:
    raw = load_digits()
    images = raw.images.astype(np.float32)[:, None, :, :]  # (N, 1, 8, 8), values 0..16
    labels = raw.target.astype(np.int64)
    # The images' indices ride along (the split is the same with or without them): a report
    # names each validation image by its place in scikit-learn's load_digits().
    x_train, x_val, y_train, y_val, _, i_val = train_test_split(
        images,
        labels,
        np.arange(len(labels)),
        test_size=cfg.val_fraction,
        random_state=cfg.split_seed,
        stratify=labels,
    )
    # Statistics come from the training split only, and are stored with every checkpoint.
    mean = x_train.mean(axis=(0, 2, 3)).tolist()
    std = (x_train.std(axis=(0, 2, 3)) + 1e-6).tolist()
    class_names = tuple(str(i) for i in range(10))
    recipe = ImageRecipe(
        mean=tuple(mean),
        std=tuple(std),
        channels=1,
        image_size=(8, 8),
        class_names=class_names,
        value_range=(0.0, 16.0),
    )
    spec = DataSpec("classification", "image", 10, class_names, channels=1, image_size=(8, 8))
    return DataBundle(
        spec=spec,
        train=TensorDataset(normalise(x_train, mean, std), torch.from_numpy(y_train)),
        val=TensorDataset(normalise(x_val, mean, std), torch.from_numpy(y_val)),
        recipe=recipe,
        sources={"val": SourceNames("load_digits()[{}]", i_val)},
    )
