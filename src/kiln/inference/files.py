"""Batch prediction files: raw inputs from .npy / .npz / .csv, image files (a file, a folder, a
glob) or a folder of images for detectors; predictions to CSV. Errors name the file, what shape
was expected and what arrived."""

from __future__ import annotations

import fnmatch
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kiln.errors import MissingFileError
from kiln.preprocessing import (
    ImageListPreprocessor,
    ImagePreprocessor,
    InputError,
    Preprocessor,
    describe_shape,
)
from kiln.preprocessing.file_tree import (
    CANNOT_OPEN,
    FILE,
    FOLDER,
    NOT_REGULAR,
    FileAccessError,
    open_regular,
    os_detail,
    walk_tree,
)
from kiln.preprocessing.image_files import DEFAULT_MAX_PIXELS
from kiln.sorting import natural_key

log = logging.getLogger(__name__)


def read_inputs(
    path: str | Path,
    preprocess: Preprocessor,
    text_column: str | None = None,
    *,
    follow_symlinks: bool = True,
) -> Any:
    """Image models: .npy (N, C, H, W) -- or (N, H, W) for one channel -- or a .csv with one
    image per row as C*H*W pixel columns; models trained on image files (data=image_folder) also
    an image file, a folder of them (recursively) or a glob: a FileListing, read file by file
    when predicted (`load_file_input`). Text models: a .csv read as training read its own (the
    text column and encoding recorded in the checkpoint; `text_column` overrides the column).
    Detectors: images of any sizes, see `read_images`."""
    text = str(path)
    path = Path(path)
    if isinstance(preprocess, ImageListPreprocessor):
        return read_images(path, follow_symlinks=follow_symlinks)
    files = isinstance(preprocess, ImagePreprocessor) and preprocess.takes_files
    if files and (path.is_dir() or (not os.path.lexists(path) and is_glob(text))):
        return list_image_files(text, follow_symlinks=follow_symlinks)
    if path.is_dir():
        raise InputError(
            f"{path} is a folder; this model reads a .npy or .csv file (its data was not read "
            "from image files)"
        )
    if not os.path.lexists(path):
        raise MissingFileError(f"input file {path} does not exist")
    suffix = path.suffix.lower()
    if isinstance(preprocess, ImagePreprocessor):
        if suffix == ".npy":
            return _images_from_npy(_regular(path), preprocess)
        if suffix == ".csv":
            return _images_from_csv(_regular(path), preprocess)
        if files:
            return list_image_files(text)
        raise InputError(
            f"{path}: this image model reads .npy or .csv files of pixels, not "
            f"{suffix or 'that'} (its data was not read from image files)"
        )
    recipe = preprocess.recipe
    column = text_column or recipe.text_column
    if suffix != ".csv":
        raise InputError(f"{path}: text models read a .csv file with a {column!r} column")
    texts = _texts_from_csv(_regular(path), column, recipe.encoding)
    if recipe.pair_column is None:
        return texts
    # a pair task: [text, pair] per row, the second column as training read it (lists: a
    # tuple here would read as a named input, kiln.inference.predictor.split_named)
    seconds = _texts_from_csv(path, recipe.pair_column, recipe.encoding)
    return [[a, b] for a, b in zip(texts, seconds, strict=True)]


def _regular(path: Path) -> Path:
    """`path` if it is a regular file (so reading it cannot block); InputError if not."""
    try:
        open_regular(path).close()
    except FileAccessError as err:
        raise InputError(f"{path}: {err.detail}") from None
    return path


def is_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


@dataclass(frozen=True)
class NamedFile:
    """One input file: its path, the name the CSV shows, and (for an entry the walk already
    knows cannot be read: a dangling link, a FIFO) why not."""

    path: Path
    source: str  # printable: the bytes of a name that are not UTF-8 escaped (caf\\xe9.jpg)
    error: str | None = None


@dataclass
class FileListing:
    """The input files of a folder, a glob or one file, and what was skipped (reason ->
    count): read one batch at a time when predicted, never all at once."""

    files: list[NamedFile]
    skipped: dict[str, int] = field(default_factory=dict)

    def skipped_line(self) -> str:
        return ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in self.skipped.items())


