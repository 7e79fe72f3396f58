"""optimizer=<option> and scheduler=<option>: one schema per optimizer and per LR schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from kiln.config.base import at_least, in_range, invalid
from kiln.registry import OPTIMIZERS, SCHEDULERS


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Options every optimizer has."""

    name: str = MISSING  # the optimizer (set by optimizer=<option>)
    lr: float = 1e-3  # learning rate (the peak for onecycle)
    weight_decay: float = 0.0  # decoupled (adamw) or L2 (sgd) weight decay
    head_lr_mult: float = 1.0  # the classifier head's lr = lr * this (fine-tuning: e.g. 10)
    # layer-wise lr decay (ELECTRA/DeBERTa fine-tuning): layer i of L at lr * this ** (L - i),
    # the embeddings at lr * this ** (L + 1), the head and what follows the last layer at lr
    layer_decay: float = 1.0
    decay_bias_and_norm: bool = False  # also decay biases and norm scales (1-D parameters)

    def check(self, key: str) -> None:
        if not self.lr > 0:
            raise invalid(f"{key}.lr", f"must be > 0, got {self.lr:g}")
        at_least(self.weight_decay, 0, f"{key}.weight_decay")
        in_range(self.layer_decay, 0, 1, f"{key}.layer_decay", open_low=True)
        if not self.head_lr_mult > 0:
            raise invalid(f"{key}.head_lr_mult", f"must be > 0, got {self.head_lr_mult:g}")


@dataclass(frozen=True, kw_only=True)
class AdamWConfig(OptimizerConfig):
    """torch.optim.AdamW."""

    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # (beta1, beta2)

    def check(self, key: str) -> None:
        super().check(key)
        for beta in self.betas:
            in_range(beta, 0, 1, f"{key}.betas", open_high=True)


@dataclass(frozen=True, kw_only=True)
class SGDConfig(OptimizerConfig):
    """torch.optim.SGD with momentum."""

    lr: float = 0.05
    weight_decay: float = 5e-4
    momentum: float = 0.9  # 0: plain SGD
    nesterov: bool = True  # Nesterov momentum (ignored when momentum is 0)

    def check(self, key: str) -> None:
        super().check(key)
        in_range(self.momentum, 0, 1, f"{key}.momentum", open_high=True)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Options every LR schedule has: it is stepped once per optimizer step."""

    name: str = MISSING  # the schedule (set by scheduler=<option>)


@dataclass(frozen=True, kw_only=True)
class OneCycleConfig(SchedulerConfig):
    """torch.optim.lr_scheduler.OneCycleLR; its peak is optimizer.lr."""

    pct_start: float = 0.3  # share of the steps spent warming up to the peak
    div_factor: float = 25.0  # initial lr = lr / div_factor
    final_div_factor: float = 1e4  # final lr = initial lr / final_div_factor

    def check(self, key: str) -> None:
        in_range(self.pct_start, 0, 1, f"{key}.pct_start", open_low=True, open_high=True)
        at_least(self.div_factor, 1, f"{key}.div_factor")
        at_least(self.final_div_factor, 1, f"{key}.final_div_factor")


@dataclass(frozen=True, kw_only=True)
class CosineConfig(SchedulerConfig):
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at the last step."""

    warmup_steps: int = 0  # warm-up in optimizer steps (0: use warmup_fraction)
    warmup_fraction: float = 0.05  # warm-up as a share of all steps, when warmup_steps is 0
    min_lr_ratio: float = 0.01  # final lr = lr * min_lr_ratio

    def check(self, key: str) -> None:
        at_least(self.warmup_steps, 0, f"{key}.warmup_steps")
        in_range(self.warmup_fraction, 0, 1, f"{key}.warmup_fraction", open_high=True)
        in_range(self.min_lr_ratio, 0, 1, f"{key}.min_lr_ratio")


@dataclass(frozen=True, kw_only=True)
class LinearWarmupConfig(SchedulerConfig):
    """Linear warm-up from 0 to optimizer.lr, then linear decay to 0 at the last step: the
    schedule BERT-style fine-tuning uses (transformers' get_linear_schedule_with_warmup)."""

    warmup_ratio: float = 0.1  # warm-up as a share of all optimizer steps
    warmup_steps: int = 0  # warm-up in optimizer steps; more than 0 overrides warmup_ratio

    def check(self, key: str) -> None:
        in_range(self.warmup_ratio, 0, 1, f"{key}.warmup_ratio", open_high=True)
        at_least(self.warmup_steps, 0, f"{key}.warmup_steps")


@dataclass(frozen=True, kw_only=True)
class ConstantConfig(SchedulerConfig):
    """No schedule: the learning rate stays optimizer.lr."""


OPTIMIZERS.declare("adamw", "kiln.engine.optim:build_adamw", config=AdamWConfig)
OPTIMIZERS.declare("sgd", "kiln.engine.optim:build_sgd", config=SGDConfig)
SCHEDULERS.declare("onecycle", "kiln.engine.optim:build_onecycle", config=OneCycleConfig)
SCHEDULERS.declare("cosine", "kiln.engine.optim:build_cosine", config=CosineConfig)
SCHEDULERS.declare(
    "linear_warmup", "kiln.engine.optim:build_linear_warmup", config=LinearWarmupConfig
)
SCHEDULERS.declare("none", "kiln.engine.optim:build_constant", config=ConstantConfig)
