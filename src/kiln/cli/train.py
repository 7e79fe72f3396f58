"""`python train.py ...` / `kiln-train ...`: check the config, let Hydra make the run directory,
train, and leave a summary.json. A user mistake ends with one `error: ...` line (exit 2); a
failed run ends with one greppable [FAIL] line (exit 1); a preempted one exits 75, an
interrupted one (Ctrl-C) 130."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kiln import startup
from kiln.cli import report
from kiln.cli.failures import record_failure
from kiln.cli.paths import (
    CONF_DIR,
    config_overrides,
    has_override,
    is_multirun,
    with_ddp_run_dir,
    with_env_profile,
)
from kiln.cli.resume import with_resume_run_dir
from kiln.cli.script import imports_done
from kiln.commands import RunCommand, cache_environment, line, script
from kiln.config import (
    hydra_mode_known,
    load_config_and_mode,
    register_configs,
    to_plain,
    to_typed,
)
from kiln.config.overrides import check_grammar
from kiln.errors import UserError
from kiln.registry import load_plugins, register_config_dir

log = logging.getLogger("kiln")

EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: requeue me (with resume=auto)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
HELP_FLAGS = ("-h", "--help", "--describe")
SEARCHPATH = "hydra.searchpath"
MIN_FREE_BYTES = 1 << 20  # a run refuses to start with less room than this for its files


def quiet_console() -> None:
    """Only warnings on the console; train.log keeps every line."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)


class KilnOnConsole(logging.Filter):
    """Other libraries' notes (compilers, tracers, deprecations) stay out of the console below
    ERROR; train.log keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith(("kiln", "__main__")) or record.levelno >= logging.ERROR


def tidy_console() -> None:
    logging.captureWarnings(True)  # Python warnings become log records: to train.log
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.addFilter(KilnOnConsole())
        else:
            handler.handleError = stop_on_full_disk(handler)


def stop_on_full_disk(handler: logging.FileHandler):
    """train.log on a full disk: the handler leaves (no traceback per record on stderr) and the
    run ends with the one-line error, as any other write to a full disk does."""
    default = handler.handleError

    def handle_error(record: logging.LogRecord) -> None:
        from kiln.errors import disk_full, is_disk_full

        if not is_disk_full(sys.exc_info()[1]):
            return default(record)
        logging.getLogger().removeHandler(handler)
        with contextlib.suppress(OSError):
            handler.close()
        raise disk_full(Path(handler.baseFilename))

    return handle_error


def enough_room(argv: list[str]) -> None:
    """Before Hydra writes anything: a disk with almost no room fails here, in one line, not in
    the middle of Hydra's own files."""
    from kiln.errors import DiskFullError, free_space

    named = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] == "hydra.run.dir"]
    where = Path(named[-1].strip("'\"")) if named and "${" not in named[-1] else Path.cwd()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return
    if free < MIN_FREE_BYTES:
        raise DiskFullError(
            f"no room for a run in {where} ({free_space(probe)} on its disk) "
            "(hydra.run.dir): a run writes its config, log, metrics and checkpoints there; "
            "free space on that disk, or run with hydra.run.dir on another one"
        )


