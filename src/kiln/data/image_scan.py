"""Finding the images of a class-folder tree (torchvision's ImageFolder layout) and accounting
for every file: kept, skipped (hidden, not an image, outside a class folder) or dropped for a
named reason (empty, truncated, unreadable), never silently.

Every candidate is decoded in full once (the dataset's own decoder, kiln.preprocessing
.image_files), so a truncated file never reaches a training step; the verdicts are cached per
folder under the cache directory, keyed by path, size and modification time, so a second run
reads only the files that changed."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from kiln.errors import UserError
from kiln.preprocessing.image_files import (
    BAD_IMAGE_REASONS,
    ImageDecodeError,
    decode,
    is_image_name,
)
from kiln.sorting import natural_key

log = logging.getLogger(__name__)

FIRST_FILES_KEPT = 100  # the report lists this many files per reason, then a count
VERDICTS_VERSION = 1  # bump when what a verdict means changes
SKIP_REASONS = ("hidden", "not_image", "outside_class")


class ImageFolderError(UserError, ValueError):
    """A problem with a user's image folder; the message names the folder or the file."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kiln" / "images"


@dataclass
class FolderLog:
    """What one folder (train_dir, val_dir or test_dir) held, file by file."""

    path: str
    files: int = 0  # every file seen (outside hidden folders)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count (files or folders)
    images_read: int = 0  # image files decoded (or found in the verdict cache)
    images_kept: int = 0  # in the dataset
    dropped: dict[str, list[dict]] = field(default_factory=dict)  # bad files: reason -> files
    dropped_counts: dict[str, int] = field(default_factory=dict)
    classes_dropped: dict[str, dict] = field(default_factory=dict)  # train: too few images
    unknown_classes: dict[str, int] = field(default_factory=dict)  # val/test: not in train
    images_unused: int = 0  # good images of dropped or unknown classes

    def skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count

    def drop(self, path: str, error: ImageDecodeError) -> None:
        reason = error.reason
        self.dropped_counts[reason] = self.dropped_counts.get(reason, 0) + 1
        shown = self.dropped.setdefault(reason, [])
        if len(shown) < FIRST_FILES_KEPT:
            shown.append({"path": path, "detail": error.detail})

    @property
    def images_dropped(self) -> int:
        return sum(self.dropped_counts.values())

    def to_dict(self) -> dict:
        out = {
            "path": self.path,
            "files": self.files,
            "images_read": self.images_read,
            "images_kept": self.images_kept,
            "images_dropped": self.images_dropped,
            "images_unused": self.images_unused,
            "skipped": {r: self.skipped[r] for r in SKIP_REASONS if r in self.skipped},
            "dropped": {
                reason: {"count": self.dropped_counts[reason], "first": self.dropped[reason]}
                for reason in BAD_IMAGE_REASONS
                if reason in self.dropped_counts
            },
        }
        if self.classes_dropped:
            out["classes_dropped"] = self.classes_dropped
        if self.unknown_classes:
            out["unknown_classes"] = self.unknown_classes
        return out

    def summary(self) -> str:
        """One line for the log: totals, then the counts per reason."""
        dropped = ", ".join(f"{r} {n}" for r, n in sorted(self.dropped_counts.items()))
        skipped = ", ".join(f"{r} {self.skipped[r]}" for r in SKIP_REASONS if r in self.skipped)
        line = (
            f"{self.path}: {self.files} files, {self.images_kept} images kept, "
            f"{self.images_dropped} dropped" + (f" ({dropped})" if dropped else "")
        )
        if skipped:
            line += f", skipped {skipped}"
        if self.images_unused:
            line += f", {self.images_unused} in classes not used"
        return line


# ---------------------------------------------------------------------------------------------
# Listing


def list_classes(root: Path, log_: FolderLog) -> dict[str, list[Path]]:
    """Class folder name -> its image files (recursively, natural order), in natural order of
    the names. Hidden entries, non-image files and files outside a class folder are counted."""
    if not root.is_dir():
        raise FileNotFoundError(root)
    classes = {}
    for entry in sorted(os.scandir(root), key=lambda e: natural_key(e.name)):
        if entry.name.startswith("."):
            log_.skip("hidden")
            log_.files += not entry.is_dir()
        elif entry.is_dir():
            classes[entry.name] = _images_under(Path(entry.path), log_)
        else:
            log_.files += 1
            log_.skip("outside_class")
    return classes


