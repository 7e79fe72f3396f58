"""device=auto|cpu|cuda -> a torch.device, the same way for training and inference."""

from __future__ import annotations

import torch

from kiln.errors import UserError


class DeviceError(UserError, ValueError):
    """device= names a device this machine does not have (or no device at all)."""


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """auto: CUDA when available. Under torchrun each rank takes the GPU of its local rank."""
    if name not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"device={name!r}; expected auto, cpu or cuda")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError("device=cuda but torch.cuda.is_available() is False; run kiln-doctor")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
