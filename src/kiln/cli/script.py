"""How the root scripts run an entry point: the work, then an exit that skips the garbage
collector's passes over the interpreter's objects at shutdown.

A process that imported torch (and torch._dynamo, which every optimizer step imports) spends
0.5-1.2 s of a 2-core machine collecting its million objects while the interpreter tears itself
down: the same per run of train.py, a sweep job or a torchrun worker, and nothing depends on it.
gc.freeze() moves every object to the permanent generation first; everything else about exit
stays as Python does it (atexit handlers, files flushed and closed, threads joined)."""

from __future__ import annotations

import gc
import importlib
import shlex
import sys
from collections.abc import Callable


def run_script(main: Callable[[], object] | str) -> None:
    """`main()` as a script runs it; whatever way it ends (returns, exits, raises), the objects it
    leaves are frozen before the interpreter shuts down. `main` may be named "module:function"
    (as an entry point is): then SIGTERM, SIGUSR1 and Ctrl-C are handled from before its
    imports (kiln.engine.preemption), and a stop during them ends the process in one line."""
    try:
        if callable(main):
            main()
        else:
            run_named(main)
    finally:
        gc.freeze()


def run_named(entry: str) -> None:
    from kiln.engine.preemption import SIGNALS, Preempted, exit_code  # imports no torch

    module, _, name = entry.partition(":")
    with SIGNALS.installed():
        try:
            main = getattr(importlib.import_module(module), name)
        except Preempted as stop:  # main() says its own stops; these came before it could
            command = shlex.join(["python", *sys.argv])
            print(f"{stop}; start it again with: {command}", flush=True)
            raise SystemExit(exit_code(stop)) from None
        main()
