"""Deterministic kernels. (The seed and the generators' states live in kiln.rng.)"""

from __future__ import annotations

import os

import torch


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
