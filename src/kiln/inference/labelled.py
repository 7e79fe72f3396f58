"""Labelled inputs for the evaluation report, read the way `infer.py` predict reads unlabelled
ones, so the report's predictions are predict's:

- image models: a folder with one subfolder per class (torchvision's ImageFolder layout). Image
  files (every format Pillow opens, extensions in any case) are read as encoded bytes, which the
  Predictor decodes with the checkpoint's own eval transform; `.npy` files are raw pixel arrays
  (C, H, W), for models trained on arrays (data=digits). Hidden files and other files are
  left out, counted and named.
- text models: a CSV with the training run's text and label columns, read as predict reads a
  CSV (every value a string, "NA" is text). A row without a label cannot be scored: left out,
  counted and named (as training drops it, `missing_label`); its text is still predicted by
  `infer.py` predict, whose rows keep their numbers here too.

A label the checkpoint does not know is an error naming the folders or rows, not a silent
exclusion: the numbers would otherwise describe a different set than the one given.

What is left out is reported as a dataset's bad inputs are (kiln.data.bad_inputs.BadInputLog):
metrics.json's `data` reads like a data_report.json entry."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.bad_inputs import BadInputLog
from kiln.data.multilabel import multi_hot, split_labels
from kiln.errors import UserError
from kiln.preprocessing.file_tree import (
    FILE,
    FOLDER,
    HIDDEN,
    TreeEntry,
    display_name,
    os_detail,
    walk_tree,
)
from kiln.preprocessing.image_files import image_extensions
from kiln.sorting import natural_key

ROWS_NAMED = 5  # an unknown label's error names this many of its rows
FIRST_LISTED = 10  # the report lists this many left-out inputs per reason, then counts


class LabelledDataError(UserError, ValueError):
    """A labelled folder or CSV that cannot be evaluated; the message names the place."""


@dataclass
class LabelledInputs:
    """Raw inputs (what `Predictor.convert` takes), their class indices and what each one is."""

    inputs: Sequence[Any]  # texts, or the paths of the files (read when predicted)
    # int64 (N,), indices into the checkpoint's class names; multi-label: multi-hot (N, C)
    targets: np.ndarray
    sources: list[str]  # a file path or "<file> row N", per input
    # what was left out and why (metrics.json's `data`): read = kept + dropped
    report: BadInputLog = field(default_factory=lambda: BadInputLog(""))


def left_out(path: Path, unit: str) -> BadInputLog:
    """The bad-input report of the labelled folder (unit images) or CSV (unit rows) at `path`."""
    return BadInputLog(str(path), unit=unit, listed_per_reason=FIRST_LISTED)


def read_labelled_folder(
    path: Path, class_names: list[str], *, takes_encoded: bool, follow_symlinks: bool = True
) -> LabelledInputs:
    """<path>/<class>/<file>: image files and .npy arrays, in natural order, as paths (each read
    when its batch is predicted: a large folder is never all in memory). Walked by
    kiln.preprocessing.file_tree: no loop, no hang; FIFOs, links not followed, files reached
    twice and entries that cannot be opened are skipped, counted and named.
    `takes_encoded`: the model's recipe decodes image files (else only .npy arrays fit)."""
    path = Path(path)
    try:
        entries = list(walk_tree(path, follow_symlinks=follow_symlinks))
    except OSError as err:
        raise LabelledDataError(f"{path}: cannot list this folder: {os_detail(err)}") from None
    folders = [
        display_name(e.parts[0]) for e in entries if e.status == FOLDER and len(e.parts) == 1
    ]
    if not folders:
        raise LabelledDataError(
            f"{path}: no class subfolders; evaluate reads <folder>/<class name>/<image files> "
            f"with the checkpoint's class names ({_some(class_names)})"
        )
    _check_classes(path, folders, class_names)
    suffixes = image_extensions()
    files: list[Path] = []
    targets: list[int] = []
    sources: list[str] = []
    report = left_out(path, "images")
    for entry in entries:
        if entry.status == FOLDER:
            continue
        if len(entry.parts) == 1:
            if entry.status == FILE:
                report.add({"reason": "top_level_file", "path": str(entry.path)})
            elif entry.status != HIDDEN:
                report.add(_named(entry))
            continue
        if entry.status != FILE:
            report.add(_named(entry))  # .DS_Store, a FIFO, a dangling link
            continue
        suffix = entry.path.suffix.lower()
        if suffix in suffixes and not takes_encoded:
            raise LabelledDataError(
                f"{entry.path}: this checkpoint's model takes pixel arrays, not image files (it "
                "was trained on arrays); put .npy arrays (C, H, W) in the class folders"
            )
        if suffix != ".npy" and suffix not in suffixes:
            report.add({"reason": "not_an_image", "path": str(entry.path)})
            continue
        files.append(entry.path)
        targets.append(class_names.index(display_name(entry.parts[0])))
        sources.append(display_name(str(entry.path)))
    if not files:
        raise LabelledDataError(
            f"{path}: no image files (or .npy arrays) in its class subfolders "
            f"({', '.join(folders)})"
        )
    order = sorted(range(len(files)), key=lambda i: (targets[i], natural_key(sources[i])))
    report.kept = len(files)
    report.read = report.kept + report.num_dropped
    return LabelledInputs(
        [files[i] for i in order],
        np.asarray([targets[i] for i in order], dtype=np.int64),
        [sources[i] for i in order],
        report=report,
    )


