"""The extremes of a dataset's training items, for the probes that run before step 1 (rule 1):
the longest sequences, the smallest and largest images, the images with no box and with the
most boxes. Chosen from the items themselves, never sampled: the same batches whatever the seed,
so a bug a probe can catch is caught on every run."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

from kiln.data.spec import DataBundle

log = logging.getLogger(__name__)

SCAN_LIMIT = 50_000  # items read to find the extremes of a dataset that does not list its sizes


@dataclass
class ProbeBatches:
    """Collated batches of training items, as the loader would collate them."""

    base: Any  # `size` items, the extremes first: what the batch-size and mode probes take from
    cases: list[tuple[str, Any]] = field(default_factory=list)  # (label, batch): forward+backward
    # texts: the shortest and the longest text in one batch, the shortest padded to the longest
    # (kiln.guards.padding); None for data without padding
    padding: Any = None


def probe_batches(bundle: DataBundle, size: int, batch_size: int) -> ProbeBatches:
    """The base batch and the data kind's extreme cases (`batch_size`: the training batch, per
    rank, for the longest batch of the epoch's plan)."""
    kind = bundle.spec.input_kind
    if kind == "tokens":
        return _token_batches(bundle, size, batch_size)
    if kind == "image_list":
        return _image_list_batches(bundle, size)
    return ProbeBatches(_collate(bundle, list(range(min(size, len(bundle.train))))))


def _collate(bundle: DataBundle, indices: list[int]) -> Any:
    collate = bundle.collate_fn or default_collate
    return collate([bundle.train[i] for i in indices])


def _scanned(bundle: DataBundle) -> range:
    count = len(bundle.train)
    if count > SCAN_LIMIT:
        log.info(
            "rule 1 probes: the extremes are those of the first %d of %d training items "
            "(the dataset does not list its item sizes)",
            SCAN_LIMIT,
            count,
        )
    return range(min(count, SCAN_LIMIT))


def token_lengths(bundle: DataBundle) -> np.ndarray:
    """Tokens per training item: the dataset's own list where it has one, else read."""
    lengths = bundle.bucket_lengths
    if lengths is None or len(lengths) != len(bundle.train):
        lengths = getattr(bundle.train, "lengths", None)
    if lengths is None or len(lengths) != len(bundle.train):
        lengths = [len(bundle.train[i][0]) for i in _scanned(bundle)]
    return np.asarray(lengths)


def _token_batches(bundle: DataBundle, size: int, batch_size: int) -> ProbeBatches:
    lengths = token_lengths(bundle)
    order = np.argsort(-lengths, kind="stable").tolist()  # longest first; ties by index
    base = _collate(bundle, order[:size])
    cases = []
    max_length = bundle.spec.max_length
    if max_length:
        cases.append(
            (
                f"2 sequences of {max_length} tokens (spec.max_length: the longest the data can "
                "produce)",
                _at_length(_collate(bundle, order[:2]), max_length, bundle.spec.pad_id),
            )
        )
    longest = int(lengths[order[0]]) if len(order) else 0
    count = min(batch_size, len(order))
    if count > 2 or longest != max_length:
        cases.append(
            (
                f"the longest batch of the epoch's plan ({count} x {longest} tokens: the "
                f"{count} longest texts)",
                _collate(bundle, order[:count]),
            )
        )
    shortest = next((i for i in reversed(order) if lengths[i] >= 1), None)
    padding = None
    if shortest is not None and int(lengths[shortest]) < longest:
        padding = _collate(bundle, [shortest, order[0]])
    return ProbeBatches(base, cases, padding)


def _at_length(batch: Any, length: int, pad_id: int) -> Any:
    """Each row's real tokens repeated to exactly `length` tokens, no padding: a text as long
    as the data allows."""
    ids, targets = batch
    rows = []
    for row in ids:
        real = row[row != pad_id]
        real = real if real.numel() else row[:1]
        rows.append(real.repeat(length // real.numel() + 1)[:length])
    return torch.stack(rows), targets


def image_list_sizes(bundle: DataBundle) -> list[tuple[int, int, int]]:
    """(height, width, boxes) per training item: the dataset's own list where it has one (a
    file's header, no decoding), else each item read (at most SCAN_LIMIT of them)."""
    listed = getattr(bundle.train, "item_sizes", None)
    known = listed() if listed is not None else None
    if known is not None and len(known) == len(bundle.train):
        return known
    sizes = []
    for i in _scanned(bundle):
        image, target = bundle.train[i]
        boxes = int(target["boxes"].shape[0]) if "boxes" in target else 0
        sizes.append((int(image.shape[-2]), int(image.shape[-1]), boxes))
    return sizes


def _image_list_batches(bundle: DataBundle, size: int) -> ProbeBatches:
    areas, boxes, aspects = [], [], []
    for height, width, count in image_list_sizes(bundle):
        areas.append(height * width)
        aspects.append(width / height)
        boxes.append(count)
    areas_a, boxes_a, aspects_a = np.asarray(areas), np.asarray(boxes), np.asarray(aspects)
    smallest, largest = int(areas_a.argmin()), int(areas_a.argmax())
    tallest, widest = int(aspects_a.argmin()), int(aspects_a.argmax())
    most, fewest = int(boxes_a.argmax()), int(boxes_a.argmin())
    fewest_label = (
        "an image with no box"
        if boxes_a[fewest] == 0
        else (f"the image with the fewest boxes ({boxes_a[fewest]})")
    )
    cases = [
        (
            f"{fewest_label} and the image with the most boxes ({boxes_a[most]}), in train mode",
            _collate(bundle, [fewest, most]),
        )
    ]
    side = lambda i: "x".join(str(s) for s in bundle.train[i][0].shape[-2:])  # noqa: E731
    cases.append(
        (
            f"the smallest ({side(smallest)}) and the largest ({side(largest)}) images",
            _collate(bundle, [smallest, largest]),
        )
    )
    if aspects_a[tallest] != aspects_a[widest]:
        cases.append(
            (
                f"the tallest ({side(tallest)}) and the widest ({side(widest)}) images",
                _collate(bundle, [tallest, widest]),
            )
        )
    cases.append(
        (f"a batch of 1 (the image with the most boxes, {side(most)})", _collate(bundle, [most]))
    )
    first = [fewest, most, smallest, largest]
    rest = [i for i in range(len(bundle.train)) if i not in first][: max(0, size - len(first))]
    base = _collate(bundle, list(dict.fromkeys(first + rest))[:size])
    return ProbeBatches(base, cases)
