"""Token ids on disk: every kept row's ids, back to back in one int32 file read row by row where
it lies (IdsFile), with the offsets, labels and train/val split beside it. Built once per (file
contents, cleaning, tokenizer settings) in a cache directory, so a second run skips reading,
cleaning and tokenizing.

    <cache_dir>/<csv name>-<key>/
        ids.int32        token ids of every kept row (read row by row: IdsFile)
        offsets.npy      row i's ids are ids[offsets[i]:offsets[i + 1]]
        labels.npy       class index per row (-1: a row left out, e.g. a suspect label)
        lines.npy        each row's line in its file (for reports)
        source_rows.npy  each row's number in its file, from 1 after the header (for reports)
        train_index.npy, val_index.npy
        tokenizer.json
        meta.json        class names, the data report, the key's inputs

An entry is built in a temporary directory and renamed into place (a reader never sees half of
one), under a file lock, so ranks of a DDP run or parallel runs build it once."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from kiln.atomic import on_failure
from kiln.caches import cache_dir
from kiln.preprocessing.text import PAD_ID

BASELINE = "baseline.json"  # the linear baseline's sample of texts, beside the store
STORE_VERSION = 2  # bump when the layout or the meaning of a stored entry changes
ID_DTYPE = np.int32
ENCODE_BATCH = 4096  # texts per encode_batch call: bounds the tokenizer's per-call memory


def default_cache_dir() -> Path:
    return cache_dir("text")


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_key(inputs: dict[str, Any]) -> str:
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


# ---------------------------------------------------------------------------------------------
# Cleaned texts, spooled to disk between the read and the tokenizer


class TextSpool:
    """Cleaned texts appended to a file as UTF-8, read back in batches: the read, the tokenizer
    training and the encoding each see every text once, and none holds them all."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("wb")
        self._sizes: list[np.ndarray] = []

    def append(self, texts: Sequence[str]) -> None:
        encoded = [t.encode("utf-8", "surrogatepass") for t in texts]
        self._file.write(b"".join(encoded))
        self._sizes.append(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))

    def close(self) -> None:
        self._file.close()

    def __len__(self) -> int:
        return int(sum(len(s) for s in self._sizes))

    def batches(self, batch_size: int, keep: np.ndarray | None = None) -> Iterator[list[str]]:
        """The texts in order, `batch_size` at a time; only rows where keep[i] if given. Each
        batch is one read of the bytes it spans: nothing stays mapped or cached in memory."""
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int64)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        rows = np.arange(len(sizes)) if keep is None else np.flatnonzero(keep)
        with self.path.open("rb") as f:
            for first in range(0, len(rows), batch_size):
                chosen = rows[first : first + batch_size]
                base = int(starts[chosen[0]])
                f.seek(base)
                data = f.read(int(ends[chosen[-1]]) - base)
                yield [
                    data[start - base : end - base].decode("utf-8", "surrogatepass")
                    for start, end in zip(
                        starts[chosen].tolist(), ends[chosen].tolist(), strict=True
                    )
                ]


# ---------------------------------------------------------------------------------------------
# A built store


