"""One run directory, one writer. A run holds an OS lock (a POSIX record lock, fcntl) on `<run
dir>/.lock` for its whole life, so a second process on the same directory (two `resume=auto`
launches, a requeued job while the first still runs) refuses at once, naming the process that
holds it, instead of writing the same steps twice. The OS drops the lock when the holder exits,
however it exits: a killed run never leaves a stale lock behind. A record lock, not flock:
flock's lock belongs to the open file, which the DataLoader's forked workers inherit, so a
SIGKILLed run's workers kept it alive for seconds after it died; a record lock belongs to the
process and is not inherited.

A leaf: train.py takes the lock before Hydra writes anything into the directory, and `train()`
takes it again (re-entrant within a process) for runs started in-process."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import UserError, disk_full, is_disk_full

LOCK_FILE = ".lock"

_held: dict[Path, list[int]] = {}  # resolved run dir -> [fd, depth]: re-entrant per process


class RunDirInUse(UserError, RuntimeError):
    """Another process is writing this run directory."""


def acquire(run_dir: Path) -> None:
    """Take the run directory's lock (again, if this process holds it), or raise RunDirInUse."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        _held[run_dir][1] += 1
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another process holds it
        holder, pid = _holder(fd)
        os.close(fd)
        stop = f"stop it (kill {pid})" if pid else "stop it"
        raise RunDirInUse(
            f"run directory {run_dir} is in use by {holder} (hydra.run.dir): one run directory "
            f"has one writer; wait for that run to end or {stop}, or use another hydra.run.dir"
        ) from None
    except OSError:
        os.close(fd)
        raise
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }
    try:
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(record) + "\n").encode())
    except OSError as err:
        os.close(fd)
        if is_disk_full(err):
            raise disk_full(path, "the run's lock file") from None
        raise
    _held[run_dir] = [fd, 1]


def release(run_dir: Path) -> None:
    run_dir = Path(run_dir).resolve()
    entry = _held.get(run_dir)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[run_dir]
        os.close(entry[0])  # closing the descriptor drops the lock


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    acquire(run_dir)
    try:
        yield
    finally:
        release(run_dir)


def _holder(fd: int) -> tuple[str, int | None]:
    """Who holds the lock, from what it wrote into the file: (description, pid)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        record = {}
    if not record.get("pid"):
        return "another process (its details are unreadable)", None
    where = f"{record.get('host', '?')}, started {record.get('started', '?')}"
    return f"process {record['pid']} ({where}: {record.get('command', '?')})", record["pid"]
