"""The rest of a training run: precision, trainer, logger, loss, env, debug, and the top-level
KilnConfig that holds one option of every group."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from omegaconf import MISSING

from kiln.config.base import (
    ConfigError,
    at_least,
    auto_or_count,
    check_branch_defaults,
    invalid,
    limit_or_all,
)
from kiln.config.data import DataConfig
from kiln.config.model import ModelConfig
from kiln.config.optim import OptimizerConfig, SchedulerConfig
from kiln.registry import LOGGERS, PRECISIONS


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Numeric precision of the forward pass."""

    name: str = MISSING  # fp32 | amp (fp16 + GradScaler on CUDA, bf16 on CPU) | bf16


class NanPolicy(StrEnum):
    fail = "fail"  # stop with the [FAIL] line
    skip = "skip"  # drop the step's gradients and go on


class Backend(StrEnum):
    auto = "auto"  # nccl on CUDA, gloo on CPU
    gloo = "gloo"
    nccl = "nccl"


class CompileMode(StrEnum):
    default = "default"
    reduce_overhead = "reduce-overhead"  # CUDA graphs: small batches, launch-bound models
    max_autotune = "max-autotune"
    max_autotune_no_cudagraphs = "max-autotune-no-cudagraphs"


class MatmulPrecision(StrEnum):
    highest = "highest"  # full fp32 matmuls
    high = "high"  # TF32 on Ampere and newer GPUs
    medium = "medium"  # bf16 inside fp32 matmuls where supported


class BestCheckpoint(StrEnum):
    weights = "weights"  # what inference needs: weights, config, preprocessing (a third the size)
    full = "full"  # also the optimizer, scheduler and RNG states: resumable


class MonitorMode(StrEnum):
    max = "max"
    min = "min"


class Strategy(StrEnum):
    ddp = "ddp"  # every rank holds the whole model; gradients are all-reduced
    fsdp = "fsdp"  # parameters, gradients and optimizer state sharded over the ranks (FSDP2)


@dataclass(frozen=True, kw_only=True)
class FsdpConfig:
    """trainer.strategy=fsdp: how the model is cut into blocks, each sharded on its own."""

    # Size policy: a submodule with this many parameters outside smaller blocks is one block.
    # A model with an `fsdp_blocks()` method names its blocks itself and this is not used.
    min_block_params: int = 1_000_000  # parameters per block, at least (size policy)
    reshard_after_forward: bool = True  # free gathered parameters after each block's forward

    def check(self, key: str) -> None:
        at_least(self.min_block_params, 1, f"{key}.min_block_params")


@dataclass(frozen=True, kw_only=True)
class ProbeBudgetConfig:
    """What the checks before step 1 may cost (docs/antibodies.md, "The probe budget"): the
    first check, one observed step, is timed; the others run in order while their estimates fit,
    and one that does not is skipped and named (the learn probe reads the first steps instead)."""

    share_of_epoch: float = 0.02  # of the first epoch's time, estimated from the observed step
    min_s: float = 1.0  # seconds allowed whatever the epoch (a small run checks everything)
    max_s: float | None = 15.0  # seconds at most, however long the epoch (null: no cap)
    enforce: bool = True  # false: every check runs before step 1, whatever it costs

    def check(self, key: str) -> None:
        if not 0 <= self.share_of_epoch <= 1:
            raise invalid(
                f"{key}.share_of_epoch", f"must be in [0, 1], got {self.share_of_epoch:g}"
            )
        if not self.min_s >= 0:
            raise invalid(f"{key}.min_s", f"must be >= 0 seconds, got {self.min_s:g}")
        if self.max_s is not None and not self.max_s >= self.min_s:
            raise invalid(
                f"{key}.max_s",
                f"must be >= {key}.min_s ({self.min_s:g} s), got {self.max_s:g}, or null (no cap)",
            )


