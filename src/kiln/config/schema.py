"""Typed config schemas. Every YAML under conf/ is merged onto these dataclasses, so an unknown
key or a wrong type fails when Hydra composes the config, before any work starts. Choices that
the type system cannot express (names, policies) are checked by `validate` with the valid list."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class ConfigError(ValueError):
    """A user mistake in the config; the message says which key and what is valid."""


@dataclass
class DataConfig:
    name: str = MISSING  # a registered dataset: digits, synthetic_images, csv_text, ...
    batch_size: int = 64  # per process (per rank under DDP)
    num_workers: int = 0
    pin_memory: bool = True  # applied only when training on CUDA
    persistent_workers: bool = True  # applied only when num_workers > 0
    prefetch_factor: int = 2  # batches each worker loads ahead; only when num_workers > 0
    val_fraction: float = 0.2  # share of the data held out for validation (digits, csv_text)
    split_seed: int = 0  # the train/val split never depends on the run's seed
    # synthetic_images / shapes_detection
    image_size: int = 32  # side in pixels (shapes_detection: the largest side)
    min_image_size: int = 0  # shapes_detection: smallest side (0: same as image_size)
    channels: int = 3
    num_classes: int = 10
    num_train: int = 2048
    num_val: int = 512
    max_objects: int = 3  # shapes_detection: objects per image, at most
    # csv_text
    train_path: str | None = None  # CSV with a text and a label column (null: generate a demo)
    val_path: str | None = None  # null: split val_fraction off train_path
    text_column: str = "text"
    label_column: str = "label"
    vocab_size: int = 2000  # tokenizer vocabulary, at most
    max_length: int = 64  # tokens per text after truncation


@dataclass
class ModelConfig:
    name: str = MISSING  # a registered model: mlp, resnet18, resnet50, text_bow, ...
    hidden_dims: list[int] = field(default_factory=lambda: [256, 128])  # mlp
    dropout: float = 0.0
    init: str = "default"  # default | kaiming | xavier
    small_input_stem: bool | None = None  # resnets: 3x3 stem, no max-pool (null: when side < 64)
    embed_dim: int = 64  # text models
    num_layers: int = 2  # text_transformer
    num_heads: int = 4  # text_transformer
    aux_head: bool = False  # add an auxiliary classifier head (used by loss.aux_head)


@dataclass
class OptimizerConfig:
    name: str = MISSING  # adamw | sgd
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw


@dataclass
class SchedulerConfig:
    name: str = MISSING  # onecycle | cosine | none
    warmup_steps: int = 0  # cosine: linear warm-up in optimizer steps
    warmup_fraction: float = 0.0  # cosine: warm-up as a share of all steps (when warmup_steps=0)
    min_lr_ratio: float = 0.0  # cosine: final lr = lr * min_lr_ratio
    pct_start: float = 0.3  # onecycle
    div_factor: float = 25.0  # onecycle: initial lr = lr / div_factor
    final_div_factor: float = 1e4  # onecycle


@dataclass
class PrecisionConfig:
    name: str = MISSING  # fp32 | amp (fp16+GradScaler on CUDA, bf16 on CPU) | bf16


@dataclass
class TrainerConfig:
    name: str = MISSING  # default | ddp
    distributed: bool = False  # use torch.distributed (set by trainer=ddp; run under torchrun)
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    max_epochs: int = 10
    max_steps: int = -1  # optimizer steps; -1: no limit
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None  # max total grad norm; null: off
    deterministic: bool = False
    nan_policy: str = "fail"  # fail | skip
    check_inputs: bool = False  # raise on NaN/Inf in a batch, naming the tensor
    shape_check: bool = True  # train/eval-mode output contract before first step and every eval
    checkpoint_every_n_steps: int = 0  # 0: only at epoch ends
    checkpoint_every_epoch: bool = True
    keep_last_k: int = 2  # epoch checkpoints kept besides last.pt and best.pt
    monitor: str = "auto"  # metric that picks best.pt (auto: val_acc, val_map50 for detection)
    monitor_mode: str = "max"  # max | min
    log_every_n_steps: int = 10
    limit_train_batches: int = -1  # per epoch; -1: all
    limit_val_batches: int = -1  # -1: all


@dataclass
class LoggerConfig:
    backends: list[str] = field(default_factory=lambda: ["csv"])  # csv, tensorboard, wandb
    wandb_project: str = "kiln"
    wandb_mode: str = "offline"  # offline | online (online also needs WANDB_API_KEY)
    wandb_entity: str | None = None


@dataclass
class LossConfig:
    criterion: str = "cross_entropy"
    label_smoothing: bool = False
    label_smoothing_eps: float = 0.1
    z_loss: bool = False  # penalise log-sum-exp of logits (logit drift)
    z_loss_weight: float = 1e-4
    confidence_penalty: bool = False  # penalise low-entropy (over-confident) predictions
    confidence_penalty_weight: float = 0.1
    aux_head: bool = False  # auxiliary-head loss (models built with an aux head)
    aux_head_weight: float = 0.4
    force_all_branches: bool = False  # switch every branch on (the tests use this)


@dataclass
class EnvConfig:
    name: str = MISSING  # experiment | production
    progress_bar: bool = True  # tqdm on a terminal; plain log lines otherwise
    debug_allowed: bool = True  # debug=... hooks are refused when false
    quiet: bool = False  # fewer log lines
    require_best_checkpoint: bool = False  # inference refuses anything but best.pt


@dataclass
class DebugConfig:
    name: str = "none"  # none | fast_dev_run | overfit_batch | activations
    overfit_steps: int = 50  # overfit_batch: steps on the one batch


@dataclass
class KilnConfig:
    data: DataConfig = MISSING
    model: ModelConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    precision: PrecisionConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    loss: LossConfig = field(default_factory=LossConfig)
    env: EnvConfig = MISSING
    debug: DebugConfig = field(default_factory=DebugConfig)
    name: str = "${data.name}-${model.name}"  # experiment name: resume=auto and failures use it
    seed: int = 42
    device: str = "auto"  # auto | cpu | cuda
    resume: str | None = None  # null | auto | <path to .pt>
    output_root: str = "outputs"  # where failures.log goes
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes kept with the run


SCHEMAS = {
    cls.__name__: cls
    for cls in (DataConfig, ModelConfig, OptimizerConfig, SchedulerConfig, PrecisionConfig,
                TrainerConfig, LoggerConfig, LossConfig, EnvConfig, DebugConfig)
}  # fmt: skip

CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "cuda"),
    "precision.name": ("fp32", "amp", "bf16"),
    "optimizer.name": ("adamw", "sgd"),
    "scheduler.name": ("onecycle", "cosine", "none"),
    "trainer.nan_policy": ("fail", "skip"),
    "trainer.backend": ("auto", "gloo", "nccl"),
    "trainer.monitor_mode": ("max", "min"),
    "model.init": ("default", "kaiming", "xavier"),
    "loss.criterion": ("cross_entropy",),
    "env.name": ("experiment", "production"),
    "debug.name": ("none", "fast_dev_run", "overfit_batch", "activations"),
    "logger.wandb_mode": ("offline", "online"),
}
LOGGER_BACKENDS = ("csv", "tensorboard", "wandb")


def _lookup(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_known_keys(cfg: Any, schema: type = None, path: str = "") -> None:
    """Hydra's `+key=value` adds keys even to typed nodes; kiln refuses any key its schema lacks,
    so a typo never silently reads as a default."""
    schema = schema or KilnConfig
    known = {f.name: f for f in fields(schema)}
    for key in cfg:
        if key not in known:
            raise ConfigError(
                f"unknown key {path}{key}; {schema.__name__} has: {', '.join(sorted(known))}"
            )
        field_type = known[key].type
        sub = SCHEMAS.get(field_type if isinstance(field_type, str) else field_type.__name__)
        if sub is not None:
            check_known_keys(cfg[key], sub, f"{path}{key}.")


def validate(cfg: Any) -> None:
    """Cross-field and choice checks the schema types cannot express. Raises ConfigError."""
    from kiln.registry import DATASETS, MODELS

    check_known_keys(cfg)
    for key, valid in CHOICES.items():
        value = _lookup(cfg, key)
        if value not in valid:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(valid)}")
    for key, registry in (("data.name", DATASETS), ("model.name", MODELS)):
        name = _lookup(cfg, key)
        if name not in registry:
            known = ", ".join(registry.names())
            raise ConfigError(f"{key}={name!r} is not registered; known: {known}")
    for backend in cfg.logger.backends:
        if backend not in LOGGER_BACKENDS:
            raise ConfigError(
                f"logger.backends has {backend!r}; choose from: {', '.join(LOGGER_BACKENDS)}"
            )
    positive = ("data.batch_size", "trainer.accumulate_grad_batches", "trainer.max_epochs")
    for key in positive:
        if _lookup(cfg, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {_lookup(cfg, key)}")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers must be >= 0, got {cfg.data.num_workers}")
    if cfg.trainer.gradient_clip_val is not None and cfg.trainer.gradient_clip_val <= 0:
        raise ConfigError("trainer.gradient_clip_val must be > 0, or null to switch clipping off")
    if cfg.debug.name != "none" and not cfg.env.debug_allowed:
        raise ConfigError(
            f"debug={cfg.debug.name} is not allowed in env={cfg.env.name}; use env=experiment"
        )


def register_configs() -> None:
    ConfigStore.instance().store(name="kiln_schema", node=KilnConfig)
