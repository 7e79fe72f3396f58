"""Split hygiene, checked as data before any model is built: the same example in the training
split and in the validation (or test) split makes the validation score a memory test (a
validation split equal to the training split ended `ok` at val_acc 1.00), and splits that map
the classes to other indices make every score a mix-up (it ended `at_chance`, blamed on the
model).

Every item of every split is reduced to a content digest -- the decoded tensor's bytes for
in-memory data (feature rows, pixels), the token ids for texts (the tokenizer's normalised
text), the file's bytes for image files (cached by path, size and modification time, as the
image scan caches its verdicts) -- and the splits are compared. A dataset of your own may say
what its items are (`content_keys()`: one digest per item); one read item by item is read up to
ITEM_LIMIT items per split.

Data that repeats itself (the same short review twice in one file) shares some items with any
split drawn from it: the share of the training items that have a copy inside the training split
is the overlap a random split would show. Only the overlap beyond it counts against
data.max_split_overlap; above it (and by MIN_LEAKED items at least) the run stops, naming
examples. Every overlap is reported
(data_report.json, "splits") and, when there is one, said as a finding."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

from kiln.errors import first_few
from kiln.guards.rules import ProbeFailure

log = logging.getLogger(__name__)

ITEM_LIMIT = 20_000  # items read one by one per split (a dataset without content_keys)
EXAMPLES = 5  # shared items named in the message and the report
# Items beyond the data's own repetition that a stop needs: one copied file in a validation
# folder of 17 is 5.9% of it, reported, not a leak that makes the score meaningless.
MIN_LEAKED = 2
DIGEST_BYTES = 16


class SplitLeakError(ProbeFailure):
    """The validation or test split shares more examples with training than the data's own
    repetition explains. A check's error: `what` names it in the [FAIL] line, `kind` is its
    finding's (kiln.findings.KINDS)."""

    what = "split leak"
    kind = "split leak"


class ClassMapError(ProbeFailure):
    """Two splits map class names to different indices."""

    what = "class map"
    kind = "class map"


# ------------------------------------------------------------------------------ the digests


def digest(value: Any) -> bytes:
    """A short digest of one item's input: tensors and arrays by dtype, shape and bytes; texts
    normalised (case-folded, whitespace collapsed); containers by their parts."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _feed(h, value)
    return h.digest()


def _feed(h, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        h.update(f"{array.dtype.str}{array.shape}".encode())
        h.update(array.tobytes())
    elif isinstance(value, str):
        h.update(b"s" + " ".join(value.casefold().split()).encode())
    elif isinstance(value, bytes):
        h.update(b"b" + value)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            h.update(str(key).encode())
            _feed(h, value[key])
    elif isinstance(value, list | tuple):
        h.update(f"[{len(value)}".encode())
        for part in value:
            _feed(h, part)
    else:
        h.update(repr(value).encode())


def row_digests(inputs: torch.Tensor | np.ndarray) -> list[bytes]:
    """One digest per row of an in-memory input table (a TensorDataset's first tensor)."""
    array = inputs.detach().cpu().numpy() if isinstance(inputs, torch.Tensor) else inputs
    return [digest(row) for row in array]


def file_digests(paths: Sequence[str | Path], cache: Path | None = None) -> list[bytes]:
    """One digest of each file's bytes, read in threads (hashing releases the GIL). Kept per
    folder under kiln's cache (absolute path -> size, mtime_ns, digest), so a second run reads
    only the files that changed."""
    from kiln.caches import cache_dir

    paths = [Path(p) for p in paths]
    if not paths:
        return []
    root = Path(os.path.commonpath([os.path.realpath(p) for p in paths]))
    store = FileDigests((cache or cache_dir("digests")), root)
    found = store.digests(paths)
    store.save()
    return found


@dataclass
class FileDigests:
    cache_dir: Path
    root: Path
    entries: dict[str, list] = field(default_factory=dict)
    changed: int = 0

    def __post_init__(self) -> None:
        name = hashlib.sha256(str(self.root).encode()).hexdigest()[:16]
        self.path = self.cache_dir / f"digests-{self.root.name or 'root'}-{name}.json"
        try:
            self.entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}  # no cache yet, or an unreadable one: read the files again
        if not isinstance(self.entries, dict):
            self.entries = {}

    def digests(self, paths: list[Path]) -> list[bytes]:
        keys = [os.path.realpath(p) for p in paths]
        stamps = [_stamp(p) for p in paths]
        out: list[bytes | None] = []
        todo = []
        for i, (key, stamp) in enumerate(zip(keys, stamps, strict=True)):
            cached = self.entries.get(key)
            if stamp is not None and isinstance(cached, list) and cached[:2] == list(stamp):
                out.append(bytes.fromhex(cached[2]))
            else:
                out.append(None)
                todo.append(i)
        if todo:
            workers = max(1, min(len(todo), os.cpu_count() or 1, 8))
            with ThreadPoolExecutor(workers) as pool:
                read = list(pool.map(lambda i: _file_digest(paths[i]), todo))
            for i, value in zip(todo, read, strict=True):
                out[i] = value
                if stamps[i] is not None:
                    self.entries[keys[i]] = [*stamps[i], value.hex()]
            self.changed += len(todo)
        return [value or b"" for value in out]

    def save(self) -> None:
        if not self.changed:
            return
        from kiln.atomic import write_json

        try:
            write_json(self.path, self.entries, unique=True)
        except OSError as err:  # a cache: the check itself has its answer
            log.debug("file digests not cached (%s): %s", self.path, err)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _file_digest(path: Path) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        h.update(f"unreadable {path}".encode())  # its own item: the dataset reports it
    return h.digest()


