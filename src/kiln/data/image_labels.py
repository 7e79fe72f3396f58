"""Multi-label images listed in a CSV (`data=image_folder data.labels_csv=<csv>`): one row per
image, `path,labels`, the path relative to data.root (default: the CSV's folder), the labels
joined by data.label_separator. Every row is accounted for in the same bad-input report as a
class folder's files (kiln.data.image_scan.FolderLog): a row whose file is missing or not a
good image (verified as the folder scan verifies, with its verdict cache), whose labels split
into nothing (`missing_label`), or that holds a label with fewer than two good images
(`unknown_label`: not a class) is dropped with its reason and row; data.bad_rows=error stops at
the first. A validation or test CSV (data.val_labels_csv, data.test_labels_csv) is read the same
way against the training CSV's classes: a row holding a label they lack is `unseen_label`."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.config.base import ConfigError
from kiln.data.image_scan import FolderLog, ImageFolderError, VerdictCache, verify_file
from kiln.data.multilabel import split_labels
from kiln.preprocessing.image_files import DEFAULT_MAX_PIXELS
from kiln.sorting import natural_key

PATH_COLUMN, LABELS_COLUMN = "path", "labels"
MIN_IMAGES_PER_CLASS = 2  # as a class folder needs


@dataclass
class ListedImages:
    """The good rows of a labels CSV: image paths, each one's labels, its CSV row."""

    paths: list[str]
    labels: list[tuple[str, ...]]
    rows: list[int]
    log: FolderLog
    cache: dict | None = None


def read_labels_csv(
    csv_path: str,
    root: str | None,
    separator: str,
    *,
    channels: int,
    bad_rows: str,
    cache_dir: Path | None,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    key: str = "data.labels_csv",
    classes: Sequence[str] | None = None,
) -> tuple[ListedImages, list[str]]:
    """(the good rows, the classes: every label of two or more good images, natural order).
    `classes`: the training CSV's, for a validation or test CSV (`key`): a row holding another
    label is dropped as unseen_label, and the classes come back as given."""
    path = Path(csv_path)
    base = Path(root) if root is not None else path.parent
    log_ = FolderLog(str(path))
    try:
        with open(path, newline="", encoding="utf-8") as f:
            records = list(csv.DictReader(f))
            columns = list(records[0]) if records else []
    except (FileNotFoundError, IsADirectoryError):
        raise missing_labels_csv(path, key) from None
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ImageFolderError(f"cannot read {path} ({key}): {err}") from None
    if not records or PATH_COLUMN not in columns or LABELS_COLUMN not in columns:
        raise ImageFolderError(
            f"{path} ({key}): needs a header with {PATH_COLUMN!r} and "
            f"{LABELS_COLUMN!r} columns and one row per image; found columns {columns}"
        )
    log_.read = log_.files = len(records)

    def drop(row: int, reason: str, where: str, detail: str) -> None:
        if bad_rows == "error":
            raise ImageFolderError(
                f"{path}: row {row} ({where}) {detail} (data.bad_rows=drop skips such rows, "
                "listing them in data_report.json)"
            )
        log_.add({"reason": reason, "row": row, "path": where, "detail": detail})

    candidates = []  # (row, file, labels)
    for row, record in enumerate(records, start=1):
        name = (record.get(PATH_COLUMN) or "").strip()
        labels = split_labels(record.get(LABELS_COLUMN) or "", separator)
        if not name:
            drop(row, "missing_path", "", f"has no path in column {PATH_COLUMN!r}")
        elif not labels:
            what = f"has no label in column {LABELS_COLUMN!r} once split on {separator!r}"
            drop(row, "missing_label", name, what)
        else:
            candidates.append((row, base / name, labels))
    files = [file for _, file, _ in candidates]
    check = lambda file: verify_file(file, channels, max_pixels)  # noqa: E731
    cache = VerdictCache(cache_dir, base, max_pixels) if cache_dir is not None else None
    verdicts = cache.verdicts(files, check) if cache else {file: check(file) for file in files}
    if cache is not None:
        cache.save()
    good = []
    for row, file, labels in candidates:
        error = verdicts[file]
        if error is None:
            good.append((row, file, labels))
        else:
            drop(row, error.reason, str(file), error.detail)
    given = classes is not None
    if classes is None:
        counts: dict[str, int] = {}
        for _, _, labels in good:
            for label in labels:
                counts[label] = counts.get(label, 0) + 1
        classes = sorted(
            (n for n, c in counts.items() if c >= MIN_IMAGES_PER_CLASS), key=natural_key
        )
    classes = list(classes)
    listed = ListedImages([], [], [], log_)
    for row, file, labels in good:
        rare = [label for label in labels if label not in classes]
        if rare and given:
            drop(
                row,
                "unseen_label",
                str(file),
                f"has label(s) {', '.join(map(repr, rare))} that data.labels_csv's classes lack",
            )
            continue
        if rare:
            drop(
                row,
                "unknown_label",
                str(file),
                f"has label(s) {', '.join(map(repr, rare))} with fewer than "
                f"{MIN_IMAGES_PER_CLASS} good images: not a class",
            )
            continue
        listed.paths.append(str(file))
        listed.labels.append(labels)
        listed.rows.append(row)
    log_.kept = len(listed.paths)
    if cache is not None:
        listed.cache = {"file": str(cache.path), "hits": cache.hits, "checked": cache.checked}
    if given and not listed.paths:
        raise ImageFolderError(f"{path}: no usable images ({key}): {log_.summary()}")
    if len(classes) < 2:
        raise ImageFolderError(
            f"{path}: {len(classes)} label(s) have two or more good images ({key}): "
            "multi-label classification needs at least two classes (see data_report.json)"
        )
    return listed, classes


def missing_labels_csv(path: Path, key: str) -> ConfigError:
    return ConfigError(
        f"no such file: {path}",
        key,
        "give a CSV with a header of path,labels and one row per image (paths relative to "
        "data.root, else the CSV's folder)",
    )
