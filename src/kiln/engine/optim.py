"""Optimizers and per-optimizer-step LR schedules. Each builder is a registry entry (declared in
kiln.config.optim beside its schema); `build_optimizer`/`build_scheduler` look them up."""

from __future__ import annotations

import functools
import math
import sys
import warnings

import torch
from torch._C._autograd import _profiler_enabled as profiler_enabled
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from kiln.config.optim import (
    AdamWConfig,
    ConstantConfig,
    CosineConfig,
    LinearWarmupConfig,
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
    params = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    devices = {p.device.type for p in params}
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: nothing is sharded
    sharded = dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in params)
    return bool(params) and devices <= {"cpu", "cuda"} and (sharded_ok or not sharded)


def undecorated(cls: type, name: str):
    """`cls.name` as torch wrote it, without the wrapper torch puts around it to keep
    torch.compile out (`torch._disable_dynamo`, `_use_grad_for_differentiable`). Each wrapper
    imports torch._dynamo on its first call -- 1.0-1.3 s of a run's start-up here (sympy,
    triton, torch.distributed.fsdp) -- which an eager optimizer never uses. While dynamo traces,
    torch's wrapped method."""
    method = cls.__dict__[name]
    if torch.compiler.is_compiling():
        return method
    return getattr(method, "__wrapped__", method)


def observed(optimizer: torch.optim.Optimizer) -> bool:
    """Something watches this optimizer's steps: a profiler, or step hooks (its own or global)."""
    return bool(
        profiler_enabled()
        or optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or _global_optimizer_pre_hooks
        or _global_optimizer_post_hooks
    )


def with_step_hooks(step):
    """`step` with torch's wrapper (`Optimizer.profile_hook_step`: the step hooks, a profiler
    range, the profiler's entry point) when something watches, and without it when nothing
    does: its record_function is entered and left on every step, watched or not (a few percent
    of a small model's step here). Marked `hooked`, so torch does not wrap it again."""
    watched = torch.optim.Optimizer.profile_hook_step(step)

    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        return (watched if observed(self) else step)(self, *args, **kwargs)

    wrapper.hooked = True
    return wrapper


class EagerOptimizer(torch.optim.Optimizer):
    """Optimizer methods run eagerly, without importing torch._dynamo (see `undecorated`) and
    without the profiler's ranges when no profiler runs; a subclass's `step` calls
    `eager_step(<torch's optimizer class>, closure)`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:
            cls.step = with_step_hooks(cls.__dict__["step"])

    def add_param_group(self, param_group: dict) -> None:
        undecorated(torch.optim.Optimizer, "add_param_group")(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none or profiler_enabled():
            undecorated(torch.optim.Optimizer, "zero_grad")(self, set_to_none)
            return
        for group in self.param_groups:  # torch's loop, less its profiler range
            for p in group["params"]:
                p.grad = None

    def state_dict(self) -> dict:
        return undecorated(torch.optim.Optimizer, "state_dict")(self)

    def load_state_dict(self, state_dict: dict) -> None:
        undecorated(torch.optim.Optimizer, "load_state_dict")(self, state_dict)

    def eager_step(self, torch_class: type, closure=None):
        # What torch's _use_grad_for_differentiable does around the step, less the dynamo
        # graph breaks (no-ops in eager mode).
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(self.defaults["differentiable"])
        try:
            return undecorated(torch_class, "step")(self, closure)
        finally:
            torch._C._set_grad_enabled(grad_was)


class SGD(EagerOptimizer, torch.optim.SGD):
    """torch.optim.SGD, without importing torch._dynamo."""

    def step(self, closure=None):
        return self.eager_step(torch.optim.SGD, closure)


class AdamW(EagerOptimizer, torch.optim.AdamW):
    """torch.optim.AdamW, lazy on a sparse gradient (an nn.EmbeddingBag(sparse=True) table):
    only the rows the gradient holds are updated -- their moments, their decay, their values,
    gathered and stepped by torch's fused AdamW kernel -- as TensorFlow's LazyAdam and torch's
    SparseAdam do, so a step costs what the batch touched, not the table's size. Dense
    parameters take torch's (fused) AdamW step. It skips an update on the device when the
    trainer sets `found_inf`, as the fused kernel does. Without importing torch._dynamo
    (`EagerOptimizer`)."""

    def step(self, closure=None):
        sparse = [
            (group, p)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None and p.grad.is_sparse
        ]
        grads = [p.grad for _, p in sparse]
        for _, p in sparse:
            p.grad = None  # torch's step skips a parameter without a gradient
        try:
            loss = self.eager_step(torch.optim.Adam, closure)
        finally:
            for (_, p), grad in zip(sparse, grads, strict=True):
                p.grad = grad
        with torch.no_grad():
            for (group, p), grad in zip(sparse, grads, strict=True):
                self._lazy_step(group, p, grad)
        return loss

    def _lazy_step(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        grad = grad.coalesce()  # one entry per row
        rows, values = grad.indices()[0], grad.values()
        scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        # The touched rows gathered, stepped by torch's fused AdamW kernel (one pass over them:
        # unscale, decay, moments, bias correction, update; a flagged step changes nothing),
        # and written back. The count moves only when the step is not flagged.
        step = state["step"] + (1 if found_inf is None else 1 - found_inf)
        touched = [t.index_select(0, rows) for t in (p, state["exp_avg"], state["exp_avg_sq"])]
        torch._fused_adamw_(
            [touched[0]],
            [values.contiguous()],
            [touched[1]],
            [touched[2]],
            [],
            [step.clone()],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
            grad_scale=scale,
            found_inf=found_inf,
        )
        state["step"] = step
        for table, new in zip((p, state["exp_avg"], state["exp_avg_sq"]), touched, strict=True):
            table.index_copy_(0, rows, new)


def sparse_capable(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's embedding tables that may take sparse gradients: marked `sparse_ok` by the
    model (text_bow's table), or built with sparse=True."""
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return [
        m
        for m in model.modules()
        if isinstance(m, kinds) and (m.sparse or getattr(m, "sparse_ok", False))
    ]


