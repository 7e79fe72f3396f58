"""Where a resumed run goes: it carries on in the run it resumes. resume=auto continues the
newest run of the same experiment, resume=<run>/checkpoints/<file>.pt that file's run, each in
its own run directory, unless hydra.run.dir says otherwise."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from kiln.checkpoint import candidates
from kiln.cli.paths import has_override, is_multirun
from kiln.config.overrides import override

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
RUN_MARKER = Path(".hydra") / "config.yaml"


def newest_run_of(name: str, outputs: Path) -> Path | None:
    """The run directory under `outputs` of experiment `name` holding the newest checkpoint."""
    newest, newest_time = None, -1.0
    for config_file in outputs.glob("**/.hydra/config.yaml"):
        run_dir = config_file.parent.parent
        found = candidates(run_dir / "checkpoints")
        if not found or OmegaConf.load(config_file).get("name") != name:
            continue
        mtime = max(p.stat().st_mtime for p in found)
        if mtime > newest_time:
            newest, newest_time = run_dir, mtime
    return newest


def run_of_checkpoint(path: Path) -> Path | None:
    """The run directory a checkpoint file (or sharded folder) sits in: the parent of the
    `checkpoints/` folder above it, when that parent is a run (it has .hydra/config.yaml)."""
    for folder in Path(path).resolve().parents:
        if folder.name == CHECKPOINTS:
            return folder.parent if (folder.parent / RUN_MARKER).is_file() else None
    return None


def resume_value(argv: list[str]) -> str | None:
    """The last resume=... value as Hydra reads it (quotes removed), `~` expanded as in every
    path key."""
    import os

    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = [a for a in argv if has_override([a], "resume")]
    if not found:
        return None
    value = OverridesParser.create().parse_overrides(found[-1:])[0].value()
    return None if value is None else os.path.expanduser(str(value))


def with_resume_run_dir(
    argv: list[str], experiment: str, outputs: Path = Path("outputs")
) -> list[str]:
    """Adds hydra.run.dir=<the run it resumes> to a resume=auto or resume=<path> command line."""
    resume = resume_value(argv)
    if resume in (None, "null") or has_override(argv, "hydra.run.dir") or is_multirun(argv):
        return argv
    if resume == "auto":
        run_dir = newest_run_of(experiment, outputs)
        if run_dir is None:
            log.warning(
                "resume=auto: no earlier run of %r under %s; starting fresh", experiment, outputs
            )
            return argv
    else:
        run_dir = run_of_checkpoint(Path(resume))
        if run_dir is None:  # a checkpoint outside any run: a new run directory
            return argv
    return [*argv, override("hydra.run.dir", _typed(run_dir))]


def _typed(run_dir: Path) -> str:
    """The run directory relative to the working directory when inside it (as Hydra's own
    outputs/<date>/<time> is), so printed paths stay short."""
    try:
        return str(run_dir.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(run_dir.resolve())
