"""precision=<option> -> (autocast dtype, whether a GradScaler runs) on the training device."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kiln.registry import PRECISIONS


@dataclass(frozen=True)
class Precision:
    name: str
    autocast_dtype: torch.dtype | None  # None: no autocast
    use_grad_scaler: bool
    device_type: str

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)


def resolve_precision(name: str, device: torch.device) -> Precision:
    return PRECISIONS.get(name)(device)


def fp32(device: torch.device) -> Precision:
    return Precision("fp32", None, False, device.type)


def amp(device: torch.device) -> Precision:
    """fp16 + GradScaler on CUDA; on CPU fp16 autocast is slow and has no scaler, so amp falls
    back to bf16 there."""
    if device.type == "cuda":
        return Precision("amp", torch.float16, True, device.type)
    return Precision("amp", torch.bfloat16, False, device.type)


def bf16(device: torch.device) -> Precision:
    """bf16 never needs a scaler: it has fp32's exponent range."""
    return Precision("bf16", torch.bfloat16, False, device.type)
