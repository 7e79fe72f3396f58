"""Finding the images of a class-folder tree (torchvision's ImageFolder layout) and accounting
for every file: kept, skipped (hidden, not an image, outside a class folder, a symlink not
followed or leading back into the tree, a file reached twice, a FIFO/socket/device) or dropped
for a named reason (empty, truncated, unreadable, too large, cannot be opened), never silently.

The walk is kiln.preprocessing.file_tree's: it cannot loop (a symlinked folder leading back
into the tree is not entered, a file is read once by its resolved path) nor hang (non-regular
files are never opened). Every candidate's header is checked against data.max_image_pixels and
then decoded in full once (the dataset's own decoder, kiln.preprocessing.image_files), so a
truncated file or a decompression bomb never reaches a training step; the verdicts are cached
per folder under the cache directory, keyed by path, size and modification time, so a second
run reads only the files that changed."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from kiln.atomic import write_json
from kiln.caches import cache_dir
from kiln.data.bad_inputs import BadInputLog
from kiln.errors import UserError
from kiln.preprocessing.file_tree import (
    CANNOT_OPEN,
    DUPLICATE,
    FILE,
    FOLDER,
    HIDDEN,
    LINK_INTO_TREE,
    NOT_REGULAR,
    SYMLINK,
    FileAccessError,
    TreeEntry,
    display_name,
    walk_tree,
)
from kiln.preprocessing.image_files import (
    BAD_IMAGE_REASONS,
    DEFAULT_MAX_PIXELS,
    ImageDecodeError,
    ImageTooLargeError,
    is_image_name,
    read_image_file,
)
from kiln.sorting import natural_key

log = logging.getLogger(__name__)

FIRST_FILES_KEPT = 100  # the report lists this many files per reason, then a count
VERDICTS_VERSION = 2  # bump when what a verdict means changes (2: too_large, GIFs by Pillow)
SKIP_REASONS = (
    HIDDEN,
    "not_image",
    "outside_class",
    SYMLINK,
    LINK_INTO_TREE,
    DUPLICATE,
    NOT_REGULAR,
)
BAD_FILE_REASONS = (*BAD_IMAGE_REASONS, CANNOT_OPEN)
# A bad file: an ImageDecodeError or a FileAccessError (both carry .reason and .detail).
BadFile = ImageDecodeError | FileAccessError


class ImageFolderError(UserError, ValueError):
    """A problem with a user's image folder; the message names the folder or the file."""


def default_cache_dir() -> Path:
    return cache_dir("images")


@dataclass
class FolderLog(BadInputLog):
    """What one folder (train_dir, val_dir or test_dir) held, file by file: the bad-input
    report every dataset writes (kiln.data.bad_inputs; read: image files decoded or found in the
    verdict cache, kept: in the dataset), and what the walk passed over."""

    unit: str = "images"
    reasons: tuple[str, ...] = BAD_FILE_REASONS
    listed_per_reason: int | None = FIRST_FILES_KEPT
    files: int = 0  # every file seen (outside hidden folders)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count (files or folders)
    classes_dropped: dict[str, dict] = field(default_factory=dict)  # train: too few images
    unknown_classes: dict[str, int] = field(default_factory=dict)  # val/test: not in train
    images_unused: int = 0  # good images of dropped or unknown classes

    def skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count

    def drop(self, path: str, error: BadFile) -> None:
        record = {"reason": error.reason, "path": path, "detail": error.detail}
        if isinstance(error, ImageTooLargeError):
            record |= {"pixels": error.pixels, "max_pixels": error.max_pixels}
        self.add(record)

    def to_dict(self) -> dict:
        out = {
            **super().to_dict(),
            "files": self.files,
            "images_unused": self.images_unused,
            "skipped": {r: self.skipped[r] for r in SKIP_REASONS if r in self.skipped},
        }
        if self.classes_dropped:
            out["classes_dropped"] = self.classes_dropped
        if self.unknown_classes:
            out["unknown_classes"] = self.unknown_classes
        return out

    def summary(self) -> str:
        """One line for the log: totals, then the counts per reason."""
        return folder_line(self.to_dict())


def folder_line(folder: dict) -> str:
    """`<path>: F files, K images kept, D dropped (reason n, ...), skipped ...` from a report
    entry."""
    dropped = ", ".join(f"{r} {n}" for r, n in folder["dropped"].items())
    skipped = ", ".join(f"{r} {n}" for r, n in folder["skipped"].items())
    line = (
        f"{folder['path']}: {folder['files']} files, {folder['images_kept']} images kept, "
        f"{folder['images_dropped']} dropped" + (f" ({dropped})" if dropped else "")
    )
    if skipped:
        line += f", skipped {skipped}"
    if folder["images_unused"]:
        line += f", {folder['images_unused']} in classes not used"
    return line


