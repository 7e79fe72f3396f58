"""A single-label classifier's scores from its predicted and true class indices, through the
confusion matrix: per class precision, recall, F1 and support, and their macro averages over
the classes present in the labels or the predictions (a class absent from both would only add
a meaningless 0; scikit-learn's and torchmetrics' default, tested equal to scikit-learn's).
Plain numpy: torchmetrics' import alone took 3-6 s of every evaluation report (it imports its
image, text and audio metrics, and scipy.signal)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ClassScores:
    counts: np.ndarray  # (K, K) confusion matrix, rows: true class, columns: predicted
    precision: np.ndarray  # (K,), 0 where the class was never predicted
    recall: np.ndarray  # (K,), 0 where the class has no sample
    f1: np.ndarray  # (K,)
    support: np.ndarray  # (K,) samples of each true class

    @classmethod
    def of(cls, predicted: np.ndarray, targets: np.ndarray, k: int) -> ClassScores:
        predicted, targets = np.asarray(predicted, np.int64), np.asarray(targets, np.int64)
        return cls.from_counts(np.bincount(targets * k + predicted, minlength=k * k).reshape(k, k))

    @classmethod
    def from_counts(cls, counts: np.ndarray) -> ClassScores:
        """From a (K, K) confusion matrix (rows: true class), as validation sums it over ranks."""
        k = len(counts)
        hits, support, chosen = np.diag(counts), counts.sum(axis=1), counts.sum(axis=0)

        def ratio(a, b):
            return np.divide(a, b, out=np.zeros(k), where=b > 0)

        precision, recall = ratio(hits, chosen), ratio(hits, support)
        return cls(counts, precision, recall, ratio(2 * hits, support + chosen), support)

    @property
    def accuracy(self) -> float:
        return float(np.trace(self.counts) / max(int(self.counts.sum()), 1))

    def macro(self, values: np.ndarray) -> float:
        """The mean over the classes in the labels or the predictions."""
        present = (self.counts.sum(axis=1) + self.counts.sum(axis=0)) > 0
        return float(values[present].mean()) if present.any() else 0.0

    def per_class(self, class_names) -> dict[str, dict[str, float | int]]:
        return {
            name: {
                "precision": float(self.precision[i]),
                "recall": float(self.recall[i]),
                "f1": float(self.f1[i]),
                "support": int(self.support[i]),
            }
            for i, name in enumerate(class_names)
        }


def top_k_accuracy(probs: np.ndarray, targets: np.ndarray, k: int) -> float:
    """The share of samples whose true class is among their k most probable ones."""
    top = np.argsort(-np.asarray(probs), axis=1, kind="stable")[:, :k]
    return float((top == np.asarray(targets)[:, None]).any(axis=1).mean()) if len(top) else 0.0