def user_error(err: BaseException, message: str | None = None) -> SystemExit:
    """One line on stderr; the traceback only when asked for (HYDRA_FULL_ERROR=1)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        import traceback

        traceback.print_exception(err)
    print(f"error: {message or err}", file=sys.stderr, flush=True)
    return SystemExit(EXIT_USER_ERROR)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_main(raw_cfg: DictConfig) -> float | None:
    """One job: its run directory made, trained (run_job). A stop before step 1 that came
    before train() could record it (during the imports, say) is recorded here, in
    summary.json; main() says it."""
    startup.lap("config")  # the command line checked, Hydra's composition and run directory
    from kiln.engine.preemption import SIGNALS, Interrupted, Preempted, PreemptedBeforeStart
    from kiln.logging.summary import stopped_summary, write_summary  # before any stop: no torch

    hydra = HydraConfig.get()
    run_dir = Path(hydra.runtime.output_dir)
    model = (raw_cfg.get("model") or {}).get("name")
    # to type it again, with the caches a pretrained model was read from
    environment = cache_environment(model, os.environ)
    command = RunCommand.of(hydra.overrides.task, hydra.overrides.hydra, environment)
    tidy_console()
    SIGNALS.starting()  # each job of a multirun starts anew
    main_rank = not int(os.environ.get("RANK", 0))

    def record_stop(stop: Preempted) -> None:
        if main_rank and not getattr(stop, "summary_written", False):
            write_summary(run_dir, stopped_summary(None, stop))
            stop.summary_written = True

    def last_word(stop: Preempted) -> None:  # the process ends in a native call
        record_stop(stop)
        if main_rank and not isinstance(stop, PreemptedBeforeStart):  # (main() says those)
            print(report.preempted(run_dir, command, isinstance(stop, Interrupted)), flush=True)

    try:
        with SIGNALS.last_word(last_word):
            return run_job(raw_cfg, run_dir, command)
    except PreemptedBeforeStart as err:
        record_stop(err)
        raise


def run_job(raw_cfg: DictConfig, run_dir: Path, command: RunCommand) -> float | None:
    """Train, then say how it went: the run's end, or its one [FAIL] line, error line or
    preemption (exit 75/130)."""
    from kiln.engine.distributed import env_dist_info, leave_together, teardown
    from kiln.engine.preemption import Interrupted, Preempted, PreemptedBeforeStart
    from kiln.engine.rank_watch import claim_report, open_report, post_failure
    from kiln.engine.run import train

    startup.lap("imports")  # torch and the engine
    imports_done()  # what they made is frozen: no collection walks it again
    hydra = HydraConfig.get()
    multirun = hydra.mode == RunMode.MULTIRUN
    dist = env_dist_info()
    open_report()  # each job of a multirun reports its own failure
    finished = False
    try:
        cfg = to_typed(raw_cfg)
        if cfg.env.quiet:
            quiet_console()
        summary = train(cfg, run_dir, lambda err: record_failure(cfg, run_dir, err, True))
        finished = True
    except PreemptedBeforeStart:  # nothing trained: main() says it in one line
        finished = True  # no report to wait for: every rank leaves at once
        raise
    except Preempted as err:
        log.warning("%s", err)
        interrupted = isinstance(err, Interrupted)
        if dist.is_main:
            print(report.preempted(run_dir, command, interrupted=interrupted), flush=True)
        raise SystemExit(EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED) from None
    except KeyboardInterrupt:  # Ctrl-C twice, or before the loop started: no new checkpoint
        if dist.is_main:
            print(report.stopped_at_once(run_dir, command), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except UserError as err:
        if multirun:
            raise
        from kiln.engine.checkpointer import ResumeError
        from kiln.errors import DiskFullError

        message = None
        if isinstance(err, ResumeError):  # its fixes as the exact commands to type
            message = err.with_commands(list(hydra.overrides.task), dist.world_size, str(run_dir))
        if isinstance(err, DiskFullError):  # and what survived
            newest = report.newest_checkpoint(run_dir)
            kept = f"newest: {newest}" if newest else "none written yet"
            message = f"{str(err).removesuffix('; nothing written before is lost')}; the " + (
                f"checkpoints are intact ({kept})"
            )
        raise user_error(err, message) from None
    except Exception as err:  # the run died: one [FAIL] line, whatever killed it
        if dist.is_main and claim_report():
            record_failure(cfg, run_dir, err, dist.enabled)
            print(report.failed(run_dir), file=sys.stderr, flush=True)
        elif dist.enabled and not dist.is_main:  # the main rank reports it if it is stuck
            from kiln.cli.failures import what_failed

            post_failure(
                dist,
                what_failed(err)[0],
                str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__,
            )
        if multirun:
            raise  # Hydra records the failed job and the sweep goes on
        raise SystemExit(EXIT_FAILED) from None
    finally:
        if not finished:  # every rank exits non-zero: none may leave before the report
            leave_together(dist)
        teardown()
    if dist.is_main:
        link = None if multirun else report.link_latest(cfg.output_root, run_dir)
        print(report.finished(summary, run_dir, link, command, to_plain(cfg)), flush=True)
        log.debug("summary: %s", json.dumps(summary))
    value = summary.get(summary.get("monitor") or "", None)
    return float(value) if value is not None else None  # what Optuna optimises


def check_model_names(cfg) -> None:
    """A zoo model's arch and weights, checked against its library before Hydra starts a run:
    a misspelt arch or a missing weights file fails here. Only then is torch imported (the
    library needs it, and the run would import it next); so it is for text_bow, whose
    declaration (what it asks of its data) lives beside the model; other models import
    nothing."""
    from kiln.registry import MODELS

    if MODELS.entry(cfg.model.name).meta.get("preprocessing"):
        from kiln.preprocessing.pretrained import pretrained_input, recorded_pretrained

        if recorded_pretrained(cfg.model, cfg.init_from) is None:  # else the checkpoint's own
            pretrained_input(cfg.model)


def help_text(argv: list[str]) -> str:
    """`--help [GROUP[=OPTION]]`, also on a command line that names plugins and their
    hydra.searchpath (main() has imported and registered those already)."""
    from kiln.cli.help import describe, overview

    register_configs()
    carried = ("plugins", SEARCHPATH)
    targets = [
        a for a in argv if a not in HELP_FLAGS and not any(has_override([a], k) for k in carried)
    ]
    return describe(targets[0]) if targets else overview()


def override_values(argv: list[str], key: str) -> list[str]:
    """The list (or value) the last `key=...` override of the command line gives."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = [a for a in argv if has_override([a], key)]
    if not found:
        return []
    value = OverridesParser.create().parse_overrides(found[-1:])[0].value()
    return [str(v) for v in (value if isinstance(value, list) else [value])]


