"""How the root scripts run an entry point: the work, then an exit that skips the garbage
collector's passes over the interpreter's objects at shutdown.

A process that imported torch (and torch._dynamo, which every optimizer step imports) spends
0.5-1.2 s of a 2-core machine collecting its million objects while the interpreter tears itself
down: the same per run of train.py, a sweep job or a torchrun worker, and nothing depends on it.
gc.freeze() moves every object to the permanent generation first; everything else about exit
stays as Python does it (atexit handlers, files flushed and closed, threads joined)."""

from __future__ import annotations

import gc
from collections.abc import Callable


def run_script(main: Callable[[], object]) -> None:
    """`main()` as a script runs it; whatever way it ends (returns, exits, raises), the objects it
    leaves are frozen before the interpreter shuts down."""
    try:
        main()
    finally:
        gc.freeze()
