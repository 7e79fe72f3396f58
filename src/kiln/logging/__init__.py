"""Metric logging: the run record (metrics.jsonl, always) plus optional backends.

    loggers = build_loggers(["csv", "tensorboard"], run_dir, run_name="digits_mlp")
    loggers.log_config(OmegaConf.to_container(cfg, resolve=True))
    loggers.log_metrics({"loss": 0.7, "lr": 1e-3}, step=10)
    loggers.close()

Backends (logger.backends): csv -> <run_dir>/metrics.csv, tensorboard -> <run_dir>/tensorboard/,
wandb -> <run_dir>/wandb/ (offline unless told otherwise). Metric names may contain "/".
A backend that raises while logging is dropped with a warning and the run goes on: the run record
(metrics.jsonl, written by the engine with JsonlWriter) does not depend on any backend.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from kiln.atomic import on_failure
from kiln.logging.jsonl import JsonlWriter, read_jsonl
from kiln.logging.redaction import redact
from kiln.registry import LOGGERS

log = logging.getLogger(__name__)


@runtime_checkable
class MetricLogger(Protocol):
    def log_config(self, config: dict) -> None:
        """Record the composed config (a plain dict, e.g. OmegaConf.to_container(resolve=True))."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalar metrics at an optimizer step."""

    def close(self) -> None:
        """Flush and release files; safe to call more than once."""


def _quietly(call, failed: str, level: int = logging.WARNING) -> bool:
    """Whether `call()` (a third-party logger's) went through; its failure is logged, never
    raised: logging must not end a run that is training fine."""
    try:
        call()
    except Exception:  # a third-party logger may raise anything
        log.log(level, "%s", failed, exc_info=True)
        return False
    return True


class MultiLogger:
    """Fans every call out to its backends; itself a MetricLogger.

    A backend that raises is closed and dropped with a warning (logging must not end a run that
    is training fine); `close()` is idempotent and never raises.
    """

    def __init__(self, backends: Mapping[str, MetricLogger]):
        self.backends: dict[str, MetricLogger] = dict(backends)

    def log_config(self, config: dict) -> None:
        safe_config = redact(config)  # no credential reaches a backend
        self._each(lambda backend: backend.log_config(safe_config), "log_config")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._each(lambda backend: backend.log_metrics(metrics, step), "log_metrics")

    def close(self) -> None:
        backends, self.backends = self.backends, {}
        for name, backend in backends.items():
            _quietly(backend.close, f"logger backend {name!r} failed to close")

    def _each(self, call, what: str) -> None:
        for name, backend in list(self.backends.items()):
            if not _quietly(
                lambda b=backend: call(b), f"logger backend {name!r} failed in {what}; dropping it"
            ):
                del self.backends[name]  # dropped, closed, and the run goes on
                _quietly(backend.close, f"and {name!r} failed to close", logging.DEBUG)

    def __enter__(self) -> MultiLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def build_loggers(
    backends: Sequence[str],
    run_dir: str | Path,
    *,
    run_name: str,
    wandb_project: str = "kiln",
    wandb_mode: str = "offline",
    wandb_entity: str | None = None,
    resume_id: str | None = None,
) -> MultiLogger:
    """The loggers named in `backends` (entries of the LOGGERS registry), writing under `run_dir`.

    Raises ValueError for an unknown backend or an unusable W&B mode, before anything is created;
    if a backend fails to start, the ones already started are closed before the error propagates.
    """
    unknown = [name for name in backends if name not in LOGGERS]
    if unknown:
        raise ValueError(
            f"unknown logger backend(s) {unknown}; choose from: {', '.join(LOGGERS.names())}"
        )
    if "wandb" in backends:
        from kiln.logging.wandb_backend import check_wandb_mode

        check_wandb_mode(wandb_mode)  # fail before any file is written
    run_dir = Path(run_dir)
    options = {  # each backend takes the keyword arguments it declares
        "run_dir": run_dir,
        "run_name": run_name,
        "project": wandb_project,
        "mode": wandb_mode,
        "entity": wandb_entity,
        "resume_id": resume_id,
    }
    started = MultiLogger({})
    with on_failure(started.close):  # a backend that fails closes those started
        for name in dict.fromkeys(backends):  # ordered, duplicates dropped
            backend = LOGGERS.get(name)
            wanted = inspect.signature(backend).parameters
            started.backends[name] = backend(**{k: v for k, v in options.items() if k in wanted})
    return started


__all__ = [
    "JsonlWriter",
    "MetricLogger",
    "MultiLogger",
    "build_loggers",
    "read_jsonl",
    "redact",
]
