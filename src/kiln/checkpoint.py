"""Checkpoint files: plain dicts, written atomically and only ever loaded with weights_only=True.
A leaf module: the engine, inference and the CLI all read and write checkpoints through it.

A kill at any moment leaves the previous file intact: we write a temp file in the same directory,
fsync it, rename it over the target (atomic on POSIX) and fsync the directory."""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from kiln.errors import UserError

log = logging.getLogger(__name__)

EPOCH_FILE = re.compile(r"epoch-(\d+)\.pt$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used or written: missing, truncated, corrupt, not a
    checkpoint, not weights-only, or a failed write."""


def atomic_save(obj: dict[str, Any], path: Path) -> None:
    """Write `obj` to `path` so that a crash or a full disk never leaves a half-written file;
    the previous file at `path` survives any failure."""
    import torch  # here: listing checkpoints (resume=auto) must not pay torch's import

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except (OSError, RuntimeError) as err:
        Path(tmp_name).unlink(missing_ok=True)
        raise CheckpointError(_write_failure(path, err)) from err
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write_failure(path: Path, err: BaseException) -> str:
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    kept = f"the previous {path.name} is kept" if path.exists() else f"no {path.name} was written"
    return f"could not write checkpoint {path} ({free} on its disk; {kept}): {err}"


def load_checkpoint(path: Path, map_location="cpu") -> dict[str, Any]:
    """Load with weights_only=True; anything that would need unpickling code is refused."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupt, or not a checkpoint at all (it is not "
            "the zip archive torch.save writes)"
        )
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing {path}: it cannot be loaded with weights_only=True (it holds Python "
            f"objects beyond tensors and plain data, which kiln never unpickles): {err}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {err}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a kiln checkpoint (no 'model' entry)")
    return ckpt


def candidates(checkpoint_dir: Path) -> list[Path]:
    """Resume candidates, newest first: last.pt, then step/epoch files by mtime, then best.pt."""
    checkpoint_dir = Path(checkpoint_dir)
    others = sorted(
        (p for p in checkpoint_dir.glob("*.pt") if p.name not in ("last.pt", "best.pt")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    ordered = [checkpoint_dir / "last.pt", *others, checkpoint_dir / "best.pt"]
    return [p for p in ordered if p.is_file()]


def load_newest_valid(
    checkpoint_dir: Path, map_location="cpu", accept=lambda checkpoint: True
) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint that loads (and that `accept` takes); each unusable one is reported
    and skipped."""
    problems = []
    for path in candidates(checkpoint_dir):
        try:
            checkpoint = load_checkpoint(path, map_location)
        except CheckpointError as err:
            log.warning("skipping unusable checkpoint: %s", err)
            problems.append(str(err))
            continue
        if accept(checkpoint):
            return path, checkpoint
        problems.append(f"{path.name} cannot be resumed (weights only)")
    detail = "; ".join(problems) or "no *.pt files"
    raise CheckpointError(f"no usable checkpoint in {checkpoint_dir}: {detail}")


def prune_epoch_checkpoints(checkpoint_dir: Path, keep_last_k: int) -> None:
    """Keep the newest k epoch-N.pt files; last.pt and best.pt are never pruned."""
    epochs = sorted(
        (p for p in Path(checkpoint_dir).glob("epoch-*.pt") if EPOCH_FILE.search(p.name)),
        key=lambda p: int(EPOCH_FILE.search(p.name).group(1)),
    )
    for stale in epochs[: max(0, len(epochs) - keep_last_k)]:
        stale.unlink(missing_ok=True)
