"""The checkpoint policy of a run: last.pt after every evaluation (and every N steps when asked),
best.pt when the monitored metric improves, epoch-N.pt at epoch ends with the newest k kept; and
on resume, which file to continue from and whether this config can continue it."""

from __future__ import annotations

import logging
import math
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kiln import checkpoint as files
from kiln.config.run import TrainerConfig
from kiln.errors import UserError

if TYPE_CHECKING:
    from kiln.engine.sharded_checkpoint import ShardedWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fix:
    """A command line that would work instead: the user's overrides with `set` added (replacing
    the same keys) and `drop` removed, launched on `world_size` ranks (None: as now)."""

    purpose: str  # "to resume it as it was", "for a new run from these weights", ...
    set: tuple[tuple[str, str], ...] = ()
    drop: tuple[str, ...] = ()
    world_size: int | None = None
    same_run: bool = True  # continues the run (in its directory), or starts a new one

    def overrides(self, given: list[str]) -> list[str]:
        """`given` with each key of `set` replaced where it stands (else appended)."""
        values, out = dict(self.set), []
        for override in given:
            key = override.split("=", 1)[0].lstrip("+~")
            if key in self.drop:
                continue
            out.append(f"{key}={values.pop(key)}" if key in values else override)
        return out + [f"{key}={value}" for key, value in values.items()]

    def fragment(self) -> str:
        """What to change, for a message without the command line at hand."""
        parts = [f"{key}={value}" for key, value in self.set]
        parts += ["(without resume=)" for key in self.drop if key == "resume"]
        if self.world_size is not None:
            parts.append(f"on {self.world_size} rank(s) (torchrun --nproc_per_node)")
        return " ".join(parts)

    def command(self, given: list[str], world_size: int, run_dir: str | None = None) -> str:
        ranks = self.world_size or world_size
        launcher = (
            "python train.py" if ranks == 1 else f"torchrun --nproc_per_node={ranks} train.py"
        )
        args = self.overrides(given)
        if self.same_run and run_dir is not None:
            args.append(f"hydra.run.dir={run_dir}")
        return " ".join([launcher, *(shlex.quote(a) for a in args)])


class ResumeError(UserError, ValueError):
    """The checkpoint cannot be continued with this config; the message says what differs and,
    with `fixes`, the command lines that would work."""

    def __init__(self, message: str, fixes: Sequence[Fix] = (), *, what: str = ""):
        self.what = what or message  # the message before its fixes
        self.fixes = list(fixes)
        super().__init__(message)

    def with_commands(self, given: list[str], world_size: int, run_dir: str | None) -> str:
        """The message with each fix as the exact command to type (the CLI knows the command
        line; the engine does not)."""
        if not self.fixes:
            return str(self)
        commands = "; ".join(
            f"{f.purpose}: {f.command(given, world_size, run_dir)}" for f in self.fixes
        )
        return f"{self.what}: {commands}"


# What inference needs from a checkpoint; a weights-only best.pt holds just these.
INFERENCE_KEYS = ("model", "config", "preprocessing", "data_spec", "model_name", "kiln_version",
                  "state", "contract")  # fmt: skip


def resumable(checkpoint: dict) -> bool:
    """A full training state: the optimizer's in the file, or in the shards it names."""
    return "optimizer" in checkpoint or files.is_sharded(checkpoint)


class Checkpointer:
    def __init__(
        self,
        directory: Path,
        cfg: TrainerConfig,
        *,
        monitor: str,
        monitor_mode: str,
        is_main: bool,
        sharded: ShardedWriter | None = None,
    ):
        self.directory = Path(directory)
        self.cfg = cfg
        self.monitor, self.monitor_mode = monitor, str(monitor_mode)
        self.is_main = is_main  # only the main rank writes (but each rank its shards)
        self.sharded = sharded  # trainer=fsdp: every rank writes its shards through it

    def save(self, name: str, state: dict) -> None:
        if self.sharded is not None:
            self.sharded.save(self.directory / name, state)
        elif self.is_main:
            files.atomic_save(state, self.directory / name)

    def should_save_step(self, step: int) -> bool:
        every = self.cfg.checkpoint_every_n_steps
        return every > 0 and step % every == 0

    def is_improvement(self, value: float | None, best: float | None) -> bool:
        if value is None:
            return best is None  # keep a best.pt even without the metric
        if not math.isfinite(value):
            return False  # never best on NaN/Inf
        if best is None:
            return True
        return value > best if self.monitor_mode == "max" else value < best

    def after_evaluation(
        self, metrics: dict, state, state_dict: Callable[[], dict], epoch_end: bool
    ) -> None:
        """Updates state.best_metric, then writes last.pt, best.pt and epoch-N.pt as due."""
        value = metrics.get(self.monitor)
        # An evaluation with any non-finite metric picks no best.pt, whatever the monitor says.
        finite = all(math.isfinite(v) for v in metrics.values() if isinstance(v, int | float))
        improved = finite and self.is_improvement(value, state.best_metric)
        if improved and value is not None and math.isfinite(value):
            state.best_metric = value
        if improved:
            state.best_step = state.global_step
        snapshot = state_dict()
        self.save("last.pt", snapshot)
        if improved:
            # Sharded checkpoints name one shard folder: best.pt is that same (full) snapshot.
            full = str(self.cfg.best_checkpoint) == "full" or self.sharded is not None
            best = snapshot if full else {k: snapshot[k] for k in INFERENCE_KEYS if k in snapshot}
            self.save("best.pt", best)
        if epoch_end and self.cfg.checkpoint_every_epoch:
            self.save(f"epoch-{state.epoch}.pt", snapshot)
            if self.is_main:
                files.prune_epoch_checkpoints(self.directory, self.cfg.keep_last_k)

    def resume_source(self, resume: str | None) -> tuple[Path, dict] | None:
        """(path, checkpoint) to continue from: resume=auto takes the newest valid file in this
        run's checkpoints/ (None when there is none yet); a path takes that file."""
        if resume is None:
            return None
        if resume == "auto":
            if not files.candidates(self.directory):
                log.info("resume=auto: no checkpoint in %s, starting fresh", self.directory)
                return None
            return files.load_newest_valid(self.directory, consolidate=False, accept=resumable)
        checkpoint = files.load_checkpoint(Path(resume), consolidate=False)
        if not resumable(checkpoint):
            raise ResumeError(
                f"{resume} holds the weights only (trainer.best_checkpoint=weights writes best.pt "
                "for inference); resume from last.pt or an epoch-N.pt of that run"
            )
        return Path(resume), checkpoint
