"""Checkpoint files: plain dicts, written atomically and only ever loaded with weights_only=True.
A leaf module: the engine, inference and the CLI all read and write checkpoints through it.

A kill at any moment leaves the previous file intact: kiln.atomic writes a temp file in the same
directory, fsyncs it, renames it over the target (atomic on POSIX) and fsyncs the directory.

A sharded (trainer=fsdp) checkpoint is the same file without the model and optimizer, naming the
folder (checkpoints/sharded/<step>-<token>/) where torch.distributed.checkpoint wrote them, one
file per rank. `load_checkpoint` consolidates the model from it, so inference and export read a
sharded checkpoint like any other; the engine reads the shards itself (kiln.engine.
sharded_checkpoint), resharded to its own ranks."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

from kiln.atomic import atomic_file, fsync_directory, on_failure
from kiln.errors import DiskFullError, UserError, free_space, is_disk_full

log = logging.getLogger(__name__)

EPOCH_FILE = re.compile(r"epoch-(\d+)\.pt$")
SHARDS_DIR = "sharded"  # under checkpoints/: one folder of DCP shards per sharded checkpoint
RECORD_FILE = "record.pt"  # in a shard folder: the checkpoint minus its model and optimizer
DCP_METADATA = ".metadata"  # DCP writes it last, once every rank's shards are on disk


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used or written: missing, truncated, corrupt, not a
    checkpoint, not weights-only, or a failed write."""


def atomic_save(obj: dict[str, Any], path: Path) -> None:
    """Write `obj` to `path` so that a crash or a full disk never leaves a half-written file;
    the previous file at `path` survives any failure."""
    import torch  # here: listing checkpoints (resume=auto) must not pay torch's import

    _atomic_write(path, lambda f: torch.save(obj, f))


