"""The training loop. Read `fit` -> `train_epoch` -> `train_step` top to bottom: there are no
callbacks; checkpointing, evaluation and logging are explicit calls guarded by `should_...`."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.engine import checkpoint as ckpt
from kiln.engine.distributed import DistInfo, all_reduce_sum
from kiln.engine.loss import LossBranches, classification_loss
from kiln.engine.precision import Precision
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

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class NonFiniteLossError(RuntimeError):
    """The loss was NaN/Inf under trainer.nan_policy=fail."""

    def __init__(self, kind: str, step: int, batch_stats: dict, bad_terms: list[str]):
        detail = f" (non-finite terms: {', '.join(bad_terms)})" if bad_terms else ""
        super().__init__(f"loss {kind} @ step {step}{detail}")
        self.kind, self.step, self.batch_stats, self.bad_terms = kind, step, batch_stats, bad_terms


class Preempted(Exception):  # noqa: N818  (a control-flow signal, not an error)
    """SIGTERM/SIGUSR1 arrived; a checkpoint was saved at the step boundary."""


@dataclass(frozen=True)
class LoopSettings:
    max_epochs: int
    max_steps: int  # -1: no limit
    accumulate: int
    clip_norm: float | None
    nan_policy: str  # fail | skip
    check_inputs: bool
    shape_check: bool
    checkpoint_every_n_steps: int
    checkpoint_every_epoch: bool
    keep_last_k: int
    monitor: str
    monitor_mode: str  # max | min
    log_every_n_steps: int
    limit_train_batches: int
    limit_val_batches: int
    progress_bar: bool


@dataclass
class TrainState:
    """Everything about progress that a checkpoint must carry for an exact resume."""

    epoch: int = 0
    global_step: int = 0  # optimizer steps taken
    batch_in_epoch: int = 0  # batches of `epoch` already consumed
    best_metric: float | None = None
    nonfinite_skipped: int = 0  # steps skipped under nan_policy=skip
    scaler_skipped: int = 0  # steps GradScaler skipped for inf/NaN gradients
    samples_seen: int = 0
    data_time_s: float = 0.0
    step_time_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


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


@dataclass
class Interval:
    """Sums between two log lines."""

    steps: int = 0
    finite_steps: int = 0  # steps whose loss counts towards the mean
    samples: int = 0
    data_time_s: float = 0.0
    step_time_s: float = 0.0
    # Device tensors, read once per log line: no host sync on the steps in between.
    loss_sum: Any = 0.0
    terms: dict[str, Any] = field(default_factory=dict)
    grad_norm_max: Any = None  # every step's norm counts, not only the logged step's


def batch_size_of(batch: Any) -> int:
    inputs = batch[0]
    return len(inputs) if isinstance(inputs, list | tuple) else inputs.shape[0]


def move_to(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: move_to(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(move_to(v, device, non_blocking) for v in obj)
    return obj


class Trainer:
    def __init__(
        self,
        *,
        model: nn.Module,
        raw_model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        scaler: torch.amp.GradScaler,
        train_loader,
        val_loader,
        example_batch: Any,
        precision: Precision,
        device: torch.device,
        dist: DistInfo,
        settings: LoopSettings,
        loss_branches: LossBranches,
        seed: int,
        checkpoint_dir: Path,
        checkpoint_extra: dict,
        on_metrics: Callable[[dict, int], None],
        evaluate_fn: Callable[[nn.Module, Any, Trainer], dict] | None = None,
    ):
        self.model, self.raw_model = model, raw_model  # raw: unwrapped (no DDP/compile prefix)
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.train_loader, self.val_loader = train_loader, val_loader
        self.example_batch = example_batch
        self.precision, self.device, self.dist = precision, device, dist
        self.settings, self.loss_branches, self.seed = settings, loss_branches, seed
        self.checkpoint_dir, self.checkpoint_extra = Path(checkpoint_dir), checkpoint_extra
        self.on_metrics = on_metrics
        self.evaluate_fn = evaluate_fn
        self.own_loss = bool(getattr(raw_model, "computes_own_loss", False))
        self.state = TrainState()
        self.params = [p for p in raw_model.parameters() if p.requires_grad]
        self.non_blocking = bool(getattr(train_loader, "pin_memory", False))
        self.batches_per_epoch = batches_per_epoch(train_loader, settings.limit_train_batches)
        self.last_eval: dict = {}
        self._preempt_requested = False
        self._interval = Interval()

    # ----------------------------------------------------------------------------- the loop
    def fit(self) -> dict:
        """Train until max_epochs or max_steps; returns the last evaluation's metrics."""
        self._install_preemption_handlers()
        try:
            self.check_shapes()
            while self.state.epoch < self.settings.max_epochs and not self.reached_max_steps():
                self.train_epoch()
                if self.reached_max_steps() and self.state.batch_in_epoch < self.batches_per_epoch:
                    break  # stopped mid-epoch by max_steps: the final eval happens below
                self.state.epoch += 1
                self.state.batch_in_epoch = 0
                self.evaluate_and_checkpoint(epoch_end=True)
            if not self.last_eval or self.state.batch_in_epoch:
                self.evaluate_and_checkpoint(epoch_end=False)
        finally:
            self._restore_signal_handlers()
        self.report_data_time()
        return self.last_eval

    def train_epoch(self) -> None:
        sampler = self.train_loader.sampler
        sampler.set_epoch(self.state.epoch, skip=self.state.batch_in_epoch * self._loader_batch())
        # Worker seeds are drawn from this generator: re-seed it per epoch so a resumed run
        # hands its workers the same seeds as an uninterrupted one.
        self.train_loader.generator.manual_seed(self.seed * 1000 + self.state.epoch)
        batches = iter(self.train_loader)
        with self._progress_bar() as bar:
            while self.state.batch_in_epoch < self.batches_per_epoch:
                window = min(
                    self.settings.accumulate, self.batches_per_epoch - self.state.batch_in_epoch
                )
                result = self.train_step(batches, window)
                self.state.batch_in_epoch += window
                self.state.global_step += 1
                self.after_step(result, bar)
                if self.reached_max_steps():
                    return

    def train_step(self, batches: Iterator, window: int) -> StepResult:
        """One optimizer step over `window` micro-batches (gradient accumulation)."""
        model, optimizer, scaler = self.model, self.optimizer, self.scaler
        model.train()
        start, data_time, samples = time.perf_counter(), 0.0, 0
        loss_sum, terms_sum, finite = torch.zeros((), device=self.device), {}, True
        for micro in range(window):
            fetch_start = time.perf_counter()
            batch = move_to(next(batches), self.device, self.non_blocking)
            data_time += time.perf_counter() - fetch_start
            if self.settings.check_inputs:
                assert_finite_inputs(batch)
            # Under DDP only the window's last backward all-reduces gradients.
            sync = micro == window - 1 or not self.dist.enabled
            with contextlib.nullcontext() if sync else model.no_sync():
                with self.precision.autocast():
                    loss, terms = self.compute_loss(batch)
                # raises under nan_policy=fail
                finite = self.check_loss(loss, terms, batch) and finite
                # Divide by the window so k micro-batches of b equal one batch of k*b.
                scaler.scale(loss / window).backward()
            loss_sum += loss.detach()
            for name, term in terms.items():
                terms_sum[name] = terms_sum.get(name, 0.0) + term.detach()
            samples += batch_size_of(batch)
        if not finite:  # nan_policy=skip: drop this step's gradients
            optimizer.zero_grad(set_to_none=True)
            self.state.nonfinite_skipped += 1
            grad_norm, stepped = None, False
        else:
            scaler.unscale_(optimizer)  # true-scale gradients before the norm and clipping
            max_norm = self.settings.clip_norm or math.inf  # inf: measure, never clip
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
            loss_sum / window, terms, grad_norm, samples, data_time, elapsed, lr, stepped
        )

    # ------------------------------------------------------------------------- loss & guards
    def forward(self, model: nn.Module, batch: Any, train_mode: bool) -> Any:
        """Call the model the way training does (shape check and evaluation use it too)."""
        inputs, targets = batch
        if self.own_loss:
            return model(inputs, targets) if train_mode else model(inputs)
        return model(inputs)

    def compute_loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        try:
            output = self.forward(self.model, batch, train_mode=True)
        except RuntimeError as err:
            if is_device_mismatch(err):
                raise DeviceMismatchError(
                    explain_device_mismatch(err, self.raw_model, batch)
                ) from err
            raise
        if self.own_loss:  # e.g. detectors: a dict of loss terms in train mode
            return sum(output.values()), output
        return classification_loss(output, batch[1], self.loss_branches)

    def check_loss(self, loss: torch.Tensor, terms: dict, batch: Any) -> bool:
        """False (skip) or NonFiniteLossError (fail) when the loss is NaN/Inf on any rank."""
        flags = torch.stack([torch.isnan(loss.detach()), torch.isinf(loss.detach())]).float()
        nan, inf = all_reduce_sum(flags).tolist()
        if not (nan or inf):
            return True
        step = self.state.global_step + 1
        if self.settings.nan_policy == "skip":
            log.warning("non-finite loss @ step %d skipped (nan_policy=skip)", step)
            return False
        bad_terms = [name for name, term in terms.items() if not torch.isfinite(term).all()]
        raise NonFiniteLossError("NaN" if nan else "Inf", step, tensor_stats(batch), bad_terms)

    def check_shapes(self) -> None:
        if self.settings.shape_check:
            check_train_eval_agreement(self.raw_model, self.example_batch, self.forward)

    # ---------------------------------------------------------------- logging & checkpoints
    def after_step(self, result: StepResult, bar) -> None:
        s = self.state
        s.samples_seen += result.samples * self.dist.world_size
        s.data_time_s += result.data_time_s
        s.step_time_s += result.step_time_s
        interval = self._interval
        interval.steps += 1
        interval.samples += result.samples * self.dist.world_size
        interval.data_time_s += result.data_time_s
        interval.step_time_s += result.step_time_s
        if result.stepped:
            interval.finite_steps += 1
            interval.loss_sum = interval.loss_sum + result.loss
            for name, value in result.terms.items():
                interval.terms[name] = interval.terms.get(name, 0.0) + value
            norm = result.grad_norm.detach()
            previous = interval.grad_norm_max
            interval.grad_norm_max = norm if previous is None else torch.maximum(previous, norm)
        if bar is not None:
            bar.update(1)
        if self.should_log():
            metrics = self.interval_metrics(result)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{metrics['loss']:.4f}", sps=f"{metrics['samples_per_s']:.0f}"
                )
            if self.dist.is_main:
                log.info(
                    "epoch %d step %d loss %.4f lr %.3g grad_norm %.3g %.0f samples/s data %.0f%%",
                    s.epoch,
                    s.global_step,
                    metrics["loss"],
                    metrics["lr"],
                    metrics.get("grad_norm", float("nan")),
                    metrics["samples_per_s"],
                    100 * metrics["data_time_frac"],
                )
            self.on_metrics(metrics, s.global_step)
            self._interval = Interval()
        if self.should_checkpoint_step():
            self.save("last.pt")
        if self._preemption_agreed():
            self.save("last.pt")
            raise Preempted(f"preempted at step {s.global_step}; resume with resume=auto")

    def interval_metrics(self, result: StepResult) -> dict:
        iv = self._interval
        counted = max(1, iv.finite_steps)
        loss = torch.as_tensor(iv.loss_sum / counted, device=self.device, dtype=torch.float32)
        loss = float(all_reduce_sum(loss.clone())) / self.dist.world_size
        metrics = {
            "epoch": self.state.epoch,
            "loss": loss,
            "lr": result.lr,
            "samples_per_s": iv.samples / max(iv.step_time_s, 1e-9),
            "data_time_frac": iv.data_time_s / max(iv.step_time_s, 1e-9),
            "memory_mb": memory_mb(self.device),
            "nonfinite_skipped": self.state.nonfinite_skipped,
            "scaler_skipped": self.state.scaler_skipped,
        }
        if result.grad_norm is not None:
            metrics["grad_norm"] = float(result.grad_norm)
        if iv.grad_norm_max is not None:
            metrics["grad_norm_max"] = float(iv.grad_norm_max)
        for name, value in iv.terms.items():
            metrics[f"loss/{name}"] = float(value) / counted
        return metrics

    def should_log(self) -> bool:
        every = max(1, self.settings.log_every_n_steps)
        return self.state.global_step % every == 0 or self.state.global_step == 1

    def should_checkpoint_step(self) -> bool:
        every = self.settings.checkpoint_every_n_steps
        return every > 0 and self.state.global_step % every == 0

    def reached_max_steps(self) -> bool:
        return 0 < self.settings.max_steps <= self.state.global_step

    def evaluate_and_checkpoint(self, epoch_end: bool) -> None:
        self.last_eval = self.evaluate()
        if self.dist.is_main:
            shown = " ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items())
            log.info(
                "eval after epoch %d step %d: %s", self.state.epoch, self.state.global_step, shown
            )
        self.on_metrics({"epoch": self.state.epoch, **self.last_eval}, self.state.global_step)
        improved = self.update_best(self.last_eval)
        self.save("last.pt")
        if improved:
            self.save("best.pt")
        if epoch_end and self.settings.checkpoint_every_epoch:
            self.save(f"epoch-{self.state.epoch}.pt")
            if self.dist.is_main:
                ckpt.prune_epoch_checkpoints(self.checkpoint_dir, self.settings.keep_last_k)

    def update_best(self, metrics: dict) -> bool:
        value = metrics.get(self.settings.monitor)
        if value is None or not math.isfinite(value):
            return self.state.best_metric is None  # keep a best.pt even without the metric
        best = self.state.best_metric
        better = (
            best is None
            or (self.settings.monitor_mode == "max" and value > best)
            or (self.settings.monitor_mode == "min" and value < best)
        )
        if better:
            self.state.best_metric = value
        return better

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.check_shapes()
        self.model.eval()
        if self.evaluate_fn is not None:
            return self.evaluate_fn(self.raw_model, self._val_batches(), self)
        totals = torch.zeros(3, device=self.device, dtype=torch.float64)  # loss sum, correct, n
        for batch in self._val_batches():
            inputs, targets = batch
            with self.precision.autocast():
                output = self.model(inputs)
            logits = (output["logits"] if isinstance(output, dict) else output).float()
            loss = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
            correct = (logits.argmax(dim=-1) == targets).sum()
            totals += torch.stack(
                [
                    loss.double(),
                    correct.double(),
                    torch.tensor(float(len(targets)), device=self.device, dtype=torch.float64),
                ]
            )
        loss_sum, correct, count = all_reduce_sum(totals).tolist()
        count = max(count, 1.0)
        return {"val_loss": loss_sum / count, "val_acc": correct / count}

    def _val_batches(self):
        limit = self.settings.limit_val_batches
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
            **self.checkpoint_extra,  # config, preprocessing, data spec, model name
        }

    def load_state_dict(self, checkpoint: dict) -> None:
        self.raw_model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        if self.scheduler is not None and checkpoint.get("scheduler") is not None:
            planned = checkpoint["scheduler"].get("total_steps")
            now = getattr(self.scheduler, "total_steps", planned)
            if planned != now:
                raise ValueError(
                    f"the checkpoint's LR schedule spans {planned} optimizer steps but this config "
                    f"implies {now}; resume with the run's trainer.max_epochs, trainer.max_steps, "
                    "trainer.accumulate_grad_batches and data.batch_size, or start a new run"
                )
            self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.scaler.load_state_dict(checkpoint["scaler"])
        self.state = TrainState(**checkpoint["state"])
        if self.dist.is_main:
            set_rng_state(checkpoint["rng"])
        else:  # other ranks keep distinct streams, re-derived from the position in training
            torch.manual_seed(self.seed + self.dist.rank + 7919 * self.state.global_step)

    def save(self, name: str) -> None:
        if self.dist.is_main:
            ckpt.atomic_save(self.state_dict(), self.checkpoint_dir / name)

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

    def _loader_batch(self) -> int:
        return self.train_loader.batch_size

    @contextlib.contextmanager
    def _progress_bar(self):
        """A tqdm bar on a terminal (log lines are routed around it), None otherwise."""
        if not (self.settings.progress_bar and self.dist.is_main and sys.stderr.isatty()):
            yield None
            return
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        steps = math.ceil(
            (self.batches_per_epoch - self.state.batch_in_epoch) / self.settings.accumulate
        )
        bar = tqdm(total=steps, desc=f"epoch {self.state.epoch}", unit="step", leave=False)
        with logging_redirect_tqdm(), bar:
            yield bar

    def _install_preemption_handlers(self) -> None:
        self._previous_handlers = {}
        with contextlib.suppress(ValueError):  # not in the main thread: no handlers
            for sig in PREEMPT_SIGNALS:
                self._previous_handlers[sig] = signal.signal(sig, self._request_preemption)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in getattr(self, "_previous_handlers", {}).items():
            signal.signal(sig, handler)

    def _request_preemption(self, signum, frame) -> None:
        log.warning("received signal %d: checkpointing at the next step boundary", signum)
        self._preempt_requested = True

    def _preemption_agreed(self) -> bool:
        if not self.dist.enabled:
            return self._preempt_requested
        # The signal may reach ranks at different steps: stop together or not at all.
        flag = torch.tensor(float(self._preempt_requested), device=self.device)
        return bool(all_reduce_sum(flag) > 0)


def batches_per_epoch(train_loader, limit_train_batches: int) -> int:
    """Batches this rank trains on per epoch: its sampler's share, capped by the limit (> 0)."""
    batches = math.ceil(train_loader.sampler.num_samples / train_loader.batch_size)
    return min(batches, limit_train_batches) if limit_train_batches > 0 else batches


def memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20