def settle_sparse_gradients(model: torch.nn.Module, cfg: OptimizerConfig, *, dense: bool) -> bool:
    """Switch the tables that may take sparse gradients to them where the optimizer has a lazy
    sparse step (kiln's adamw) and one process trains; under `dense` (several ranks: DDP/FSDP
    reduce dense buckets; torch.compile) or with another optimizer, they stay dense. True when
    some table went sparse."""
    sparse = not dense and cfg.name in SPARSE_GRADIENT_OPTIMIZERS
    tables = sparse_capable(model)
    for module in tables:
        module.sparse = sparse
    return sparse and bool(tables)


def build_adamw(params, cfg: AdamWConfig) -> torch.optim.Optimizer:
    params = list(params)
    return AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        weight_decay=cfg.weight_decay,
        fused=fused_where_supported(params),
    )


SPARSE_GRADIENT_OPTIMIZERS = ("adamw",)  # optimizers with a lazy step for sparse gradients


def build_sgd(params, cfg: SGDConfig) -> torch.optim.Optimizer:
    params = list(params)
    return SGD(
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


def warmup_linear(total_steps: int, warmup_steps: int):
    """lr factor per step: (step + 1) / warmup during warm-up, then linear to 0 at the end."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        remaining = total_steps - step
        return max(0.0, remaining / max(1, total_steps - warmup_steps))

    return factor


def build_linear_warmup(optimizer, cfg: LinearWarmupConfig, total_steps: int) -> LRScheduler:
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    return LambdaLR(optimizer, warmup_linear(total_steps, warmup))


def build_constant(optimizer, cfg: ConstantConfig, total_steps: int) -> None:
    return None


def apply_hyperparameters(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig) -> None:
    """Give a restored optimizer (its moments kept) the hyper-parameters of `cfg`, as a fresh
    one would have them; the schedule's own bookkeeping is dropped so it can be rebuilt."""
    template = build_optimizer([torch.zeros(1, requires_grad=True)], cfg).param_groups[0]
    for group in optimizer.param_groups:
        group.update({k: v for k, v in template.items() if k != "params"})
        if "lr_mult" in group:  # parameter_groups' own: optimizer.head_lr_mult as cfg says
            head = cfg.head_lr_mult if group["group"] == "head" else 1.0
            group["lr_mult"] = group["layer_mult"] * head
            group["lr"] = cfg.lr * group["lr_mult"]
            group["weight_decay"] = cfg.weight_decay if group["decay"] else 0.0
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