# The behaviour checks of the probes before step 1 a run can leave out (trainer.skip_checks), by
# the name its [FAIL] line gives them. Rules 1 and 3 have their own switches (trainer.probe_sizes,
# trainer.shape_check), the learn probe and the fp16 probe theirs.
SKIPPABLE_CHECKS = (
    "batch dependence",
    "determinism",
    "purity",
    "numerics",
    "dead gradients",
    "device",
)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The training loop: length, accumulation, clipping, checkpoints, guards, logging."""

    name: str = MISSING  # the trainer option (default | ddp | fsdp)
    distributed: bool = False  # torch.distributed data parallel; run under torchrun
    backend: Backend = Backend.auto  # process-group backend: auto | gloo | nccl
    strategy: Strategy = Strategy.ddp  # with distributed: ddp (replicate) | fsdp (shard)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)  # blocks and resharding (strategy=fsdp)
    max_epochs: int = 10  # epochs to train
    max_steps: int = -1  # optimizer steps, at most (-1: no limit)
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step
    gradient_clip_val: float | None = None  # max total grad norm (null: no clipping)
    deterministic: bool = False  # bitwise-repeatable kernels (errors where an op has none)
    nan_policy: NanPolicy = NanPolicy.fail  # on a NaN/Inf loss: fail | skip
    check_inputs: bool = False  # raise on NaN/Inf in a batch, naming the tensor
    shape_check: bool = True  # rule 3 before the first step and before every evaluation
    probe_sizes: bool = True  # rule 1 before the first step: other batch and input sizes
    learn_probe: bool = True  # before step 1, a few steps on one batch (on copies) must lower it
    fp16_check: bool = False  # the fp16 overflow probe also without precision=amp
    skip_checks: list[str] = field(default_factory=list)  # checks left out: [determinism,...]
    # What the checks before step 1 may cost: a share of the first epoch, within min_s..max_s
    probe_budget: ProbeBudgetConfig = field(default_factory=ProbeBudgetConfig)
    probe_cache: bool = True  # a model that passed its checks before is not probed again
    find_unused_parameters: bool = False  # DDP: parameters may go unused in some steps (slower)
    max_skipped_steps: int = 20  # nan_policy=skip fails the run past this many (-1: no limit)
    checkpoint_every_n_steps: int = 0  # also save last.pt every N optimizer steps (0: off)
    checkpoint_every_epoch: bool = True  # keep an epoch-N.pt at every epoch end
    keep_last_k: int = 2  # epoch-N.pt files kept besides last.pt and best.pt (0: none)
    best_checkpoint: BestCheckpoint = BestCheckpoint.weights  # best.pt: weights | full
    monitor: str = "auto"  # metric that picks best.pt (auto: the evaluator's, e.g. val_acc)
    monitor_mode: MonitorMode = MonitorMode.max  # whether a larger monitor value is better
    log_every_n_steps: int = 10  # optimizer steps between log lines
    limit_train_batches: int = -1  # batches per epoch, at most (-1: all)
    limit_val_batches: int = -1  # validation batches, at most (-1: all)
    overfit_batches: int = 0  # train and validate on the first N batches only (0: off)
    log_activations: bool = False  # per-layer output mean/std in the metrics
    compile: bool = False  # torch.compile the model (checkpoints and guards see the eager one)
    compile_mode: CompileMode = CompileMode.default  # torch.compile's mode
    channels_last: bool = False  # NHWC memory format for 4-D image batches and the model
    host_malloc: bool = True  # glibc: freed host memory kept for the next step (fewer faults)
    matmul_precision: MatmulPrecision = MatmulPrecision.highest  # high: TF32 matmuls on GPUs
    peak_tflops: float | None = None  # the device's peak for MFU (null: known GPUs' table)
    find_batch_size: bool = False  # the largest data.batch_size that fits, found on real steps
    ema_decay: float | None = None  # EMA of the weights, evaluated beside them (null: off; 0.999)
    unfreeze_at_epoch: int | None = None  # epoch from which model.freeze'd modules train
    # torch's intra-op threads: auto (one for a small step, the usable physical cores for a
    # large one, from the counted FLOPs and the CPUs this process may use: kiln.threads) or N
    threads: Any = "auto"
    # Stop after this many epochs without a better trainer.monitor (best.pt keeps the best):
    # auto (2 for text data, off otherwise), null (off) or N
    early_stopping: Any = "auto"

    def check(self, key: str) -> None:
        at_least(self.max_epochs, 1, f"{key}.max_epochs")
        auto_or_count(self.threads, 1, f"{key}.threads")
        if self.early_stopping is not None:
            auto_or_count(self.early_stopping, 1, f"{key}.early_stopping")
        limit_or_all(self.max_steps, f"{key}.max_steps")
        at_least(self.accumulate_grad_batches, 1, f"{key}.accumulate_grad_batches")
        if self.gradient_clip_val is not None and not self.gradient_clip_val > 0:
            raise invalid(
                f"{key}.gradient_clip_val",
                f"must be > 0, got {self.gradient_clip_val:g}, or null to switch clipping off",
            )
        at_least(self.checkpoint_every_n_steps, 0, f"{key}.checkpoint_every_n_steps")
        at_least(self.keep_last_k, 0, f"{key}.keep_last_k", "0 keeps no epoch-N.pt files")
        at_least(self.log_every_n_steps, 1, f"{key}.log_every_n_steps")
        limit_or_all(self.limit_train_batches, f"{key}.limit_train_batches")
        limit_or_all(self.limit_val_batches, f"{key}.limit_val_batches")
        at_least(self.overfit_batches, 0, f"{key}.overfit_batches")
        at_least(self.max_skipped_steps, -1, f"{key}.max_skipped_steps", "-1: no limit")
        for check in self.skip_checks:
            if check.replace("_", " ") not in SKIPPABLE_CHECKS:
                raise invalid(
                    f"{key}.skip_checks",
                    f"unknown check {check!r}; the checks a run can skip: "
                    f"{', '.join(SKIPPABLE_CHECKS)} "
                    "(rules 1 and 3: trainer.probe_sizes, trainer.shape_check; "
                    "trainer.learn_probe)",
                )
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise invalid(f"{key}.ema_decay", f"must be in (0, 1) or null, got {self.ema_decay}")
        if self.unfreeze_at_epoch is not None:
            at_least(self.unfreeze_at_epoch, 1, f"{key}.unfreeze_at_epoch")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise invalid(f"{key}.peak_tflops", f"must be > 0 or null, got {self.peak_tflops}")
        if self.strategy == Strategy.fsdp and (self.ema_decay or self.unfreeze_at_epoch):
            raise invalid(
                f"{key}.strategy",
                "trainer.ema_decay and trainer.unfreeze_at_epoch are not supported with sharded "
                "parameters (trainer=fsdp): use trainer=ddp, or leave them null",
            )
        if self.strategy == Strategy.fsdp and not self.distributed:
            raise invalid(
                f"{key}.strategy",
                "strategy=fsdp shards over torch.distributed ranks: use trainer=fsdp "
                "(or set trainer.distributed=true)",
            )
        if self.strategy != Strategy.fsdp and self.fsdp != FsdpConfig():
            warnings.warn(
                f"{key}.fsdp is ignored unless {key}.strategy=fsdp (use trainer=fsdp)", stacklevel=2
            )


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"


@dataclass(frozen=True, kw_only=True)
class LoggerConfig:
    """Where metrics go besides metrics.jsonl (always written)."""

    backends: list[str] = field(default_factory=lambda: ["csv"])  # csv, tensorboard, wandb
    wandb_project: str = "kiln"  # W&B project
    wandb_mode: WandbMode = WandbMode.offline  # offline | online (online needs WANDB_API_KEY)
    wandb_entity: str | None = None  # W&B team or user (null: your default)
    # <run>/curves.png, drawn by a process beside the run (false: no matplotlib process, no
    # picture; metrics.jsonl holds every value it would show)
    curves: bool = True

    def check(self, key: str) -> None:
        for backend in self.backends:
            if backend not in LOGGERS:
                raise ConfigError(
                    f"unknown backend {backend!r}",
                    f"{key}.backends",
                    f"choose from {', '.join(LOGGERS.names())}",
                )


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The main criterion plus optional branches, each behind a flag (default off)."""

    label_smoothing: bool = False  # smooth the targets towards uniform
    label_smoothing_eps: float = 0.1  # smoothing strength
    z_loss: bool = False  # penalise the log-sum-exp of the logits (logit drift)
    z_loss_weight: float = 1e-4  # z-loss weight
    confidence_penalty: bool = False  # penalise low-entropy (over-confident) predictions
    confidence_penalty_weight: float = 0.1  # confidence-penalty weight
    aux_head: bool = False  # loss on an auxiliary head (the model is built with one)
    aux_head_weight: float = 0.4  # auxiliary-head weight
    force_all_branches: bool = False  # switch every branch on (the tests do)

    branch_flags: ClassVar[tuple[str, ...]] = (
        "label_smoothing",
        "z_loss",
        "confidence_penalty",
        "aux_head",
        "force_all_branches",
    )

    def check(self, key: str) -> None:
        check_branch_defaults(type(self), self.branch_flags, key)


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """A profile: experiment (interactive) or production (unattended)."""

    name: str = MISSING  # experiment | production
    progress_bar: bool = True  # tqdm on a terminal; plain log lines otherwise
    debug_allowed: bool = True  # debug=... options are refused when false
    quiet: bool = False  # only warnings on the console (train.log keeps every line)
    require_best_checkpoint: bool = False  # inference refuses anything but best.pt


