"""The training loop. Read `fit` -> `train_epoch` -> `train_step` top to bottom: there are no
callbacks; evaluation, checkpoints and log lines are explicit calls guarded by `should_...`.
The Trainer is composed of parts built elsewhere (kiln.engine.run): the model and its optimizer,
a criterion (the loss), an evaluator (per task), a checkpointer (the file policy) and a metric
window (device-side sums between log lines)."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.config.run import NanPolicy, TrainerConfig
from kiln.engine.batches import batch_size_of, move_to
from kiln.engine.checkpointer import Checkpointer, check_schedule
from kiln.engine.distributed import DistInfo, all_reduce_sum
from kiln.engine.metrics import MetricWindow
from kiln.engine.precision import Precision
from kiln.engine.preemption import Preempted, PreemptionFlag
from kiln.engine.seeding import rng_state, set_rng_state
from kiln.guards import (
    DeviceMismatchError,
    assert_finite_inputs,
    check_train_eval_agreement,
    explain_device_mismatch,
    tensor_stats,
)
from kiln.guards.devices import is_device_mismatch

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss was NaN/Inf under trainer.nan_policy=fail."""

    def __init__(self, kind: str, step: int, batch_stats: dict, bad_terms: list[str]):
        detail = f" (non-finite terms: {', '.join(bad_terms)})" if bad_terms else ""
        super().__init__(f"loss {kind} @ step {step}{detail}")
        self.kind, self.step, self.batch_stats, self.bad_terms = kind, step, batch_stats, bad_terms


@dataclass
class TrainState:
    """Everything about progress that a checkpoint must carry for an exact resume."""

    epoch: int = 0
    global_step: int = 0  # optimizer steps taken
    batch_in_epoch: int = 0  # batches of `epoch` already consumed
    planned_steps: int = 0  # optimizer steps the run plans (the LR schedule's length)
    best_metric: float | None = None
    nonfinite_skipped: int = 0  # steps skipped under nan_policy=skip
    scaler_skipped: int = 0  # steps GradScaler skipped for inf/NaN gradients
    samples_seen: int = 0
    data_time_s: float = 0.0
    step_time_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TrainingParts:
    """What the loop runs, built by kiln.engine.run from the config."""

    model: nn.Module  # what the loop calls (DDP-wrapped under DDP)
    raw_model: nn.Module  # unwrapped: checkpoints and guards see plain parameter names
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LRScheduler or None
    scaler: torch.amp.GradScaler
    precision: Precision
    criterion: (
        Any  # kiln.engine.loss: (model, batch) -> (loss, terms); .forward(model, batch, mode)
    )
    evaluator: Callable[[nn.Module, Any], dict]  # kiln.engine.evaluators, per task
    train_loader: Any
    val_loader: Any
    probe_batch: Any  # one real training batch on the device, for rule 3
    batch_metrics: Callable[[Any], dict[str, torch.Tensor]] | None = None  # from the dataset


