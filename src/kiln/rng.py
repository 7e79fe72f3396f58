"""Every random number generator's state, as plain data: what a checkpoint saves (loadable with
torch.load(weights_only=True)) and what a check that must leave no trace puts back; one seed for
them all; torch's generators forked for a block. The one place that knows the generators (python,
numpy, torch's CPU and CUDA ones). DataLoader workers are seeded from the loader's own generator
(kiln.data.loaders)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


@contextlib.contextmanager
def forked(seed: int | None = None, cuda: bool = True) -> Iterator[None]:
    """torch's generators (CPU, and CUDA unless cuda=False) as they were, after the block; seeded
    with `seed` inside it when given. The random numbers drawn inside are not the run's."""
    with torch.random.fork_rng(devices=None if cuda else []):
        if seed is not None and cuda:
            torch.manual_seed(seed)
        elif seed is not None:
            torch.default_generator.manual_seed(seed)  # not touching CUDA (a loader worker)
        yield


def rng_state() -> dict:
    """All RNG states as plain data (tensors and tuples, no pickled objects)."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value):
    if isinstance(value, list | tuple):
        return tuple(_as_tuple(v) for v in value)
    return value