def _images_under(folder: Path, log_: FolderLog) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        hidden = [d for d in dirnames if d.startswith(".")]
        if hidden:
            log_.skip("hidden", len(hidden))
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            log_.files += 1
            if name.startswith("."):
                log_.skip("hidden")
            elif not is_image_name(name):
                log_.skip("not_image")
            else:
                found.append(Path(dirpath) / name)
    return sorted(found, key=lambda p: natural_key(p.relative_to(folder).as_posix()))


# ---------------------------------------------------------------------------------------------
# Verifying


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def verify_file(path: Path, channels: int) -> ImageDecodeError | None:
    """A full decode, as the dataset will make it: None if the file is a good image."""
    try:
        decode(path.read_bytes(), channels)
    except ImageDecodeError as err:
        return err
    return None


class VerdictCache:
    """Per folder: absolute path -> [size, mtime_ns, reason or None, detail or None], in one
    JSON file under the cache directory (written atomically: parallel runs never see half)."""

    def __init__(self, cache_dir: Path, root: Path):
        digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
        self.path = cache_dir / f"verdicts-{root.resolve().name}-{digest}.json"
        self.tag = f"{VERDICTS_VERSION} torchvision {version('torchvision')} "
        self.tag += f"pillow {version('pillow')}"
        self.entries: dict[str, list] = {}
        self.hits = self.checked = 0
        try:
            stored = json.loads(self.path.read_text())
            if stored.get("tag") == self.tag:
                self.entries = stored["entries"]
        except (OSError, ValueError, KeyError):
            pass  # no cache yet, or an unreadable one: verify again

    def verdicts(self, paths: list[Path], check: Callable[[Path], ImageDecodeError | None]):
        """path -> ImageDecodeError or None, for every path: cached verdicts whose size and
        mtime still match, the rest checked (in threads: decoders release the GIL)."""
        out: dict[Path, ImageDecodeError | None] = {}
        todo = []
        for path in paths:
            stamp = _stamp(path)
            cached = self.entries.get(str(path.resolve()))
            if cached is not None and tuple(cached[:2]) == stamp:
                out[path] = None if cached[2] is None else ImageDecodeError(cached[2], cached[3])
                self.hits += 1
            else:
                todo.append((path, stamp))
        workers = min(len(todo), os.cpu_count() or 1, 8)
        if todo:
            with ThreadPoolExecutor(max(1, workers)) as pool:
                results = list(pool.map(lambda item: check(item[0]), todo))
            for (path, stamp), error in zip(todo, results, strict=True):
                out[path] = error
                reason, detail = (None, None) if error is None else (error.reason, error.detail)
                self.entries[str(path.resolve())] = [*stamp, reason, detail]
            self.checked += len(todo)
        return out

    def save(self) -> None:
        if not self.checked:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".verdicts-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"tag": self.tag, "entries": self.entries}, f)
        os.replace(tmp, self.path)


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
) -> FolderImages:
    """Every image of `root` (data.<key>) verified and accounted for. `classes`: the training
    classes (val/test folders); a folder naming another class is reported, its images unused.
    Without `classes` (the training folder) a class with fewer than two good images is dropped
    and reported. data.bad_rows=error raises on the first bad file."""
    folder = Path(root)
    log_ = FolderLog(str(folder))
    try:
        listed = list_classes(folder, log_)
    except FileNotFoundError:
        raise ImageFolderError(
            f"no such folder: {folder} (data.{key}): give a folder with one subfolder per class"
        ) from None
    if not listed:
        raise ImageFolderError(
            f"{folder} has no class subfolders (data.{key}): put each class's images in a "
            f"folder of its own, e.g. {folder}/cat/1.jpg"
        )
    cache = VerdictCache(cache_dir, folder) if cache_dir is not None else None
    candidates = [path for paths in listed.values() for path in paths]
    check = lambda path: verify_file(path, channels)  # noqa: E731
    if cache is None:
        verdicts = {path: check(path) for path in candidates}
    else:
        verdicts = cache.verdicts(candidates, check)
        cache.save()
    log_.images_read = len(candidates)
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
                raise ImageFolderError(
                    f"{error.reason.replace('_', ' ')} image: {error.detail} ({path}): fix or "
                    "remove the file, or set data.bad_rows=drop to skip such files (listed in "
                    "data_report.json)"
                )
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
    log_.images_kept = len(images.paths)
    if cache is not None:
        images.cache = {"file": str(cache.path), "hits": cache.hits, "checked": cache.checked}
    return images


def _unusable_class(name: str, good: int, known: set[str] | None) -> str | None:
    if known is not None:
        return None if name in known else "unknown_class"
    if good == 0:
        return "empty"
    if good == 1:
        return "single_image"
    return None