# ---------------------------------------------------------------------------------------------
# Listing


def list_classes(
    root: Path, log_: FolderLog, follow_symlinks: bool = True
) -> dict[str, list[Path]]:
    """Class folder name -> its image files (recursively, natural order), in natural order of
    the names. Hidden entries, non-image files, files outside a class folder, links not
    followed, duplicates and non-regular files are counted as skipped; entries that cannot be
    opened (a dangling link, a link loop, a folder that cannot be listed) are dropped."""
    if not root.is_dir():
        raise FileNotFoundError(root)
    classes: dict[str, list[Path]] = {}
    for entry in walk_tree(root, follow_symlinks=follow_symlinks):
        _account(entry, classes, log_)
    for name, paths in classes.items():
        folder = root / name
        paths.sort(key=lambda p: natural_key(p.relative_to(folder).as_posix()))
    return {display_name(name): paths for name, paths in classes.items()}  # the classes' names


def _account(entry: TreeEntry, classes: dict[str, list[Path]], log_: FolderLog) -> None:
    """One walked entry, counted where it belongs."""
    status, top_level = entry.status, len(entry.parts) == 1
    if status == FOLDER:
        if top_level:
            classes[entry.parts[0]] = []
        return
    log_.files += not entry.is_folder
    if status == FILE:
        if top_level:
            log_.skip("outside_class")
        elif not is_image_name(entry.path.name):
            log_.skip("not_image")
        else:
            classes[entry.parts[0]].append(entry.path)
    elif status == CANNOT_OPEN and (entry.is_folder or is_image_name(entry.path.name)):
        log_.drop(str(entry.path), FileAccessError(CANNOT_OPEN, entry.path, entry.detail))
    elif status == CANNOT_OPEN:
        log_.skip("not_image")  # a broken link named notes.txt would not be read anyway
    else:
        log_.skip(status)


# ---------------------------------------------------------------------------------------------
# Verifying


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None  # gone since the walk: verify says why
    return st.st_size, st.st_mtime_ns


def verify_file(
    path: Path, channels: int, max_pixels: int | None = DEFAULT_MAX_PIXELS
) -> BadFile | None:
    """The header checked against `max_pixels`, then a full decode, as the dataset will make
    it: None if the file is a good image, else why not."""
    try:
        read_image_file(path, channels, max_pixels)
    except (ImageDecodeError, FileAccessError) as err:
        return err
    return None


def _cached_verdict(cached: list) -> BadFile | None:
    reason, detail = cached[2], cached[3]
    if reason is None:
        return None
    if reason == "too_large":
        return ImageTooLargeError(detail, cached[4], cached[5], None)
    return ImageDecodeError(reason, detail)


class VerdictCache:
    """Per folder: absolute path -> [size, mtime_ns, reason or None, detail or None], in one
    JSON file under the cache directory (written atomically: parallel runs never see half)."""

    def __init__(self, cache_dir: Path, root: Path, max_pixels: int | None = DEFAULT_MAX_PIXELS):
        digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
        self.path = cache_dir / f"verdicts-{root.resolve().name}-{digest}.json"
        self.tag = f"{VERDICTS_VERSION} torchvision {version('torchvision')} "
        self.tag += f"pillow {version('pillow')} max_pixels {max_pixels}"
        self.entries: dict[str, list] = {}
        self.hits = self.checked = 0
        try:
            stored = json.loads(self.path.read_text())
            if stored.get("tag") == self.tag:
                self.entries = stored["entries"]
        except (OSError, ValueError, KeyError):
            pass  # no cache yet, or an unreadable one: verify again

    def verdicts(self, paths: list[Path], check: Callable[[Path], BadFile | None]):
        """path -> why it is a bad file, or None, for every path: cached verdicts whose size
        and mtime still match, the rest checked (in threads: decoders release the GIL). A
        file that cannot be opened is not cached (a permission changes no mtime)."""
        out: dict[Path, BadFile | None] = {}
        todo = []
        for path in paths:
            stamp = _stamp(path)
            key = os.path.realpath(path)
            cached = self.entries.get(key)
            if stamp is not None and cached is not None and tuple(cached[:2]) == stamp:
                out[path] = _cached_verdict(cached)
                self.hits += 1
            else:
                todo.append((path, key, stamp))
        workers = min(len(todo), os.cpu_count() or 1, 8)
        if todo:
            with ThreadPoolExecutor(max(1, workers)) as pool:
                results = list(pool.map(lambda item: check(item[0]), todo))
            for (path, key, stamp), error in zip(todo, results, strict=True):
                out[path] = error
                if stamp is None or (error is not None and error.reason == CANNOT_OPEN):
                    continue
                verdict = [None, None] if error is None else [error.reason, error.detail]
                if isinstance(error, ImageTooLargeError):
                    verdict += [error.pixels, error.max_pixels]
                self.entries[key] = [*stamp, *verdict]
            self.checked += len(todo)
        return out

    def save(self) -> None:
        if not self.checked:
            return
        # Runs sharing the cache may save it side by side.
        write_json(self.path, {"tag": self.tag, "entries": self.entries}, unique=True)


