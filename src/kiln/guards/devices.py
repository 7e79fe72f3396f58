"""Turn PyTorch's terse 'tensors on different devices' error into a table of who sits where."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch import nn

from kiln.guards.tree import iter_tensors

MISMATCH_MARKERS = (
    "Expected all tensors to be on the same device",
    "on different devices",
    "is not on the expected device",
)


class DeviceMismatchError(RuntimeError):
    """Tensors of one step live on different devices; the message tables them."""


def is_device_mismatch(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(m in str(err) for m in MISMATCH_MARKERS)


def _group(named) -> dict[str, list[str]]:
    by_device: dict[str, list[str]] = defaultdict(list)
    for name, tensor in named:
        by_device[str(tensor.device)].append(name)
    return by_device


def explain_device_mismatch(err: BaseException, model: nn.Module, batch: Any) -> str:
    sections = {
        "parameters": _group(model.named_parameters()),
        "buffers": _group(model.named_buffers()),
        "batch tensors": _group(iter_tensors(batch)),
    }
    lines = [f"tensors on different devices: {err}", "", f"{'device':<10} {'kind':<14} names"]
    for kind, by_device in sections.items():
        for device, names in sorted(by_device.items()):
            shown = ", ".join(names[:6]) + (f", ... (+{len(names) - 6})" if len(names) > 6 else "")
            lines.append(f"{device:<10} {kind:<14} {shown}")
    lines.append("Move the model and every batch tensor to the one training device.")
    return "\n".join(lines)
