"""Optimizers and per-optimizer-step LR schedules. Each builder is a registry entry (declared in
kiln.config.optim beside its schema); `build_optimizer`/`build_scheduler` look them up."""

from __future__ import annotations

import math
import warnings

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


def fused_where_supported(params: list, sharded_ok: bool = True) -> bool:
    """The fused kernels (one per step, CPU and CUDA) also skip an update on the device when
    the trainer flags a non-finite loss, without waiting for the device. Sharded (DTensor)
    parameters have a fused kernel for Adam(W) only."""
    from torch.distributed.tensor import DTensor

    params = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    devices = {p.device.type for p in params}
    sharded = any(isinstance(p, DTensor) for p in params)
    return bool(params) and devices <= {"cpu", "cuda"} and (sharded_ok or not sharded)


def build_adamw(params, cfg: AdamWConfig) -> torch.optim.Optimizer:
    params = list(params)
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        weight_decay=cfg.weight_decay,
        fused=fused_where_supported(params),
    )


def build_sgd(params, cfg: SGDConfig) -> torch.optim.Optimizer:
    params = list(params)
    return torch.optim.SGD(
        params,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov and cfg.momentum > 0,
        weight_decay=cfg.weight_decay,
        fused=fused_where_supported(params, sharded_ok=False),
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


def apply_hyperparameters(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig) -> None:
    """Give a restored optimizer (its moments kept) the hyper-parameters of `cfg`, as a fresh
    one would have them; the schedule's own bookkeeping is dropped so it can be rebuilt."""
    template = build_optimizer([torch.zeros(1, requires_grad=True)], cfg).param_groups[0]
    for group in optimizer.param_groups:
        group.update({k: v for k, v in template.items() if k != "params"})
        if group.get("group") == "head":  # optimizer.head_lr_mult, as the new config says
            group["lr"], group["lr_mult"] = cfg.lr * cfg.head_lr_mult, cfg.head_lr_mult
        for key in ("initial_lr", "max_lr", "min_lr"):  # set by the schedule being replaced
            group.pop(key, None)


def schedule_at(optimizer, cfg: SchedulerConfig, total_steps: int, step: int):
    """The schedule of `cfg` as it stands after `step` optimizer steps (rebuilt and replayed, so
    new hyper-parameters apply from here on exactly as if the run had used them)."""
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    if scheduler is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
            for _ in range(step):
                scheduler.step()
    return scheduler
