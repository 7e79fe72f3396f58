"""Batch prediction files: raw inputs from .npy / .npz / .csv or a folder of images, predictions to
CSV. Errors name the file, what shape was expected and what arrived."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kiln.preprocessing import (
    ImageListPreprocessor,
    ImagePreprocessor,
    InputError,
    Preprocessor,
    describe_shape,
)

IMAGE_FILE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


def read_inputs(path: str | Path, preprocess: Preprocessor, text_column: str | None = None) -> Any:
    """Image models: .npy (N, C, H, W) -- or (N, H, W) for one channel -- or a .csv with one
    image per row as C*H*W pixel columns. Text models: a .csv read as training read its own
    (the text column and encoding recorded in the checkpoint; `text_column` overrides the
    column). Detectors: images of any sizes, see `read_images`."""
    path = Path(path)
    if isinstance(preprocess, ImageListPreprocessor):
        return read_images(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    suffix = path.suffix.lower()
    if isinstance(preprocess, ImagePreprocessor):
        if suffix == ".npy":
            return _images_from_npy(path, preprocess)
        if suffix == ".csv":
            return _images_from_csv(path, preprocess)
        raise InputError(f"{path}: image models read .npy or .csv files, not {suffix or 'that'}")
    recipe = preprocess.recipe
    column = text_column or recipe.text_column
    if suffix != ".csv":
        raise InputError(f"{path}: text models read a .csv file with a {column!r} column")
    return _texts_from_csv(path, column, recipe.encoding)


def read_images(path: Path) -> list[tuple[str, np.ndarray]]:
    """Images of mixed sizes, named: a folder of image files (.png/.jpg, pixels scaled from
    0..255 to 0..1) and .npy arrays (C, H, W), sorted by name; a .npz of (C, H, W) arrays (one
    per key); or a .npy (N, C, H, W) of same-size images."""
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir() if p.suffix.lower() in (*IMAGE_FILE_SUFFIXES, ".npy")
        )
        if not files:
            raise InputError(f"{path}: no image files (.png, .jpg, .npy) in this folder")
        return [(p.name, _image_file(p)) for p in files]
    if not path.is_file():
        raise FileNotFoundError(f"input {path} does not exist (a file or a folder of images)")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as arrays:
            return [(key, arrays[key]) for key in arrays.files]
    if suffix == ".npy":
        array = _load_npy(path)
        if array.ndim != 4:
            raise InputError(
                f"{path}: expected an array of shape (N, C, H, W), got "
                f"{describe_shape(array.shape)}; for images of mixed sizes use a .npz or a folder"
            )
        return [(f"{path.name}[{i}]", image) for i, image in enumerate(array)]
    if suffix in IMAGE_FILE_SUFFIXES:
        return [(path.name, _image_file(path))]
    raise InputError(f"{path}: detectors read a folder of images, a .npz or a .npy file")


def _image_file(path: Path) -> np.ndarray:
    if path.suffix.lower() == ".npy":
        return _load_npy(path)
    from PIL import Image

    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return pixels.transpose(2, 0, 1)  # (H, W, 3) -> (3, H, W)


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)  # never unpickle user files
    except ValueError as err:
        raise InputError(f"{path}: not a plain numeric .npy array ({err})") from None


def _images_from_npy(path: Path, preprocess: ImagePreprocessor) -> np.ndarray:
    array = _load_npy(path)
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


def _texts_from_csv(path: Path, text_column: str, encoding: str) -> list[str]:
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, encoding=encoding)
    except UnicodeDecodeError as err:
        raise InputError(
            f"{path}: not valid {encoding} (the training data's encoding) at byte {err.start}"
        ) from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise InputError(f"{path}: cannot be read as CSV: {str(err).strip()}") from None
    if text_column not in frame.columns:
        raise InputError(
            f"{path}: no {text_column!r} column; columns present: {', '.join(frame.columns)} "
            "(set text_column=...)"
        )
    return frame[text_column].tolist()


EMPTY_AFTER_CLEANING = "empty after cleaning"


def predictable_texts(texts: list[str], preprocess) -> tuple[list[str], dict[int, str]]:
    """(the texts to predict, {index: why not} for the others): a text that the training's
    cleaning reduces to nothing has no words to predict from, so it is reported per row
    instead of given a made-up label."""
    cleaned = preprocess.recipe.clean(texts)
    skipped = {i: EMPTY_AFTER_CLEANING for i, text in enumerate(cleaned) if not text}
    return [text for i, text in enumerate(texts) if i not in skipped], skipped


def write_predictions(
    probs: np.ndarray,
    class_names: list[str],
    path: str | Path,
    skipped: dict[int, str] | None = None,
) -> Path:
    """CSV: index, label, then prob_<class name> for every class. With `skipped` (text models)
    a last column `error` says why a row has no prediction; `probs` holds the other rows."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(probs, columns=[f"prob_{name}" for name in class_names])
    frame.insert(0, "label", [class_names[i] for i in probs.argmax(axis=1)])
    if skipped is not None:
        total = len(probs) + len(skipped)
        predicted = [i for i in range(total) if i not in skipped]
        frame.index = predicted
        frame = frame.reindex(range(total))
        frame["label"] = frame["label"].fillna("")
        frame["error"] = [skipped.get(i, "") for i in range(total)]
    frame.insert(0, "index", np.arange(len(frame)))
    frame.to_csv(path, index=False)
    return path


DETECTION_COLUMNS = ["index", "source", "x1", "y1", "x2", "y2", "label", "score"]


def write_detections(
    detections: list[dict], sources: list[str], class_names: list[str], path: str | Path
) -> Path:
    """CSV, one row per box: index, source, x1, y1, x2, y2 (pixels of that image), label, score.
    An image with no box still gets one row (empty box, label and score), so every input shows."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, (found, source) in enumerate(zip(detections, sources, strict=True)):
        for box, label, score in zip(found["boxes"], found["labels"], found["scores"], strict=True):
            rows.append(
                [index, source, *map(float, box), class_names[int(label) - 1], float(score)]
            )
        if len(found["boxes"]) == 0:
            rows.append([index, source, None, None, None, None, None, None])
    pd.DataFrame(rows, columns=DETECTION_COLUMNS).to_csv(path, index=False)
    return path
