"""Busy neighbours for the benchmarks' --contention mode: N processes that each keep one core
busy (a pure-Python loop: no memory traffic, no I/O), started before the side they load and
stopped after it, so a side meets them from its start (as a job does on a shared machine).

    with busy_processes(1):
        run the side
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

SPIN = "while True:\n    pass\n"
SETTLE_S = 0.5  # the busy processes are running (and seen running) before the side starts


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen]]:
    """`count` busy processes for the duration of the block (none for 0)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        if procs:
            time.sleep(SETTLE_S)
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def their_defaults(env: dict[str, str]) -> dict[str, str]:
    """The environment without thread pins: each library sizes its own pools, as their users
    run them."""
    pins = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")
    return {k: v for k, v in env.items() if k not in pins}


def load_average() -> float:
    return os.getloadavg()[0]
