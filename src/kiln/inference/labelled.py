"""Labelled inputs for the evaluation report, read the way `infer.py` predict reads unlabelled
ones, so the report's predictions are predict's:

- image models: a folder with one subfolder per class (torchvision's ImageFolder layout). Image
  files (every format Pillow opens, extensions in any case) are read as encoded bytes, which the
  Predictor decodes with the checkpoint's own eval transform; `.npy` files are raw pixel arrays
  (C, H, W), for models trained on arrays (data=digits). Hidden files and other files are
  skipped and counted.
- text models: a CSV with the training run's text and label columns, read as predict reads a
  CSV (every value a string, "NA" is text).

A label the checkpoint does not know is an error naming the folders or rows, not a silent
exclusion: the numbers would otherwise describe a different set than the one given."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import UserError
from kiln.sorting import natural_key

ROWS_NAMED = 5  # an unknown label's error names this many of its rows


class LabelledDataError(UserError, ValueError):
    """A labelled folder or CSV that cannot be evaluated; the message names the place."""


@dataclass
class LabelledInputs:
    """Raw inputs (what `Predictor.convert` takes), their class indices and what each one is."""

    inputs: list[Any]
    targets: np.ndarray  # int64 (N,), indices into the checkpoint's class names
    sources: list[str]  # a file path or "<file> row N", per input
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count


def image_suffixes() -> frozenset[str]:
    """Extensions of every format Pillow can open (lower case, with the dot)."""
    from PIL import Image

    Image.init()
    return frozenset(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN)


def read_labelled_folder(
    path: Path, class_names: list[str], *, takes_encoded: bool
) -> LabelledInputs:
    """<path>/<class>/<file>: image files as bytes, .npy files as arrays, in natural order.
    `takes_encoded`: the model's recipe decodes image files (else only .npy arrays fit)."""
    path = Path(path)
    folders = sorted(
        (d for d in path.iterdir() if d.is_dir() and not _hidden(d)),
        key=lambda d: natural_key(d.name),
    )
    if not folders:
        raise LabelledDataError(
            f"{path}: no class subfolders; evaluate reads <folder>/<class name>/<image files> "
            f"with the checkpoint's class names ({_some(class_names)})"
        )
    _check_classes(path, [d.name for d in folders], class_names)
    suffixes = image_suffixes()
    inputs: list[Any] = []
    targets: list[int] = []
    sources: list[str] = []
    skipped: Counter[str] = Counter()
    skipped["top_level_file"] = sum(1 for f in path.iterdir() if f.is_file() and not _hidden(f))
    for target, folder in ((class_names.index(d.name), d) for d in folders):
        for file in sorted(folder.rglob("*"), key=lambda f: natural_key(str(f))):
            if not file.is_file():
                continue
            suffix = file.suffix.lower()
            if any(part.startswith(".") for part in file.relative_to(folder).parts):
                skipped["hidden"] += 1  # .DS_Store, .ipynb_checkpoints/, ...
                continue
            if suffix == ".npy":
                inputs.append(_load_npy(file))
            elif suffix in suffixes and takes_encoded:
                inputs.append(file.read_bytes())
            elif suffix in suffixes:
                raise LabelledDataError(
                    f"{file}: this checkpoint's model takes pixel arrays, not image files (it "
                    "was trained on arrays); put .npy arrays (C, H, W) in the class folders"
                )
            else:
                skipped["not_an_image"] += 1
                continue
            targets.append(target)
            sources.append(str(file))
    if not inputs:
        raise LabelledDataError(
            f"{path}: no image files (or .npy arrays) in its class subfolders "
            f"({', '.join(d.name for d in folders)})"
        )
    return LabelledInputs(
        inputs,
        np.asarray(targets, dtype=np.int64),
        sources,
        skipped={reason: count for reason, count in skipped.items() if count},
    )


def read_labelled_csv(
    path: Path, class_names: list[str], *, text_column: str, label_column: str
) -> LabelledInputs:
    """The texts and labels of a CSV, as `infer.py` predict reads a CSV (kiln.inference.files);
    rows are numbered from 1 after the header, as the training data report numbers them."""
    import pandas as pd

    path = Path(path)
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        message = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise LabelledDataError(f"{path}: cannot be read as CSV: {message}") from None
    missing = [c for c in (text_column, label_column) if c not in frame.columns]
    if missing:
        raise LabelledDataError(
            f"{path}: no {' or '.join(map(repr, missing))} column; columns present: "
            f"{', '.join(map(repr, frame.columns))} (evaluate reads the training run's "
            f"data.text_column={text_column!r} and data.label_column={label_column!r})"
        )
    if frame.empty:
        raise LabelledDataError(f"{path}: has a header but no rows to evaluate")
    labels = frame[label_column].str.strip().tolist()  # as the training reader strips labels
    index = {name: i for i, name in enumerate(class_names)}
    unknown = [(row, label) for row, label in enumerate(labels, start=1) if label not in index]
    if unknown:
        raise LabelledDataError(
            f"{path}: {_unknown_rows(unknown)} not among the checkpoint's classes "
            f"({_some(class_names)}) in column {label_column!r}; remove those rows, or "
            "evaluate a checkpoint trained with those classes"
        )
    name = path.name
    return LabelledInputs(
        inputs=frame[text_column].tolist(),
        targets=np.asarray([index[label] for label in labels], dtype=np.int64),
        sources=[f"{name} row {row}" for row in range(1, len(frame) + 1)],
    )


def _check_classes(path: Path, folders: list[str], class_names: list[str]) -> None:
    unknown = [name for name in folders if name not in set(class_names)]
    if unknown:
        raise LabelledDataError(
            f"{path}: class folder(s) {', '.join(map(repr, unknown))} are not among the "
            f"checkpoint's classes ({_some(class_names)}); remove or rename them, or evaluate "
            "a checkpoint trained with those classes"
        )


def _unknown_rows(unknown: list[tuple[int, str]]) -> str:
    """'label "x" (rows 3, 9) and "" (row 4)' for the first few rows of each unknown label."""
    by_label: dict[str, list[int]] = {}
    for row, label in unknown:
        by_label.setdefault(label, []).append(row)
    parts = []
    for label, rows in by_label.items():
        shown = ", ".join(map(str, rows[:ROWS_NAMED])) + (" ..." if len(rows) > ROWS_NAMED else "")
        what = "an empty label" if not label else f"label {label!r}"
        parts.append(f"{what} ({len(rows)} row{'s' if len(rows) > 1 else ''}: {shown})")
    return f"{len(unknown)} row(s) have " + "; ".join(parts) + ","


def _some(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... {len(names)} in all" if len(names) > limit else "")


def _hidden(path: Path) -> bool:
    return path.name.startswith(".")


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)  # never unpickle user files
    except ValueError as err:
        raise LabelledDataError(f"{path}: not a plain numeric .npy array ({err})") from None
