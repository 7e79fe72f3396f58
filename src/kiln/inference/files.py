"""Batch prediction files: raw inputs from .npy / .npz / .csv, image files (a file, a folder, a
glob) or a folder of images for detectors; predictions to CSV. Errors name the file, what shape
was expected and what arrived."""

from __future__ import annotations

import glob
import logging
import math
import os
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

log = logging.getLogger(__name__)

IMAGE_FILE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


def read_inputs(path: str | Path, preprocess: Preprocessor, text_column: str | None = None) -> Any:
    """Image models: .npy (N, C, H, W) -- or (N, H, W) for one channel -- or a .csv with one
    image per row as C*H*W pixel columns; models trained on image files (data=image_folder) also
    an image file, a folder of them (recursively) or a glob: named (path, bytes) pairs, see
    `read_image_files`. Text models: a .csv read as training read its own (the text column and
    encoding recorded in the checkpoint; `text_column` overrides the column). Detectors: images
    of any sizes, see `read_images`."""
    text = str(path)
    path = Path(path)
    if isinstance(preprocess, ImageListPreprocessor):
        return read_images(path)
    files = isinstance(preprocess, ImagePreprocessor) and preprocess.takes_files
    if files and (path.is_dir() or (not path.exists() and is_glob(text))):
        return read_image_files(text)
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    suffix = path.suffix.lower()
    if isinstance(preprocess, ImagePreprocessor):
        if suffix == ".npy":
            return _images_from_npy(path, preprocess)
        if suffix == ".csv":
            return _images_from_csv(path, preprocess)
        if files:
            return read_image_files(text)
        raise InputError(
            f"{path}: this image model reads .npy or .csv files of pixels, not "
            f"{suffix or 'that'} (its data was not read from image files)"
        )
    recipe = preprocess.recipe
    column = text_column or recipe.text_column
    if suffix != ".csv":
        raise InputError(f"{path}: text models read a .csv file with a {column!r} column")
    return _texts_from_csv(path, column, recipe.encoding)


def is_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def list_image_files(spec: str) -> tuple[list[Path], int]:
    """(image files, files skipped) of a file, a folder (recursively: class subfolders are
    fine) or a glob, in natural order. Hidden files and folders and names without an image
    extension are skipped (a file named on its own is always read)."""
    from kiln.preprocessing.image_files import is_image_name
    from kiln.sorting import natural_key

    path = Path(spec)
    if path.is_file():
        return [path], 0
    if path.is_dir():
        found, skipped = [], 0
        for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
            skipped += sum(d.startswith(".") for d in dirnames)
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if is_image_name(name):
                    found.append(Path(dirpath) / name)
                else:
                    skipped += 1
        order = lambda p: natural_key(p.relative_to(path).as_posix())  # noqa: E731
        where = f"{path}: no image files in this folder or below"
    else:
        matches = [Path(m) for m in glob.glob(spec, recursive=True)]
        files = [m for m in matches if m.is_file() and not _hidden(m)]
        found = [m for m in files if is_image_name(m.name)]
        skipped = len(matches) - len(found)
        order = lambda p: natural_key(p.as_posix())  # noqa: E731
        where = f"{spec}: no image files match"
    if not found:
        raise InputError(f"{where} ({skipped} other files skipped)")
    return sorted(found, key=order), skipped


def _hidden(path: Path) -> bool:
    return any(part.startswith(".") and part not in (".", "..") for part in path.parts)


def read_image_files(spec: str) -> list[tuple[str, bytes]]:
    """(path, the file's bytes) of every image file `spec` names (see list_image_files); each
    is decoded by the model's preprocessing, as the training data was."""
    files, skipped = list_image_files(spec)
    if skipped:
        log.info("%s: %d files skipped (hidden, or not image files)", spec, skipped)
    return [(str(p), p.read_bytes()) for p in files]


def split_named(inputs: Any) -> tuple[list[str] | None, Any]:
    """(sources, items) of named (source, item) pairs; (None, inputs) for anything else."""
    if isinstance(inputs, list) and inputs and isinstance(inputs[0], tuple):
        return [name for name, _ in inputs], [item for _, item in inputs]
    return None, inputs


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
    sources: list[str] | None = None,
    skipped: dict[int, str] | None = None,
) -> Path:
    """CSV: index, source (the input file, when inputs were files), label, then
    prob_<class name> for every class. With `skipped` (text models) a last column `error` says
    why a row has no prediction; `probs` holds the other rows."""
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
    if sources is not None:
        frame.insert(0, "source", sources)
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