def _named(entry: TreeEntry) -> dict[str, str]:
    record = {"reason": entry.status, "path": str(entry.path)}
    return record | {"detail": entry.detail} if entry.detail else record


def read_labelled_csv(
    path: Path,
    class_names: list[str],
    *,
    text_column: str,
    label_column: str,
    pair_column: str | None = None,
    label_separator: str | None = None,
) -> LabelledInputs:
    """The texts (with `pair_column`: (text, pair) pairs) and labels of a CSV, as `infer.py`
    predict reads a CSV (kiln.inference.files); rows are numbered from 1 after the header, as
    the training data report numbers them. `label_separator` (a multi-label model): each label
    field is a set, split as training split it; targets are multi-hot (N, C) float32."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():  # a FIFO named x.csv would block pandas: never opened
        raise LabelledDataError(f"{path}: not a regular file; evaluate reads a .csv file")
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        message = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise LabelledDataError(f"{path}: cannot be read as CSV: {message}") from None
    wanted = (text_column, label_column, pair_column)
    missing = [c for c in wanted if c is not None and c not in frame.columns]
    if missing:
        raise LabelledDataError(
            f"{path}: no {' or '.join(map(repr, missing))} column; columns present: "
            f"{', '.join(map(repr, frame.columns))} (evaluate reads the training run's "
            f"data.text_column={text_column!r} and data.label_column={label_column!r})"
        )
    if frame.empty:
        raise LabelledDataError(f"{path}: has a header but no rows to evaluate")
    labels = frame[label_column].str.strip().tolist()  # as the training reader strips labels
    if label_separator is not None:  # a set per row; a row of no label cannot be scored
        sets = [split_labels(label, label_separator) for label in labels]
        labels = [label if found else "" for label, found in zip(labels, sets, strict=True)]
    index = {name: i for i, name in enumerate(class_names)}
    rows = [row for row, label in enumerate(labels, start=1) if label]
    name = path.name
    report = left_out(path, "rows")
    for row, label in enumerate(labels, start=1):
        if not label:
            report.add({"reason": "missing_label", "row": row, "column": label_column})
    report.read, report.kept = len(labels), len(rows)
    if label_separator is not None:
        unknown = [(row, label) for row in rows for label in sets[row - 1] if label not in index]
    else:
        unknown = [(row, labels[row - 1]) for row in rows if labels[row - 1] not in index]
    if unknown:
        raise LabelledDataError(
            f"{path}: {_unknown_rows(unknown)} not among the checkpoint's classes "
            f"({_some(class_names)}) in column {label_column!r}; remove those rows, or "
            "evaluate a checkpoint trained with those classes"
        )
    if not rows:
        raise LabelledDataError(f"{path}: no row has a label in column {label_column!r}")
    texts = frame[text_column].tolist()
    if pair_column is not None:
        texts = [[a, b] for a, b in zip(texts, frame[pair_column].tolist(), strict=True)]
    return LabelledInputs(
        inputs=[texts[row - 1] for row in rows],
        targets=multi_hot([[index[x] for x in sets[row - 1]] for row in rows], len(index))
        if label_separator is not None
        else np.asarray([index[labels[row - 1]] for row in rows], dtype=np.int64),
        sources=[f"{name} row {row}" for row in rows],
        report=report,
    )


def read_labelled_records(
    path: Path,
    fmt: str,
    class_names: list[str],
    *,
    text_column: str,
    label_column: str,
    pair_column: str | None = None,
    label_separator: str | None = None,
) -> LabelledInputs:
    """The texts and labels of Parquet, JSON Lines or a `datasets` folder (`fmt`), read by the
    training's reader (kiln.data.text_formats: the same columns, ClassLabel names, bounds) with
    no cleaning (the Predictor cleans as training did). A row without a text or a label, or
    that the reader cannot use, is left out and counted with its reason and row."""
    from kiln.data.csv_reader import CsvSettings, CsvTextError
    from kiln.data.text_formats import read_rows, source_name
    from kiln.preprocessing.cleaning import TextCleaning
    from kiln.preprocessing.text import split_pair

    raw = TextCleaning(False, False, "none", False, False)  # as written: the Predictor cleans
    settings = CsvSettings(
        text_column,
        label_column,
        cleaning=raw,
        pair_column=pair_column,
        label_separator=label_separator,
    )
    report = left_out(path, "rows")
    texts, labels, rows = [], [], []
    try:
        for chunk in read_rows(path, settings, report, fmt):
            texts += [list(p) if isinstance(p := split_pair(t), tuple) else p for t in chunk.texts]
            labels += chunk.labels
            rows += chunk.rows
    except CsvTextError as err:
        raise LabelledDataError(str(err)) from None
    index = {name: i for i, name in enumerate(class_names)}
    sets = [split_labels(label, label_separator) for label in labels] if label_separator else []
    if label_separator is not None:
        pairs = zip(rows, sets, strict=True)
        unknown = [(r, x) for r, found in pairs for x in found if x not in index]
    else:
        unknown = [(r, label) for r, label in zip(rows, labels, strict=True) if label not in index]
    if unknown:
        raise LabelledDataError(
            f"{path}: {_unknown_rows(unknown)} not among the checkpoint's classes "
            f"({_some(class_names)}) in column {label_column!r}; remove those rows, or "
            "evaluate a checkpoint trained with those classes"
        )
    if not rows:
        raise LabelledDataError(f"{path}: no row has a text and a label ({report.summary()})")
    name = source_name(path)
    return LabelledInputs(
        inputs=texts,
        targets=multi_hot([[index[x] for x in found] for found in sets], len(index))
        if label_separator is not None
        else np.asarray([index[label] for label in labels], dtype=np.int64),
        sources=[f"{name} row {row}" for row in rows],
        report=report,
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
    """ "label 'x' (2 rows: 3, 9); label 'y' (1 row: 4)", the first few rows of each label."""
    by_label: dict[str, list[int]] = {}
    for row, label in unknown:
        by_label.setdefault(label, []).append(row)
    parts = []
    for label, rows in by_label.items():
        shown = ", ".join(map(str, rows[:ROWS_NAMED])) + (" ..." if len(rows) > ROWS_NAMED else "")
        parts.append(f"label {label!r} ({len(rows)} row{'s' if len(rows) > 1 else ''}: {shown})")
    return f"{len(unknown)} row(s) have " + "; ".join(parts) + ","


def _some(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... {len(names)} in all" if len(names) > limit else "")


# ---------------------------------------------------------------------------------------------
# Detection: a COCO file or a YOLO images folder, read by the training's own readers


@dataclass
class LabelledBoxes:
    """A labelled detection set for the report: its images and boxes (a DetectionImages over
    every image, labels as the checkpoint numbers its classes), what each image is, and what
    the reader left out (a data_report.json split entry)."""

    dataset: Any  # kiln.data.detection_files.DetectionImages
    sources: list[str]
    report: dict[str, Any]
    layout: str  # coco | yolo


def coco_images_folder(json_path: Path) -> Path:
    """The folder a COCO file's file_names are relative to: kiln's layout (coco/val.json +
    coco/images/val/), COCO 2017's (annotations/instances_val2017.json + val2017/), or the
    file's own folder (Roboflow's valid/_annotations.coco.json + valid/*.jpg)."""
    folder, stem = json_path.parent, json_path.stem
    for candidate in (
        folder / "images" / stem,
        folder.parent / stem.removeprefix("instances_"),
        folder / "images",
    ):
        if candidate.is_dir():
            return candidate
    return folder


def read_labelled_boxes(
    path: Path, class_names: Sequence[str], *, max_image_pixels: int | None
) -> LabelledBoxes:
    """`data=` of a detector's evaluation: a COCO `instances` JSON (or a folder holding exactly
    one), or a YOLO images folder (<root>/images/<split>, its labels beside it, its names in a
    data.yaml above). Boxes and images are checked as training checks them (what is left out is
    in the report); classes are matched to the checkpoint's by name, and a box of a class it
    does not know is an error naming the class."""
    from kiln.data.detection_files import DetectionImages
    from kiln.data.yolo import labels_dir

    if path.is_dir() and "images" in path.parts and labels_dir(path).is_dir():
        split, file_names, root, layout = _yolo_folder(path, max_image_pixels)
    else:
        split, file_names, root, layout = _coco_file(_coco_json(path), max_image_pixels)
    names = list(class_names)
    # The file's labels (1..len(file_names)) as the checkpoint numbers its classes
    to_ours = np.array([0] + [names.index(n) + 1 if n in names else -1 for n in file_names])
    used = {int(k) for labels in split.labels + split.crowd_labels for k in labels}
    unknown = sorted(file_names[k - 1] for k in used if to_ours[k] < 0)
    if unknown:
        raise LabelledDataError(
            f"data={path}: boxes of class(es) {', '.join(map(repr, unknown))}, which the "
            f"checkpoint does not know (its classes: {', '.join(names)}): evaluate on data "
            "labelled with its classes"
        )
    if not split.paths:
        raise LabelledDataError(
            f"data={path}: no usable image ({split.images_log.summary()}; images looked for "
            f"under {root})"
        )
    dataset = DetectionImages(
        split.paths,
        split.boxes,
        [to_ours[k] for k in split.labels],
        max_pixels=max_image_pixels,
        sizes=split.sizes,
        crowd=list(zip(split.crowd_boxes, [to_ours[k] for k in split.crowd_labels], strict=True)),
    )
    sources = [display_name(os.path.relpath(p, root)) for p in split.paths]
    return LabelledBoxes(dataset, sources, split.report(), layout)


def _coco_json(path: Path) -> Path:
    """The COCO file `data=` names: itself, or the one .json of a folder."""
    if path.is_dir():
        found = sorted(path.glob("*.json"))
        if len(found) == 1:
            return found[0]
        raise LabelledDataError(
            f"data={path}: a detector is evaluated on a COCO file (data=<file>.json, or a "
            "folder holding one) or a YOLO images folder (data=<root>/images/<split>, with "
            f"<root>/labels/<split> beside it); this folder has {len(found)} .json files and "
            "no labels folder beside it"
        )
    if not path.is_file():
        raise LabelledDataError(f"data={path}: no such file or folder")
    if path.suffix.lower() != ".json":
        raise LabelledDataError(
            f"data={path}: a detector is evaluated on a COCO .json file or a YOLO images folder"
        )
    return path


def _coco_file(path: Path, max_image_pixels: int | None):
    """(split, the file's class names by label, its images folder, "coco")."""
    from kiln.config.data import CocoConfig
    from kiln.data.coco import read_coco_file, read_coco_split

    cfg = CocoConfig(name="coco", train_json=str(path), max_image_pixels=max_image_pixels)
    coco = read_coco_file(path, "data", cfg.max_json_bytes)
    root = coco_images_folder(path)
    label_of = {category: k for k, category in enumerate(coco.categories, start=1)}
    split, _ = read_coco_split(coco, root, label_of, cfg)
    return split, list(coco.categories.values()), root, "coco"


def _yolo_folder(path: Path, max_image_pixels: int | None):
    """(split, the names file's class names by label, the images folder, "yolo")."""
    from kiln.config.data import YoloConfig
    from kiln.data.yolo import find_names_file, read_names, read_yolo_split

    cfg = YoloConfig(name="yolo", train_dir=str(path), max_image_pixels=max_image_pixels)
    file_names = read_names(find_names_file(path, None), cfg.max_label_file_bytes)
    return read_yolo_split(path, len(file_names), cfg, "data"), file_names, path, "yolo"