def content_keys(dataset, limit: int = ITEM_LIMIT) -> list[bytes]:
    """One digest per item of `dataset` (its first `limit` items where they are read one by
    one): what the dataset says its items are (`content_keys()`), an in-memory table's rows,
    else each item's input as the dataset gives it (`load(i)`, before random augmentation,
    where it has one)."""
    listed = _listed(dataset)
    if listed is not None:
        return listed
    count = min(len(dataset), limit)
    if count < len(dataset):
        log.info(
            "split hygiene: the first %d of %d items compared (the dataset gives no "
            "content_keys())",
            count,
            len(dataset),
        )
    return [digest(_input(dataset, i)) for i in range(count)]


def _listed(dataset) -> list[bytes] | None:
    """The digests a dataset gives without reading item by item: its own `content_keys()`, an
    in-memory table's rows, a Subset's share of its parent's (torch's random_split)."""
    own = getattr(dataset, "content_keys", None)
    if callable(own):
        return list(own())
    if isinstance(dataset, TensorDataset):
        return row_digests(dataset.tensors[0])
    if isinstance(dataset, Subset):
        parent = _listed(dataset.dataset)
        return [parent[i] for i in dataset.indices] if parent is not None else None
    return None


def _input(dataset, index: int) -> Any:
    if hasattr(dataset, "load"):
        return dataset.load(index)
    item = dataset[index]
    return item[0] if isinstance(item, tuple | list) else item


# ------------------------------------------------------------------------------ the overlap


@dataclass
class Overlap:
    """Items of `split` whose content is also in `other`."""

    split: str
    other: str
    shared: int
    compared: int  # items of `split` compared
    repeated: float  # the share of `other`'s items with a copy inside `other`
    examples: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.shared / self.compared if self.compared else 0.0

    @property
    def excess(self) -> float:
        """The overlap beyond what the data's own repetition gives a random split."""
        return max(0.0, self.fraction - self.repeated)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shared": self.shared,
            "compared": self.compared,
            "fraction": round(self.fraction, 6),
            "repeated_within": round(self.repeated, 6),
            "examples": self.examples,
        }

    def line(self) -> str:
        return (
            f"{self.shared} of {self.compared} {self.split} items ({self.fraction:.1%}) are also "
            f"in the {self.other} split"
            + (
                f" (the {self.other} split repeats {self.repeated:.1%} of its own items)"
                if self.repeated
                else ""
            )
        )


def overlap(
    split: str,
    keys: list[bytes],
    other: str,
    other_keys: list[bytes],
    sources: dict[str, Sequence[str]] | None = None,
) -> Overlap:
    counts = Counter(other_keys)
    first = {}
    for i, key in enumerate(other_keys):
        first.setdefault(key, i)
    repeated = sum(n for n in counts.values() if n > 1) / len(other_keys) if other_keys else 0.0
    shared = [i for i, key in enumerate(keys) if key in first]
    examples = [
        f"{_name(split, i, sources)} = {_name(other, first[keys[i]], sources)}"
        for i in shared[:EXAMPLES]
    ]
    return Overlap(split, other, len(shared), len(keys), repeated, examples)


def _name(split: str, index: int, sources: dict[str, Sequence[str]] | None) -> str:
    names = (sources or {}).get(split)
    if names is not None and index < len(names):
        return f"{split} {names[index]}"
    return f"{split} item {index}"


