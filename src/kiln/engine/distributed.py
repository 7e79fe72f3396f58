"""torch.distributed set-up and teardown, and how ranks share the model. torchrun sets RANK,
LOCAL_RANK and WORLD_SIZE; on several nodes its c10d rendezvous assigns them, so nothing here
knows about nodes. After a rank dies, `torchrun --max-restarts=N` starts every rank again with
TORCHELASTIC_RESTART_COUNT > 0, and the run continues from its own newest checkpoint."""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kiln.checkpoint import candidates
from kiln.config.run import Strategy, TrainerConfig
from kiln.engine.precision import Precision

log = logging.getLogger(__name__)

# If a peer dies, the survivors fail within this time instead of hanging for 30 minutes.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_dist_info() -> DistInfo:
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


# The process group's key-value store, kept for the ranks' last word (leave_together).
_group_store: dist.Store | None = None
REPORT_WAIT_S = 20.0  # how long the other ranks wait for the main rank's failure report


def init_distributed(requested: bool, backend: str, device: torch.device) -> DistInfo:
    global _group_store
    info = env_dist_info()
    if not requested:
        if info.enabled:
            raise ValueError(
                f"launched with WORLD_SIZE={info.world_size} but trainer.distributed is false; "
                "add trainer=ddp or trainer=fsdp"
            )
        return DistInfo()
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        return info
    if "MASTER_ADDR" in os.environ:  # torchrun's rendezvous (or a launcher that exports it)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=COLLECTIVE_TIMEOUT))
        # torchrun keeps one store for every restart of the group: without a key space per
        # attempt, a restarted rank can read the addresses its dead predecessor published there
        # (gloo then fails with "connectFullMesh ... Connection refused").
        store = dist.PrefixStore(f"kiln/attempt-{restart_count()}", store)
        _group_store = store
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    else:
        # A plain `python train.py trainer=fsdp`: a group of one, so the sharded code paths and
        # checkpoints are the same as under torchrun (and resume on any number of ranks).
        log.warning("not launched by torchrun: training as one rank (a process group of one)")
        dist.init_process_group(
            backend=backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=COLLECTIVE_TIMEOUT,
        )
    return info


def group_store() -> dist.Store | None:
    """The process group's key-value store under torchrun (None otherwise)."""
    return _group_store


