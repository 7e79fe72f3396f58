"""The predictions table, one writer for every command that writes one: infer.py predict on
arrays, texts or files (preds.csv) and evaluate (eval/predictions.csv). Columns: index,
[source], [true], label, prob_<class>..., [error]; one row per input, in input order; a row
without a prediction has an empty label and probabilities and says why in `error`. A multi-label
model's table has `labels` instead of `label`: the classes at or above its threshold, joined by
its label separator (as the training file held them; `true` likewise). Written through
kiln.atomic: a failed run leaves no half-written table."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kiln.atomic import AtomicFile
from kiln.data.multilabel import join_labels, predicted_sets


class CsvTable(AtomicFile):
    """Rows written as they come to a temporary file beside `path`, moved onto `path` by
    `commit` (or removed by `discard`)."""

    def __init__(self, path: Path, header: list[str]):
        # A path that is not UTF-8 on disk (lone surrogates) is written escaped, never a crash
        super().__init__(
            path, "w", unique=True, newline="", encoding="utf-8", errors="backslashreplace"
        )
        self.writer = csv.writer(self.file, lineterminator="\n")  # as pandas writes it
        self.writer.writerow(header)


def number(value) -> str:
    return str(np.float32(value))  # float32's shortest text (what pandas writes for float32)


class PredictionsCsv(CsvTable):
    """index, [source], [true], label, prob_<class>..., [error]."""

    def __init__(
        self,
        path,
        class_names: Sequence[str],
        *,
        sources: bool = True,
        truth: bool = False,
        errors: bool = True,
        multi_label=None,
    ):
        """multi_label: (label separator, threshold) of a multi-label model, else None."""
        self.class_names = list(class_names)
        self.sources, self.truth, self.errors = sources, truth, errors
        self.multi_label = multi_label
        header = [
            "index",
            *(["source"] if sources else []),
            *(["true"] if truth else []),
            "labels" if multi_label else "label",
            *[f"prob_{name}" for name in self.class_names],
            *(["error"] if errors else []),
        ]
        super().__init__(Path(path), header)

    def predicted(self, probs) -> str:
        """The prediction cell: the most probable class, or (multi-label) the joined set."""
        if self.multi_label is None:
            return self.class_names[int(np.argmax(probs))]
        separator, threshold = self.multi_label
        chosen = np.flatnonzero(predicted_sets(probs, threshold))
        return join_labels([self.class_names[i] for i in chosen], separator)

    def row(self, index: int, probs=None, source: str = "", true: str = "", error: str = ""):
        """One input's row: its probabilities, or (probs=None) none and why not."""
        cells: list = [index, *([source] if self.sources else []), *([true] if self.truth else [])]
        if probs is None:
            cells += [""] * (len(self.class_names) + 1)
        else:
            cells += [self.predicted(probs), *map(number, probs)]
        self.writer.writerow([*cells, *([error] if self.errors else [])])

    def write(self, batch, files) -> None:
        """A batch of input files (kiln.inference.stream.ItemBatch), in input order."""
        rows = dict(zip(batch.good, np.asarray(batch.outputs), strict=True))
        for i in batch.indices:
            self.row(i, rows.get(i), files[i].source, error=batch.errors.get(i, ""))


def write_predictions(
    probs: np.ndarray,
    class_names: Sequence[str],
    path,
    sources: Sequence[str] | None = None,
    skipped: dict[int, str] | None = None,
    truth: Sequence[str] | None = None,
    multi_label: tuple[str, float] | None = None,
) -> Path:
    """The table for predictions already made: `probs` (N, K) for the inputs not in `skipped`
    ({index: why not}: an `error` column, text models); `sources` and `truth` (class names) add
    their columns; `multi_label`: (separator, threshold) of a multi-label model."""
    table = PredictionsCsv(
        path,
        class_names,
        sources=sources is not None,
        truth=truth is not None,
        errors=skipped is not None,
        multi_label=multi_label,
    )
    skipped = skipped or {}
    total = len(probs) + len(skipped)
    predicted = iter(probs)
    with table:
        for i in range(total):
            table.row(
                i,
                None if i in skipped else next(predicted),
                sources[i] if sources is not None else "",
                truth[i] if truth is not None else "",
                skipped.get(i, ""),
            )
    return table.path
