"""The training loop. Read `fit` -> `train_epoch` -> `train_step` top to bottom: there are no
callbacks; evaluation, checkpoints and log lines are explicit calls guarded by `should_...`.
The Trainer is composed of parts built elsewhere (kiln.engine.run): the model and its optimizer,
a criterion (the loss), an evaluator (per task), a checkpointer (the file policy) and a metric
window (device-side sums between log lines)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from kiln.atomic import on_failure
from kiln.config.run import NanPolicy, TrainerConfig
from kiln.engine.batches import batch_size_of, move_to, to_channels_last
from kiln.engine.checkpointer import Checkpointer
from kiln.engine.distributed import (
    DistInfo,
    GradientNorm,
    all_reduce_max,
    is_fsdp,
    skip_gradient_sync,
)
from kiln.engine.finetune import FreezePlan, WeightAverage
from kiln.engine.loss import BRANCHES
from kiln.engine.metrics import MetricWindow, rate_text
from kiln.engine.precision import Precision
from kiln.engine.preemption import Preempted, PreemptionFlag
from kiln.engine.sharded_checkpoint import load_model_and_optimizer, model_and_optimizer_state
from kiln.engine.throughput import flops_per_sample
from kiln.guards import assert_finite_inputs, check_train_eval_agreement, describe, tensor_stats
from kiln.guards.conditional_params import GradientPresence
from kiln.guards.devices import diagnose, is_device_mismatch
from kiln.guards.input_sizes import take
from kiln.guards.no_trace import untouched
from kiln.guards.probes import ProbePlan, ProbeReport, ProbeSubject, probe_model, run_probe_plan
from kiln.guards.rules import RULE_2
from kiln.rng import forked, rng_state, set_rng_state
from kiln.startup import StartupClock

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss was NaN/Inf under trainer.nan_policy=fail."""

    def __init__(
        self,
        kind: str,
        step: int,
        batch_stats: dict,
        bad_terms: list[str],
        batches: list | None = None,
        bad_micro: int = 0,
    ):
        branches = [t for t in bad_terms if t in BRANCHES]
        rule = f"{RULE_2}: " if branches else ""  # an optional branch broke it
        detail = f" (non-finite terms: {', '.join(bad_terms)})" if bad_terms else ""
        super().__init__(f"{rule}loss {kind} @ step {step}{detail}")
        self.kind, self.step, self.batch_stats, self.bad_terms = kind, step, batch_stats, bad_terms
        self.batches, self.bad_micro = batches or [], bad_micro  # the step's micro-batches


class NonFiniteEvalError(RuntimeError):
    """A validation metric was NaN/Inf under trainer.nan_policy=fail."""

    def __init__(self, metrics: dict, bad: list[str], step: int):
        self.metric, self.step = bad[0], step
        self.kind = "NaN" if math.isnan(metrics[self.metric]) else "Inf"
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float))
        super().__init__(
            f"{self.metric} {self.kind} @ step {step}: the evaluation after step {step} gave "
            f"{shown}; no best.pt was chosen from it (kiln triage <run dir> replays it)"
        )


class TooManySkippedSteps(RuntimeError):
    """nan_policy=skip skipped more steps than trainer.max_skipped_steps allows."""

    def __init__(self, skipped: int, limit: int, step: int):
        super().__init__(
            f"{skipped} steps had a non-finite loss and were skipped, more than "
            f"trainer.max_skipped_steps={limit}; lower optimizer.lr or set "
            "trainer.gradient_clip_val (kiln triage <run dir> ranks the causes)"
        )
        self.skipped, self.limit, self.step = skipped, limit, step


@dataclass
class TrainState:
    """Everything about progress that a checkpoint must carry for an exact resume."""

    epoch: int = 0
    global_step: int = 0  # optimizer steps taken
    batch_in_epoch: int = 0  # batches of `epoch` already consumed
    planned_steps: int = 0  # optimizer steps the run plans (the LR schedule's length)
    best_metric: float | None = None
    # val_loss of the evaluation best.pt came from: breaks ties on best_metric (None in
    # checkpoints written before it was kept: any finite loss then wins the next tie).
    best_tiebreak: float | None = None
    best_step: int | None = None  # the step best.pt was saved at
    lowest_val_loss: float | None = None  # over the evaluations: a run at chance never fell
    best_epoch: int | None = None  # the epochs done when best.pt was saved (early stopping)
    nonfinite_skipped: int = 0  # steps skipped under nan_policy=skip
    scaler_skipped: int = 0  # steps GradScaler skipped for inf/NaN gradients
    samples_seen: int = 0
    data_time_s: float = 0.0
    step_time_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TrainingParts:
    """What the loop runs, built by kiln.engine.run from the config (and not changed after:
    what a run changes as it goes is the Trainer's own, trainer.state and its attributes)."""

    model: nn.Module  # what the loop calls (DDP-wrapped under DDP, sharded in place under FSDP)
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
    peak_flops: float | None = None  # the device's peak FLOP/s in the run's dtype, if known
    batch_metrics: Callable[[Any], dict[str, torch.Tensor]] | None = None  # from the dataset
    freeze: FreezePlan | None = None  # model.freeze until trainer.unfreeze_at_epoch
    rewrap: Callable[[], nn.Module] | None = None  # a new DDP wrapper once parameters unfreeze
    ema: WeightAverage | None = None  # trainer.ema_decay: evaluated beside the weights
    data: Any = None  # the DataBundle: its test split is evaluated when training ends (run.py)
    probe_plan: ProbePlan = field(default_factory=ProbePlan)  # which checks run before step 1
    probe_subject: ProbeSubject | None = None  # what they run on: model, batches, builders
    probe_key: Any = None  # kiln.guards.probe_cache.ProbeKey: what a pass was kept under
    cpu_watch: Any = None  # kiln.threads.BusyElsewhere, started with the run: threads=auto
    early_stopping: int | None = None  # trainer.early_stopping resolved: patience in epochs
    warmup_end: int = 1  # the step the lr warm-up ends at: early stopping counts from there


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """The trainer.* keys the loop reads (kiln.config.run.TrainerConfig says what each means)."""

    max_epochs: int
    max_steps: int
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    nan_policy: NanPolicy
    max_skipped_steps: int
    check_inputs: bool
    channels_last: bool
    shape_check: bool
    find_unused_parameters: bool
    threads: Any  # "auto" or a count
    deterministic: bool
    log_every_n_steps: int
    limit_train_batches: int
    limit_val_batches: int


