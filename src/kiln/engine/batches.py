"""Batches as the loaders give them: a tensor, or tensors nested in tuples, lists and dicts."""

from __future__ import annotations

from typing import Any

import torch

from kiln.guards.tree import same_container


def move_to(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: move_to(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return same_container(obj, [move_to(v, device, non_blocking) for v in obj])
    return obj


def batch_size_of(batch: Any) -> int:
    """Samples in an (inputs, targets) batch: inputs are a tensor or a list (one per sample)."""
    inputs = batch[0]
    return len(inputs) if isinstance(inputs, list | tuple) else inputs.shape[0]


def to_channels_last(obj: Any) -> Any:
    """4-D float tensors (image batches) in NHWC memory format; everything else as it is."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 4 and obj.is_floating_point():
            return obj.contiguous(memory_format=torch.channels_last)
        return obj
    if isinstance(obj, dict):
        return {k: to_channels_last(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return same_container(obj, [to_channels_last(v) for v in obj])
    return obj
