"""Files and folders a user points at, treated as hostile until bounded, for every reader of user
files (the image scan and loaders, `infer.py`, the evaluation report, the server's files):

- `open_regular` / `read_regular`: only regular files are opened. A FIFO named x.jpg would block
  its reader forever and a device never ends: both are refused from their stat().
- `walk_tree`: a folder's files, walked so that it cannot loop or hang. A symlinked file is
  followed and read once by its resolved path (a second way to it is a `duplicate`); a symlinked
  folder is followed only when it does not lead back into the tree (`link_into_tree`: `a/loop
  -> .` or `-> ..` would walk the tree again and again) and was not walked before; with
  `follow_symlinks=False` no link is followed (`symlink`). FIFOs, sockets and devices are
  `not_regular`: counted, never opened. A dangling link, a link loop or a folder that cannot be
  listed is `cannot_open`: reported with its reason, never a crash."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kiln.atomic import on_failure
from kiln.sorting import natural_key

NOT_REGULAR = "not_regular"  # a FIFO, socket or device: never opened
CANNOT_OPEN = "cannot_open"  # a dangling link, a link loop, no permission, an I/O error
TOO_LARGE = "too_large"  # open_regular(max_bytes=): more bytes than the reader's limit
HIDDEN = "hidden"  # a name starting with "." (.DS_Store, .ipynb_checkpoints/, ._x.jpg)
SYMLINK = "symlink"  # a link, not followed (follow_symlinks=False)
LINK_INTO_TREE = "link_into_tree"  # a folder link leading back into the walked tree
DUPLICATE = "duplicate"  # a file or folder already reached by another path
FILE, FOLDER = "file", "folder"  # what walk_tree yields to read, and folders it enters


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


def display_name(name: str) -> str:
    """A file or folder name (or path) as text every writer takes. A name that is not UTF-8 on
    disk reaches Python with its bytes as lone surrogates, which UTF-8 files, JSON readers and
    fonts refuse (a class folder b"caf\\xe9" crashed infer.py's table and evaluate's plot):
    those bytes become `\\xNN` escapes, "caf\\xe9" -- the same name every time it is read."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    return name


def os_detail(err: OSError) -> str:
    """An OSError as a person reads it, without the path (the caller names it): "Permission
    denied", "dangling symbolic link", "symbolic link loop"."""
    import errno

    if err.errno == errno.ELOOP:
        return "a symbolic link loop (too many levels of symbolic links)"
    return err.strerror or type(err).__name__


