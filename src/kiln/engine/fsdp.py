"""trainer=fsdp: FSDP2 (torch.distributed.fsdp.fully_shard). The model is cut into blocks, each
sharded on its own, so in forward and backward only one block's full parameters are gathered at
a time; the root is sharded last and holds what no block took. Blocks come from the model when
it names them (an `fsdp_blocks()` method, e.g. a transformer's layers), else from a size policy.

Mixed precision follows `precision=`: parameters are gathered in its autocast dtype, gradients
are reduced in fp32, and the sharded weights and optimizer state stay fp32."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kiln.config.run import FsdpConfig
from kiln.engine.precision import Precision

log = logging.getLogger(__name__)


def shard_model(
    model: nn.Module, cfg: FsdpConfig, precision: Precision, device: torch.device
) -> nn.Module:
    """Shards `model` in place over every rank of the default process group; returns it."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options = {
        "mesh": mesh,
        "mp_policy": mixed_precision_policy(precision),
        "reshard_after_forward": cfg.reshard_after_forward,
    }
    blocks = fsdp_blocks(model, cfg.min_block_params)
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    if dist.get_rank() == 0:
        log.info(
            "FSDP: %d blocks + root over %d ranks (%s)",
            len(blocks),
            dist.get_world_size(),
            "the model's fsdp_blocks()" if hasattr(model, "fsdp_blocks") else "size policy",
        )
    return model


def fsdp_blocks(model: nn.Module, min_block_params: int) -> list[nn.Module]:
    """The submodules to shard one by one: the model's own choice when it has `fsdp_blocks()`,
    else the size policy."""
    named_by_model = getattr(model, "fsdp_blocks", None)
    if callable(named_by_model):
        return list(named_by_model())
    return blocks_by_size(model, min_block_params)


def blocks_by_size(model: nn.Module, min_block_params: int) -> list[nn.Module]:
    """Bottom-up, as FSDP1's size_based_auto_wrap_policy: a submodule becomes a block when the
    parameters it holds outside the blocks already chosen below it reach `min_block_params`. The
    root is never a block: it is sharded last, around them."""
    blocks: list[nn.Module] = []

    def loose_params(module: nn.Module) -> int:  # parameters under `module` in no block yet
        count = sum(p.numel() for p in module.parameters(recurse=False))
        count += sum([loose_params(child) for child in module.children()])
        if module is not model and count >= min_block_params:
            blocks.append(module)
            return 0
        return count

    loose_params(model)
    return blocks


def mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    """Gather parameters in the autocast dtype (bf16, or fp16 for amp on CUDA); reduce gradients
    in fp32 so that summing over ranks loses nothing."""
    if precision.autocast_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)
