"""Checkpoints of a sharded (FSDP2) model, written with torch.distributed.checkpoint (DCP).

Every rank writes its own shards into a new folder, checkpoints/sharded/<step>-<token>/; DCP
writes the folder's .metadata last, once every rank's files are on disk. Only then does rank 0
commit it, by atomically writing the checkpoint file (last.pt, best.pt, epoch-N.pt) that names the
folder beside the rest of the training state (kiln.checkpoint). A kill at any moment therefore
leaves the previous checkpoint file and its folder intact, and a folder no file names is never
resumed from: it is removed at the next save. DCP reshards on load, so a checkpoint written on
N ranks resumes on any number of ranks."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kiln import checkpoint as files
from kiln.engine.checkpointer import ResumeError
from kiln.engine.distributed import is_fsdp

SHARDED_STATE = ("model", "optimizer")  # what DCP writes; the rest goes in the checkpoint file


def model_and_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model", "optimizer"} for a checkpoint. Sharded: DTensors keyed by parameter name (DCP
    needs the names to reshard); otherwise the plain state dicts."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def load_model_and_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: dict[str, Any]
) -> None:
    """Restores what model_and_optimizer_state saved. A sharded checkpoint is read straight into
    this run's shards (on every rank, any number of ranks); it is never consolidated here."""
    sharded_model = is_fsdp(model)
    if sharded_model and not files.is_sharded(checkpoint):
        raise ResumeError(
            "this checkpoint was written without sharding: resume it with the trainer that wrote "
            "it (trainer=default or trainer=ddp), or start a new run under trainer=fsdp"
        )
    if files.is_sharded(checkpoint) and not sharded_model:
        raise ResumeError(
            "this checkpoint was written by trainer=fsdp (sharded): resume it with trainer=fsdp, "
            "on any number of ranks"
        )
    if not sharded_model:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)  # this run's shards
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=files.shards_folder(checkpoint))  # in place, resharded
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


class ShardedWriter:
    """Writes a checkpoint of a sharded model. Every rank calls `save` with the same arguments
    (the Checkpointer's policy runs identically on all ranks)."""

    def __init__(self, directory: Path, *, is_main: bool):
        self.directory = Path(directory)
        self.is_main = is_main
        # The snapshot last written and its folder: after an evaluation the same snapshot becomes
        # last.pt, best.pt and epoch-N.pt, and its shards are written once for all three.
        self._written: tuple[dict, Path] | None = None

    def save(self, path: Path, state: dict[str, Any]) -> None:
        if self._written is None or self._written[0] is not state:
            self._written = (state, self._write_shards(state))
        folder = self._written[1]
        if self.is_main:
            pointer = files.sharded_record(self._record(state), folder, path.parent)
            files.atomic_save(pointer, path)  # the commit
            files.remove_unnamed_shard_folders(self.directory)

    @staticmethod
    def _record(state: dict[str, Any]) -> dict[str, Any]:
        """Everything but the sharded tensors: progress, scheduler, scaler, RNG, config..."""
        return {key: value for key, value in state.items() if key not in SHARDED_STATE}

    def _write_shards(self, state: dict[str, Any]) -> Path:
        import torch.distributed.checkpoint as dcp

        folder = self.directory / files.SHARDS_DIR / self._agreed_name(state)
        dcp.save({key: state[key] for key in SHARDED_STATE}, checkpoint_id=folder)
        if self.is_main:  # the folder describes itself too: load_checkpoint(folder) works
            files.atomic_save(self._record(state), folder / files.RECORD_FILE)
        return folder

    def _agreed_name(self, state: dict[str, Any]) -> str:
        """A new folder name, the same on every rank: rank 0 draws it and sends it to all."""
        step = state["state"]["global_step"]
        name = [f"step-{step:08d}-{secrets.token_hex(4)}" if self.is_main else None]
        dist.broadcast_object_list(name, src=0)
        return name[0]
