"""Data no model can learn from, named as data before any model is built or checked: a training
split whose inputs are all one input (a folder of copies of one image, a CSV whose texts are
all the same) stopped the run later as a model failure (`at_chance`, or a probe's "dead
gradients") that pointed at the model. A split of a single class is refused by each dataset
(classification needs two). Here: one `error:` line, exit 2."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.errors import UserError

SAMPLED = 64  # training inputs compared, evenly spread over the split


class DegenerateDataError(UserError, ValueError):
    """A training split no model can learn from; the message says what and where."""


def check_inputs_vary(dataset, where: str) -> None:
    """DegenerateDataError when the SAMPLED inputs evenly spread over `dataset` are all the
    same. Inputs are read until the first that differs from the first one (two reads on any
    real data); an image file dataset's `load` gives the decoded picture before its random
    augmentation, so copies of one image are found however they are flipped or cropped."""
    count = len(dataset)
    if count < 2:
        return
    picks = np.unique(np.linspace(0, count - 1, min(SAMPLED, count)).round().astype(np.int64))
    first = _input(dataset, int(picks[0]))
    if any(not _same(first, _input(dataset, int(i))) for i in picks[1:]):
        return
    raise DegenerateDataError(
        f"all {len(picks)} training inputs sampled (of {count:,}) are identical ({where}): no "
        "model can learn from copies of one input; check the data (one file copied under "
        "every name? an export that wrote one text in every row?)"
    )


def _input(dataset, index: int) -> Any:
    if hasattr(dataset, "load"):
        return dataset.load(index)
    item = dataset[index]
    return item[0] if isinstance(item, tuple | list) else item


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and np.array_equal(a, b)
    return type(a) is type(b) and bool(a == b)