def source_name(path: Path | str) -> str:
    """A path as text that any UTF-8 writer takes: the bytes of a name that are not UTF-8
    (which Python holds as surrogates) written as backslash escapes, e.g. caf\\xe9.jpg."""
    text = str(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(text).decode("utf-8", "backslashreplace")
    return text


def list_image_files(
    spec: str,
    *,
    follow_symlinks: bool = True,
    is_input: Callable[[str], bool] | None = None,
    relative_sources: bool = False,
    max_depth: int | None = None,
) -> FileListing:
    """The input files of a file, a folder (recursively: class subfolders are fine) or a glob
    (`**` for any depth), in natural order, walked by kiln.preprocessing.file_tree (no loop, no
    hang: a FIFO is never opened, a file reached twice is listed once). An entry named like an
    input that cannot be read (a dangling link, a FIFO, a folder that cannot be listed) is
    listed with its error, so it gets a row of its own; hidden files and folders and other
    names are skipped and counted. A file named on its own is always listed.
    `is_input(name)`: which names are inputs (default: image extensions); `relative_sources`:
    sources relative to the folder (else the path as reached)."""
    from kiln.preprocessing.image_files import is_image_name

    is_input = is_input or is_image_name
    path = Path(spec)
    if os.path.lexists(path) and not path.is_dir():
        return FileListing([NamedFile(path, source_name(path.name if relative_sources else path))])
    if path.is_dir():
        base, pattern, where = path, None, f"{path}: no input files in this folder or below"
    else:
        base, pattern = _glob_base(spec)
        where = f"{spec}: no input files match"
    if pattern is not None and "**" not in pattern:
        max_depth = len(pattern)
    try:
        entries = list(walk_tree(base, follow_symlinks=follow_symlinks, max_depth=max_depth))
    except FileNotFoundError:
        entries = []  # a glob below a folder that does not exist matches nothing
    except OSError as err:
        raise InputError(f"{base}: cannot list this folder: {os_detail(err)}") from None
    listing = FileListing([])
    for entry in entries:
        if entry.status == FOLDER:
            continue
        if pattern is not None and not _glob_match(pattern, entry.parts):
            continue
        unreadable_folder = entry.is_folder and entry.status == CANNOT_OPEN
        if unreadable_folder or (
            entry.status in (FILE, CANNOT_OPEN, NOT_REGULAR) and is_input(entry.path.name)
        ):
            error = None if entry.status == FILE else f"{entry.status}: {entry.detail}"
            shown = Path(*entry.parts) if relative_sources else entry.path
            listing.files.append(NamedFile(entry.path, source_name(shown), error))
        else:
            reason = "not_input" if entry.status in (FILE, CANNOT_OPEN) else entry.status
            listing.skipped[reason] = listing.skipped.get(reason, 0) + 1
    if not listing.files:
        raise InputError(f"{where} ({sum(listing.skipped.values())} other entries skipped)")
    listing.files.sort(key=lambda f: natural_key(f.path.relative_to(base).as_posix()))
    return listing


def _glob_base(spec: str) -> tuple[Path, tuple[str, ...]]:
    """The folder a glob starts from (its leading components without wildcards) and the
    pattern of the rest, one entry per path component."""
    parts = Path(spec).parts
    fixed = 0
    while fixed < len(parts) - 1 and not is_glob(parts[fixed]):
        fixed += 1
    return (Path(*parts[:fixed]) if fixed else Path(".")), tuple(parts[fixed:])


def _glob_match(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """glob's rules on a walked path: `*`, `?`, `[...]` within one name; `**` any number of
    folders (none included)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    if not parts or not fnmatch.fnmatchcase(parts[0], pattern[0]):
        return False
    return _glob_match(pattern[1:], parts[1:])


def load_file_input(
    preprocess: Preprocessor, path: Path, max_image_pixels: int | None = DEFAULT_MAX_PIXELS
) -> Any:
    """One input file -> the raw item the predictor converts, its bytes freed at once: for a
    model trained on image files, float32 (C, S, S) in [0, 1] (decoded, eval-transformed);
    for a detector, float32 (3, H, W) in [0, 1] or a .npy array. Only a regular file is opened
    and an image's header is checked against `max_image_pixels` first. Raises FileAccessError,
    ImageDecodeError or InputError."""
    if path.suffix.lower() == ".npy":
        return _load_npy(_regular(path))
    if isinstance(preprocess, ImageListPreprocessor):
        from kiln.preprocessing.image_files import read_image_file

        return read_image_file(path, 3, max_image_pixels).numpy().astype(np.float32) / 255.0
    return preprocess.file_loader(max_image_pixels).load_file(path).numpy()


def split_named(inputs: Any) -> tuple[list[str] | None, Any]:
    """(sources, items) of named (source, item) pairs; (None, inputs) for anything else."""
    if isinstance(inputs, list) and inputs and isinstance(inputs[0], tuple):
        return [name for name, _ in inputs], [item for _, item in inputs]
    return None, inputs


DETECTOR_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".npy")


def read_images(path: Path, *, follow_symlinks: bool = True) -> FileListing | list:
    """Images of mixed sizes: a folder of image files (.png/.jpg/.bmp, pixels scaled from
    0..255 to 0..1) and .npy arrays (C, H, W), by name (a FileListing, read when predicted);
    one such file; a .npz of (C, H, W) arrays (one per key); or a .npy (N, C, H, W) of
    same-size images (named (source, array) pairs)."""
    if path.is_dir():
        return list_image_files(
            str(path),
            follow_symlinks=follow_symlinks,
            is_input=lambda name: Path(name).suffix.lower() in DETECTOR_SUFFIXES,
            relative_sources=True,
            max_depth=1,
        )
    if not os.path.lexists(path):
        raise MissingFileError(f"input {path} does not exist (a file or a folder of images)")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        with np.load(_regular(path), allow_pickle=False) as arrays:
            return [(key, arrays[key]) for key in arrays.files]
    if suffix == ".npy":
        array = _load_npy(_regular(path))
        if array.ndim != 4:
            raise InputError(
                f"{path}: expected an array of shape (N, C, H, W), got "
                f"{describe_shape(array.shape)}; for images of mixed sizes use a .npz or a folder"
            )
        return [(f"{path.name}[{i}]", image) for i, image in enumerate(array)]
    if suffix in DETECTOR_SUFFIXES:
        return list_image_files(str(path), relative_sources=True)
    raise InputError(f"{path}: detectors read a folder of images, a .npz or a .npy file")


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
        from kiln.data.csv_reader import wide_encoding

        wide = wide_encoding(path)
        if wide is not None:
            raise InputError(
                f"{path}: the file is {wide.upper()} (its first bytes say so), but this model "
                f"reads {encoding} (the training data's encoding): save it as {encoding}"
            ) from None
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
    recipe = preprocess.recipe
    if recipe.pair_column is not None:  # a pair: neither side may clean to nothing
        firsts, seconds = recipe.clean([a for a, _ in texts]), recipe.clean([b for _, b in texts])
        cleaned = [a and b for a, b in zip(firsts, seconds, strict=True)]
    else:
        cleaned = recipe.clean(texts)
    skipped = {i: EMPTY_AFTER_CLEANING for i, text in enumerate(cleaned) if not text}
    return [text for i, text in enumerate(texts) if i not in skipped], skipped


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
