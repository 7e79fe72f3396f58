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
