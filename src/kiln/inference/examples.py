"""An input that fits a checkpoint, so that the commands kiln prints and the request bodies the
server offers (GET /v1/example) work as they are: the preprocessor's own example (the input the
server warms up with), in the forms infer.py and the HTTP APIs read."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

from kiln.checkpoint import load_checkpoint
from kiln.preprocessing import recipe_from_dict

EXAMPLE_STEM = "example_input"  # <run>/example_input.npy (images) or .csv (texts)
NUM_EXAMPLES = 2


def example_items(preprocess: Any, count: int = NUM_EXAMPLES) -> list[Any]:
    """`count` raw inputs the preprocessor accepts: images as (C, H, W) arrays, texts as str."""
    return [preprocess.example() for _ in range(count)]


def write_example_input(ckpt: Path, folder: Path, text_column: str = "text") -> Path:
    """A file `python infer.py ckpt=<ckpt> input=<it>` reads: .npy (N, C, H, W) for image
    models and detectors, a .csv with a `text_column` column for text models."""
    recipe = recipe_from_dict(load_checkpoint(ckpt)["preprocessing"])
    items = example_items(recipe.preprocessor())
    if isinstance(items[0], str):
        path = Path(folder) / f"{EXAMPLE_STEM}.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow([text_column])
            writer.writerows([item] for item in items)
        return path
    path = Path(folder) / f"{EXAMPLE_STEM}.npy"
    np.save(path, np.stack(items).astype(np.float32))
    return path
