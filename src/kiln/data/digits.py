"""scikit-learn's bundled 8x8 digits: real handwriting, no download. The split is kiln.data.split's
(scikit-learn's stratified train_test_split to the index), cached as arrays after the first run:
importing scikit-learn (for load_digits) costs about 1.4 s, a quarter of a short digits run."""

from __future__ import annotations

import importlib.metadata
import math
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from kiln.atomic import atomic_file
from kiln.caches import cache_dir
from kiln.config.data import DigitsConfig
from kiln.data.spec import DataBundle, DataSpec, SourceNames
from kiln.data.split import stratified_split
from kiln.preprocessing import ImageRecipe, normalise

SPLIT_KEYS = ("x_train", "x_val", "y_train", "y_val", "i_val")


def split_digits(cfg: DigitsConfig) -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits

    raw = load_digits()
    images = raw.images.astype(np.float32)[:, None, :, :]  # (N, 1, 8, 8), values 0..16
    labels = raw.target.astype(np.int64)
    # train_test_split's count for a fractional test_size, as earlier runs held out.
    num_val = math.ceil(cfg.val_fraction * len(labels))
    # i_val: a report names each validation image by its place in load_digits().
    i_train, i_val = stratified_split(labels, num_val, cfg.split_seed)
    arrays = (images[i_train], images[i_val], labels[i_train], labels[i_val], i_val)
    return dict(zip(SPLIT_KEYS, arrays, strict=True))


def split_cache_path(cfg: DigitsConfig) -> Path:
    """Keyed by scikit-learn's version (its file and its split) and the split's settings."""
    version = importlib.metadata.version("scikit-learn")
    return cache_dir("digits") / f"sklearn{version}-{cfg.val_fraction!r}-{cfg.split_seed}.npz"


def digits_split(cfg: DigitsConfig) -> dict[str, np.ndarray]:
    """scikit-learn's split, from the cache when a run made it before (exactly the same arrays);
    a missing, unreadable or unwritable cache only costs the import."""
    path = split_cache_path(cfg)
    try:
        with np.load(path) as cached:
            return {key: cached[key] for key in SPLIT_KEYS}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        pass
    split = split_digits(cfg)
    try:
        with atomic_file(path, unique=True) as f:  # runs starting side by side: one wins
            np.savez(f, **split)
    except OSError:
        pass
    return split


def build_digits(cfg: DigitsConfig) -> DataBundle:
    split = digits_split(cfg)
    x_train, x_val, y_train, y_val, i_val = (split[key] for key in SPLIT_KEYS)
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
