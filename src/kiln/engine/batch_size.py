"""trainer.find_batch_size: the largest per-device batch that fits, found on real training steps
(forward, backward and optimizer step), doubling until one runs out of memory and then bisecting.
The model and optimizer are restored after every trial."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def largest_that_fits(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest n in [1, limit] with fits(n), assuming fits is monotone: doubling from
    `start`, then bisecting between the last size that fit and the first that did not."""
    low, high = 0, None  # low fits (0: none yet), high does not
    n = max(1, min(start, limit))
    while high is None:
        if fits(n):
            low = n
            if n >= limit:
                return n
            n = min(n * 2, limit)
        else:
            high = n
    if low == 0:  # even the start did not fit: go down
        low, high = 0, n
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        if low == 0:
            raise RuntimeError("not even a batch of 1 fits in memory")
        return low
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def trial_step(model, optimizer, criterion, make_batch: Callable[[int], object], precision):
    """fits(n): one real training step at batch n; the model and optimizer come back as they
    were (their states are copied to the host first)."""

    def fits(n: int) -> bool:
        weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        state = copy.deepcopy(optimizer.state_dict())
        try:
            model.train()
            with precision.autocast():
                loss, _ = criterion(model, make_batch(n))
            loss.backward()
            optimizer.step()
            return True
        except Exception as err:  # any error: only an OOM is an answer, the rest re-raised
            if not is_out_of_memory(err):
                raise
            return False
        finally:
            optimizer.zero_grad(set_to_none=True)
            model.load_state_dict(weights)
            optimizer.load_state_dict(state)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    return fits
