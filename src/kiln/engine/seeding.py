"""One seed drives python, numpy and torch (CPU and CUDA); DataLoader workers are seeded from the
loader's own generator (kiln.data.loaders)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def set_deterministic(enabled: bool) -> None:
    """Bitwise-repeatable kernels where PyTorch has them; errors where an op has none."""
    if enabled:
        # cuBLAS needs this workspace setting for deterministic matmuls on CUDA >= 10.2.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled
    if enabled or torch.are_deterministic_algorithms_enabled():
        # Only when it changes something: the call imports torch._inductor (over a second of
        # every run's start-up) even to switch off what is already off.
        torch.use_deterministic_algorithms(enabled, warn_only=False)


def rng_state() -> dict:
    """All RNG states as plain data (loadable with torch.load(weights_only=True))."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


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