def loop_settings(cfg: TrainerConfig) -> LoopSettings:
    return LoopSettings(**{f.name: getattr(cfg, f.name) for f in fields(LoopSettings)})


@dataclass
class StepResult:
    """One optimizer step, as device tensors where the device computed it (no host sync)."""

    step: int
    loss: torch.Tensor  # the mean over the window's micro-batches
    loss_value: float | None  # the same, already read to the host (a one-batch step on the host)
    terms: dict[str, torch.Tensor]
    grad_norm: torch.Tensor | float | None  # a float where it was read on the host
    bad: torch.Tensor | bool  # the loss was NaN/Inf (on some rank): the update was skipped
    samples: int
    data_time_s: float
    step_time_s: float
    lr: float  # the learning rate this step used
    scaler_found_inf: torch.Tensor | None = None  # GradScaler skipped the update
    batch_metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # summed over the window
    batches: list = field(default_factory=list)  # kept under nan_policy=fail, for the report
    micro_bad: list = field(default_factory=list)  # per micro-batch: its loss was NaN/Inf
    micro_batches: int = 1  # batches in this step (the accumulation window)


class StepSums:
    """A step's micro-batches summed as they come: the loss, its terms, the dataset's batch
    metrics, whether some loss was NaN/Inf. On the host (`on_host`: the CPU, one process) the
    loss is read as it comes, else everything stays a device tensor (no host sync). The first
    value is taken as it is (no zeros + x: each op is a dispatch, and a small model's step is a
    few dozen of them)."""

    def __init__(self, on_host: bool, keep_batches: bool, batch_metrics=None):
        self.on_host, self.keep_batches, self.batch_metrics = on_host, keep_batches, batch_metrics
        self.loss, self.terms, self.metrics, self.bad = None, {}, {}, None
        self.loss_value: float | None = None
        self.kept, self.micro_bad, self.samples, self.data_time = [], [], 0, 0.0

    def add(self, batch: Any, loss: torch.Tensor, terms: dict, data_time: float) -> None:
        value = loss.detach()
        if self.on_host:
            self.loss_value = value.item()  # read once: a one-batch step's window sums it
            nonfinite = not math.isfinite(self.loss_value)
        else:
            nonfinite = ~torch.isfinite(value)
        self.bad = nonfinite if self.bad is None else self.bad | nonfinite
        self.loss = value if self.loss is None else self.loss + value
        for name, term in terms.items():
            term = value if term is loss else term.detach()  # the window reads it once
            self.terms[name] = self.terms[name] + term if name in self.terms else term
        self.samples += batch_size_of(batch)
        self.data_time += data_time
        if self.batch_metrics is not None:
            for name, metric in self.batch_metrics(batch).items():
                self.metrics[name] = self.metrics.get(name, 0.0) + metric
        if self.keep_batches:
            self.kept.append(batch)
            self.micro_bad.append(nonfinite)

    def result(self, step, window, grad_norm, bad, lr, scaler_found_inf, start) -> StepResult:
        return StepResult(
            step=step,
            loss=self.loss / window if window > 1 else self.loss,
            loss_value=self.loss_value if window == 1 else None,
            terms={k: v / window for k, v in self.terms.items()} if window > 1 else self.terms,
            grad_norm=grad_norm,
            bad=bad,
            samples=self.samples,
            data_time_s=self.data_time,
            step_time_s=time.perf_counter() - start,
            lr=lr,
            scaler_found_inf=scaler_found_inf,
            batch_metrics=self.metrics,
            batches=self.kept,
            micro_bad=self.micro_bad,
            micro_batches=window,
        )


