"""The one split (kiln.data.split) against scikit-learn's own train_test_split: the digits and
image-folder splits (and the digits cache) of earlier runs stay the same to the index."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.data.split import stratified_split, val_count

LABEL_SETS = {
    "balanced": np.repeat(np.arange(4), 25),
    "skewed": np.array([0] * 70 + [1] * 20 + [2] * 7 + [3] * 3),
    "tied remainders": np.repeat(np.arange(7), 3),
    "gaps in the codes": np.array([5, 9, 9, 5, 2, 2, 9, 5, 2, 9, 9, 5]),
    "a class of one": np.array([0] * 10 + [1] * 9 + [2]),
    "random": np.random.default_rng(0).integers(0, 10, 1797),
}


def sklearn_split(labels: np.ndarray, num_val: int, seed: int):
    from sklearn.model_selection import train_test_split  # 2 CPU-s: not at every collection

    n = len(labels)
    counts = np.unique(labels, return_counts=True)[1]
    stratify = counts.min() >= 2 and len(counts) <= num_val <= n - len(counts)
    return train_test_split(
        np.arange(n), test_size=num_val, random_state=seed, stratify=labels if stratify else None
    )


@pytest.mark.parametrize("name", list(LABEL_SETS))
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("seed", [0, 3, 12345])
def test_the_split_is_scikit_learns(name, fraction, seed):
    labels = LABEL_SETS[name]
    num_val = max(1, round(len(labels) * fraction))
    train, val = stratified_split(labels, num_val, seed)
    expected_train, expected_val = sklearn_split(labels, num_val, seed)
    assert np.array_equal(train, expected_train) and np.array_equal(val, expected_val)
    assert len(val) == num_val and sorted([*train, *val]) == list(range(len(labels)))


def test_every_class_is_in_both_splits_where_it_can_be():
    labels = LABEL_SETS["skewed"]
    train, val = stratified_split(labels, 20, 0)
    assert set(labels[train]) == set(labels[val]) == {0, 1, 2, 3}
    assert np.bincount(labels[val]).tolist() == [14, 4, 1, 1]  # each class's share of 20


def test_an_empty_split_names_the_fraction_and_the_way_out():
    assert val_count(10, 0.25, "rows", "data.val_path") == 2  # round(2.5): to even
    expected = (
        r"data.val_fraction=0.01 of 10 rows leaves an empty split: use more rows, another "
        r"data.val_fraction, or data.val_path"
    )
    with pytest.raises(ValueError, match=expected):
        val_count(10, 0.01, "rows", "data.val_path")
    with pytest.raises(KeyError):
        val_count(4, 1.0, "images", "data.val_dir", error=KeyError)
