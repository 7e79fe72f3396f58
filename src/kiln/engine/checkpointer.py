"""The checkpoint policy of a run: last.pt after every evaluation (and every N steps when asked),
best.pt when the monitored metric improves, epoch-N.pt at epoch ends with the newest k kept; and
on resume, which file to continue from and whether this config can continue it.

With `background=True` (what the engine builds, unless sharded) a save takes a snapshot of the
state on the training thread (serialized when small, else copied to the host) and a writer
thread writes it while training goes on: each file atomically as before (a kill mid-write
leaves the previous file whole), in the order asked. A failed write is raised on the training
thread at the next save or at `flush`, and nothing asked after it is written. The same
snapshot under a second name (epoch-N.pt beside last.pt) is a hard link to the first file, not
a second write."""

from __future__ import annotations

import copy
import logging
import math
import queue
import shlex
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from kiln import checkpoint as files
from kiln.config.overrides import override
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
        for typed in given:
            key = typed.split("=", 1)[0].lstrip("+~")
            if key in self.drop:
                continue
            out.append(f"{key}={values.pop(key)}" if key in values else typed)
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
            args.append(override("hydra.run.dir", run_dir))
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
INFERENCE_KEYS = (
    "model",
    "config",
    "preprocessing",
    "pretrained",
    "data_spec",
    "model_name",
    "kiln_version",
    "state",
    "contract",
    "plugins",
    files.EMBEDDED_SHA256,
)


# The metric that breaks ties on the monitored one (lower is better); its value at the best
# evaluation is TrainState.best_tiebreak, saved with the training state.
TIEBREAK = "val_loss"