def teardown() -> None:
    global _group_store
    _group_store = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_together(info: DistInfo, timeout_s: float = REPORT_WAIT_S) -> None:
    """On the way out of a failed or stopped run: the main rank marks the group's store once it
    has reported (the [FAIL] line, summary.json), and the other ranks wait for that mark before
    they exit. torchrun stops every worker as soon as one exits non-zero: a rank that left first
    would cut the main rank's report short. A main rank that never marks (it died, or is stuck in
    a collective the failed rank left) costs the others timeout_s, never a hang."""
    store = _group_store
    if store is None or not info.enabled:
        return
    key = "kiln/reported"
    try:
        if info.is_main:
            store.set(key, "1")
        else:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001 -- already failing: the exit must go on
        log.debug("leave_together: %s: %s", type(err).__name__, err)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """The largest value over ranks (a device collective; no host read)."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    as_int = tensor.to(torch.int32)
    dist.all_reduce(as_int, op=dist.ReduceOp.MAX)
    return as_int.to(tensor.dtype)


# --------------------------------------------------------------------- sharing the model


def is_sharded(trainer: TrainerConfig) -> bool:
    return trainer.distributed and trainer.strategy == Strategy.fsdp


def wrap_model(
    model: nn.Module,
    trainer: TrainerConfig,
    info: DistInfo,
    device: torch.device,
    precision: Precision,
) -> nn.Module:
    """What the loop calls. FSDP shards `model` in place (it stays the same object, so build the
    optimizer afterwards, from its sharded parameters); DDP wraps it; one process runs it as is."""
    if is_sharded(trainer):
        from kiln.engine.fsdp import shard_model

        return shard_model(model, trainer.fsdp, precision, device)
    if info.enabled:
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(
            model, device_ids=device_ids, find_unused_parameters=trainer.find_unused_parameters
        )
    return model


def grad_scaler(trainer: TrainerConfig, device: torch.device, precision: Precision):
    """fp16 loss scaling. Sharded, each rank checks only its own gradient shards for inf/NaN, so
    ShardedGradScaler all-reduces the finding and every rank skips the same steps."""
    if is_sharded(trainer):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=precision.use_grad_scaler)
    return torch.amp.GradScaler(device.type, enabled=precision.use_grad_scaler)


def is_fsdp(model: nn.Module) -> bool:
    """Whether `model` is sharded by FSDP2, without importing FSDP (0.6 s of every run's start-up)
    in a run that never sharded anything: no model is an FSDPModule before FSDP is imported."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


@contextlib.contextmanager
def skip_gradient_sync(model: nn.Module) -> Iterator[None]:
    """For the micro-batches before the last of an accumulation window: gradients accumulate on
    each rank and are reduced once, by the window's last backward."""
    if is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


class GradientNorm:
    """torch.nn.utils.clip_grad_norm_ for the loop, also over sharded (DTensor) gradients: the
    total 2-norm of the parameters' gradients (of the whole model, all ranks' shards together,
    the same number on every rank), clipping them to `max_norm` when finite. Dense gradients of
    one device and dtype (the usual case) take get_total_norm's arithmetic without its grouping,
    whose Python cost is a good part of a small model's step; which way is decided once per set
    of gradients."""

    def __init__(self, parameters: Iterable[torch.Tensor]):
        self.parameters = list(parameters)
        self._decided_for = -1  # how many gradients the decision saw
        self._direct = False

    def __call__(self, max_norm: float, on_host: bool = False) -> torch.Tensor | float:
        """`on_host`: the caller reads the norm at once (the CPU, one process); measured only,
        it comes back as a float, the per-tensor norms combined on the host (two fewer ops)."""
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if len(grads) != self._decided_for:
            self._decided_for, self._direct = len(grads), _one_dense_kind(grads)
        if self._direct and on_host and not math.isfinite(max_norm):
            return math.hypot(*[norm.item() for norm in torch._foreach_norm(grads)])
        if self._direct:
            total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        else:
            total_norm = torch.nn.utils.get_total_norm(grads)
            dtensor = sys.modules.get("torch.distributed.tensor")  # imported by what sharded them
            if dtensor is not None and isinstance(total_norm, dtensor.DTensor):  # partial: reduce
                total_norm = total_norm.full_tensor()
        if math.isfinite(max_norm):  # inf: measured only (clipping would multiply every grad by 1)
            torch.nn.utils.clip_grads_with_norm_(self.parameters, max_norm, total_norm)
        return total_norm


def _one_dense_kind(grads: list[torch.Tensor]) -> bool:
    first = grads[0] if grads else None
    return first is not None and all(
        type(g) is torch.Tensor
        and g.layout == torch.strided
        and g.dtype == first.dtype
        and g.device == first.device
        and not g.requires_grad
        for g in grads
    )


def run_mode(trainer: TrainerConfig, multi_rank: bool) -> str:
    """The mode word of the [FAIL] line: FSDP (on any number of ranks), DDP or single."""
    if is_sharded(trainer):
        return "FSDP"
    return "DDP" if multi_rank else "single"


# ------------------------------------------------------------------------- elastic restarts


def restart_count() -> int:
    """How many times torchrun restarted the group (--max-restarts); 0 on the first attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def resume_after_restart(resume: str | None, checkpoint_dir: Path) -> str | None:
    """After torchrun restarted the group, continue from this run's newest checkpoint
    (resume=auto), not from the start nor from the checkpoint the first attempt began with."""
    if restart_count() == 0 or not candidates(checkpoint_dir):
        return resume
    log.warning(
        "torchrun restart %d: continuing from the newest checkpoint in %s (resume=auto)",
        restart_count(),
        checkpoint_dir,
    )
    return "auto"
