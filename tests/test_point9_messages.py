"""The messages of issue 32's point 9, each said plainly where it used to be wrong or missing."""

from __future__ import annotations

import json
import logging

import numpy as np
from PIL import Image

from kiln.data import build_data

from .conftest import compose_config


def test_a_channel_of_one_value_is_divided_by_one_and_said(tmp_path, caplog):
    for name in ("a", "b"):
        (tmp_path / "train" / name).mkdir(parents=True)
        for i in range(3):
            pixels = np.zeros((12, 12, 3), np.uint8)
            pixels[..., 0] = np.random.default_rng(i).integers(0, 256, (12, 12))  # red varies
            pixels[..., 1] = 90  # green: one value everywhere
            Image.fromarray(pixels).save(tmp_path / "train" / name / f"{i}.png")
    cfg = compose_config(
        "data=image_folder",
        f"data.train_dir={tmp_path / 'train'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.image_size=8",
        "data.normalize=dataset",
        "data.val_fraction=0.34",
        "model=mlp",
    )
    with caplog.at_level(logging.WARNING):
        bundle = build_data(cfg.data)
    std = bundle.recipe.std
    assert std[0] > 0.1 and std[1] == std[2] == 1.0  # green and blue hold one value each
    normalize = json.loads(json.dumps(bundle.report["normalize"]))
    assert normalize["flat_channels"] == [1, 2] and normalize["measured_std"][1] < 1e-6
    assert "channel(s) 1, 2 of the training images hold one value" in caplog.text