def _loss_or_inf(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else math.inf


def resumable(checkpoint: dict) -> bool:
    """A full training state: the optimizer's in the file, or in the shards it names."""
    return "optimizer" in checkpoint or files.is_sharded(checkpoint)


def host_copy(obj):
    """A copy of a state tree that later steps cannot change: tensors copied to the host,
    containers rebuilt (a state dict keeps its version metadata), other leaves deep-copied."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = {key: host_copy(value) for key, value in obj.items()}
        if isinstance(obj, OrderedDict):
            out = OrderedDict(out)
            if hasattr(obj, "_metadata"):  # module versions: load_state_dict reads them
                out._metadata = copy.deepcopy(obj._metadata)
        return out
    if isinstance(obj, list):
        return [host_copy(value) for value in obj]
    if type(obj) is tuple:
        return tuple(host_copy(value) for value in obj)
    return copy.deepcopy(obj)


# A state up to this size is serialized on the training thread and the writer thread only
# writes its bytes: pickling holds the GIL, and from a thread it slows the next steps more than
# doing it at once costs (a 1 MB MLP state: 2 ms). A larger state is copied to the host here
# and serialized by the writer thread (a resnet18's 140 MB: 25 ms here against 160 ms there).
SERIALIZE_ON_THE_STEP_BYTES = 16 << 20


def tensor_bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(value) for value in obj)
    return 0


def snapshot_of(state: dict) -> bytes | dict:
    """What the writer thread writes: the state as of now, serialized or copied to the host."""
    if tensor_bytes(state) <= SERIALIZE_ON_THE_STEP_BYTES:
        return files.serialized(state)
    return host_copy(state)


def write_snapshot(snapshot: bytes | dict, path: Path) -> None:
    if isinstance(snapshot, bytes):
        files.atomic_write_bytes(snapshot, path)
    else:
        files.atomic_save(snapshot, path)


class BackgroundWriter:
    """One thread running the checkpoint writes in the order they were asked."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self.raise_failure()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kiln-checkpoints", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def flush(self) -> None:
        """Waits until everything asked is on disk; raises a failed write."""
        self._jobs.join()
        self.raise_failure()

    def raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if self._failure is None:  # after a failed write, nothing later is written
                    job()
            except BaseException as err:  # noqa: BLE001 -- raised on the training thread
                self._failure = err
            finally:
                self._jobs.task_done()


def _link_or_save(first: Path, snapshot: bytes | dict, path: Path) -> None:
    """`path` as a second name of the file `first` holding `snapshot`, else written anew."""
    if first != path and first.is_file() and files.atomic_link(first, path):
        return
    write_snapshot(snapshot, path)


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
        background: bool = False,
    ):
        self.directory = Path(directory)
        self.cfg = cfg
        self.monitor, self.monitor_mode = monitor, str(monitor_mode)
        self.is_main = is_main  # only the main rank writes (but each rank its shards)
        self.sharded = sharded  # trainer=fsdp: every rank writes its shards through it
        # DCP's sharded writes are collective: those stay on the training thread.
        self.writer = BackgroundWriter() if background and sharded is None and is_main else None
        self._last: tuple[dict, bytes | dict, Path] | None = None  # (state, snapshot, file)
        self.best_set_aside = False  # resume found best.pt unreadable and moved it aside

    def save(self, name: str, state: dict) -> None:
        path = self.directory / name
        if self.sharded is not None:
            self.sharded.save(path, state)
            return
        if not self.is_main:
            return
        if self._last is None or self._last[0] is not state:
            # The snapshot is taken here, on the training thread: the state as of this step.
            snapshot = snapshot_of(state) if self.writer is not None else state
            self._last = (state, snapshot, path)
            job = partial(write_snapshot, snapshot, path)
        else:  # the same snapshot under another name (epoch-N.pt after last.pt)
            _, snapshot, first = self._last
            job = partial(_link_or_save, first, snapshot, path)
        if self.writer is None:
            job()
        else:
            self.writer.submit(job)

    def check_pointed_files(self) -> None:
        """At the end of a run: last.pt and best.pt, what the run points to, read back (their
        CRCs); CheckpointError naming one that cannot be, so the run does not end ok."""
        if not self.is_main or self.sharded is not None:
            return
        for name in ("last.pt", "best.pt"):
            path = self.directory / name
            problem = files.unreadable(path) if path.is_file() else None
            if problem is not None:
                raise files.CheckpointError(
                    f"{path} cannot be read back at the end of the run ({problem}); the run's "
                    "other checkpoints are listed in its checkpoints/ folder"
                )

    def flush(self) -> None:
        """Waits for the background writes; raises one that failed (a full disk...)."""
        self._last = None  # the host copy is no longer needed
        if self.writer is not None:
            self.writer.flush()

    def prune(self) -> None:
        """epoch-N.pt files beyond keep_last_k, after the writes before it."""
        if not self.is_main:
            return
        prune = lambda: files.prune_epoch_checkpoints(self.directory, self.cfg.keep_last_k)  # noqa: E731
        if self.writer is None:
            prune()
        else:
            self.writer.submit(prune)

    def should_save_step(self, step: int) -> bool:
        every = self.cfg.checkpoint_every_n_steps
        return every > 0 and step % every == 0

    def is_improvement(
        self,
        value: float | None,
        best: float | None,
        tiebreak: float | None = None,
        best_tiebreak: float | None = None,
    ) -> bool:
        """Whether `value` of the monitored metric beats `best`. A tie is broken by the
        validation loss (`tiebreak` against `best_tiebreak`, lower wins): a val_acc of 1.0 reached
        at epoch 1 must not keep that barely trained checkpoint over a later one that fits better.
        A missing or non-finite loss never wins a tie."""
        if value is None:
            return best is None  # keep a best.pt even without the metric
        if not math.isfinite(value):
            return False  # never best on NaN/Inf
        if best is None:
            return True
        if value == best:
            return _loss_or_inf(tiebreak) < _loss_or_inf(best_tiebreak)
        return value > best if self.monitor_mode == "max" else value < best

    def after_evaluation(
        self,
        metrics: dict,
        state,
        state_dict: Callable[[], dict],
        epoch_end: bool,
        best_weights: str = "raw",
    ) -> None:
        """Updates state.best_metric, then writes last.pt, best.pt and epoch-N.pt as due.
        best_weights="ema": `metrics` are the EMA weights' and best.pt gets those weights."""
        value, loss = metrics.get(self.monitor), metrics.get(TIEBREAK)
        tied = value is not None and value == state.best_metric
        # An evaluation with any non-finite metric picks no best.pt, whatever the monitor says.
        finite = all(math.isfinite(v) for v in metrics.values() if isinstance(v, int | float))
        improved = finite and self.is_improvement(
            value, state.best_metric, loss, state.best_tiebreak
        )
        if improved and value is not None and math.isfinite(value):
            state.best_metric, state.best_tiebreak = value, loss
            if tied and self.is_main:
                log.info(
                    "best.pt: %s %.4g tied, %s %.4g is lower: this checkpoint replaces it",
                    self.monitor,
                    value,
                    TIEBREAK,
                    loss,
                )
        if improved:
            state.best_step, state.best_epoch = state.global_step, state.epoch
        snapshot = state_dict()
        self.save("last.pt", snapshot)
        if improved:
            # Sharded checkpoints name one shard folder: best.pt is that same (full) snapshot.
            full = str(self.cfg.best_checkpoint) == "full" or self.sharded is not None
            best = snapshot if full else {k: snapshot[k] for k in INFERENCE_KEYS if k in snapshot}
            if best_weights == "ema":  # inference reads "model": the better of the two
                best = {**best, "model": snapshot["ema"], "weights": "ema"}
            self.save("best.pt", best)
        if epoch_end and self.cfg.checkpoint_every_epoch:
            self.save(f"epoch-{state.epoch}.pt", snapshot)
            self.prune()

    def set_aside_unreadable(self, corrupt: list[tuple[Path, str]], resumed_from: Path) -> None:
        """last.pt and best.pt of this run that cannot be read (found so while looking for a
        checkpoint, or checked here: best.pt comes last in that search) are renamed
        <name>.corrupt, said, and remembered (`best_set_aside`: the next evaluation writes a
        best.pt again); other unreadable files (epoch-N.pt) are only reported."""
        found = {Path(p).name: why for p, why in corrupt}
        best = self.directory / "best.pt"
        if "best.pt" not in found and best.is_file() and best.resolve() != resumed_from.resolve():
            problem = files.unreadable(best)
            if problem is not None:
                found["best.pt"] = problem
        for name in ("last.pt", "best.pt"):
            if name not in found:
                continue
            path = self.directory / name
            if self.is_main and path.is_file():
                aside = files.set_aside(path)
                why = found[name].replace(f"checkpoint {path} ", "").replace(f"{path} ", "")
                log.warning(
                    "%s cannot be read (%s): moved aside to %s, so nothing points at it; %s",
                    path,
                    why,
                    aside.name,
                    "the next evaluation writes a new best.pt"
                    if name == "best.pt"
                    else "the next save writes a new last.pt",
                )
            self.best_set_aside |= name == "best.pt"

    def adopt_best(self, source: Path, state) -> None:
        """A run resumed into a new directory keeps what a run has: the best.pt beside the
        checkpoint it resumed when that best.pt is from no later than the resumed step (so it
        stays the best of this run's past), else a best.pt written at its next evaluation."""
        theirs = Path(source).parent / "best.pt"
        best = None
        if self.sharded is None and theirs.is_file():  # a sharded best.pt names its own folder
            try:
                best = files.load_checkpoint(theirs, consolidate=False)
            except files.CheckpointError as err:
                log.warning("not copying %s into %s: %s", theirs, self.directory, err)
                best = {}
            if best.get("state", {}).get("global_step", math.inf) > state.global_step:
                best = None  # from a later point of the original run: not this run's past
        if best is None:
            state.best_metric = None  # the next evaluation writes this directory's best.pt
            log.info("resumed into %s: best.pt is written at the next evaluation", self.directory)
            return
        if self.is_main:
            files.atomic_save(best, self.directory / "best.pt")
        log.info("resumed into %s: best.pt copied from %s", self.directory, theirs)

    def resume_source(self, resume: str | None) -> tuple[Path, dict] | None:
        """(path, checkpoint) to continue from: resume=auto takes the newest valid file in this
        run's checkpoints/ (None when there is none yet); a path takes that file. Whatever the
        run will point to and cannot be read (last.pt, best.pt: `outputs/latest`, the printed
        commands) is set aside first (`set_aside_unreadable`)."""
        if resume is None:
            return None
        if resume == "auto":
            if not files.candidates(self.directory):
                log.info("resume=auto: no checkpoint in %s, starting fresh", self.directory)
                return None
            corrupt: list[tuple[Path, str]] = []
            found = files.load_newest_valid(
                self.directory, consolidate=False, accept=resumable, corrupt=corrupt
            )
            self.set_aside_unreadable(corrupt, resumed_from=found[0])
            return found
        if Path(resume).resolve().parent == self.directory.resolve():
            self.set_aside_unreadable([], resumed_from=Path(resume))
        checkpoint = files.load_checkpoint(Path(resume), consolidate=False)
        if not resumable(checkpoint):
            raise ResumeError(
                f"{resume} holds the weights only (trainer.best_checkpoint=weights writes best.pt "
                "for inference); resume from last.pt or an epoch-N.pt of that run"
            )
        return Path(resume), checkpoint
