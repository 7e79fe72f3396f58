"""device=auto|cpu|cuda -> a torch.device, the same way for training and inference."""

from __future__ import annotations

import torch

from kiln.errors import UserError, attempt


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


def cpu_runs_natively(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions for bf16 or fp16 (AVX512-BF16/FP16, AMX, Arm's), as
    oneDNN sees it. Without them oneDNN emulates the type: a convolution costs 65 fp32 ones
    (measured on an AVX2 CPU), a transformer's layers 2.5."""
    probe = {
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
    }[dtype]
    native, err = attempt(probe)
    return err is None and bool(native)
