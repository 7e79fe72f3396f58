"""Files written whole or not at all: into a temporary file beside the target (the same file
system), renamed over it when complete (atomic on POSIX). A reader never sees half a file; a
failure, a kill or a full disk leaves the previous file as it was, and the temporary file is
removed. A full disk is one DiskFullError naming the file. The one home of every such write:
checkpoints, summaries, reports, figures, caches, predictions.

The temporary file is `.<name>.tmp` beside the target, or a unique name (unique=True) where
writers may run side by side (a sweep's jobs, runs sharing a cache). durable=True also fsyncs
the file and its directory (checkpoints: the rename survives a power cut)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from kiln.errors import disk_full, is_disk_full

Failed = Callable[[Exception, Path], None]


def _umask() -> int:
    mask = os.umask(0)  # read it (at import: no other thread can be writing yet)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # a unique temporary file gets what a plain open() would give


class AtomicFile:
    """An open temporary file beside `path`: `commit` puts it in place, `discard` removes it.
    For a writer that spans calls (rows written as they come); a block uses `atomic_file`."""

    def __init__(self, path, mode: str = "wb", unique: bool = False, durable: bool = False, **kw):
        self.path, self.durable = Path(path), durable
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if unique:
            fd, name = tempfile.mkstemp(
                prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
            )
            self.tmp = Path(name)
            os.chmod(fd, FILE_MODE)
            self.file: IO = os.fdopen(fd, mode, **kw)
        else:
            self.tmp = self.path.with_name(f".{self.path.name}.tmp")
            self.file = open(self.tmp, mode, **kw)  # noqa: SIM115 -- closed by commit/discard

    def commit(self) -> Path:
        try:
            if self.durable:
                self.file.flush()
                os.fsync(self.file.fileno())
        finally:
            self.file.close()
        os.replace(self.tmp, self.path)
        if self.durable:
            fsync_directory(self.path.parent)
        return self.path

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()  # a full disk can fail the close's flush too
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


def disk_full_error(err: Exception, path: Path) -> None:
    """The default for a failed write: a full disk is a DiskFullError naming the file."""
    if is_disk_full(err):
        raise disk_full(path) from None


@contextlib.contextmanager
def atomic_file(
    path,
    mode: str = "wb",
    *,
    unique: bool = False,
    durable: bool = False,
    failed: Failed = disk_full_error,
    **open_kwargs: Any,
) -> Iterator[IO]:
    """The file to write `path` through (open() keyword arguments pass on), in place when the
    block ends. On failure `failed(error, path)` runs while the temporary file is still on disk
    (a full disk is still full) and may raise its own error; then the temporary file goes."""
    out = AtomicFile(path, mode, unique=unique, durable=durable, **open_kwargs)
    try:
        yield out.file
        out.commit()
    except BaseException as err:  # Ctrl-C too: no half-written file, re-raised
        try:
            if isinstance(err, Exception):
                failed(err, out.path)
        finally:
            out.discard()
        raise


@contextlib.contextmanager
def atomic_path(path, *, failed: Failed = disk_full_error) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that takes a file name, not a file
    (torch.onnx.export, onnx.save, a quantiser): `path` is replaced by what was written there
    when the block ends; on failure, or a stop, the temporary file goes and `path` is as it
    was. The temporary name keeps the suffix (`.model.onnx.tmp.onnx`): some writers read it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as err:  # Ctrl-C too: no half-written file, re-raised
        try:
            if isinstance(err, Exception):
                failed(err, path)
        finally:
            tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def on_failure(cleanup: Callable[[], object]) -> Iterator[None]:
    """`cleanup()` when the block raises anything (Ctrl-C and a preemption too), and the error
    goes on: no half-built folder, store or table where the block did not finish."""
    finished = False
    try:
        yield
        finished = True
    finally:
        if not finished:
            cleanup()


def write_bytes(path, data: bytes, **kw: Any) -> None:
    with atomic_file(path, "wb", **kw) as f:
        f.write(data)


def write_text(path, text: str, **kw: Any) -> None:
    with atomic_file(path, "w", encoding="utf-8", **kw) as f:
        f.write(text)


def write_json(path, data: Any, indent: int | None = None, **kw: Any) -> None:
    """`data` as JSON (anything else as its str), a newline after it when indented."""
    text = json.dumps(data, indent=indent, default=str)
    write_text(path, text + "\n" if indent is not None else text, **kw)


def fsync_directory(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