def open_regular(path: str | os.PathLike, *, max_bytes: int | None = None) -> BinaryIO:
    """The file at `path` opened for reading in binary, if it is a regular file (links
    followed); FileAccessError saying why not. Non-regular files are refused from their
    stat() before any open, and the opened descriptor is checked again (the path may have been
    swapped for a FIFO in between: opened non-blocking, so even then nothing hangs). A file
    larger than `max_bytes` is refused from the opened descriptor's size (TOO_LARGE), before
    a byte is read."""
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
    with on_failure(lambda: os.close(fd)):  # returned open, or closed
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileAccessError(NOT_REGULAR, path, f"{file_kind(st.st_mode)}, not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise FileAccessError(
                TOO_LARGE, path, f"{st.st_size:,} bytes, over the limit of {max_bytes:,}"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of a regular file; FileAccessError if it is not one or cannot be read."""
    with open_regular(path) as f:
        try:
            return f.read()
        except OSError as err:  # EIO, EISDIR on odd file systems
            raise FileAccessError(CANNOT_OPEN, path, os_detail(err)) from None


@dataclass(frozen=True)
class TreeEntry:
    """One entry met by walk_tree. `status`: file (a regular file to read), folder (a folder
    entered), or why it is not read: hidden, symlink, link_into_tree, duplicate, not_regular
    (skipped) or cannot_open (a bad entry, `detail` says why)."""

    path: Path  # as reached: the root joined with the names walked (links not resolved)
    parts: tuple[str, ...]  # the names below the root
    status: str
    is_folder: bool = False
    detail: str = ""


def walk_tree(
    root: str | os.PathLike, *, follow_symlinks: bool = True, max_depth: int | None = None
) -> Iterator[TreeEntry]:
    """Every entry under `root` (a folder), depth first, each folder's names in natural order:
    regular files as `file`, folders entered as `folder` (before their entries), the rest with
    the reason they are not read (see the module's doc). `max_depth`: enter folders at most
    this deep (1: the root's entries only; their folders are yielded, not entered).
    OSError (FileNotFoundError, NotADirectoryError, ...) if the root cannot be listed."""
    root = Path(root)
    real_root = os.path.realpath(root)
    seen_folders, seen_files = {real_root}, set()
    stack = [(root, (), real_root, _listing(root))]
    while stack:
        folder, parts, real_folder, entries = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            continue
        path, names = folder / entry.name, (*parts, entry.name)
        status, real, detail = _classify(entry, path, real_folder, follow_symlinks)
        is_folder = status == FOLDER or (status in (HIDDEN, SYMLINK) and _is_dir(entry))
        if status == FOLDER:
            if _within(real_root, real) or (entry.is_symlink() and _within(real, real_root)):
                # a link to the tree's ancestor holds the whole tree; a link inside it reaches
                # what the walk reaches by its own path
                status = LINK_INTO_TREE
            elif real in seen_folders:
                status = DUPLICATE
        elif status == FILE:
            status = DUPLICATE if real in seen_files else FILE
            seen_files.add(real)
        if status == FOLDER:
            seen_folders.add(real)
        if status != FOLDER or (max_depth is not None and len(names) >= max_depth):
            yield TreeEntry(path, names, status, is_folder, detail)
            continue
        try:
            listing = _listing(path)
        except OSError as err:
            yield TreeEntry(path, names, CANNOT_OPEN, True, f"a folder: {os_detail(err)}")
            continue
        yield TreeEntry(path, names, FOLDER, True)
        stack.append((path, names, real, listing))


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def inside(path: str | os.PathLike, real_root: str) -> bool:
    """Whether `path`, every link on its way resolved, is `real_root` (a realpath) or below it:
    a name holding `..`, an absolute name or a link leading elsewhere is not."""
    return _within(os.path.realpath(path), real_root)


def _listing(folder: Path) -> Iterator[os.DirEntry]:
    """The folder's entries in natural order of their names (read now: errors raise here)."""
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda e: natural_key(e.name))
    return iter(entries)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _classify(
    entry: os.DirEntry, path: Path, real_folder: str, follow_symlinks: bool
) -> tuple[str, str, str]:
    """(status, resolved path, detail) of one entry, from its directory entry and, for a
    link, one stat() of its target: nothing is opened."""
    if entry.name.startswith("."):
        return HIDDEN, "", ""
    real = os.path.join(real_folder, entry.name)
    try:
        if entry.is_symlink():
            if not follow_symlinks:
                return SYMLINK, "", "a symbolic link, not followed (follow_symlinks is off)"
            try:
                mode = os.stat(path).st_mode
            except FileNotFoundError:
                return CANNOT_OPEN, "", "a dangling symbolic link"
            real = os.path.realpath(path)
        else:
            mode = entry.stat(follow_symlinks=False).st_mode
    except OSError as err:
        return CANNOT_OPEN, "", os_detail(err)
    if stat.S_ISDIR(mode):
        return FOLDER, real, ""
    if stat.S_ISREG(mode):
        return FILE, real, ""
    return NOT_REGULAR, "", f"{file_kind(mode)}, not a regular file: never opened"


__all__ = [
    "CANNOT_OPEN",
    "DUPLICATE",
    "FILE",
    "FOLDER",
    "HIDDEN",
    "LINK_INTO_TREE",
    "NOT_REGULAR",
    "SYMLINK",
    "FileAccessError",
    "TreeEntry",
    "file_kind",
    "open_regular",
    "os_detail",
    "read_regular",
    "walk_tree",
]
