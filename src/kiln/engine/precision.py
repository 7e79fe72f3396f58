"""The precision group turned into (autocast dtype, whether a GradScaler runs)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    name: str
    autocast_dtype: torch.dtype | None  # None: no autocast
    use_grad_scaler: bool
    device_type: str

    @property
    def mixed(self) -> bool:
        return self.autocast_dtype is not None

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)


def resolve_precision(name: str, device: torch.device) -> Precision:
    """amp means fp16 + GradScaler on CUDA; on CPU fp16 autocast is slow and has no scaler, so amp
    falls back to bf16 there. bf16 never needs a scaler (fp32's exponent range)."""
    kind = device.type
    if name == "fp32":
        return Precision(name, None, False, kind)
    if name == "amp":
        if kind == "cuda":
            return Precision(name, torch.float16, True, kind)
        return Precision(name, torch.bfloat16, False, kind)
    if name == "bf16":
        return Precision(name, torch.bfloat16, False, kind)
    raise ValueError(f"precision={name!r}; choose fp32, amp or bf16")
