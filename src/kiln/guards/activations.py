"""debug=activations: forward hooks that record each layer's output mean/std and flag layers that
are dead (almost all zeros or no variance) or exploding (huge or non-finite values)."""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

DEAD_STD = 1e-6
EXPLODING_ABS_MEAN = 1e3


class ActivationMonitor:
    def __init__(self, model: nn.Module):
        self.stats: dict[str, tuple[float, float]] = {}
        self._handles = [
            module.register_forward_hook(self._hook(name))
            for name, module in model.named_modules()
            if name and not list(module.children())  # leaf layers only
        ]

    def _hook(self, name: str):
        def record(module, inputs, output):
            if module.training and isinstance(output, torch.Tensor) and output.is_floating_point():
                detached = output.detach().float()
                self.stats[name] = (float(detached.mean()), float(detached.std()))

        return record

    def flagged(self) -> dict[str, str]:
        problems = {}
        for name, (mean, std) in self.stats.items():
            if not (torch.isfinite(torch.tensor(mean)) and torch.isfinite(torch.tensor(std))):
                problems[name] = "non-finite"
            elif abs(mean) > EXPLODING_ABS_MEAN:
                problems[name] = f"exploding (mean {mean:.3g})"
            elif std < DEAD_STD:
                problems[name] = f"dead (std {std:.2g})"
        return problems

    def metrics(self) -> dict[str, float]:
        out = {}
        for name, (mean, std) in self.stats.items():
            out[f"act/{name}/mean"] = mean
            out[f"act/{name}/std"] = std
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
