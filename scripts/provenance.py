"""The line a measured table carries in docs/benchmarks.md: when, at which commit, on what machine
(the CPU, how many of them, the GPU or none, the load average while it ran). Every bench
script's --markdown output starts with it; `write_report` stores that Markdown in the script's
--out JSON, where a `<!-- figures: <json> -->` block of docs/ reads it (kiln.cli.docs)."""

from __future__ import annotations

import datetime
import json
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
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
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


FIGURES = REPO / "docs" / "figures"


def write_report(report: dict, markdown: str, out: Path | None) -> str:
    """Store `markdown` (the stamp and the tables under it) as report["markdown"], what
    `python -m kiln.cli.docs --write` copies into a `<!-- figures: <out> -->` block (one source
    per figure), and write the report as JSON to `out` when given. Returns the Markdown.

    A smoke run (KILN_SMOKE=1: the docs' commands and `make bench` run as typed by the tests, in
    their quick form) never writes into docs/figures/: its numbers are no figure of the docs."""
    report["markdown"] = markdown.rstrip("\n") + "\n"
    smoke = os.environ.get("KILN_SMOKE") == "1"
    if out is not None and smoke and out.resolve().parent == FIGURES.resolve():
        print(f"KILN_SMOKE=1: {out} not written (a smoke run's numbers are not the docs')")
    elif out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return report["markdown"]
