"""torch.distributed set-up and teardown. torchrun sets RANK, LOCAL_RANK and WORLD_SIZE."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def init_distributed(requested: bool, backend: str, device: torch.device) -> DistInfo:
    info = env_dist_info()
    if not requested:
        if info.enabled:
            raise ValueError(
                f"launched with WORLD_SIZE={info.world_size} but trainer.distributed is false; "
                "add trainer=ddp"
            )
        return DistInfo()
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        # A short timeout: if a peer dies, the survivors fail instead of hanging for 30 min.
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=5))
    return info


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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