@dataclass
class TokenStore:
    """Token ids of every kept row (an IdsFile when on disk), their offsets and labels."""

    ids: IdsFile | np.ndarray
    offsets: np.ndarray  # int64, len = rows + 1
    labels: np.ndarray  # int64 class index per row
    directory: Path | None = None  # where ids came from: workers reopen the map from here

    def __len__(self) -> int:
        return len(self.labels)

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        return self.offsets[rows + 1] - self.offsets[rows]

    def row_ids(self, row: int) -> np.ndarray:
        return self.ids[self.offsets[row] : self.offsets[row + 1]]

    def __getstate__(self):
        # A DataLoader worker (or a spawned process) reopens the file instead of copying.
        state = dict(self.__dict__)
        if self.directory is not None:
            state["ids"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.ids is None:
            self.ids = open_ids(self.directory)


class IdsFile:
    """ids.int32 read where it lies: each row's ids by one positional read (os.preadv) into
    the batch being built. A memory map would be simpler, but every page a run touches stays in
    its resident memory: an epoch over a 9.8 GB store took a run past 6 GB. Read like this, the
    pages stay in the kernel's cache, shared and dropped under pressure, and the run's own
    memory is one batch. Supports `len`, `[start:stop]` and `read(starts, lengths)`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._length = os.fstat(self._fd).st_size // ID_DTYPE().itemsize

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, step = rows.indices(self._length)
        if step != 1:
            raise IndexError("IdsFile reads contiguous slices only")
        return self.read(np.array([start]), np.array([max(stop - start, 0)]))

    def read(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The ids of rows starting at `starts` with `lengths`, back to back."""
        out = np.empty(int(np.sum(lengths)), dtype=ID_DTYPE)
        buffer, size = memoryview(out).cast("B"), ID_DTYPE().itemsize
        at = 0
        for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
            offset, end = start * size, at + length * size
            while at < end:  # a read may return less than asked
                got = os.preadv(self._fd, [buffer[at:end]], offset)
                if got <= 0:
                    raise OSError(f"{self.path}: ended before the ids its offsets index")
                at, offset = at + got, offset + got
        return out

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def __del__(self):
        with contextlib.suppress(AttributeError, OSError):
            os.close(self._fd)


def open_ids(directory: Path) -> IdsFile | np.ndarray:
    path = directory / "ids.int32"
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=ID_DTYPE)
    return IdsFile(path)


def read_rows(ids: IdsFile | np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Rows' ids back to back, from the file or an in-memory array."""
    if isinstance(ids, IdsFile):
        return ids.read(starts, lengths)
    position = np.arange(int(lengths.max()) if len(lengths) else 0)
    inside = position < lengths[:, None]
    return ids[(starts[:, None] + position)[inside]]


class PaddedTokens(NamedTuple):
    """A batch as TokenDataset.__getitems__ makes it: ids (N, L) padded, labels (N,) (multi-
    label: multi-hot (N, C) float)."""

    ids: Tensor
    labels: Tensor


class TokenDataset(Dataset):
    """One split of a TokenStore: item i is (token ids LongTensor (L_i,), label LongTensor ()).
    Multi-label (`targets`: the (label sets, C) multi-hot table the store's labels index): the
    label is the row's multi-hot float (C,)."""

    in_memory = True  # a batch is one read per row: no DataLoader worker needed

    def __init__(
        self,
        store: TokenStore,
        rows: np.ndarray,
        pad_id: int = PAD_ID,
        targets: np.ndarray | None = None,
    ):
        self.store = store
        self.rows = np.asarray(rows, dtype=np.int64)
        self.pad_id = pad_id  # kiln's tokenizers pad with 0; a pretrained one with its own
        self.targets = targets

    def _labels(self, rows) -> Tensor:
        codes = np.asarray(self.store.labels[rows], dtype=np.int64)  # one row: a 0-d array
        if self.targets is None:
            return torch.from_numpy(codes)
        return torch.from_numpy(np.array(self.targets[codes]))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        row = self.rows[index]
        ids = torch.from_numpy(self.store.row_ids(row).astype(np.int64))
        return ids, self._labels(row)

    def __getitems__(self, indices: list[int]) -> PaddedTokens:
        """A whole batch at once (what a DataLoader asks for when it can): the rows' ids
        gathered in one numpy step and padded to the longest, instead of a tensor per item."""
        rows = self.rows[np.asarray(indices, dtype=np.int64)]
        starts, ends = self.store.offsets[rows], self.store.offsets[rows + 1]
        lengths = ends - starts
        width = int(lengths.max()) if len(rows) else 0
        inside = np.arange(width) < lengths[:, None]  # (N, width), row by row
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        ids[inside] = read_rows(self.store.ids, starts, lengths)
        return PaddedTokens(torch.from_numpy(ids), self._labels(rows))

    @property
    def labels(self) -> Tensor:
        return self._labels(self.rows)

    def content_keys(self) -> list[bytes]:
        """Each text as its token ids (the tokenizer's normalised text), digested: what the
        split check compares (kiln.data.split_hygiene)."""
        from kiln.data.split_hygiene import digest

        return [digest(self.store.row_ids(row).astype(np.int64)) for row in self.rows]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per item: what the length-bucketed sampler groups by."""
        return self.store.lengths(self.rows)


# ---------------------------------------------------------------------------------------------
# Writing and reading entries


class IdsWriter:
    """Appends each row's token ids to ids.int32 and remembers the offsets."""

    def __init__(self, directory: Path):
        self.path = directory / "ids.int32"
        self._file = self.path.open("wb")
        self._lengths: list[np.ndarray] = []

    def append(self, rows: list[list[int]]) -> None:
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=ID_DTYPE, count=lengths.sum())
        self._file.write(flat.tobytes())
        self._lengths.append(lengths)

    def append_flat(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Rows given as their ids back to back and each row's length."""
        self._file.write(ids.astype(ID_DTYPE, copy=False).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int64))

    def finish(self) -> np.ndarray:
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