def serialized(obj: dict[str, Any]) -> bytes:
    """`obj` as the bytes atomic_save would write."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def atomic_write_bytes(data: bytes, path: Path) -> None:
    """atomic_save for a checkpoint already serialized (`serialized`): no pickling here, so a
    writer thread holds the GIL for almost none of it."""
    _atomic_write(path, lambda f: f.write(data))


def _atomic_write(path: Path, write) -> None:
    with atomic_file(path, "wb", unique=True, durable=True, failed=_checkpoint_error) as f:
        write(f)


def _checkpoint_error(err: Exception, path: Path) -> None:
    if not isinstance(err, OSError | RuntimeError):
        return
    # torch's writer reports a full disk as a RuntimeError ("unexpected pos"): judged by what
    # is left on the disk, before the temp file goes.
    if is_disk_full(err) or _nearly_full(path.parent):
        raise DiskFullError(_write_failure(path, err, disk_full=True)) from None
    raise CheckpointError(_write_failure(path, err)) from err


def atomic_link(source: Path, path: Path) -> bool:
    """`path` becomes a second name of the finished file `source` (a hard link put in place by
    an atomic rename): the same bytes, not written again. False where the file system has no
    hard links (then write it with atomic_save)."""
    source, path = Path(source), Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        return False
    with on_failure(lambda: tmp.unlink(missing_ok=True)):  # no half-written checkpoint
        os.replace(tmp, path)
    fsync_directory(path.parent)
    return True


NEARLY_FULL_BYTES = 1 << 20  # less than this left after a failed write: the disk was full


def _nearly_full(directory: Path) -> bool:
    try:
        return shutil.disk_usage(directory).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def _write_failure(path: Path, err: BaseException, disk_full: bool = False) -> str:
    kept = f"the previous {path.name} is kept" if path.exists() else f"no {path.name} was written"
    if disk_full:
        return (
            f"no space left on the device writing checkpoint {path} ({free_space(path.parent)}; "
            f"{kept}) ({path.parent}): free space on that disk, or run with hydra.run.dir on "
            "another one; nothing written before is lost"
        )
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    return f"could not write checkpoint {path} ({free} on its disk; {kept}): {err}"


PLAIN = (type(None), bool, int, float, str, bytes)


def plain_record(value: Any, where: str = "record") -> Any:
    """`value` as data torch.load(weights_only=True) loads back: numpy scalars and strings (a
    dataset's class names from a pandas column, say) become Python's own, numpy arrays lists,
    containers are rebuilt of plain parts. Anything else (an object of a plugin's class) is a
    CheckpointError naming where it is in the record, at start-up: a run whose best.pt kiln
    cannot load back must not train first."""
    import numpy as np
    import torch

    if type(value) in PLAIN or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    for kind in (bool, int, float, str):  # subclasses (numpy's str_ and float64 among them)
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, dict):
        return {
            plain_record(k, where): plain_record(v, f"{where}[{k!r}]") for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        parts = [plain_record(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return parts if isinstance(value, list) else tuple(parts)
    raise CheckpointError(
        f"the checkpoint's {where} is a {type(value).__module__}.{type(value).__qualname__} "
        f"({value!r:.80}): checkpoints hold tensors and plain data only (loaded with "
        "weights_only=True); give it as str, int, float, a list or a dict"
    )


def load_checkpoint(path: Path, map_location="cpu", *, consolidate: bool = True) -> dict[str, Any]:
    """Load with weights_only=True; anything that would need unpickling code is refused. A sharded
    checkpoint (its file or its shard folder) comes back with its full model consolidated from
    the shards, unless `consolidate` is false (the engine loads the shards itself)."""
    path = Path(path)
    if path.is_dir():
        return _load_shard_folder(path, consolidate)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    ckpt = _load_weights_only(path, map_location)
    if not isinstance(ckpt, dict) or not ("model" in ckpt or is_sharded(ckpt)):
        raise CheckpointError(f"{path} is not a kiln checkpoint (no 'model' entry)")
    if is_sharded(ckpt):
        return _with_shards(ckpt, path.parent / ckpt["sharded"]["folder"], path, consolidate)
    return ckpt


# ---------------------------------------------------------------------------------------------
# The files a checkpoint embeds, and their recorded hashes

EMBEDDED_SHA256 = "embedded_sha256"  # the checkpoint's key: {file name: sha256 hex}


def canonical_json(value: Any) -> str:
    """`value` as one canonical JSON text (keys sorted, no spaces): what its hash is taken of."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr
    )


def embedded_files(preprocessing: dict[str, Any]) -> dict[str, str]:
    """The files a checkpoint's preprocessing record embeds, as text, by the name a refusal
    gives them: tokenizer.json (a text model's tokenizer, as the Rust tokenizer reads it),
    config.json (model=hf's) and the whole record ("preprocessing": normalisation, cleaning,
    class names, ... as canonical JSON)."""
    files = {}
    if isinstance(preprocessing.get("tokenizer_json"), str):
        files["tokenizer.json"] = preprocessing["tokenizer_json"]
    pretrained = preprocessing.get("pretrained") or {}
    if isinstance(pretrained, dict) and isinstance(pretrained.get("model_config"), dict):
        files["config.json"] = canonical_json(pretrained["model_config"])
    files["preprocessing"] = canonical_json(preprocessing)
    return files


def embedded_hashes(preprocessing: dict[str, Any]) -> dict[str, str]:
    """{file name: sha256} of `embedded_files`: what a checkpoint records when it is written."""
    return {name: _sha256(text) for name, text in embedded_files(preprocessing).items()}


def check_embedded(ckpt: dict[str, Any], source: Path | str) -> None:
    """Each file the checkpoint embeds against the sha256 recorded when it was written (its
    EMBEDDED_SHA256; model=hf's tokenizer also against the tokenizer_sha256 its record held
    before these hashes were): a file edited since is one CheckpointError naming the checkpoint
    and the file. A checkpoint older than both records is read as it is.

    The hashes are in the file they check: they catch an edit of an embedded file (or damage
    that leaves the archive readable), not someone who also rewrites the hashes -- for that,
    compare the checkpoint's own sha256 with one kept elsewhere."""
    preprocessing = ckpt.get("preprocessing") or {}
    files = embedded_files(preprocessing)
    expected = dict(ckpt.get(EMBEDDED_SHA256) or {})
    pretrained = preprocessing.get("pretrained") or {}
    if isinstance(pretrained, dict) and pretrained.get("tokenizer_sha256"):
        expected.setdefault("tokenizer.json", pretrained["tokenizer_sha256"])
        if isinstance(pretrained.get("tokenizer_json"), str):  # the copy inside the record
            found = _sha256(pretrained["tokenizer_json"])
            if found != pretrained["tokenizer_sha256"]:
                raise _edited(source, "tokenizer.json", pretrained["tokenizer_sha256"], found)
    for name, recorded in expected.items():
        found = _sha256(files[name]) if name in files else "absent"
        if found != recorded:
            raise _edited(source, name, recorded, found)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _edited(source: Path | str, name: str, recorded: str, found: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {source}: its embedded {name} does not match the sha256 recorded when it "
        f"was written ({recorded[:12]}..., now {found[:12]}...): it was edited or damaged "
        "since; refused -- use the checkpoint as its training run wrote it"
    )


def load_weights_file(path: Path) -> Any:
    """Any torch.save file (a kiln checkpoint, a plain state dict), weights_only, on the CPU; a
    sharded kiln checkpoint comes back consolidated."""
    path = Path(path)
    if path.is_dir() or not path.is_file():
        return load_checkpoint(path)
    data = _load_weights_only(path, "cpu")
    return load_checkpoint(path) if isinstance(data, dict) and is_sharded(data) else data


def _load_weights_only(path: Path, map_location) -> Any:
    """torch.load(weights_only=True) of the zip archive torch.save writes, or of its legacy
    (pre-1.6, `_use_new_zipfile_serialization=False`) format, which torch still reads."""
    import torch

    if not _zip_archive(path) and not _legacy_magic(path):
        # decided before unpickling: random bytes can fail inside torch.load in any way at all
        # (an IndexError from the unpickler's stack, say)
        raise CheckpointError(_not_a_checkpoint(path))
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing {path}: it cannot be loaded with weights_only=True (it holds Python "
            f"objects beyond tensors and plain data, which kiln never unpickles): {err}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {err}") from None


def _zip_archive(path: Path) -> bool:
    """A zip archive from its first bytes (a local file header, where torch.save's archive
    starts and torch.load looks) and its end record. zipfile.is_zipfile alone looks only for
    the end record's 4-byte signature anywhere in the last 64 KiB, which random bytes hold
    about once in a million 4 KiB files: those went on to torch's legacy unpickler."""
    return _starts_with(path, b"PK\x03\x04") and zipfile.is_zipfile(path)


# A legacy torch.save file starts with a pickled magic number (protocol 2: 0x80 0x02, then
# the long 0x1950a86a20f9469cfc6c).
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."


def _legacy_magic(path: Path) -> bool:
    return _starts_with(path, _LEGACY_MAGIC)


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def _not_a_checkpoint(path: Path) -> str:
    return (
        f"checkpoint {path} is truncated or corrupt, or not a checkpoint at all (neither the zip "
        "archive torch.save writes nor its legacy format)"
    )


def unreadable(path: Path) -> str | None:
    """Why the checkpoint file at `path` cannot be read back (None: it can): every entry of its
    zip archive checked against its CRC, without unpickling or allocating tensors; a legacy
    file is loaded."""
    path = Path(path)
    try:
        if _zip_archive(path):
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            return None if bad is None else f"entry {bad} fails its CRC check"
        _load_weights_only(path, "cpu")
    except CheckpointError as err:
        return str(err)
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def set_aside(path: Path) -> Path:
    """Rename an unreadable checkpoint out of the way (<name>.corrupt, then .corrupt-2, ...):
    no run, no `outputs/latest` and no printed command points at it, and its bytes are kept
    for a look."""
    path = Path(path)
    target, n = path.with_name(path.name + ".corrupt"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{n}")
    os.replace(path, target)
    return target


# ---------------------------------------------------------------------- sharded checkpoints


def is_sharded(ckpt: dict[str, Any]) -> bool:
    return "sharded" in ckpt


def sharded_record(record: dict[str, Any], folder: Path, checkpoint_dir: Path) -> dict[str, Any]:
    """The checkpoint file of a sharded checkpoint: `record` (everything but the model and
    optimizer) naming its shard folder, relative, so a run directory can be moved."""
    relative = os.path.relpath(folder, checkpoint_dir)
    return {**record, "sharded": {"folder": relative, "format": "torch.distributed.checkpoint"}}


def shards_folder(ckpt: dict[str, Any]) -> Path:
    """The shard folder of a checkpoint returned by load_checkpoint (an absolute path)."""
    return Path(ckpt["sharded"]["folder"])


def named_shard_folders(checkpoint_dir: Path) -> list[Path]:
    """The shard folders that the checkpoint files in `checkpoint_dir` name."""
    folders = []
    for path in Path(checkpoint_dir).glob("*.pt"):
        try:
            ckpt = _load_weights_only(path, "cpu")
        except CheckpointError:
            continue
        if isinstance(ckpt, dict) and is_sharded(ckpt):
            folders.append(path.parent / ckpt["sharded"]["folder"])
    return folders


def remove_unnamed_shard_folders(checkpoint_dir: Path) -> None:
    """Shard folders no checkpoint file names: replaced, pruned, or left by a killed save."""
    shards = Path(checkpoint_dir) / SHARDS_DIR
    if not shards.is_dir():
        return
    named = {folder.resolve() for folder in named_shard_folders(checkpoint_dir)}
    for folder in shards.iterdir():
        if folder.resolve() not in named:
            shutil.rmtree(folder, ignore_errors=True)


def _load_shard_folder(folder: Path, consolidate: bool) -> dict[str, Any]:
    record_file = folder / RECORD_FILE
    if not record_file.is_file():
        raise CheckpointError(
            f"{folder} is a directory but not a kiln shard folder (no {RECORD_FILE}); pass a "
            "checkpoint file (checkpoints/best.pt) or a folder under checkpoints/sharded/"
        )
    record = _load_weights_only(record_file, "cpu")
    return _with_shards({**record, "sharded": {"folder": str(folder)}}, folder, folder, consolidate)


def _with_shards(ckpt: dict, folder: Path, source: Path, consolidate: bool) -> dict[str, Any]:
    if not (folder / DCP_METADATA).is_file():
        raise CheckpointError(
            f"checkpoint {source} names the shard folder {folder}, which is missing or was never "
            f"completed (no {DCP_METADATA})"
        )
    ckpt["sharded"] = {**ckpt["sharded"], "folder": str(folder.resolve())}
    if consolidate:
        ckpt["model"] = consolidated_model(folder)
    return ckpt


def consolidated_model(folder: Path) -> dict[str, Any]:
    """The full model state dict from a shard folder, read in this one process (no process group):
    every parameter's shards land in one tensor of its full size."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(folder)
    try:
        entries = reader.read_metadata().state_dict_metadata
        model = {
            key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in entries.items()
            if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
        }
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    except (RuntimeError, OSError, ValueError, EOFError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"the shards in {folder} are truncated or corrupt: {err}") from None
    return model


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
    checkpoint_dir: Path,
    map_location="cpu",
    *,
    consolidate: bool = True,
    accept=lambda checkpoint: True,
    corrupt: list[tuple[Path, str]] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint that loads (and that `accept` takes); each unusable one is reported
    and skipped, and those that do not load are appended to `corrupt` as (path, why)."""
    problems = []
    for path in candidates(checkpoint_dir):
        try:
            checkpoint = load_checkpoint(path, map_location, consolidate=consolidate)
        except CheckpointError as err:
            log.warning("skipping unusable checkpoint: %s", err)
            problems.append(str(err))
            if corrupt is not None:
                corrupt.append((path, str(err)))
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
    remove_unnamed_shard_folders(checkpoint_dir)  # a pruned sharded checkpoint's folder too