def check_splits(bundle, max_overlap: float, where: str) -> dict[str, Any]:
    """Compare the bundle's splits (train, val, test): their class maps, then their contents.
    Returns the report (data_report.json's "splits"); raises ClassMapError, or SplitLeakError
    when a split shares more than `max_overlap` of its items with an earlier one beyond the
    data's own repetition, and MIN_LEAKED items at least."""
    splits = {"train": bundle.train, "val": bundle.val}
    if bundle.test is not None:
        splits["test"] = bundle.test
    check_class_maps(splits, where)
    keys = {name: content_keys(dataset) for name, dataset in splits.items()}
    found = []
    names = list(keys)
    for i, split in enumerate(names):
        for other in names[:i]:
            found.append(overlap(split, keys[split], other, keys[other], bundle.sources))
    report = {
        "compared": {name: len(k) for name, k in keys.items()},
        "overlap": {f"{o.split}/{o.other}": o.to_dict() for o in found},
        "max_split_overlap": max_overlap,
    }
    leaks = [o for o in found if o.excess > max_overlap and o.excess * o.compared >= MIN_LEAKED]
    if leaks:
        worst = leaks[0]
        raise SplitLeakError(
            f"split leak (no example in two splits): {'; '.join(o.line() for o in leaks)} "
            f"({where}), more than data.max_split_overlap={max_overlap:g} allows: the "
            f"{worst.split} score would measure memory, not learning; shared: "
            f"{first_few(worst.examples, EXAMPLES)}. Give the {worst.split} split its own "
            "examples (another file or folder, or one file deduplicated before it is split)",
            fix=f"give the {worst.split} split examples the training split does not hold "
            "(deduplicate before splitting); data.max_split_overlap=1 keeps them",
        )
    return report


def overlap_lines(report: dict[str, Any]) -> list[str]:
    """The overlaps a report holds, one line each (for the log and the finding)."""
    lines = []
    for pair, found in report.get("overlap", {}).items():
        if found["shared"]:
            split, other = pair.split("/")
            lines.append(
                f"{found['shared']} of {found['compared']} {split} items "
                f"({found['fraction']:.1%}) are also in the {other} split, e.g. "
                f"{first_few(found['examples'], 2)}"
            )
    return lines


# ---------------------------------------------------------------------------- the class maps


def class_map(dataset) -> dict[str, int] | None:
    """The split's own class-to-index map where its dataset declares one (torchvision's
    `class_to_idx`, or `classes` listed in index order); None where it does not."""
    mapping = getattr(dataset, "class_to_idx", None)
    if isinstance(mapping, dict) and mapping:
        return {str(name): int(index) for name, index in mapping.items()}
    classes = getattr(dataset, "classes", None)
    if isinstance(classes, list | tuple) and classes and all(isinstance(c, str) for c in classes):
        return {str(name): index for index, name in enumerate(classes)}
    return None


def check_class_maps(splits: dict[str, Any], where: str) -> None:
    """ClassMapError when a split maps a class another split has to another index."""
    maps = {name: class_map(dataset) for name, dataset in splits.items()}
    train = maps.get("train")
    if train is None:
        return
    for name, mapping in maps.items():
        if name == "train" or mapping is None:
            continue
        moved = [
            f"{c!r} -> {mapping[c]} in {name}, {train[c]} in train"
            for c in sorted(set(mapping) & set(train), key=lambda c: train[c])
            if mapping[c] != train[c]
        ]
        only = sorted(set(mapping) - set(train))
        if not moved and not only:
            continue
        said = [f"{len(moved)} class(es) at another index: {first_few(moved, 4)}"] if moved else []
        said += [f"classes the training split does not have: {first_few(only, 4)}"] if only else []
        raise ClassMapError(
            f"class map (every split maps a class to the same index): the {name} split's map "
            f"differs from the training split's ({where}): {'; '.join(said)}. Its labels would "
            f"be scored as other classes; build every split's labels from the training split's "
            "class-to-index map"
        )


def checked_splits(bundle, max_overlap: float, where: str):
    """The bundle with its splits checked (class maps, contents; detection targets' box
    conventions too): the report under data_report.json's "splits", and an overlap within
    data.max_split_overlap said as a finding (and in the log). Raises what `check_splits` and
    kiln.data.box_conventions raise."""
    import dataclasses

    from kiln.findings import Finding

    if bundle.spec.task == "detection":
        from kiln.data.box_conventions import check_box_conventions

        check_box_conventions(bundle, where, lambda split, i: _name(split, i, bundle.sources))
    report = check_splits(bundle, max_overlap, where)
    lines = overlap_lines(report)
    findings = list(bundle.findings)
    if lines:
        said = f"split overlap within data.max_split_overlap={max_overlap:g} ({where}): "
        said += "; ".join(lines)
        log.warning("%s", said)
        findings.append(Finding("split leak", said, fatal=False))
    return dataclasses.replace(
        bundle, report={**(bundle.report or {}), "splits": report}, findings=findings
    )