@dataclass(frozen=True, kw_only=True)
class DebugConfig:
    """Which debug option is on; each is a YAML of trainer overrides (conf/debug/)."""

    name: str = "none"  # none | fast_dev_run | overfit_batch | activations


class Device(StrEnum):
    auto = "auto"  # CUDA when available, else CPU
    cpu = "cpu"
    cuda = "cuda"


@dataclass(frozen=True, kw_only=True)
class KilnConfig:
    """One option of every group plus the run-wide keys."""

    PATH_KEYS: ClassVar[tuple[str, ...]] = ("resume", "init_from", "output_root")

    data: DataConfig = MISSING  # the dataset and its loaders (data=<option>)
    model: ModelConfig = MISSING  # the network (model=<option>)
    optimizer: OptimizerConfig = MISSING  # optimizer=<option>
    scheduler: SchedulerConfig = MISSING  # the LR schedule (scheduler=<option>)
    precision: PrecisionConfig = MISSING  # precision=<option>
    trainer: TrainerConfig = MISSING  # the loop (trainer=<option>)
    logger: LoggerConfig = MISSING  # metric backends (logger=<option>)
    loss: LossConfig = field(default_factory=LossConfig)  # criterion and its branches
    env: EnvConfig = MISSING  # the profile (env=<option>)
    debug: DebugConfig = field(default_factory=DebugConfig)  # debug=<option>
    name: str = "${data.name}-${model.name}"  # experiment name: resume=auto and failures use it
    seed: int = 42  # seeds python, numpy, torch and the DataLoader workers
    device: Device = Device.auto  # auto | cpu | cuda
    resume: str | None = None  # null | auto | <path to a .pt>
    resume_override: list[str] = field(default_factory=list)  # keys a resume may change
    init_from: str | None = None  # weights only (a kiln checkpoint or a state dict): a new run
    output_root: str = "outputs"  # where failures.log and failures/ go
    plugins: list[str] = field(default_factory=list)  # your modules that register entries
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes kept with the run

    def check(self, key: str) -> None:
        from dataclasses import asdict

        known = _dotted_keys(asdict(self))
        for override in self.resume_override:
            if override not in known:
                raise ConfigError(
                    f"unknown key {override!r}",
                    "resume_override",
                    "list config keys (optimizer.lr) or groups (optimizer) the resume may change",
                )
        if self.trainer.unfreeze_at_epoch is not None and not getattr(self.model, "freeze", None):
            warnings.warn(
                "trainer.unfreeze_at_epoch is ignored: model.freeze is null (nothing to unfreeze)",
                stacklevel=2,
            )
        # A schema's own default first (check_tree checks this node before its children).
        flags = getattr(self.model, "branch_flags", ())
        check_branch_defaults(type(self.model), flags, "model", self.model.name)
        trains_aux = self.loss.aux_head or self.loss.force_all_branches
        if getattr(self.model, "aux_head", False) and not trains_aux:
            raise ConfigError(
                "rule 2 (every optional loss branch has a flag and must work): "
                f"model.aux_head is on for model={self.model.name} but loss.aux_head is off, so "
                "the auxiliary head would be built and never trained",
                "model.aux_head",
                "set loss.aux_head=true to train it (that flag alone builds the head too), or "
                "model.aux_head=false",
            )
        if self.debug.name != "none" and not self.env.debug_allowed:
            raise ConfigError(
                f"debug={self.debug.name} is not allowed in env={self.env.name}",
                "debug",
                "use env=experiment for debug tools",
            )


def _dotted_keys(tree: dict, prefix: str = "") -> set[str]:
    """Every group and dotted key of a config: {"optimizer", "optimizer.lr", ...}."""
    keys = set()
    for key, value in tree.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= _dotted_keys(value, f"{prefix}{key}.")
    return keys


PRECISIONS.declare("fp32", "kiln.engine.precision:fp32", config=PrecisionConfig)
PRECISIONS.declare("amp", "kiln.engine.precision:amp", config=PrecisionConfig)
PRECISIONS.declare("bf16", "kiln.engine.precision:bf16", config=PrecisionConfig)
LOGGERS.declare("csv", "kiln.logging.csv_backend:CsvLogger")
LOGGERS.declare("tensorboard", "kiln.logging.tensorboard_backend:TensorBoardLogger")
LOGGERS.declare("wandb", "kiln.logging.wandb_backend:WandbLogger")
