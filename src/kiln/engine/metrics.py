"""MetricWindow: what happened between two log lines. Losses, loss terms, the largest grad norm,
the dataset's batch metrics, and the non-finite record (how many steps had a NaN/Inf loss, the
first of them, its terms and, under nan_policy=fail, its batch) are summed with device ops step
after step; `read` makes the one host transfer (and, under DDP, the one all-reduce) per log
line. Nothing in a step waits for the device.

On the CPU in one process a read waits for nothing, while each device op costs a dispatch (a
small model's whole step is a few dozen): there (`on_host`) each step's numbers are read as they
come, a float each, and summed in Python. Both ways give the same metrics and the same record."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.engine.distributed import all_reduce_sum

FOLD_EVERY = 64  # steps kept as they are before they are summed (however rare the log lines)


@dataclass
class NonFinite:
    """What read() found about non-finite losses in the window."""

    skipped: int = 0  # steps whose loss was NaN/Inf (their update was skipped on the device)
    first_step: int | None = None
    kind: str = "NaN"  # of the first: NaN or Inf
    bad_terms: list[str] = field(default_factory=list)  # non-finite terms at the first
    batch: Any = None  # the first non-finite micro-batch, when batches are kept
    scaler_skipped: int = 0  # steps GradScaler skipped although the loss was finite
    step_batches: list = field(default_factory=list)  # every micro-batch of that step
    bad_micro: int = 0  # which of them had the non-finite loss


class MetricWindow:
    def __init__(
        self,
        device: torch.device,
        world_size: int,
        keep_batches: bool = False,
        on_host: bool | None = None,
    ):
        self.device, self.world_size = device, world_size
        self.keep_batches = keep_batches  # nan_policy=fail reports the offending batch
        # None: on the host where reading is free (the CPU, one process).
        self.on_host = device.type == "cpu" and world_size == 1 if on_host is None else on_host
        self.reset()

    def reset(self) -> None:
        if self.on_host:
            zeros = lambda dtype=None: False if dtype is torch.bool else 0.0  # noqa: E731
        else:
            zeros = lambda dtype=torch.float32: torch.zeros((), device=self.device, dtype=dtype)  # noqa: E731
        self.steps = 0
        self.micro_batches = 0  # a fraction among the batch metrics is a mean per micro-batch
        self.samples = 0  # over all ranks
        self.data_time_s = 0.0
        self.step_time_s = 0.0
        self.finite_steps = zeros()
        self.loss_sum = zeros()
        self.terms: dict[str, torch.Tensor] = {}
        self.grad_norm = zeros()  # the last finite step's
        self.grad_norm_max = zeros()
        self.batch_sums: dict[str, torch.Tensor] = {}
        self.bad_steps = zeros()
        self.scaler_skips = zeros()
        self.first_bad = -1.0 if self.on_host else torch.full((), -1.0, device=self.device)
        self.first_nan = zeros(torch.bool)
        self.first_bad_terms: dict[str, torch.Tensor] = {}
        self.kept: list[tuple[int, list, list[torch.Tensor]]] = []  # (step, batches, bad flags)
        self._pending: list[tuple] = []  # steps added since the last fold

    def add(self, result) -> None:
        """One optimizer step's StepResult. Its device scalars are kept as they are and summed
        at the next log line (or every FOLD_EVERY steps) in a few vector ops: per step that
        is no op at all, where a small model's whole step is a few dozen."""
        self.steps += 1
        self.samples += result.samples * self.world_size
        self.data_time_s += result.data_time_s
        self.step_time_s += result.step_time_s
        for name, value in result.batch_metrics.items():
            value = value.item() if self.on_host else value
            self.batch_sums[name] = self.batch_sums.get(name, 0.0) + value
        self.micro_batches += result.micro_batches
        if self.keep_batches:
            self.kept.append((result.step, result.batches, result.micro_bad))
        if self.on_host:
            self._add_on_host(result)
            return
        self._pending.append(
            (
                result.step,
                result.bad,
                result.loss,
                result.terms,
                result.grad_norm,
                result.scaler_found_inf,
            )
        )
        if len(self._pending) >= FOLD_EVERY:
            self._fold()

    def _add_on_host(self, result) -> None:
        """The step's numbers into the sums as floats: what _fold computes, one step at a time."""
        loss = result.loss.item() if result.loss_value is None else result.loss_value
        # The main term is often the loss itself: one read for both.
        terms = {
            name: loss if value is result.loss else value.item()
            for name, value in result.terms.items()
        }
        bad = bool(result.bad)
        if result.scaler_found_inf is not None and not bad and bool(result.scaler_found_inf):
            self.scaler_skips += 1.0
        if bad:
            self.bad_steps += 1.0
            for name in terms:
                self.terms.setdefault(name, 0.0)
            if self.first_bad < 0:
                self.first_bad, self.first_nan = float(result.step), math.isnan(loss)
                self.first_bad_terms = {name: not math.isfinite(v) for name, v in terms.items()}
            return
        self.finite_steps += 1.0
        self.loss_sum += loss
        for name, value in terms.items():
            self.terms[name] = self.terms.get(name, 0.0) + value
        if result.grad_norm is not None:
            self.grad_norm = float(result.grad_norm)
            self.grad_norm_max = max(self.grad_norm_max, self.grad_norm)

    def _fold(self) -> None:
        """The pending steps into the window's sums, in order (device ops, no host read)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        steps = [p[0] for p in pending]
        bad = torch.stack([p[1] for p in pending])
        loss = torch.stack([p[2].float() for p in pending])
        # On the CPU a read costs no wait: a window without a bad step skips their bookkeeping.
        clean = bad.device.type == "cpu" and not bool(bad.any())
        if clean:
            self.finite_steps = self.finite_steps + float(len(pending))
            self.loss_sum = self.loss_sum + loss.sum()
        else:
            self.finite_steps = self.finite_steps + (~bad).sum().float()
            self.bad_steps = self.bad_steps + bad.sum().float()
            self.loss_sum = self.loss_sum + torch.where(bad, 0.0, loss).sum()
        names = list(dict.fromkeys(name for p in pending for name in p[3]))
        term_values = {}
        for name in names:
            have = [i for i, p in enumerate(pending) if name in p[3]]
            values = torch.stack([pending[i][3][name].float() for i in have])
            flags = bad if len(have) == len(pending) else bad[have]
            term_values[name] = (have, values)
            kept = values if clean else torch.where(flags, 0.0, values)
            self.terms[name] = self.terms.get(name, 0.0) + kept.sum()
        normed = [i for i, p in enumerate(pending) if p[4] is not None]
        if normed:
            norms = torch.stack([pending[i][4].detach().float() for i in normed])
            flags = bad if len(normed) == len(pending) else bad[normed]
            if clean:  # every step finite: the last norm, and the largest
                self.grad_norm = norms[-1]
                self.grad_norm_max = self.grad_norm_max.maximum(norms.max())
            else:  # the last finite step's norm, and the largest over the finite steps
                order = torch.arange(len(normed), device=norms.device)
                last = torch.where(flags, -1, order).max()
                self.grad_norm = torch.where(last >= 0, norms[last.clamp(min=0)], self.grad_norm)
                largest = torch.where(flags, -math.inf, norms).max()
                self.grad_norm_max = torch.where(
                    largest > -math.inf, self.grad_norm_max.maximum(largest), self.grad_norm_max
                )
        scaled = [i for i, p in enumerate(pending) if p[5] is not None]
        if scaled:
            found = torch.stack([pending[i][5] for i in scaled])
            flags = bad if len(scaled) == len(pending) else bad[scaled]
            self.scaler_skips = self.scaler_skips + (found & ~flags).sum().float()
        if clean:  # no non-finite step here: the record of the first one stays as it is
            return
        # The window's first non-finite step: its step number, NaN or Inf, its bad terms.
        first = bad.int().argmax()  # the first True (0 when none: masked by is_first)
        is_first = bad.any() & (self.first_bad < 0)
        if steps == list(range(steps[0], steps[0] + len(steps))):
            number = first.float() + float(steps[0])  # consecutive: no host-to-device copy
        else:
            number = torch.tensor(steps, device=bad.device, dtype=torch.float32)[first]
        self.first_bad = torch.where(is_first, number, self.first_bad)
        self.first_nan = torch.where(is_first, loss[first].isnan(), self.first_nan)
        for name, (have, values) in term_values.items():
            stored = self.first_bad_terms.get(
                name, torch.zeros((), dtype=torch.bool, device=bad.device)
            )
            if len(have) == len(pending):
                flag = ~values[first].isfinite()
            else:  # a term only some steps have: unset at the steps without it
                per_step = torch.zeros(len(pending), dtype=torch.bool, device=bad.device)
                per_step[have] = ~values.isfinite()
                flag = per_step[first]
            self.first_bad_terms[name] = torch.where(is_first, flag, stored)

    def read(self) -> tuple[dict[str, Any], NonFinite]:
        """The window's means, all ranks averaged, and its non-finite record: one transfer."""
        self._fold()
        names, extra, flags = list(self.terms), list(self.batch_sums), list(self.first_bad_terms)
        if self.on_host:
            values = self._read_on_host(names, extra, flags)
        else:
            summed = [self.finite_steps, self.loss_sum, *(self.terms[n] for n in names)]
            summed += [
                torch.as_tensor(self.batch_sums[n], device=self.device).float() for n in extra
            ]
            local = [self.bad_steps, self.scaler_skips, self.first_bad, self.first_nan.float()]
            local += [self.first_bad_terms[n].float() for n in flags]
            local += [self.grad_norm, self.grad_norm_max]
            sums = all_reduce_sum(torch.stack(summed))  # the bad-step flags are already global
            values = torch.cat([sums, torch.stack(local)]).tolist()
        finite_steps, loss_sum = values[0], values[1]
        at = 2
        term_sums = values[at : at + len(names)]
        at += len(names)
        batch_totals = dict(zip(extra, values[at : at + len(extra)], strict=True))
        at += len(extra)
        bad, scaler_skips, first, first_nan = values[at : at + 4]
        at += 4
        bad_terms = [n for n, v in zip(flags, values[at : at + len(flags)], strict=True) if v]
        grad_norm, grad_norm_max = values[-2:]
        count = max(1.0, finite_steps)  # summed over ranks already
        metrics = {
            "loss": loss_sum / count if finite_steps else float("nan"),
            "samples_per_s": self.samples / max(self.step_time_s, 1e-9),
            "data_time_frac": self.data_time_s / max(self.step_time_s, 1e-9),
        }
        metrics.update({f"loss/{n}": v / count for n, v in zip(names, term_sums, strict=True)})
        metrics.update(
            batch_rates(batch_totals, self.micro_batches * self.world_size, self.step_time_s)
        )
        if finite_steps:
            metrics["grad_norm"], metrics["grad_norm_max"] = grad_norm, grad_norm_max
        batches, bad_micro = self._step_batches(int(first)) if bad else ([], 0)
        record = NonFinite(
            skipped=int(bad),
            first_step=int(first) if first >= 0 else None,
            kind="NaN" if first_nan else "Inf",
            bad_terms=bad_terms,
            batch=batches[bad_micro] if batches else None,
            scaler_skipped=int(scaler_skips),
            step_batches=batches,
            bad_micro=bad_micro,
        )
        return metrics, record

    def _read_on_host(self, names: list[str], extra: list[str], flags: list[str]) -> list[float]:
        """The sums in read()'s order, as they are (already floats)."""
        values = [self.finite_steps, self.loss_sum, *(self.terms[n] for n in names)]
        values += [float(self.batch_sums[n]) for n in extra]
        values += [self.bad_steps, self.scaler_skips, self.first_bad, float(self.first_nan)]
        values += [float(self.first_bad_terms[n]) for n in flags]
        return [*values, self.grad_norm, self.grad_norm_max]

    def _step_batches(self, step: int) -> tuple[list, int]:
        """The kept micro-batches of `step` and the index of the first non-finite one."""
        for kept_step, batches, flags in self.kept:
            if kept_step == step:
                micro = [bool(flag) for flag in flags]  # a failure path: reading is fine here
                return batches, micro.index(True) if any(micro) else 0
        return [], 0


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


def rate_text(per_second: float) -> str:
    """A rate for the step log: whole numbers from 10 up, two significant digits below (a
    torchvision detector on a CPU trains well under one image a second: "%.0f" said 0)."""
    return f"{per_second:.0f}" if per_second >= 10 else f"{per_second:.2g}"