@dataclass
class StepResult:
    loss: torch.Tensor
    terms: dict[str, torch.Tensor]
    grad_norm: torch.Tensor | None
    samples: int
    data_time_s: float
    step_time_s: float
    lr: float  # the learning rate this step used
    stepped: bool = True
    batch_metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # summed over the window
    micro_batches: int = 1  # batches in this step (the accumulation window)


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        parts: TrainingParts,
        *,
        checkpointer: Checkpointer,
        on_metrics: Callable[[dict, int], None],
        dist: DistInfo,
        device: torch.device,
        seed: int,
        record: dict,
        progress_bar: bool = False,
    ):
        self.cfg, self.parts = cfg, parts
        self.model, self.raw_model = parts.model, parts.raw_model
        self.optimizer, self.scheduler, self.scaler = parts.optimizer, parts.scheduler, parts.scaler
        self.precision, self.criterion = parts.precision, parts.criterion
        self.train_loader, self.val_loader = parts.train_loader, parts.val_loader
        self.checkpointer, self.on_metrics = checkpointer, on_metrics
        self.dist, self.device, self.seed = dist, device, seed
        self.record = record  # config, preprocessing recipe, data spec: saved in every checkpoint
        self.progress_bar = progress_bar
        self.state = TrainState()
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self.non_blocking = bool(getattr(self.train_loader, "pin_memory", False))
        self.batches_per_epoch = batches_per_epoch(self.train_loader, cfg.limit_train_batches)
        self.window = MetricWindow(device, dist.world_size)
        self.preemption = PreemptionFlag(dist, device)
        self.last_eval: dict = {}

    # ----------------------------------------------------------------------------- the loop
    def fit(self) -> dict:
        """Train until max_epochs or max_steps; returns the last evaluation's metrics."""
        with self.preemption:
            self.check_shapes()
            while self.state.epoch < self.cfg.max_epochs and not self.reached_max_steps():
                self.train_epoch()
                if self.reached_max_steps() and self.state.batch_in_epoch < self.batches_per_epoch:
                    break  # stopped mid-epoch by max_steps: the final eval happens below
                self.state.epoch += 1
                self.state.batch_in_epoch = 0
                self.evaluate_and_checkpoint(epoch_end=True)
            if not self.last_eval or self.state.batch_in_epoch:
                self.evaluate_and_checkpoint(epoch_end=False)
        self.report_data_time()
        return self.last_eval

    def train_epoch(self) -> None:
        s = self.state
        sampler = self.train_loader.sampler
        sampler.set_epoch(s.epoch, skip=s.batch_in_epoch * self.train_loader.batch_size)
        # Worker seeds are drawn from this generator: re-seed it per epoch so a resumed run
        # hands its workers the same seeds as an uninterrupted one.
        self.train_loader.generator.manual_seed(self.seed * 1000 + s.epoch)
        batches = iter(self.train_loader)
        with self._progress_bar() as bar:
            while s.batch_in_epoch < self.batches_per_epoch:
                window = min(
                    self.cfg.accumulate_grad_batches, self.batches_per_epoch - s.batch_in_epoch
                )
                result = self.train_step(batches, window)
                s.batch_in_epoch += window
                s.global_step += 1
                self.after_step(result, bar)
                if self.reached_max_steps():
                    return

    def train_step(self, batches: Iterator, window: int) -> StepResult:
        """One optimizer step over `window` micro-batches (gradient accumulation)."""
        model, optimizer, scaler = self.model, self.optimizer, self.scaler
        model.train()
        start, data_time, samples = time.perf_counter(), 0.0, 0
        loss_sum, terms_sum, finite = torch.zeros((), device=self.device), {}, True
        batch_sums: dict[str, torch.Tensor] = {}
        for micro in range(window):
            fetch_start = time.perf_counter()
            batch = move_to(next(batches), self.device, self.non_blocking)
            data_time += time.perf_counter() - fetch_start
            if self.cfg.check_inputs:
                assert_finite_inputs(batch)
            # Under DDP only the window's last backward all-reduces gradients.
            sync = micro == window - 1 or not self.dist.enabled
            with contextlib.nullcontext() if sync else model.no_sync():
                with self.precision.autocast():
                    loss, terms = self.compute_loss(batch)
                finite = self.check_loss(loss, terms, batch) and finite  # raises if nan=fail
                # Divide by the window so k micro-batches of b equal one batch of k*b.
                scaler.scale(loss / window).backward()
            loss_sum += loss.detach()
            for name, term in terms.items():
                terms_sum[name] = terms_sum.get(name, 0.0) + term.detach()
            samples += batch_size_of(batch)
            if self.parts.batch_metrics is not None:
                for name, value in self.parts.batch_metrics(batch).items():
                    batch_sums[name] = batch_sums.get(name, 0.0) + value
        if not finite:  # nan_policy=skip: drop this step's gradients
            optimizer.zero_grad(set_to_none=True)
            self.state.nonfinite_skipped += 1
            grad_norm, stepped = None, False
        else:
            scaler.unscale_(optimizer)  # true-scale gradients before the norm and clipping
            max_norm = self.cfg.gradient_clip_val or math.inf  # inf: measure, never clip
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            scale_before = scaler.get_scale()
            scaler.step(optimizer)  # GradScaler skips the step when gradients hold inf/NaN
            scaler.update()
            if scaler.is_enabled() and scaler.get_scale() < scale_before:
                self.state.scaler_skipped += 1
            optimizer.zero_grad(set_to_none=True)
            stepped = True
        lr = optimizer.param_groups[0]["lr"]
        if self.scheduler is not None:
            self.scheduler.step()  # per optimizer step, skipped steps too: the curve stays aligned
        terms = {name: value / window for name, value in terms_sum.items()}
        elapsed = time.perf_counter() - start
        return StepResult(
            loss_sum / window,
            terms,
            grad_norm,
            samples,
            data_time,
            elapsed,
            lr,
            stepped,
            batch_sums,
            window,
        )

    # ------------------------------------------------------------------------- loss & guards
    def compute_loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        try:
            return self.criterion(self.model, batch)
        except RuntimeError as err:
            if is_device_mismatch(err):
                explained = explain_device_mismatch(err, self.raw_model, batch)
                raise DeviceMismatchError(explained) from err
            raise

    def check_loss(self, loss: torch.Tensor, terms: dict, batch: Any) -> bool:
        """False (skip) or NonFiniteLossError (fail) when the loss is NaN/Inf on any rank."""
        flags = torch.stack([torch.isnan(loss.detach()), torch.isinf(loss.detach())]).float()
        nan, inf = all_reduce_sum(flags).tolist()
        if not (nan or inf):
            return True
        step = self.state.global_step + 1
        if self.cfg.nan_policy == NanPolicy.skip:
            log.warning("non-finite loss @ step %d skipped (nan_policy=skip)", step)
            return False
        bad_terms = [name for name, term in terms.items() if not torch.isfinite(term).all()]
        raise NonFiniteLossError("NaN" if nan else "Inf", step, tensor_stats(batch), bad_terms)

    def check_shapes(self) -> None:
        """Rule 3 on one real batch: train and eval mode agree on the output."""
        if self.cfg.shape_check:
            check_train_eval_agreement(
                self.raw_model, self.parts.probe_batch, self.criterion.forward
            )

    # ---------------------------------------------------------------- logging & checkpoints
    def after_step(self, result: StepResult, bar) -> None:
        s = self.state
        s.samples_seen += result.samples * self.dist.world_size
        s.data_time_s += result.data_time_s
        s.step_time_s += result.step_time_s
        self.window.add(result)
        if bar is not None:
            bar.update(1)
        if self.should_log():
            self.log_window(result.lr, bar)
        if self.checkpointer.should_save_step(s.global_step):
            self.checkpointer.save("last.pt", self.state_dict())
        if self.preemption.agreed():
            self.checkpointer.save("last.pt", self.state_dict())
            raise Preempted(f"preempted at step {s.global_step}; resume with resume=auto")

    def log_window(self, lr: float, bar) -> None:
        s = self.state
        metrics = {
            "epoch": s.epoch,
            **self.window.read(),
            "lr": lr,
            "memory_mb": memory_mb(self.device),
            "nonfinite_skipped": s.nonfinite_skipped,
            "scaler_skipped": s.scaler_skipped,
        }
        self.window.reset()
        if bar is not None:
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", sps=f"{metrics['samples_per_s']:.0f}")
        if self.dist.is_main:
            log.info(
                "epoch %d step %d loss %.4f lr %.3g grad_norm %.3g %.0f samples/s data %.0f%%",
                s.epoch,
                s.global_step,
                metrics["loss"],
                lr,
                metrics.get("grad_norm", float("nan")),
                metrics["samples_per_s"],
                100 * metrics["data_time_frac"],
            )
        self.on_metrics(metrics, s.global_step)

    def should_log(self) -> bool:
        step = self.state.global_step
        return step % self.cfg.log_every_n_steps == 0 or step == 1

    def reached_max_steps(self) -> bool:
        return 0 < self.cfg.max_steps <= self.state.global_step

    def evaluate_and_checkpoint(self, epoch_end: bool) -> None:
        self.last_eval = self.evaluate()
        s = self.state
        if self.dist.is_main:
            shown = " ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items())
            log.info("eval after epoch %d step %d: %s", s.epoch, s.global_step, shown)
        self.on_metrics({"epoch": s.epoch, **self.last_eval}, s.global_step)
        self.checkpointer.after_evaluation(self.last_eval, s, self.state_dict, epoch_end)

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.check_shapes()
        self.model.eval()
        return self.parts.evaluator(self.raw_model, self._val_batches())

    def _val_batches(self):
        limit = self.cfg.limit_val_batches
        for i, batch in enumerate(self.val_loader):
            if 0 <= limit <= i:
                return
            yield move_to(batch, self.device, self.non_blocking)

    # ----------------------------------------------------------------------- state & resume
    def state_dict(self) -> dict:
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict(),
            "state": self.state.as_dict(),
            "rng": rng_state(),
            **self.record,
        }

    def load_state_dict(self, checkpoint: dict) -> None:
        saved = TrainState(**checkpoint["state"])
        check_schedule(saved.planned_steps, self.state.planned_steps, self.scheduler is not None)
        self.raw_model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        if self.scheduler is not None and checkpoint.get("scheduler") is not None:
            self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.scaler.load_state_dict(checkpoint["scaler"])
        self.state = saved
        if self.dist.is_main:
            set_rng_state(checkpoint["rng"])
        else:  # other ranks keep distinct streams, re-derived from the position in training
            torch.manual_seed(self.seed + self.dist.rank + 7919 * self.state.global_step)

    # ------------------------------------------------------------------------------- misc
    def report_data_time(self) -> None:
        frac = self.data_time_frac
        if frac > 0.3 and self.dist.is_main:
            log.warning(
                "data loading took %.0f%% of step time; try more data.num_workers "
                "(now %d) or data.pin_memory=true on CUDA",
                100 * frac,
                getattr(self.train_loader, "num_workers", 0),
            )

    @property
    def data_time_frac(self) -> float:
        return self.state.data_time_s / max(self.state.step_time_s, 1e-9)

    @property
    def samples_per_s(self) -> float:
        return self.state.samples_seen / max(self.state.step_time_s, 1e-9)

    @contextlib.contextmanager
    def _progress_bar(self):
        """A tqdm bar on a terminal (log lines are routed around it), None otherwise."""
        if not (self.progress_bar and self.dist.is_main and sys.stderr.isatty()):
            yield None
            return
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        remaining = self.batches_per_epoch - self.state.batch_in_epoch
        steps = math.ceil(remaining / self.cfg.accumulate_grad_batches)
        bar = tqdm(total=steps, desc=f"epoch {self.state.epoch}", unit="step", leave=False)
        with logging_redirect_tqdm(), bar:
            yield bar


def batches_per_epoch(train_loader, limit_train_batches: int) -> int:
    """Batches this rank trains on per epoch: its sampler's share, capped by the limit (> 0)."""
    batches = math.ceil(train_loader.sampler.num_samples / train_loader.batch_size)
    return min(batches, limit_train_batches) if limit_train_batches > 0 else batches


def memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


__all__ = ["NonFiniteLossError", "Preempted", "StepResult", "TrainState", "Trainer"]
