"""Throughput you can compare across machines: model FLOPs per sample (counted once, at start,
with torch.utils.flop_counter on one real training step) and MFU against the device's peak."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Dense peak TFLOPS by dtype (no sparsity), from the vendors' data sheets. Matched by a substring
# of torch.cuda.get_device_name(); trainer.peak_tflops overrides it (and is the only way on CPU).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6},
    "V100": {"fp16": 125.0, "fp32": 15.7, "tf32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1, "tf32": 8.1},
}


def compute_dtype(precision) -> str:
    """The dtype the matmuls run in: what the peak must be read for."""
    if precision.autocast_dtype == torch.bfloat16:
        return "bf16"
    if precision.autocast_dtype == torch.float16:
        return "fp16"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def peak_flops(device: torch.device, precision, override_tflops: float | None) -> float | None:
    """FLOP/s the device can do at its best in the run's dtype; None when unknown."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():
        if key in name:
            peak = table.get(compute_dtype(precision))
            return peak * 1e12 if peak else None
    return None


def flops_per_sample(model: nn.Module, forward, batch: Any, samples: int) -> float | None:
    """Model FLOPs of one training step (forward and backward) per sample, on `batch`. The
    model's gradients, buffers, RNG and mode are left as they were."""
    from kiln.engine.flop_count import count_flops
    from kiln.guards.no_trace import untouched
    from kiln.guards.tree import iter_tensors

    def step() -> None:
        model.train()
        output = forward(model, batch, True)
        tensors = [t for _, t in iter_tensors(output, "output") if t.is_floating_point()]
        sum(t.float().sum() for t in tensors).backward()

    with untouched(model):
        total = count_flops(step)
    return total / samples if total else None
