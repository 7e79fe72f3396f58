"""Batch prediction files: raw inputs from .npy / .csv, predictions to CSV. Errors name the file,
what shape was expected and what arrived."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kiln.preprocessing import ImagePreprocessor, InputError, Preprocessor, describe_shape


def read_inputs(path: str | Path, preprocess: Preprocessor, text_column: str = "text") -> Any:
    """Image models: .npy (N, C, H, W) -- or (N, H, W) for one channel -- or a .csv with one
    image per row as C*H*W pixel columns. Text models: a .csv with a text column."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    suffix = path.suffix.lower()
    if isinstance(preprocess, ImagePreprocessor):
        if suffix == ".npy":
            return _images_from_npy(path, preprocess)
        if suffix == ".csv":
            return _images_from_csv(path, preprocess)
        raise InputError(f"{path}: image models read .npy or .csv files, not {suffix or 'that'}")
    if suffix != ".csv":
        raise InputError(f"{path}: text models read a .csv file with a {text_column!r} column")
    return _texts_from_csv(path, text_column)


def _images_from_npy(path: Path, preprocess: ImagePreprocessor) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)  # never unpickle user files
    except ValueError as err:
        raise InputError(f"{path}: not a plain numeric .npy array ({err})") from None
    shape = preprocess.shape
    if preprocess.channels == 1 and array.ndim == 3:
        array = array[:, None]
    if array.ndim != 4 or tuple(array.shape[1:]) != shape:
        grey = f" or (N, {shape[1]}, {shape[2]})" if preprocess.channels == 1 else ""
        raise InputError(
            f"{path}: expected an array of shape (N, {', '.join(map(str, shape))}){grey}, "
            f"got {describe_shape(array.shape)}"
        )
    return array


def _images_from_csv(path: Path, preprocess: ImagePreprocessor) -> np.ndarray:
    frame = pd.read_csv(path)
    width = math.prod(preprocess.shape)
    if frame.shape[1] != width:
        raise InputError(
            f"{path}: expected {width} pixel columns per row (one flattened "
            f"{describe_shape(preprocess.shape)} image), got {frame.shape[1]}"
        )
    try:
        pixels = frame.to_numpy(dtype=np.float32)
    except ValueError:
        raise InputError(f"{path}: every pixel column must be numeric") from None
    return pixels.reshape(len(frame), *preprocess.shape)


def _texts_from_csv(path: Path, text_column: str) -> list[str]:
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    if text_column not in frame.columns:
        raise InputError(
            f"{path}: no {text_column!r} column; columns present: {', '.join(frame.columns)} "
            "(set text_column=...)"
        )
    return frame[text_column].tolist()


def write_predictions(probs: np.ndarray, class_names: list[str], path: str | Path) -> Path:
    """CSV: index, label, then prob_<class name> for every class."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(probs, columns=[f"prob_{name}" for name in class_names])
    frame.insert(0, "label", [class_names[i] for i in probs.argmax(axis=1)])
    frame.insert(0, "index", np.arange(len(probs)))
    frame.to_csv(path, index=False)
    return path
