"""The line a measured table carries in docs/benchmarks.md: when, at which commit, on what machine
(the CPU, how many of them, the GPU or none, the load average while it ran). Every bench
script's --markdown output starts with it."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's short commit, `+changes` when the work tree differs from it."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    except OSError:
        return "unknown"
    return (sha or "unknown") + (" +changes" if dirty else "")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {gpu}"


def stamp(load_average: tuple[float, ...] | None = None) -> str:
    """`*Recorded <date>, commit <sha>, on <machine>, load average <x>.*`"""
    load = load_average or os.getloadavg()
    today = datetime.date.today().isoformat()
    return f"*Recorded {today}, commit {commit()}, on {machine()}, load average {load[0]:.1f}.*"
