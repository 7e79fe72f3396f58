"""Files a user points at, treated as hostile until bounded: opening only regular files (a FIFO
named x.jpg would block the reader forever, a device never ends), so every reader of user files
(the image scan, the loaders, `infer.py`, the evaluation report) opens them here."""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

NOT_REGULAR = "not_regular"  # a FIFO, socket or device: never opened
CANNOT_OPEN = "cannot_open"  # a dangling link, a link loop, no permission, an I/O error


class FileAccessError(OSError):
    """A path that cannot be read as a regular file. `reason`: not_regular | cannot_open."""

    def __init__(self, reason: str, path: str | os.PathLike, detail: str):
        super().__init__(f"{path}: {detail}")
        self.reason, self.path, self.detail = reason, str(path), detail


def file_kind(mode: int) -> str:
    """What a non-regular st_mode is, in words ("a FIFO", "a socket", ...)."""
    for test, name in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def os_detail(err: OSError) -> str:
    """An OSError as a person reads it, without the path (the caller names it): "Permission
    denied", "dangling symbolic link", "symbolic link loop"."""
    import errno

    if err.errno == errno.ELOOP:
        return "a symbolic link loop (too many levels of symbolic links)"
    return err.strerror or type(err).__name__


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """The file at `path` opened for reading in binary, if it is a regular file (links
    followed); FileAccessError saying why not. Non-regular files are refused from their
    stat() before any open, and the opened descriptor is checked again (the path may have been
    swapped for a FIFO in between: opened non-blocking, so even then nothing hangs)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        detail = "a dangling symbolic link" if os.path.islink(path) else "no such file"
        raise FileAccessError(CANNOT_OPEN, path, detail) from None
    except OSError as err:
        raise FileAccessError(CANNOT_OPEN, path, os_detail(err)) from None
    if not stat.S_ISREG(mode):
        raise FileAccessError(NOT_REGULAR, path, f"{file_kind(mode)}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise FileAccessError(CANNOT_OPEN, path, os_detail(err)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileAccessError(NOT_REGULAR, path, f"{file_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of a regular file; FileAccessError if it is not one or cannot be read."""
    with open_regular(path) as f:
        try:
            return f.read()
        except OSError as err:  # EIO, EISDIR on odd file systems
            raise FileAccessError(CANNOT_OPEN, path, os_detail(err)) from None


__all__ = [
    "CANNOT_OPEN",
    "NOT_REGULAR",
    "FileAccessError",
    "file_kind",
    "open_regular",
    "os_detail",
    "read_regular",
]
