"""Where kiln's config lives and which run directory a launch should use."""

from __future__ import annotations

import os
import socket
from datetime import datetime
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[3]
CONF_DIR = Path(os.environ.get("KILN_CONF_DIR", REPO_ROOT / "conf"))


def has_override(argv: list[str], key: str) -> bool:
    return any(arg.split("=", 1)[0].lstrip("+~") == key for arg in argv)


def is_multirun(argv: list[str]) -> bool:
    return "-m" in argv or "--multirun" in argv


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
            raise ValueError("multi-node torchrun needs --rdzv-id (or set hydra.run.dir)")
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
