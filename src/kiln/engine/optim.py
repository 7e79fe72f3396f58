"""Optimizers and per-optimizer-step LR schedules. Each builder is a registry entry (declared in
kiln.config.optim beside its schema); `build_optimizer`/`build_scheduler` look them up."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

from kiln.config.optim import (
    AdamWConfig,
    ConstantConfig,
    CosineConfig,
    OneCycleConfig,
    OptimizerConfig,
    SchedulerConfig,
    SGDConfig,
)
from kiln.registry import OPTIMIZERS, SCHEDULERS


def build_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return OPTIMIZERS.get(cfg.name)(params, cfg)


def build_scheduler(optimizer, cfg: SchedulerConfig, total_steps: int) -> LRScheduler | None:
    """Stepped once per optimizer step (never per micro-batch); None: a constant lr."""
    return SCHEDULERS.get(cfg.name)(optimizer, cfg, total_steps)


def build_adamw(params, cfg: AdamWConfig) -> torch.optim.Optimizer:
    params = list(params)
    # The fused kernel does the same update in one pass over each tensor: about 3-10x faster
    # than the default per-tensor loop on CPU (large embedding tables are bound by it).
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=fused
    )


def build_sgd(params, cfg: SGDConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        params,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov and cfg.momentum > 0,
        weight_decay=cfg.weight_decay,
    )


def total_optimizer_steps(
    batches_per_epoch: int, max_epochs: int, accumulate: int, max_steps: int
) -> int:
    """Optimizer steps the run will take. A partial accumulation window at an epoch's end still
    steps, hence the ceil. max_steps (> 0) caps it."""
    per_epoch = math.ceil(batches_per_epoch / accumulate)
    total = per_epoch * max_epochs
    return min(total, max_steps) if max_steps > 0 else total


def build_onecycle(optimizer, cfg: OneCycleConfig, total_steps: int) -> LRScheduler:
    return OneCycleLR(
        optimizer,
        max_lr=[group["lr"] for group in optimizer.param_groups],
        total_steps=max(total_steps, 2),
        pct_start=cfg.pct_start,
        div_factor=cfg.div_factor,
        final_div_factor=cfg.final_div_factor,
    )


def warmup_cosine(total_steps: int, warmup_steps: int, min_lr_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        # The last step (total_steps - 1) runs at exactly lr * min_lr_ratio.
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps - 1)
        progress = min(progress, 1.0)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_cosine(optimizer, cfg: CosineConfig, total_steps: int) -> LRScheduler:
    warmup = cfg.warmup_steps or int(cfg.warmup_fraction * total_steps)
    return LambdaLR(optimizer, warmup_cosine(total_steps, warmup, cfg.min_lr_ratio))


def build_constant(optimizer, cfg: ConstantConfig, total_steps: int) -> None:
    return None