class Trainer:
    def __init__(
        self,
        cfg: LoopSettings,
        parts: TrainingParts,
        *,
        checkpointer: Checkpointer,
        on_metrics: Callable[[dict, int], None],
        dist: DistInfo,
        device: torch.device,
        seed: int,
        record: dict,
        progress_bar: bool = False,
        planned_steps: int = 0,
        contract: Any = None,
        startup: StartupClock | None = None,
    ):
        """`planned_steps`: the optimizer steps the run plans (the LR schedule's length);
        `contract`: what a resume must agree with (kiln.engine.resume.Contract); `startup`: the
        run's start-up clock, said in one line after the first step (kiln.startup)."""
        self.cfg, self.parts = cfg, parts
        self.model, self.raw_model = parts.model, parts.raw_model
        self.optimizer, self.scheduler, self.scaler = parts.optimizer, parts.scheduler, parts.scaler
        self.precision, self.criterion = parts.precision, parts.criterion
        self.ema = parts.ema
        self.train_loader, self.val_loader = parts.train_loader, parts.val_loader
        self.checkpointer, self.on_metrics = checkpointer, on_metrics
        self.dist, self.device, self.seed = dist, device, seed
        self.record = record  # config, preprocessing recipe, data spec: saved in every checkpoint
        self.progress_bar = progress_bar
        self.state = TrainState(planned_steps=planned_steps)
        self.contract = contract
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self.grad_norm = GradientNorm(self.params)
        self.non_blocking = bool(getattr(self.train_loader, "pin_memory", False))
        self.moves_batches = device.type != "cpu"
        self.batches_per_epoch = batches_per_epoch(self.train_loader, cfg.limit_train_batches)
        self.read_on_host(device.type == "cpu" and not dist.enabled)
        self.preemption = PreemptionFlag(dist, device)
        self.last_eval: dict = {}
        self.probe_time_s = 0.0
        self.probe_report = ProbeReport()
        self.probes_cached: Any = None  # kiln.guards.probe_cache.CachedProbes: passed before
        # Which parameters got gradients, step by step: one used only in some steps is named at
        # once (under DDP without find_unused_parameters the step fails before its collective).
        self.gradient_presence = self.new_gradient_presence()
        self.flops_time_s = 0.0  # counting the model's FLOPs, once, before the first step
        self.flops_per_sample: float | None = None  # model FLOPs of a training step, per sample
        self.current_step = 0  # the step in progress: failures are reported "@ step N"
        self.threads: int | None = None  # torch's intra-op threads, decided before step 1
        self.stopped_early = False  # trainer.early_stopping ended the run
        self.early_stop_held = False  # it would have, at chance: said once
        self.coverage_checked = False  # every trainable parameter is in the optimizer
        self.boxes_read = False  # a detector's boxes, after the first evaluation
        self.startup = startup
        self.startup_s: dict[str, float] | None = None  # where the start-up went, by phase

    def read_on_host(self, on: bool) -> None:
        """Where a step's flags and numbers live. On the host (the CPU, one process: a read
        waits for nothing) each is read as it comes, fewer ops than keeping it. Else they stay
        device tensors until the log line, and a fused optimizer skips a bad update on the
        device when told a flag (as under GradScaler). The host-read test runs the device way
        on the CPU (read_on_host(False))."""
        fail = self.cfg.nan_policy == NanPolicy.fail
        self.window = MetricWindow(self.device, self.dist.world_size, keep_batches=fail, on_host=on)
        fused = bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))
        self.skips_on_device = fused and not on

    # ----------------------------------------------------------------------------- the loop
    def fit(self) -> dict:
        """Train until max_epochs or max_steps; returns the last evaluation's metrics. However
        it ends (done, preempted, failing), the checkpoints asked for are on disk when it returns
        or raises."""
        # However it stops (Ctrl-C and preemption too) the writes finish: a preemption's last.pt
        # is what resume reads. The preemption: the process's handlers (kiln.engine.preemption).
        with on_failure(self.finish_writes_quietly), self.preemption:
            # Until this process's first step is done a signal stops the run at once (the
            # probes, a first step that compiles); from then on at a step boundary.
            self.preemption.starting_at(self.state.global_step)
            self.run_probes()
            self.settle_threads()
            while self.state.epoch < self.cfg.max_epochs and not self.reached_max_steps():
                self.train_epoch()
                if self.reached_max_steps() and self.state.batch_in_epoch < self.batches_per_epoch:
                    break  # stopped mid-epoch by max_steps: the final eval happens below
                self.state.epoch += 1
                self.state.batch_in_epoch = 0
                self.evaluate_and_checkpoint(epoch_end=True)
                if self.should_stop_early():
                    break
            if not self.last_eval or self.state.batch_in_epoch:
                self.evaluate_and_checkpoint(epoch_end=False)
        self.checkpointer.flush()  # every checkpoint on disk before the run reports done
        self.preemption.trained(self.state.global_step)  # from here a signal stops it at once
        self.report_data_time()
        return self.last_eval

    def finish_writes_quietly(self) -> None:
        """On the way out of a failing or preempted fit: the background writes end; a failure
        among them is logged (the run's own error, or the preemption, is what is reported)."""
        try:
            self.checkpointer.flush()
        except Exception as err:  # noqa: BLE001 -- already on the way out
            log.error("a checkpoint write failed too: %s: %s", type(err).__name__, err)

    def train_epoch(self) -> None:
        self.apply_freeze()
        batches = self.epoch_batches()
        self.model.train()  # once an epoch: the probes and evaluations before it switched modes
        with self._progress_bar() as bar:
            for result in self.epoch_steps(batches):
                if self.startup_s is None and self.startup is not None:
                    self.say_startup()
                self.after_step(result, bar)
                if self.reached_max_steps():
                    return

    def window_size(self) -> int:
        """Micro-batches in the next optimizer step: trainer.accumulate_grad_batches, or what
        is left of the epoch."""
        left = self.batches_per_epoch - self.state.batch_in_epoch
        return min(self.cfg.accumulate_grad_batches, left)

    def epoch_steps(self, batches: Iterator) -> Iterator[StepResult]:
        """The steps driver, for training and for `kiln triage`'s replay alike: the optimizer
        steps of the epoch from the trainer's position, each over its window of `batches`,
        the position moved on after each (the caller stops where it wants)."""
        s = self.state
        while s.batch_in_epoch < self.batches_per_epoch:
            window = self.window_size()
            self.current_step = s.global_step + 1
            result = self.train_step(batches, window)
            s.batch_in_epoch += window
            s.global_step += 1
            yield result

    def train_step(self, batches: Iterator, window: int) -> StepResult:
        """One optimizer step over `window` micro-batches (gradient accumulation). Nothing here
        waits for the device: a NaN/Inf loss sets a device flag that skips the update on the
        device; the flag is read with the metrics at the next log line."""
        if not self.model.training:  # train_epoch sets it; a caller of train_step alone may not
            self.model.train()
        start, step = time.perf_counter(), self.state.global_step + 1
        sums = StepSums(self.window.on_host, self.window.keep_batches, self.parts.batch_metrics)
        for micro in range(window):
            batch, waited = self.next_batch(batches)
            # Under DDP and FSDP only the window's last backward reduces gradients.
            syncs = micro == window - 1 or not self.dist.enabled
            with contextlib.nullcontext() if syncs else skip_gradient_sync(self.model):
                with self.precision.autocast():
                    loss, terms = self.compute_loss(batch)
                # Divide by the window so k micro-batches of b equal one batch of k*b.
                scaled = loss / window if window > 1 else loss
                (self.scaler.scale(scaled) if self.scaler.is_enabled() else scaled).backward()
            sums.add(batch, loss, terms, waited)
        self.gradient_presence.check(step)  # before the next collective
        bad = sums.bad if self.window.on_host else all_reduce_max(sums.bad)  # all ranks skip it
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)  # true-scale gradients: the norm, the clipping
        max_norm = self.cfg.gradient_clip_val or math.inf  # inf: measure, never clip
        grad_norm = self.grad_norm(max_norm, self.window.on_host)  # all ranks' shards (FSDP)
        scaler_found_inf = self.optimizer_step(bad, step)
        lr = self.optimizer.param_groups[0]["lr"]
        if self.scheduler is not None:  # per optimizer step, skipped ones too: the curve stays
            self.step_schedule(skipped=bad is True)  # aligned
        return sums.result(step, window, grad_norm, bad, lr, scaler_found_inf, start)

    def optimizer_step(self, bad: torch.Tensor | bool, step: int) -> torch.Tensor | None:
        """Apply the update unless `bad` (or GradScaler) says skip, deciding on the device where
        the optimizer can; then the gradients go and the EMA follows. Returns GradScaler's
        found-inf flag when it runs."""
        optimizer, scaler, found_inf = self.optimizer, self.scaler, None
        if scaler.is_enabled():
            found_inf = sum(scaler._found_inf_per_device(optimizer).values()) > 0
            scaler.step(optimizer)  # skips when gradients hold inf/NaN (a NaN loss makes them)
            scaler.update()
        elif self.skips_on_device:
            optimizer.found_inf, optimizer.grad_scale = bad.float(), None
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf, optimizer.grad_scale
        elif not bool(bad):  # this optimizer cannot skip on the device: one read per step
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.raw_model, step=step)
        return found_inf

    def next_batch(self, batches: Iterator) -> tuple[Any, float]:
        """The next micro-batch where it trains, and the seconds spent waiting for it."""
        fetch_start = time.perf_counter()
        batch = next(batches)
        if self.moves_batches:  # a CPU run's batches are where they train already
            batch = move_to(batch, self.device, self.non_blocking)
        if self.cfg.channels_last:
            batch = to_channels_last(batch)
        waited = time.perf_counter() - fetch_start
        if self.cfg.check_inputs:  # reads the batch on the host: opt-in
            assert_finite_inputs(batch)
        return batch, waited

    def step_schedule(self, skipped: bool) -> None:
        if not skipped:
            self.scheduler.step()
            return
        # A skipped first update makes torch warn of a schedule stepped before the optimizer:
        # here that is on purpose.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step")
            self.scheduler.step()

    # ------------------------------------------------------------------------- loss & guards
    def compute_loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        try:
            return self.criterion(self.model, batch)
        except torch.OutOfMemoryError as err:
            err.batch_shapes = describe(batch)  # for the OOM report beside the run
            raise
        except RuntimeError as err:
            if is_device_mismatch(err):  # re-run the forward under hooks to name the module
                with torch.no_grad():
                    rerun = lambda: self.criterion.forward(self.raw_model, batch, True)  # noqa: E731
                    raise diagnose(err, self.raw_model, rerun, batch) from err
            raise

    def run_probes(self) -> None:
        """Before the first step: the probe plan (rules 1 and 3, the behaviour checks, the learn
        probe; kiln.guards.probes) within its budget, on the run's real samples and its own
        model, leaving no trace on the run; what a model passed before is not run again
        (kiln.guards.probe_cache)."""
        plan, subject = self.parts.probe_plan, self.parts.probe_subject
        self.current_step = self.state.global_step
        if subject is None:
            return
        self.probes_cached = self.cached_probes()
        if self.probes_cached is not None:
            plan = dataclasses.replace(plan, passed=self.probes_cached.passed)
        started = time.perf_counter()
        try:
            self.probe_report = run_probe_plan(plan, subject)
        except BaseException as err:  # the summary keeps what ran until the check that failed
            self.probe_report = getattr(err, "probe_report", self.probe_report)
            raise
        finally:
            self.probe_time_s = time.perf_counter() - started
        report = self.probe_report
        self.gradient_presence.zero_to_confirm = list(report.pending_zero)
        if self.dist.is_main and plan.anything:
            self.say_probes(report)
        self.count_flops()
        self.remember_probes()

    def count_flops(self) -> None:
        """A training step's model FLOPs per sample, where something reads them: the thread
        count (trainer.threads=auto) and the MFU (a device whose peak is known); known from the
        probe cache where the model was counted before, else counted once, on the probes'
        batch and the run's own model (a new unsharded build for an FSDP one)."""
        subject = self.parts.probe_subject
        needed = self.cfg.threads == "auto" or self.parts.peak_flops is not None
        if self.flops_per_sample is not None or not needed or subject.build is None:
            return
        if self.probes_cached is not None and self.probes_cached.flops_per_sample:
            self.flops_per_sample = self.probes_cached.flops_per_sample
            return
        started = time.perf_counter()
        size = self.probe_report.batch_size or subject.mode_batch_size
        if subject.spec.input_kind == "image_list":
            # A detector resizes every image to one side and samples as many proposals for
            # each: its cost per image does not depend on the others, and one image is enough.
            size = 1
        counted = probe_model(self.raw_model, subject.build, subject.spec)
        # forked: a detector's forward samples proposals, not the run's numbers
        with untouched(counted), forked():
            self.flops_per_sample = flops_per_sample(
                counted, self.criterion.forward, take(subject.batch, size), size
            )
        self.flops_time_s = time.perf_counter() - started

    def cached_probes(self):
        """What this model passed before (every rank takes the main rank's answer: a rank that
        reads the cache after the main one wrote it would otherwise skip what the others run)."""
        from kiln.guards.probe_cache import lookup

        found = lookup(self.parts.probe_key)
        if self.dist.enabled:
            shared = [found]
            torch.distributed.broadcast_object_list(shared, src=0)
            found = shared[0]
        return found

    def remember_probes(self) -> None:
        """What the model passed, kept for its next run (the main rank writes it)."""
        from kiln.guards.probe_cache import remember

        cached = self.probes_cached.passed if self.probes_cached is not None else frozenset()
        if self.dist.is_main:
            passed = set(cached) | set(self.probe_report.passed)
            run_dir = self.checkpointer.directory.parent
            remember(self.parts.probe_key, passed, run_dir, self.flops_per_sample)

    def say_probes(self, report: ProbeReport) -> None:
        """One line of what the probes took and cost; one more for what they left out."""
        cached = self.probes_cached
        if cached is not None:
            left = [k for k in report.passed if k not in cached.passed]
            log.info(
                "probes: this model passed %s before (%s, %s): not run again%s "
                "(trainer.probe_cache=false runs them all)",
                ", ".join(sorted(cached.passed)),
                cached.date,
                cached.run_dir,
                f"; run now: {', '.join(left)}" if left else "",
            )
        shown = ", ".join(f"{k} {v:.2f}" for k, v in report.seconds.items())
        subject = self.parts.probe_subject
        cut = report.batch_size < subject.mode_batch_size
        took = f" on {report.batch_size} samples" if report.batch_size else ""
        took += f" (of {subject.mode_batch_size}: the budget)" if cut else ""
        log.info(
            "pre-step probes took %.2f s (%s)%s; %s",
            self.probe_time_s,
            shown,
            took,
            report.budget_note,
        )
        if report.skipped or report.learn_reading is not None or report.pending_zero:
            left_out = [f"{k} (est. {v:.2g} s)" for k, v in report.skipped.items()]
            moved = ["the learn probe"] if report.learn_reading is not None else []
            moved += ["dead gradients' second step"] if report.pending_zero else []
            log.warning(
                "probe budget: %s%s; trainer.probe_budget.enforce=false runs every check before "
                'step 1 (docs/antibodies.md, "The probe budget")',
                f"skipped {', '.join(left_out)}" if left_out else "nothing skipped",
                f"; {' and '.join(moved)} read the first steps instead" if moved else "",
            )

    def say_startup(self) -> None:
        """After this run's first step (issued: a GPU's is not waited for): where the start-up
        went, in one line. Counting the step's FLOPs is the build's, the probes their own."""
        within = {"probes": self.probe_time_s, "build": self.flops_time_s}
        self.startup.lap("first step", within=within)
        self.startup_s = self.startup.as_dict()
        if self.dist.is_main:
            log.info("%s", self.startup.line())

    def new_gradient_presence(self) -> GradientPresence:
        from kiln.engine.rank_watch import post_failure

        ddp = self.dist.enabled and not is_fsdp(self.raw_model)
        return GradientPresence(
            self.raw_model,
            fatal=ddp and not self.cfg.find_unused_parameters,
            on_fatal=lambda message: post_failure(self.dist, "dead gradients", message),
        )

    def settle_threads(self) -> None:
        """torch's intra-op threads for the step just counted (trainer.threads, kiln.threads),
        said once with the DataLoader's workers, before the first step."""
        from kiln.threads import training_threads

        size = self.train_loader.batch_size
        plan = training_threads(
            self.cfg.threads,
            self.flops_per_sample * size if self.flops_per_sample else None,
            watch=self.parts.cpu_watch,
            deterministic=self.cfg.deterministic,
            share=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        )
        torch.set_num_threads(plan.count)
        self.threads = plan.count
        if self.dist.is_main:
            workers = getattr(self.train_loader, "worker_plan", None)
            log.info(
                "threads: %d intra-op (%s); DataLoader workers: %s",
                plan.count,
                plan.reason,
                f"{workers.count} ({workers.reason})" if workers else self.train_loader.num_workers,
            )

    def should_stop_early(self) -> bool:
        """trainer.early_stopping: `patience` epochs have ended without a better monitored
        metric than best.pt's (the state says when best.pt was written, so a resumed run counts
        the same way), counted from the end of the lr warm-up at the earliest, and never while
        the best evaluation is still at chance: a run that has learned nothing yet is not
        stopped for failing to improve on nothing."""
        patience, s = self.parts.early_stopping, self.state
        per_epoch = math.ceil(self.batches_per_epoch / self.cfg.accumulate_grad_batches)
        warmed_up = math.ceil(self.parts.warmup_end / max(per_epoch, 1))  # its epoch
        if patience is None or s.best_epoch is None:
            return False
        if s.epoch - max(s.best_epoch, warmed_up) < patience:
            return False
        nothing = self.at_chance(s.best_metric, s.lowest_val_loss)
        if nothing is not None:
            if not self.early_stop_held and self.dist.is_main:
                log.info(
                    "early stopping waits: the best evaluation is at chance (%s); "
                    "nothing was learned to stop on",
                    nothing,
                )
            self.early_stop_held = True
            return False
        if s.epoch < self.cfg.max_epochs and self.dist.is_main:
            log.info(
                "early stopping: %d epoch(s) without a better %s than best.pt's %.4g (epoch %d); "
                "trainer.early_stopping=%d",
                s.epoch - s.best_epoch,
                self.checkpointer.monitor,
                s.best_metric if s.best_metric is not None else float("nan"),
                s.best_epoch,
                patience,
            )
        self.stopped_early = s.epoch < self.cfg.max_epochs
        return True

    def check_shapes(self) -> None:
        """Rule 3 on one real batch: train and eval mode agree on the output."""
        subject = self.parts.probe_subject
        if self.cfg.shape_check and subject is not None:
            with self.precision.autocast():  # as the evaluator runs the model
                check_train_eval_agreement(
                    self.raw_model,
                    take(subject.batch, subject.mode_batch_size),
                    self.criterion.forward,
                )

    # ---------------------------------------------------------------- logging & checkpoints
    def after_step(self, result: StepResult, bar) -> None:
        self.preemption.defer()  # a step is done: a stop from now on saves it first
        s = self.state
        if not self.coverage_checked:  # this process's first step: before anything is saved
            self.check_optimizer_coverage()
        s.samples_seen += result.samples * self.dist.world_size
        s.data_time_s += result.data_time_s
        s.step_time_s += result.step_time_s
        self.window.add(result)
        if bar is not None:
            bar.update(1)
        due = self.checkpointer.should_save_step(s.global_step)
        if self.should_log() or due:
            self.log_window(result.lr, bar)
        if due:
            self.checkpointer.save("last.pt", self.state_dict())
        reading = self.probe_report.learn_reading  # the learn probe, moved into the first steps
        if reading is not None and not reading.done:
            reading.after_step(s.global_step, s.planned_steps)
            if reading.done:  # it learns (else the line above raised)
                self.probe_report.passed.append("learn probe")
                self.remember_probes()
        if self.preemption.agreed(every_step=not self.dist.enabled or self.should_log()):
            self.log_window(result.lr, bar)
            raise self.checkpoint_and_stop(saved=due)

    def check_optimizer_coverage(self) -> None:
        """After the first step (a layer built in forward exists by then): every trainable
        parameter is one the optimizer holds (kiln.guards.optimizer_coverage)."""
        from kiln.guards.optimizer_coverage import check_optimizer_coverage

        self.coverage_checked = True
        self.current_step = self.state.global_step
        check_optimizer_coverage(
            self.raw_model, self.optimizer, self.state.global_step, self.dist.enabled
        )

    def checkpoint_and_stop(self, saved: bool = False) -> Preempted:
        """A stop was asked: last.pt at the step boundary the state is at, unless `saved` there
        already (its write finishes on the way out, in fit), and the exception that ends the
        run."""
        if not saved:
            self.checkpointer.save("last.pt", self.state_dict())
        return self.preemption.stop(self.state.global_step)

    def log_window(self, lr: float | None = None, bar=None) -> None:
        """One host read of the window: its metrics become a log line, its non-finite record
        fails the run (nan_policy=fail) or counts towards max_skipped_steps."""
        if not self.window.steps:
            return
        s = self.state
        metrics, nonfinite = self.window.read()
        self.window.reset()
        s.nonfinite_skipped += nonfinite.skipped
        s.scaler_skipped += nonfinite.scaler_skipped
        if nonfinite.skipped and self.cfg.nan_policy == NanPolicy.fail:
            stats = tensor_stats(nonfinite.batch) if nonfinite.batch is not None else {}
            raise NonFiniteLossError(
                nonfinite.kind,
                nonfinite.first_step,
                stats,
                nonfinite.bad_terms,
                nonfinite.step_batches,
                nonfinite.bad_micro,
            )
        if nonfinite.skipped:
            log.warning(
                "%d step(s) with a non-finite loss skipped (nan_policy=skip), the first @ step %d",
                nonfinite.skipped,
                nonfinite.first_step,
            )
        limit = self.cfg.max_skipped_steps
        if 0 <= limit < s.nonfinite_skipped:
            raise TooManySkippedSteps(s.nonfinite_skipped, limit, s.global_step)
        metrics = {
            "epoch": s.epoch,
            **metrics,
            **self.utilisation(metrics["samples_per_s"]),
            "lr": self.optimizer.param_groups[0]["lr"] if lr is None else lr,
            "memory_mb": memory_mb(self.device),
            "nonfinite_skipped": s.nonfinite_skipped,
            "scaler_skipped": s.scaler_skipped,
        }
        if bar is not None:
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", sps=rate_text(metrics["samples_per_s"]))
        if self.dist.is_main:
            log.info(
                "epoch %d step %d loss %.4f lr %.3g grad_norm %.3g %s samples/s data %.0f%%",
                s.epoch,
                s.global_step,
                metrics["loss"],
                metrics["lr"],
                metrics.get("grad_norm", float("nan")),
                rate_text(metrics["samples_per_s"]),
                100 * metrics["data_time_frac"],
            )
        self.on_metrics(metrics, s.global_step)

    def utilisation(self, samples_per_s: float) -> dict[str, float]:
        """Achieved model TFLOP/s and MFU (against the device's peak, when known)."""
        if not self.flops_per_sample:
            return {}
        achieved = self.flops_per_sample * samples_per_s
        out = {"model_tflops_per_s": achieved / 1e12}
        if self.parts.peak_flops:
            out["mfu"] = achieved / self.parts.peak_flops
        return out

    def should_log(self) -> bool:
        step = self.state.global_step
        return step % self.cfg.log_every_n_steps == 0 or step == 1

    def reached_max_steps(self) -> bool:
        return 0 < self.cfg.max_steps <= self.state.global_step

    def evaluate_and_checkpoint(self, epoch_end: bool) -> None:
        self.log_window()  # the steps since the last log line: read before anything is saved
        self.current_step = self.state.global_step
        raw = self.evaluate()
        self.last_eval, chosen, use_ema = dict(raw), raw, False
        if self.ema is not None:  # the average, evaluated beside the weights
            averaged = self.parts.evaluator(self.ema.module, self.val_batches())
            self.last_eval.update({f"ema_{k}": v for k, v in averaged.items()})
            monitor = self.checkpointer.monitor
            use_ema = self.checkpointer.is_improvement(averaged.get(monitor), raw.get(monitor))
            chosen = averaged if use_ema else raw
        s = self.state
        if self.dist.is_main:
            shown = " ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items())
            log.info("eval after epoch %d step %d: %s", s.epoch, s.global_step, shown)
            if self.ema is not None:
                log.info("best.pt candidate: the %s weights", "EMA" if use_ema else "raw")
        self.on_metrics({"epoch": s.epoch, **self.last_eval}, s.global_step)
        self.checkpointer.after_evaluation(
            chosen, s, self.state_dict, epoch_end, best_weights="ema" if use_ema else "raw"
        )
        loss = self.last_eval.get("val_loss")
        if isinstance(loss, float) and math.isfinite(loss):
            s.lowest_val_loss = loss if s.lowest_val_loss is None else min(s.lowest_val_loss, loss)
        self.say_if_at_chance(self.last_eval)
        if not self.boxes_read and self.parts.data is not None:
            self.read_box_predictions()  # a detector: once, after the first evaluation
        bad = nonfinite_metrics(self.last_eval)
        if bad and self.cfg.nan_policy == NanPolicy.fail:
            raise NonFiniteEvalError(self.last_eval, bad, s.global_step)
        if bad and self.dist.is_main:  # nan_policy=skip: said at every such evaluation
            kept = f"best.pt stays at step {s.best_step}" if s.best_step else "no best.pt yet"
            log.warning(
                "non-finite evaluation after step %d (%s; nan_policy=skip): %s",
                s.global_step,
                ", ".join(f"{k}={self.last_eval[k]}" for k in bad),
                kept,
            )

    def read_box_predictions(self) -> None:
        """A detection run's boxes on one validation batch, once, after the first evaluation
        (kiln.guards.box_predictions): degenerate boxes, or boxes that fit their targets better
        flipped or read in another format, are said and kept as findings. Every rank runs its
        own batch (a sharded model's forward is its ranks' collectives); the main rank says."""
        self.boxes_read = True
        if self.parts.data.spec.task != "detection":
            return
        from kiln.guards.box_predictions import check_box_predictions

        batch = next(iter(self.val_batches()), None)
        if batch is None:
            return
        self.raw_model.eval()
        with self.precision.autocast():
            found = check_box_predictions(
                self.raw_model, batch, self.criterion.forward, self.state.global_step
            )
        if not self.dist.is_main:
            return
        for finding in found:
            log.warning("box predictions: %s", finding.evidence)
        self.probe_report.findings.extend(found)

    def chance(self):
        """What the monitored metric is for a model that knows nothing (kiln.engine.chance), as
        the evaluator measured it; None when the metric has no known chance level."""
        chances = getattr(self.parts.evaluator, "chance", None) or {}
        return chances.get(self.checkpointer.monitor)

    def at_chance(self, monitored: float | None, loss: float | None) -> str | None:
        """Why the run is at chance, or None: the monitored metric is there, or the validation
        loss has not fallen below what always predicting the labels' frequencies gives."""
        chances = getattr(self.parts.evaluator, "chance", None) or {}
        monitor, mode = self.checkpointer.monitor, self.checkpointer.monitor_mode
        chance = chances.get(monitor)
        if chance is not None and chance.reached(monitored, mode):
            return chance.describe(monitored)
        by_loss = chances.get("val_loss")
        if monitor != "val_loss" and by_loss is not None and by_loss.reached(loss, "min"):
            return by_loss.describe(loss)
        return None

    def say_if_at_chance(self, metrics: dict) -> None:
        why = self.at_chance(metrics.get(self.checkpointer.monitor), metrics.get("val_loss"))
        if why is not None and self.dist.is_main:
            log.warning("at chance after step %d: %s", self.state.global_step, why)

    def outcome(self) -> tuple[str, str | None]:
        """("ok", None), or ("at_chance", the line) when the run's best evaluation stayed at
        chance: a run that learned nothing is not ok."""
        s = self.state
        best = (
            s.best_metric
            if s.best_metric is not None
            else self.last_eval.get(self.checkpointer.monitor)
        )
        why = self.at_chance(best, s.lowest_val_loss)
        if why is None:
            return "ok", None
        return "at_chance", (
            f"the run learned nothing: at its best, {why}; `kiln triage` on its run directory "
            "ranks the likely causes"
        )

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.check_shapes()
        self.model.eval()
        return self.parts.evaluator(self.raw_model, self.val_batches())

    def apply_freeze(self) -> None:
        """model.freeze for the epoch about to start; DDP is re-wrapped when parameters thaw
        (it registers only the trainable ones when it is built)."""
        plan = self.parts.freeze
        if plan is None or not plan.apply(self.raw_model, self.state.epoch):
            return
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self.grad_norm = GradientNorm(self.params)
        self.gradient_presence = self.new_gradient_presence()  # other parameters train now
        state = "frozen" if plan.frozen_at(self.state.epoch) else "trainable from now on"
        if self.dist.is_main:
            log.info(
                "epoch %d: %d parameter tensors of model.freeze %s",
                self.state.epoch,
                len(plan.names),
                state,
            )
        if self.parts.rewrap is not None:
            self.model = self.parts.rewrap()

    def epoch_batches(self) -> Iterator:
        """The current epoch's training batches from the state's position (state.epoch,
        state.batch_in_epoch): the same batches, and the same worker seeds, for a resumed run as
        for an uninterrupted one."""
        s = self.state
        self.train_loader.sampler.set_epoch(
            s.epoch, skip=s.batch_in_epoch * self.train_loader.batch_size
        )
        # Worker seeds are drawn from this generator: re-seeded per epoch.
        self.train_loader.generator.manual_seed(self.seed * 1000 + s.epoch)
        return iter(self.train_loader)

    def val_batches(self) -> Iterator:
        """The validation batches an evaluation reads (at most trainer.limit_val_batches), on
        the device."""
        limit = self.cfg.limit_val_batches
        for i, batch in enumerate(self.val_loader):
            if 0 <= limit <= i:
                return
            # A stop asked during an evaluation ends it at this batch: the state is still at the
            # step boundary it evaluates. Under DDP the evaluation runs to its end (stopping
            # early would need the ranks to agree at every batch): the ranks agree afterwards.
            if self.preemption.requested and not self.dist.enabled:
                self.preemption.say_what_arrived()
                raise self.checkpoint_and_stop()
            batch = move_to(batch, self.device, self.non_blocking)
            yield to_channels_last(batch) if self.cfg.channels_last else batch

    # ----------------------------------------------------------------------- state & resume
    def state_dict(self) -> dict:
        return {
            **model_and_optimizer_state(self.raw_model, self.optimizer),  # sharded under FSDP
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict(),
            "state": self.state.as_dict(),
            "rng": rng_state(),
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
            **self.record,
        }

    def load_state_dict(self, checkpoint: dict) -> None:
        """Restore an exact training state (kiln.engine.resume judged the config first)."""
        planned = self.state.planned_steps
        load_model_and_optimizer(self.raw_model, self.optimizer, checkpoint)
        if self.scheduler is not None and checkpoint.get("scheduler") is not None:
            self.scheduler.load_state_dict(checkpoint["scheduler"])
        if checkpoint["scaler"] and self.scaler.is_enabled():  # empty when it was disabled
            self.scaler.load_state_dict(checkpoint["scaler"])
        if self.ema is not None and "ema" in checkpoint:
            self.ema.load_state_dict(checkpoint["ema"])
        elif self.ema is not None:
            log.warning("the checkpoint holds no EMA weights: the average starts from these")
            self.ema.load_state_dict(self.raw_model.state_dict())
        self.state = TrainState(**checkpoint["state"])
        self.state.planned_steps = planned
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


def nonfinite_metrics(metrics: dict) -> list[str]:
    """The names of an evaluation's NaN/Inf metrics, in order."""
    return [k for k, v in metrics.items() if isinstance(v, int | float) and not math.isfinite(v)]


def batches_per_epoch(train_loader, limit_train_batches: int) -> int:
    """Batches this rank trains on per epoch: its sampler's share (without the partial last
    batch under data.drop_last), capped by the limit (> 0)."""
    cut = math.floor if getattr(train_loader, "drop_last", False) else math.ceil
    batches = cut(train_loader.sampler.num_samples / train_loader.batch_size)
    return min(batches, limit_train_batches) if limit_train_batches > 0 else batches


def memory_mb(device: torch.device) -> float:
    """The run's peak memory so far: allocated on the GPU, resident on the CPU (one system call;
    psutil's current RSS read a /proc file at every log line)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


__all__ = [
    "NonFiniteEvalError",
    "NonFiniteLossError",
    "Preempted",
    "StepResult",
    "TrainState",
    "Trainer",
]
