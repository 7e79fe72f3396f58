"""Padding: a text's output depends on its own tokens, not on how much padding its batch gave it
nor on the text beside it. The batch-dependence probe takes the 8 longest texts, which often
hold no padding at all: mean-pooling over the padding, an attention mask inverted or never
passed, and a softmax over the batch in attention pooling each trained `ok` (or stopped only
where the data's lengths happened to pad the probe batch).

So the probe varies the padding itself, with the data's shortest text (`ProbeBatches.padding`:
it beside the longest, padded to its length): eval mode, no grad, three forwards of at most two
texts -- the shortest text alone with no padding, alone padded to the longest's length, and
padded beside the longest. Alone unpadded vs alone padded differ: the model reads its padding;
alone padded vs beside the longest differ: a sample's output depends on its neighbour. The
module is named from the first module call whose output (at the text's real positions) differs
between the runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.guards.batch_independence import (
    BatchDependenceError,
    Event,
    difference,
    per_sample,
    recording,
    tolerance,
)
from kiln.guards.input_sizes import select
from kiln.guards.no_trace import untouched
from kiln.guards.rules import BATCH, PADDING, ProbeFailure

Forward = Callable[[nn.Module, Any, bool], Any]


class PaddingError(ProbeFailure):
    """The output of a text changes with the padding its batch gives it."""

    what = "padding"


def padded_runs(pair: Any, pad_id: int) -> tuple[Any, Any, int, int] | None:
    """(the shortest text alone without padding, alone padded, its tokens, the padded length)
    from `pair` (the shortest text padded beside the longest); None where the shortest is not
    padded on the right (nothing to vary)."""
    ids = pair[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or len(ids) < 2:
        return None
    real = ids[0] != pad_id
    count, width = int(real.sum()), ids.shape[1]
    if count == 0 or count == width or not bool(real[:count].all()):
        return None  # no padding, or not padded on the right
    alone = select(pair, [0])
    trimmed = type(alone)((alone[0][:, :count], *alone[1:]))
    return trimmed, alone, count, width


def check_padding(model: nn.Module, pair: Any, forward: Forward, pad_id: int) -> None:
    """PaddingError when the shortest text's output changes with its padding alone;
    BatchDependenceError when it changes with the text beside it."""
    runs = padded_runs(pair, pad_id)
    if runs is None:
        return
    trimmed, alone, count, width = runs
    with untouched(model), torch.no_grad():
        model.eval()
        outputs = [
            per_sample(forward(model, batch, False), len(batch[0]))
            for batch in (trimmed, alone, pair)
        ]
        if not outputs[0]:
            return
        for path, base in outputs[0].items():
            padded = outputs[1].get(path)
            gap = difference(padded[0], base[0]) if padded is not None else float("inf")
            if gap is not None:
                where = _first_change(model, forward, trimmed, alone, count)
                raise PaddingError(
                    f"{PADDING}: {type(model).__name__}: the data's shortest text ({count} "
                    f"tokens) gives another {path} alone with no padding than alone padded to "
                    f"{width} tokens (up to {gap:.3g} apart, tolerance {tolerance(base[0]):.2g}): "
                    f"the model reads its padding; first seen in {where[1]}. Leave padding out "
                    "of every sum, mean and attention (mask = ids != pad_id: mean over "
                    "h[mask], key_padding_mask=~mask)",
                    module=where[0],
                )
            beside = outputs[2].get(path)
            gap = difference(beside[0], padded[0]) if beside is not None else float("inf")
            if gap is not None:
                where = _first_change(model, forward, alone, pair, width, rows=[0])
                raise BatchDependenceError(
                    f"{BATCH}: {type(model).__name__}: the data's shortest text, padded to "
                    f"{width} tokens, gives another {path} alone than beside the longest text "
                    f"(up to {gap:.3g} apart): its output depends on its neighbour; first seen "
                    f"in {where[1]}. Take softmaxes and statistics over the sequence or the "
                    "features, never over dim 0 (the batch)",
                    module=where[0],
                )


def _first_change(
    model: nn.Module,
    forward: Forward,
    first: Any,
    second: Any,
    positions: int,
    rows: list[int] | None = None,
) -> tuple[str, str]:
    """(path, where) of the first module call whose input or output differs between the two
    runs, compared at the first `positions` of a sequence dimension where their lengths
    differ (and at `rows` of the second run)."""
    runs = []
    for batch in (first, second):
        with recording(model, len(batch[0])) as events:
            forward(model, batch, False)
        runs.append(events)
    for a, b in zip(*runs, strict=False):
        if (a.path, a.side) != (b.path, b.side):
            continue
        tb = b.tensor[rows] if rows is not None else b.tensor
        ta, tb = _aligned(a.tensor, tb, positions)
        if ta is None or difference(tb, ta) is None:
            continue
        return _where(model, a)
    return "", f"{type(model).__name__}.forward (no module's output shows it)"


def _aligned(a: torch.Tensor, b: torch.Tensor, positions: int):
    """The two tensors cut to their common real positions (dim 1), or (None, None)."""
    if a.shape == b.shape:
        return a, b
    if a.dim() != b.dim() or a.dim() < 2 or a.shape[0] != b.shape[0]:
        return None, None
    if a.shape[2:] != b.shape[2:]:
        return None, None
    keep = min(positions, a.shape[1], b.shape[1])
    return a[:, :keep], b[:, :keep]


def _where(model: nn.Module, event: Event) -> tuple[str, str]:
    if event.side == "output":
        return event.path, f"{event.where}: its output differs, its inputs do not"
    caller = event.caller or ""
    kind = type(model.get_submodule(caller)).__name__ if caller else type(model).__name__
    return caller, (
        f"{caller or '<model>'} ({kind}).forward, before it calls {event.where}: that call's "
        "input differs"
    )