def with_plugins(argv: list[str]) -> None:
    """Import the plugins=[...] modules before anything is looked up, and put the
    hydra.searchpath=[...] folders beside the ones plugins register, so that every checkpoint
    records where its options came from."""
    load_plugins(override_values(argv, "plugins"))
    for entry in override_values(argv, SEARCHPATH):
        register_config_dir(entry)


def with_env_overrides(argv: list[str]) -> list[str]:
    """KILN_OVERRIDES="trainer.max_steps=2 ..." is appended to every command line: shortens
    runs in CI and in the README's own test without editing a command."""
    extra = os.environ.get("KILN_OVERRIDES", "").split()
    return [*argv, *extra] if extra and not any(a in HELP_FLAGS for a in argv) else argv


def main(argv: list[str] | None = None) -> None:
    """train.py: a stop (SIGTERM, SIGUSR1, Ctrl-C) before step 1 ends it at once, with one
    line (kiln.engine.preemption), from before the heavy imports to the first step."""
    from kiln.engine.preemption import SIGNALS, Preempted, PreemptedBeforeStart, exit_code

    typed = list(sys.argv[1:] if argv is None else argv)  # to type again after a stop

    def say(stop: BaseException) -> None:
        main_rank = not int(os.environ.get("RANK", 0))  # one line for the run, from it
        if main_rank and isinstance(stop, PreemptedBeforeStart):
            print(stopped_before_start(stop, typed), flush=True)

    with SIGNALS.installed(), SIGNALS.last_word(say):
        try:
            prepare_and_train(typed)
        except PreemptedBeforeStart as stop:
            say(stop)
            raise SystemExit(exit_code(stop)) from None
        except Preempted as stop:  # between two jobs of a sweep: each job said its own end
            print(stop, flush=True)
            raise SystemExit(exit_code(stop)) from None


def stopped_before_start(stop: BaseException, typed: list[str]) -> str:
    """The one line of a run stopped before step 1: nothing trained, the same command."""
    return f"{stop}; start it again with: {line(script('train.py'), typed)}"


def prepare_and_train(argv: list[str]) -> None:
    startup.lap("imports")  # the interpreter, Hydra, kiln's command line (kiln.startup)
    argv = with_env_overrides(with_env_profile(argv))
    try:
        check_grammar(argv)  # Hydra's parse errors as one line, before anything else
        with_plugins(argv)
        if any(arg in HELP_FLAGS for arg in argv):
            print(help_text(argv))
            return
        register_configs()
        mode = None  # hydra.mode as kiln's composition reads it: Hydra need not compose again
        curves = True  # whether a run of this launch draws curves.png (a sweep's jobs: may)
        if not is_multirun(argv):  # a sweep's jobs are checked one by one as they start
            # a mistake fails here, before any work
            cfg, mode = load_config_and_mode(config_overrides(argv))
            check_model_names(cfg)
            argv = with_resume_run_dir(argv, cfg.name)
            curves = cfg.logger.curves
        if curves and not int(os.environ.get("RANK", 0)):  # the main rank draws curves.png
            from kiln.logging.curves import start_painter

            start_painter()  # it imports matplotlib once the run has a loss to draw
        argv = with_ddp_run_dir(argv)
        enough_room(argv)
        lock_run_dir(argv)
    except UserError as err:  # a bug (kiln's or a plugin's) is a traceback and exit 1
        raise user_error(err) from None
    sys.argv = [sys.argv[0], *argv]
    with hydra_mode_known(mode) if mode_is_read(argv) else contextlib.nullcontext():
        hydra_main()


def mode_is_read(argv: list[str]) -> bool:
    """Whether kiln's composition read the launch's hydra.mode: a single run's, whose command
    line neither sets hydra.mode nor picks a Hydra config group (kiln composes neither)."""
    hydra_groups = ("hydra/", "+hydra", "++hydra", "~hydra")
    return not is_multirun(argv) and not any(
        has_override([arg], "hydra.mode") or arg.startswith(hydra_groups) for arg in argv
    )


def lock_run_dir(argv: list[str]) -> None:
    """A named run directory is locked before Hydra writes into it: a second process on it
    (resume=auto twice) stops here, naming the first (kiln.run_lock); train() holds the lock
    for the run's life."""
    from kiln.run_lock import acquire

    named = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] == "hydra.run.dir"]
    if not named or "${" in named[-1] or is_multirun(argv) or int(os.environ.get("RANK", 0)):
        return
    acquire(Path(named[-1].strip("'\"")))  # RunDirInUse: a UserError
