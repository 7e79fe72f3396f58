"""precision=<option> -> (autocast dtype, whether a GradScaler runs) on the training device."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from kiln.device import cpu_runs_natively
from kiln.registry import PRECISIONS

log = logging.getLogger(__name__)


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
    precision = PRECISIONS.get(name)(device)
    bf16 = precision.autocast_dtype == torch.bfloat16
    if bf16 and device.type == "cpu" and not cpu_runs_natively(torch.bfloat16):
        log.warning(
            "precision=%s runs in bf16 on a CPU without bf16 instructions: oneDNN emulates "
            "it, convolutions tens of times slower than in fp32 (x65 measured on an AVX2 CPU, "
            "a transformer x2.7); precision=fp32 trains faster on this machine",
            name,
        )
    return precision


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
