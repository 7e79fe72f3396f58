"""The train/validation split of every dataset that holds one out (digits, image folders, CSV
text): scikit-learn's `train_test_split(..., stratify=labels)` to the index, in numpy alone.
Importing scikit-learn costs a second or more of every run's start-up, a quarter of a short run;
tests/test_splits.py holds this to scikit-learn's own on many label sets.

Stratified where every class can be in both splits (StratifiedShuffleSplit: per class its share
of each split, ties broken at random); else one seeded shuffle (ShuffleSplit)."""

from __future__ import annotations

import numpy as np


def val_count(n: int, val_fraction: float, items: str, instead: str, error=ValueError) -> int:
    """round(n * val_fraction) items held out; `error` when a split would be empty (`instead`:
    the setting that names a validation set of its own)."""
    num_val = round(n * val_fraction)
    if num_val < 1 or num_val >= n:
        raise error(
            f"data.val_fraction={val_fraction} of {n} {items} leaves an empty split: use more "
            f"{items}, another data.val_fraction, or {instead}"
        )
    return num_val


def stratified_split(labels: np.ndarray, num_val: int, seed: int) -> tuple[np.ndarray, ...]:
    """(train positions, val positions), num_val of them for validation, in scikit-learn's
    order (shuffled): what train_test_split(np.arange(n), test_size=num_val, random_state=seed,
    stratify=labels) returns, or stratify=None where some class cannot be in both splits."""
    n = len(labels)
    classes, codes, counts = np.unique(labels, return_inverse=True, return_counts=True)
    rng = np.random.RandomState(seed)
    if counts.min() < 2 or not len(classes) <= num_val <= n - len(classes):
        order = rng.permutation(n)
        return order[num_val:], order[:num_val]
    by_class = np.split(np.argsort(codes, kind="stable"), np.cumsum(counts)[:-1])
    n_train = _approximate_mode(counts, n - num_val, rng)
    n_val = _approximate_mode(counts - n_train, num_val, rng)
    train, val = [], []
    for k, members in enumerate(by_class):
        shuffled = members[rng.permutation(counts[k])]
        train.extend(shuffled[: n_train[k]])
        val.extend(shuffled[n_train[k] : n_train[k] + n_val[k]])
    return rng.permutation(train), rng.permutation(val)


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """Per class its share of `draws` (scikit-learn's utils.extmath._approximate_mode): the
    floors, then one more for the largest remainders, ties broken at random."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    need = int(draws - floored.sum())
    if need > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (tied,) = np.where(remainder == value)
            add = min(len(tied), need)
            floored[rng.choice(tied, size=add, replace=False)] += 1
            need -= add
            if need == 0:
                break
    return floored.astype(int)
