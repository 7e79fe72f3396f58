"""Walk nested batches/outputs (tensors inside lists, tuples and dicts) with their paths."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def iter_tensors(obj: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from iter_tensors(value, f"{path}[{key!r}]")
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from iter_tensors(value, f"{path}[{i}]")


def describe(obj: Any) -> Any:
    """The structure of an output with shapes in place of tensors."""
    if isinstance(obj, torch.Tensor):
        if obj.is_nested:  # ragged: no single shape (the Transformer's eval fast path)
            return f"nested tensor of {obj.size(0)}"
        return tuple(obj.shape)
    if isinstance(obj, torch.Size):  # a shape passed between modules (timm's MViTv2): its ints
        return tuple(obj)
    if isinstance(obj, dict):
        return {key: describe(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return same_container(obj, [describe(value) for value in obj])
    return type(obj).__name__


def same_container(obj: list | tuple, values: list) -> list | tuple:
    """`values` in a container of `obj`'s kind: a named tuple takes them as fields; a subclass whose
    constructor refuses them (torch.Size of non-ints) becomes a plain tuple or list."""
    if hasattr(obj, "_fields"):
        return type(obj)(*values)
    try:
        return type(obj)(values)
    except TypeError:
        return list(values) if isinstance(obj, list) else tuple(values)


def copy_batch(batch: Any) -> Any:
    """The batch with every tensor cloned (a model that changes it in place changes a copy)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: copy_batch(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return same_container(batch, [copy_batch(v) for v in batch])
    return batch
