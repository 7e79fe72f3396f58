"""How the root scripts run an entry point: the work, then an exit that skips the garbage
collector's passes over the interpreter's objects at shutdown.

A process that imported torch (and torch._dynamo, which every optimizer step imports) spends
0.5-1.2 s of a 2-core machine collecting its million objects while the interpreter tears itself
down: the same per run of train.py, a sweep job or a torchrun worker, and nothing depends on it.
gc.freeze() moves every object to the permanent generation first; everything else about exit
stays as Python does it (atexit handlers, files flushed and closed, threads joined)."""

from __future__ import annotations

import contextlib
import gc
import os
import shlex
import sys
from collections.abc import Callable, Iterator


def run_script(main: Callable[[], object]) -> None:
    """`main()` as a script runs it; whatever way it ends (returns, exits, raises), the objects it
    leaves are frozen before the interpreter shuts down."""
    try:
        main()
    finally:
        gc.freeze()


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM, SIGUSR1 and Ctrl-C handled from here on (kiln.engine.preemption), imports
    included: a stop that comes before the entry point can say it (during its own imports) ends
    the process here, in one line, exit 75 (130 for Ctrl-C)."""
    from kiln.engine.preemption import SIGNALS, Preempted, exit_code  # imports no torch

    with SIGNALS.installed():
        try:
            yield
        except Preempted as stop:
            if not int(os.environ.get("RANK", 0)):  # one line for the run, from the main rank
                print(f"{stop}; start it again with: {typed_again()}", flush=True)
            raise SystemExit(exit_code(stop)) from None


def typed_again() -> str:
    """This process's command line as kiln prints commands (kiln.commands: torchrun's too)."""
    try:
        from kiln.commands import line, script

        return line(script(os.path.basename(sys.argv[0])), sys.argv[1:])
    except Exception:  # noqa: BLE001 -- the stop cut its import short: as Python saw it
        return shlex.join(["python", *sys.argv])
