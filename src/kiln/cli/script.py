"""How the root scripts run an entry point: the work, then an exit that skips the garbage
collector's passes over the interpreter's objects at shutdown; train.py also runs its start-up
without collections, until torch and the engine are imported (`imports_done`).

A process that imported torch (and torch._dynamo, which every optimizer step imports) spends
0.5-1.2 s of a 2-core machine collecting its million objects while the interpreter tears itself
down: the same per run of train.py, a sweep job or a torchrun worker, and nothing depends on it.
gc.freeze() moves every object to the permanent generation first; everything else about exit
stays as Python does it (atexit handlers, files flushed and closed, threads joined).

The same million objects, made by `import torch`, were walked by every full collection during
the imports and the run's start; train.py pauses the collector until its task has imported
torch and the engine, then freezes what exists (the objects of its imports, and the garbage of
its two config compositions: a few MB, once) and collects again. A 3-step run: 2.77 -> 2.54
CPU-s (median of 8 pairs, 2 cores)."""

from __future__ import annotations

import contextlib
import gc
import os
import shlex
import sys
from collections.abc import Callable, Iterator


def run_script(main: Callable[[], object], *, collect_during_imports: bool = True) -> None:
    """`main()` as a script runs it; whatever way it ends (returns, exits, raises), the objects it
    leaves are frozen before the interpreter shuts down. `collect_during_imports=False`: no
    garbage collection until the entry point calls `imports_done()` (train.py: torch and the
    engine imported), which freezes what the imports made: `import torch` makes a million
    long-lived objects, and each full collection on the way walked all made so far (0.12 of
    1.8 CPU-s); frozen, no later collection walks them again."""
    global _collection_paused
    if not collect_during_imports:
        gc.disable()
        _collection_paused = True
    try:
        main()
    finally:
        gc.freeze()


_collection_paused = False


def imports_done() -> None:
    """The heavy imports are done: what they made is frozen and collection resumes (once per
    process; a no-op unless run_script paused it, as in a test's process)."""
    global _collection_paused
    if _collection_paused:
        gc.freeze()
        gc.enable()
        _collection_paused = False


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
