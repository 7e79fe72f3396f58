"""Multi-label data (several labels per item, `data.label_separator`): how a row's label field
splits into its labels, and the multi-hot targets (float, N x classes) the BCE loss takes. One
home for every dataset that reads label sets (csv_text, image_folder's labels_csv) and for the
evaluation report's labelled CSVs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def split_labels(field: str, separator: str) -> tuple[str, ...]:
    """A label field -> its labels: split on `separator`, stripped, empty pieces and repeats
    dropped, in their order ("b| a|b" -> ("b", "a")). An empty tuple: the row has no label."""
    labels = (piece.strip() for piece in field.split(separator))
    return tuple(dict.fromkeys(label for label in labels if label))


def join_labels(labels: Sequence[str], separator: str) -> str:
    """The labels as one field, as a file holds them (the predictions table's `labels`)."""
    return separator.join(labels)


def multi_hot(label_sets: Sequence[Sequence[int]], num_classes: int) -> np.ndarray:
    """(len(label_sets), num_classes) float32: 1 where the set holds the class."""
    table = np.zeros((len(label_sets), num_classes), dtype=np.float32)
    for row, classes in enumerate(label_sets):
        table[row, list(classes)] = 1.0
    return table


def predicted_sets(probs: np.ndarray, threshold: float) -> np.ndarray:
    """(N, C) probabilities -> (N, C) bool: the classes at or above the threshold."""
    return np.asarray(probs) >= threshold