@dataclass
class StoreEntry:
    """What a build leaves: the store, the split, the tokenizer and the metadata."""

    store: TokenStore
    train_rows: np.ndarray
    val_rows: np.ndarray
    tokenizer_json: str
    meta: dict[str, Any]
    lines: np.ndarray  # each row's line in its file
    source_rows: np.ndarray  # each row's number in its file (from 1 after the header)
    # a bounded sample of the training and validation texts for the linear baseline
    # (baseline.json: kiln.data.spec.TextSample's fields), or None
    baseline: dict[str, Any] | None = None


def save_entry(
    directory: Path, offsets, labels, lines, rows, train_rows, val_rows, tokenizer_json, meta
):
    np.save(directory / "offsets.npy", offsets)
    np.save(directory / "source_rows.npy", rows.astype(np.int64))
    np.save(directory / "labels.npy", labels.astype(np.int64))
    np.save(directory / "lines.npy", lines.astype(np.int64))
    np.save(directory / "train_index.npy", train_rows.astype(np.int64))
    np.save(directory / "val_index.npy", val_rows.astype(np.int64))
    (directory / "tokenizer.json").write_text(tokenizer_json)
    (directory / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")


def load_entry(directory: Path, *, in_memory: bool = False) -> StoreEntry:
    ids = open_ids(directory)
    if in_memory and isinstance(ids, IdsFile):
        ids = np.fromfile(ids.path, dtype=ID_DTYPE)
    store = TokenStore(
        ids=ids,
        offsets=np.load(directory / "offsets.npy"),
        labels=np.load(directory / "labels.npy"),
        directory=None if in_memory else directory,
    )
    return StoreEntry(
        store=store,
        train_rows=np.load(directory / "train_index.npy"),
        val_rows=np.load(directory / "val_index.npy"),
        tokenizer_json=(directory / "tokenizer.json").read_text(),
        meta=json.loads((directory / "meta.json").read_text()),
        lines=np.load(directory / "lines.npy"),
        source_rows=np.load(directory / "source_rows.npy"),
        baseline=json.loads(sample.read_text())
        if (sample := directory / BASELINE).is_file()
        else None,
    )


@contextlib.contextmanager
def locked(lock_path: Path):
    """An exclusive lock held while one process builds an entry; others wait, then reuse it."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_entry(root: Path, name: str, build) -> tuple[StoreEntry, bool]:
    """(the entry `name` under `root`, whether it was already there). On a miss `build(tmp)`
    writes the entry's files into a temporary directory, which is then renamed into place."""
    final = root / name
    with locked(root / f"{name}.lock"):
        if (final / "meta.json").is_file():
            return load_entry(final), True
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        with on_failure(lambda: shutil.rmtree(tmp, ignore_errors=True)):
            build(tmp)
            if final.exists():  # an incomplete entry left by a killed run
                shutil.rmtree(final)
            tmp.rename(final)
    return load_entry(final), False


def built_in_memory(build) -> StoreEntry:
    """An entry built in a temporary directory and held in memory (no cache)."""
    with tempfile.TemporaryDirectory(prefix="kiln-text-") as tmp:
        build(Path(tmp))
        return load_entry(Path(tmp), in_memory=True)