# ---------------------------------------------------------------------------------------------
# One folder, accounted for


@dataclass
class FolderImages:
    """The good images of one folder: paths (as the folder was given, joined) and class names."""

    paths: list[str]
    labels: list[str]
    log: FolderLog
    cache: dict | None = None  # the verdict cache's file, hits and files checked this time


def read_folder(
    root: str,
    key: str,
    *,
    channels: int,
    bad_rows: str,
    cache_dir: Path | None,
    classes: Iterable[str] | None = None,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    follow_symlinks: bool = True,
) -> FolderImages:
    """Every image of `root` (data.<key>) verified and accounted for. `classes`: the training
    classes (val/test folders); a folder naming another class is reported, its images unused.
    Without `classes` (the training folder) a class with fewer than two good images is dropped
    and reported. data.bad_rows=error raises on the first bad file."""
    folder = Path(root)
    log_ = FolderLog(str(folder))
    try:
        listed = list_classes(folder, log_, follow_symlinks)
    except FileNotFoundError:
        raise ImageFolderError(
            f"no such folder: {folder} (data.{key}): give a folder with one subfolder per class"
        ) from None
    except OSError as err:
        raise ImageFolderError(
            f"cannot list {folder}: {err.strerror or err} (data.{key}): give a folder you can read"
        ) from None
    if bad_rows == "error" and log_.records:
        first = log_.records[0]
        raise ImageFolderError(_bad_file_error(first["path"], first["reason"], first["detail"]))
    if not listed:
        raise ImageFolderError(
            f"{folder} has no class subfolders (data.{key}): put each class's images in a "
            f"folder of its own, e.g. {folder}/cat/1.jpg"
        )
    cache = VerdictCache(cache_dir, folder, max_pixels) if cache_dir is not None else None
    candidates = [path for paths in listed.values() for path in paths]
    check = lambda path: verify_file(path, channels, max_pixels)  # noqa: E731
    if cache is None:
        verdicts = {path: check(path) for path in candidates}
    else:
        verdicts = cache.verdicts(candidates, check)
        cache.save()
    log_.read = len(candidates)
    known = None if classes is None else set(classes)
    images = FolderImages([], [], log_)
    for name, paths in listed.items():
        good = []
        for path in paths:
            error = verdicts[path]
            if error is None:
                good.append(str(path))
                continue
            if bad_rows == "error":
                raise ImageFolderError(_bad_file_error(str(path), error.reason, error.detail))
            log_.drop(str(path), error)
        unusable = _unusable_class(name, len(good), known)
        if unusable is not None:
            if known is None:
                log_.classes_dropped[name] = {"reason": unusable, "images": len(good)}
            else:
                log_.unknown_classes[name] = len(good)
            log_.images_unused += len(good)
            continue
        images.paths += good
        images.labels += [name] * len(good)
    log_.kept = len(images.paths)
    if cache is not None:
        images.cache = {"file": str(cache.path), "hits": cache.hits, "checked": cache.checked}
    return images


def _bad_file_error(path: str, reason: str, detail: str) -> str:
    what = "file" if reason == CANNOT_OPEN else "image"
    fix = "fix or remove the file"
    if reason == "too_large":
        fix = "shrink or remove the file, or raise data.max_image_pixels"
    elif reason == CANNOT_OPEN:
        fix = "fix its link or permissions, or remove it"
    return (
        f"{reason.replace('_', ' ')} {what}: {detail} ({path}): {fix}, or set data.bad_rows=drop "
        "to skip such files (listed in data_report.json)"
    )


def _unusable_class(name: str, good: int, known: set[str] | None) -> str | None:
    if known is not None:
        return None if name in known else "unknown_class"
    if good == 0:
        return "empty"
    if good == 1:
        return "single_image"
    return None
