"""resume=auto: continue the newest run of the same experiment, in its own run directory."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from kiln.checkpoint import candidates
from kiln.cli.paths import has_override, is_multirun

log = logging.getLogger(__name__)


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


def with_resume_run_dir(
    argv: list[str], experiment: str, outputs: Path = Path("outputs")
) -> list[str]:
    """Adds hydra.run.dir=<the newest run of `experiment`> to a resume=auto command line."""
    if "resume=auto" not in argv or has_override(argv, "hydra.run.dir") or is_multirun(argv):
        return argv
    run_dir = newest_run_of(experiment, outputs)
    if run_dir is None:
        log.warning(
            "resume=auto: no earlier run of %r under %s; starting fresh", experiment, outputs
        )
        return argv
    return [*argv, f"hydra.run.dir={run_dir}"]
