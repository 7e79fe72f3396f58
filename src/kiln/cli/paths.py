"""Which run directory a launch should use, and what the command line asks for."""

from __future__ import annotations

import os
import socket
from datetime import datetime

import psutil

from kiln.config import CONF_DIR, REPO_ROOT  # noqa: F401  (re-exported for scripts and tests)
from kiln.config.base import ConfigError


def has_override(argv: list[str], key: str) -> bool:
    return any(arg.split("=", 1)[0].lstrip("+~") == key for arg in argv)


def is_multirun(argv: list[str]) -> bool:
    return "-m" in argv or "--multirun" in argv


def config_overrides(argv: list[str]) -> list[str]:
    """The overrides that shape the job's config: key=value arguments, minus Hydra's own (but
    hydra.searchpath, which can bring a user's config files)."""
    return [
        arg
        for arg in argv
        if "=" in arg
        and (
            has_override([arg], "hydra.searchpath")
            or not arg.startswith(("-", "hydra.", "hydra/", "+hydra", "~hydra"))
        )
    ]


def with_env_profile(argv: list[str]) -> list[str]:
    """KILN_ENV picks the env profile when env= is not on the command line."""
    profile = os.environ.get("KILN_ENV")
    if profile and not has_override(argv, "env"):
        return [*argv, f"env={profile}"]
    return argv


def shared_ddp_run_dir() -> str:
    """One run directory for every rank of a torchrun launch. On one node the ranks share the
    torchrun agent as parent process, so its start time names the directory; ranks on several
    nodes share only the rendezvous id (torchrun --rdzv-id), which names it instead."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    world = os.environ.get("WORLD_SIZE", "1")
    if os.environ.get("LOCAL_WORLD_SIZE", world) != world:  # several nodes
        if run_id == "none":
            raise ConfigError(
                "multi-node torchrun needs a run id", "hydra.run.dir", "pass --rdzv-id or set it"
            )
        return f"outputs/ddp/{run_id}"
    started = datetime.fromtimestamp(psutil.Process(os.getppid()).create_time())
    return f"outputs/{started:%Y-%m-%d}/{started:%H-%M-%S}-ddp-{socket.gethostname()}"


def with_ddp_run_dir(argv: list[str]) -> list[str]:
    """Under torchrun Hydra would give every rank its own directory: pin one, and let only
    rank 0 write Hydra's files and logs."""
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1 or is_multirun(argv):
        return argv
    if not has_override(argv, "hydra.run.dir"):
        argv = [*argv, f"hydra.run.dir={shared_ddp_run_dir()}"]
    if int(os.environ.get("RANK", 0)) > 0:
        argv = [*argv, "hydra.output_subdir=null", "hydra/job_logging=disabled"]
    return argv
