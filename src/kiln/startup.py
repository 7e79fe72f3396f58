"""Where a run's start-up goes: the seconds from the process's start to the end of its first
optimizer step, by phase, said in one train.log line after that step and kept in summary.json
as `startup_s`. For example:

    start-up 3.1 s: imports 1.9, config 0.4, data 0.1, build 0.1, probes 0.04, first step 0.2

The phases are laps of one clock: `lap(phase)` gives the time since the previous lap to
`phase` (imports come twice: Hydra's and kiln's before the config, torch's after it). train.py's
clock starts when the process did (Linux: /proc/self/stat), so the interpreter's own start
counts among the imports; its first run takes it (`run_clock`), and a later run in the same
process (a sweep's next job) or one started in-process (a test) starts a clock of its own.

Stdlib only: train.py laps it before anything heavy is imported."""

from __future__ import annotations

import os
import time
from pathlib import Path

PHASES = ("imports", "config", "data", "build", "probes", "first step")


def process_age_s() -> float:
    """Seconds since this process started (its start time in /proc/self/stat, 10 ms ticks,
    against the same boot clock); 0 where there is no /proc."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no CLOCK_BOOTTIME
        return 0.0


class StartupClock:
    """Laps of time.perf_counter from `started` (a perf_counter reading), by phase."""

    def __init__(self, started: float):
        self.last = started
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def lap(self, phase: str, within: dict[str, float] | None = None) -> None:
        """The time since the last lap, to `phase`; `within`: seconds of it that other phases
        took, measured by their own clocks (the probes: Trainer.probe_time_s)."""
        now = time.perf_counter()
        elapsed = now - self.last
        for other, seconds in (within or {}).items():
            seconds = min(max(seconds, 0.0), elapsed)
            self.seconds[other] += seconds
            elapsed -= seconds
        self.seconds[phase] += elapsed
        self.last = now

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def as_dict(self) -> dict[str, float]:
        """summary.json's startup_s: each phase and the total, in seconds."""
        return {
            **{k: round(v, 3) for k, v in self.seconds.items()},
            "total": round(self.total_s, 3),
        }

    def line(self) -> str:
        parts = ", ".join(f"{phase} {_short(s)}" for phase, s in self.seconds.items())
        return f"start-up {self.total_s:.1f} s: {parts}"


def _short(seconds: float) -> str:
    return f"{seconds:.2f}" if seconds < 0.1 else f"{seconds:.1f}"


_process_clock: StartupClock | None = None  # from the process's start, once a command laps it
_taken = False


def lap(phase: str) -> None:
    """A lap of the process's clock (train.py's command line, before its run), started at the
    process's start by the first lap; once a run has taken it, laps are the run's own."""
    global _process_clock
    if _taken:
        return
    if _process_clock is None:
        _process_clock = StartupClock(time.perf_counter() - process_age_s())
    _process_clock.lap(phase)


def run_clock() -> StartupClock:
    """The clock of a run starting now: the process's own for its first run when the command
    lapped it (its imports and config count), else a new one from now (a sweep's next job, a
    run started in-process)."""
    global _process_clock, _taken
    clock, _process_clock, _taken = _process_clock, None, True
    return clock if clock is not None else StartupClock(time.perf_counter())
