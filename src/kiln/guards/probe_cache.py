"""Probe once per model (trainer.probe_cache): which checks a model passed before step 1, kept
under a fingerprint of what they depend on -- the source of every module class the model is
made of and of the criterion, the model's and the loss's options, the probe plan, the data's
spec and the shapes and dtypes of the probe batches, torch's version and kiln's checks' own
source. A resumed run, an `init_from` run and the 2nd..Nth trial of a sweep that keeps the model
the same find it and run only what the model has not passed yet; a changed model (its code, its
options, its data's shapes) has another fingerprint and is probed again. Only passes are kept:
a model that failed a check meets it again. A model whose source cannot be read (a class made at
run time) is never cached.

The cache lives in $KILN_PROBE_CACHE, else kiln's cache folder (kiln.caches): one small JSON
file per fingerprint."""

from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.atomic import write_json
from kiln.caches import cache_dir
from kiln.guards.tree import describe

log = logging.getLogger(__name__)

GUARDS_DIR = Path(__file__).parent


def probe_cache_dir() -> Path:
    return Path(os.environ.get("KILN_PROBE_CACHE") or cache_dir("probes"))


def _source_digest(classes: set[type], files: dict[str, str]) -> bool:
    """Adds the source file of each class to `files` (path -> sha256); False where one has
    no readable source."""
    for cls in classes:
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:  # a builtin
            continue
        if path is None or not os.path.isfile(path):
            return False
        if path not in files:
            files[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return True


def fingerprint(model: nn.Module, criterion: Any, plan: Any, data: dict) -> str | None:
    """The fingerprint of what the checks depend on; None where the model's code cannot be
    read (it is then probed every time). `plan`: the probe plan (its budget and cache fields
    left out); `data`: the spec, the probe batches' shapes and the options (plain data)."""
    classes = {type(m) for m in model.modules()} | {type(criterion)}
    files: dict[str, str] = {}
    if not _source_digest(classes, files):
        return None
    for path in sorted(GUARDS_DIR.glob("*.py")):  # the checks themselves
        files[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    content = {
        "code": sorted(files.values()),
        "classes": sorted(f"{c.__module__}.{c.__qualname__}" for c in classes),
        "parameters": [
            (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()
        ],
        "plan": plan,
        "data": data,
        "torch": torch.__version__,
    }
    return digest(content)


def batch_shapes(batch: Any) -> Any:
    """Shapes and dtypes of a batch, as plain data."""
    return [describe(batch), [str(t.dtype) for t in _tensors(batch)]]


def _tensors(obj: Any) -> list[torch.Tensor]:
    from kiln.guards.tree import iter_tensors

    return [t for _, t in iter_tensors(obj)]


@dataclass(frozen=True)
class CachedProbes:
    passed: frozenset[str]
    date: str
    run_dir: str
    flops_per_sample: float | None = None  # a training step's model FLOPs, counted before


@dataclass(frozen=True)
class ProbeKey:
    """A model's fingerprint, and what some checks depend on besides it: the learn probe
    steps the run's optimizer, so a pass counts for the same optimizer options only (a sweep
    over optimizer.lr probes the model once and the learn probe for each lr)."""

    model: str
    qualifiers: tuple[tuple[str, str], ...] = ()  # (check, digest of what else it depends on)

    def stored(self, check: str) -> str:
        return next((f"{check}@{q}" for c, q in self.qualifiers if c == check), check)


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def lookup(key: ProbeKey | None) -> CachedProbes | None:
    """What a model with this fingerprint passed before; None where nothing is known (or the
    record cannot be read: the probes run)."""
    if key is None:
        return None
    path = probe_cache_dir() / f"{key.model}.json"
    try:
        record = json.loads(path.read_text())
        stored = set(record["passed"])
        names = {n.partition("@")[0] for n in stored}
        passed = frozenset(n for n in names if key.stored(n) in stored)
        flops = record.get("flops_per_sample")
        flops = float(flops) if isinstance(flops, int | float) else None
        return CachedProbes(passed, record["date"], record["run_dir"], flops)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def remember(
    key: ProbeKey | None,
    passed: set[str],
    run_dir: Path | str,
    flops_per_sample: float | None = None,
) -> None:
    """Keep what this model passed (with what it passed before, under other optimizer
    options too) and its step's FLOPs; an unwritable cache only costs the probes next time."""
    if key is None or not passed:
        return
    path = probe_cache_dir() / f"{key.model}.json"
    try:
        before = json.loads(path.read_text())
        known = set(before["passed"])
    except (OSError, ValueError, KeyError, TypeError):
        before, known = {}, set()
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    stored = known | {key.stored(name) for name in passed}
    flops = flops_per_sample or before.get("flops_per_sample")
    record = {
        "passed": sorted(stored),
        "date": now,
        "run_dir": str(run_dir),
        "flops_per_sample": flops,
    }
    try:
        write_json(path, record, unique=True)
    except OSError as err:
        log.debug("probe cache not written (%s): the probes run again next time", err)
