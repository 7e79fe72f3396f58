"""MetricWindow: what happened between two log lines. Losses, loss terms and the largest grad
norm are summed on the device, step after step; `read` makes the one host transfer (and, under
DDP, the one all-reduce) per log line."""

from __future__ import annotations

from typing import Any

import torch

from kiln.engine.distributed import all_reduce_sum


class MetricWindow:
    def __init__(self, device: torch.device, world_size: int):
        self.device, self.world_size = device, world_size
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.finite_steps = 0  # steps whose loss counts towards the mean
        self.samples = 0  # over all ranks
        self.data_time_s = 0.0
        self.step_time_s = 0.0
        self.loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        self.terms: dict[str, torch.Tensor] = {}
        self.grad_norm_max: torch.Tensor | None = None  # every step's norm counts
        self.grad_norm: torch.Tensor | None = None  # the last step's
        self.batch_sums: dict[str, torch.Tensor] = {}  # the dataset's batch metrics, summed
        self.micro_batches = 0

    def add(self, result) -> None:
        """One optimizer step's StepResult."""
        self.steps += 1
        self.samples += result.samples * self.world_size
        self.data_time_s += result.data_time_s
        self.step_time_s += result.step_time_s
        for name, value in result.batch_metrics.items():
            self.batch_sums[name] = self.batch_sums.get(name, 0.0) + value
        self.micro_batches += result.micro_batches
        if not result.stepped:
            return
        self.finite_steps += 1
        self.loss_sum += result.loss.float()
        for name, value in result.terms.items():
            self.terms[name] = self.terms.get(name, 0.0) + value.float()
        norm = result.grad_norm.detach().float()
        self.grad_norm = norm
        self.grad_norm_max = (
            norm if self.grad_norm_max is None else torch.maximum(self.grad_norm_max, norm)
        )

    def read(self) -> dict[str, Any]:
        """The window's means, all ranks averaged: one device-to-host copy. A window whose every
        step was skipped (nan_policy=skip) has no loss to report: NaN, never 0.0."""
        names, extra = list(self.terms), list(self.batch_sums)
        stacked = [self.loss_sum, *(self.terms[n] for n in names)]
        stacked += [torch.as_tensor(self.batch_sums[n], device=self.device).float() for n in extra]
        sums = all_reduce_sum(torch.stack(stacked))
        count = max(1, self.finite_steps) * self.world_size
        parts = [sums[: 1 + len(names)] / count, sums[1 + len(names) :]]
        if self.grad_norm is not None:
            parts.append(torch.stack([self.grad_norm, self.grad_norm_max]))
        values = torch.cat(parts).tolist()
        metrics = {
            "loss": values[0] if self.finite_steps else float("nan"),
            "samples_per_s": self.samples / max(self.step_time_s, 1e-9),
            "data_time_frac": self.data_time_s / max(self.step_time_s, 1e-9),
        }
        metrics.update(
            {f"loss/{n}": v for n, v in zip(names, values[1 : 1 + len(names)], strict=True)}
        )
        if self.grad_norm is not None:
            metrics["grad_norm"], metrics["grad_norm_max"] = values[-2:]
        first = 1 + len(names)
        batch_totals = dict(zip(extra, values[first : first + len(extra)], strict=True))
        metrics.update(
            batch_rates(batch_totals, self.micro_batches * self.world_size, self.step_time_s)
        )
        return metrics


def batch_rates(totals: dict[str, float], steps: int, seconds: float) -> dict[str, float]:
    """The dataset's batch metrics over a window: counts (names without "_frac") become rates
    per second ("tokens" -> "tokens_per_s"), fractions become their mean per batch (`steps`:
    the batches summed, micro-batches on every rank)."""
    rates = {}
    for name, total in totals.items():
        if name.endswith("_frac"):
            rates[name] = total / max(1, steps)
        else:
            rates[f"{name}_per_s"] = total / max(seconds, 1e-9)
    return rates
