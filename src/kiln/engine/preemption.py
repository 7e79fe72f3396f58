"""SIGTERM and SIGUSR1 (a scheduler preempting the job) and SIGINT (Ctrl-C) in every phase of a
run, from train.py's first line to its exit.

- **Before step 1 is done** (imports, config, the data scan and tokenizing, building, the
  probes, the first step itself) nothing needs saving: the handler raises PreemptedBeforeStart
  at once, and train.py exits 75 (130 for Ctrl-C) with one line saying nothing was trained and
  the command to start it again.
- **From then on** the loop checkpoints at the next step boundary and exits 75 (requeue with
  resume=auto); an evaluation in progress stops at its next batch and last.pt is saved at the
  step it evaluates. A second Ctrl-C stops at once (KeyboardInterrupt, no checkpoint of the
  half-done step). Under DDP the ranks agree at log lines before anyone stops.
- **After the last step** (every checkpoint on disk; the test-split report) the handler raises
  at once again.

A handler runs only between two bytecodes of the main thread: a native call that holds the
thread (a tokenizer's batch in Rust, a long kernel, a collective waiting for a rank that left)
delays it. Where the handler would raise, a watch thread woken by the signal itself
(signal.set_wakeup_fd) ends the process when the handler has not run within HANDLER_WAIT_S:
it says its last words (summary.json, the one line) and exits with the same code. Nothing is
lost by it: before step 1 there is nothing to save, after the last step everything is saved.

This module imports no torch: train.py installs the handlers before its heavy imports."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kiln.engine.distributed import DistInfo

log = logging.getLogger(__name__)

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_SIGNALS = (*PREEMPT_SIGNALS, signal.SIGINT)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: requeue me (with resume=auto)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
# How long the watch waits for the handler to run before it ends the process itself: the
# handler runs within milliseconds unless a native call holds the main thread.
HANDLER_WAIT_S = 1.0


# BaseException, as KeyboardInterrupt: a stop is no error, and raised from a handler at any
# bytecode it must pass every `except Exception` (a logging handler's, a probe's) untouched.
class Preempted(BaseException):  # noqa: N818  (a control-flow signal, not an error)
    """A preemption signal stopped the run (at a step boundary: its checkpoint is saved)."""

    status = "preempted"  # summary.json's


class Interrupted(Preempted):
    """Ctrl-C: a preemption the user asked for at the keyboard."""

    status = "interrupted"


class PreemptedBeforeStart(Preempted):
    """Raised by the handler itself before step 1: nothing was trained, nothing to save."""


class InterruptedBeforeStart(PreemptedBeforeStart, Interrupted):
    """Ctrl-C before step 1."""


def exit_code(err: Preempted) -> int:
    return EXIT_INTERRUPTED if isinstance(err, Interrupted) else EXIT_PREEMPTED


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopSignals:
    """The process's handlers of STOP_SIGNALS (one instance: SIGNALS) and what they saw. The
    training loop says when to stop at step boundaries instead (`defer`) and when again at once
    (`trained`); while a failure is reported a stop waits (`reporting_failure`)."""

    def __init__(self) -> None:
        self.requested = False  # a stop was asked while deferring: the loop acts on it
        self.interrupted = False  # ... by Ctrl-C
        self.deferring = False  # from step 1 to the last step: stop at a step boundary
        self.trained_to: int | None = None  # the last step, once training is over
        self.first_step = 1  # this run's first step (a resumed run's is later)
        self.raised: Preempted | None = None  # the stop on its way out
        self.notes: list[str] = []  # what the handler saw while deferring, logged by the loop
        self.seen: dict[int, float] = {}  # signal -> when the watch saw it (rank_watch reads it)
        self.ranks_watched = False  # a DDP rank watch runs (kiln.engine.rank_watch)
        self._reporting = False  # a failure is being reported: stops wait for good
        self._lock = threading.RLock()  # the handler (main thread) against the watch
        self._answered = threading.Event()  # the handler ran for the signal the watch saw
        self._last_words: list[Callable[[Preempted], None]] = []
        self._installs = 0
        self._previous: dict[int, object] = {}
        self._previous_fd = -1
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._watch: threading.Thread | None = None
        self._in_child = False  # a forked child (a DataLoader worker): its parent decides

    # ------------------------------------------------------------------ installing
    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """The handlers and the watch until the block ends (then the previous handlers);
        nested blocks share the outermost one's. Outside the main thread: no handlers."""
        outermost = self._installs == 0
        if outermost:
            self._install()
        self._installs += 1
        try:
            yield self
        finally:
            self._installs = max(0, self._installs - 1)
            if outermost:
                self._uninstall()

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._in_child = False  # a child that starts a run of its own takes them over
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # written by the C-level handler: it must never block
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._sockets = reader, writer
        self._watch = threading.Thread(target=self._watch_signals, name="kiln-stop", daemon=True)
        self._watch.start()

    def _uninstall(self) -> None:
        if self._sockets is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        reader, writer = self._sockets
        with contextlib.suppress(OSError):
            writer.send(b"\0")  # the watch's cue to end
        if self._watch is not None:
            self._watch.join(timeout=1.0)
        reader.close()
        writer.close()
        self._sockets, self._watch = None, None

    def in_child(self) -> None:
        """After a fork (a DataLoader worker): the signals are the parent's to act on; the
        child writes nothing to the parent's wake-up socket."""
        self._in_child = True
        if self._sockets is not None:
            with contextlib.suppress(ValueError):  # forked from another thread
                signal.set_wakeup_fd(-1)
        # The parent's installation is not the child's to undo (it has no watch thread).
        self._installs, self._sockets, self._watch, self._previous = 0, None, None, {}

    # ------------------------------------------------------------------------ phases
    def starting(self) -> None:
        """A run starts in this process (each job of a sweep): until step 1 a signal stops it
        at once."""
        with self._lock:
            self.requested = self.interrupted = self.deferring = self._reporting = False
            self.trained_to, self.raised, self.first_step = None, None, 1
            self.notes.clear()
            self.seen.clear()

    def starting_at(self, step: int) -> None:
        """The run's first step will be step + 1 (a resumed run's is later than 1)."""
        self.first_step = step + 1

    def defer(self) -> None:
        """A step is done: from now on a signal asks the loop to stop at a step boundary."""
        if not self.deferring:
            with self._lock:
                self.deferring = True

    def trained(self, step: int) -> None:
        """Training is over and every checkpoint is on disk: a signal stops the run at once
        again (a stop asked since the last boundary is raised here)."""
        with self._lock:
            self.deferring, self.trained_to = False, step
            if self.requested and self.raised is None:
                self.raised = self.stop_now(self.interrupted)
        if self.raised is not None:
            raise self.raised

    def reporting_failure(self) -> None:
        """The run is failing and its report is being written: a stop waits for good (the
        process exits with the failure's code; torchrun's SIGTERM after a rank died must not cut
        the main rank's [FAIL] line short)."""
        with self._lock:
            self._reporting = True

    @contextlib.contextmanager
    def last_word(self, say: Callable[[Preempted], None]) -> Iterator[None]:
        """`say(stop)` runs if the watch ends the process during the block (the handler could
        not run): the latest registered first."""
        self._last_words.append(say)
        try:
            yield
        finally:
            self._last_words.remove(say)

    # ----------------------------------------------------------------------- handling
    # The handler logs nothing itself: it runs between two bytecodes of the main thread,
    # perhaps in the middle of a log line's write to the same stream, and writing there fails
    # ("reentrant call inside <_io.BufferedWriter>", printed as a logging error). What it saw
    # while deferring is logged at the loop's next check (PreemptionFlag.agreed).
    def _handle(self, signum: int, frame) -> None:
        if self._in_child:
            return
        ctrl_c = signum == signal.SIGINT
        with self._lock:
            if self._reporting or self.raised is not None:
                self._answered.set()
                return
            if self.deferring:
                self._answered.set()
                if ctrl_c and self.interrupted:  # the second Ctrl-C: stop now, wherever it is
                    raise KeyboardInterrupt
                self.notes.append(
                    "Ctrl-C: checkpointing at the next step boundary (Ctrl-C again stops at once)"
                    if ctrl_c
                    else f"received {signal_name(signum)}: checkpointing at the next step boundary"
                )
                self.requested, self.interrupted = True, self.interrupted or ctrl_c
                return
            self.raised = self.stop_now(ctrl_c)
            self._answered.set()
        raise self.raised

    def stop_now(self, ctrl_c: bool) -> Preempted:
        """The stop raised at once: before step 1, or after the last one."""
        if self.trained_to is not None:
            kind = Interrupted if ctrl_c else Preempted
            how = "interrupted (Ctrl-C)" if ctrl_c else "preempted"
            return kind(
                f"{how} at step {self.trained_to}, after the last step (its checkpoints are "
                "complete); resume with resume=auto"
            )
        kind = InterruptedBeforeStart if ctrl_c else PreemptedBeforeStart
        how = "interrupted (Ctrl-C)" if ctrl_c else "preempted"
        if self.first_step > 1:  # a resumed run
            return kind(
                f"{how} before step {self.first_step}: nothing was trained since its checkpoint "
                f"at step {self.first_step - 1}"
            )
        return kind(f"{how} before step 1: nothing was trained")

    # ------------------------------------------------------------------------ the watch
    def _watch_signals(self) -> None:
        """Reads the signal numbers the C-level handler writes as each signal arrives, even
        while the main thread is held in native code; ends the process when the handler would
        raise and has not run within HANDLER_WAIT_S."""
        reader = self._sockets[0]
        while True:
            try:
                received = reader.recv(64)
            except OSError:
                return
            if not received or 0 in received:
                return
            now = time.monotonic()
            stops = [sig for sig in received if sig in STOP_SIGNALS]
            for sig in stops:
                self.seen.setdefault(sig, now)
            if stops and not self._answered.wait(HANDLER_WAIT_S):
                self._end_if_stuck(stops[0])
            self._answered.clear()

    def _end_if_stuck(self, signum: int) -> None:
        if self.ranks_watched:
            # A DDP rank held in a collective gets out once its peers, signalled too, reach it;
            # or a peer stopped before step 1 (the rank watch ends this rank the same way), or
            # died (the rank watch reports that failure).
            return
        with self._lock:
            if self.deferring or self._reporting or self.raised is not None:
                return  # the loop stops at its step boundary; a failure's report finishes
            self.end_now(self.stop_now(signum == signal.SIGINT))

    def end_now(self, stop: Preempted) -> None:
        """From a thread: end the process with `stop`'s code after its last words, unless the
        main thread is already on its way out (then this returns)."""
        with self._lock:
            if self.raised is not None:
                return
            self.raised = stop
        for say in reversed(self._last_words):
            with contextlib.suppress(Exception):  # the exit must go on
                say(stop)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(exit_code(stop))


SIGNALS = StopSignals()
os.register_at_fork(after_in_child=SIGNALS.in_child)


class PreemptionFlag:
    """The training loop's view of SIGNALS: the handlers for the duration of a `with` block
    (unless the process installed them already), what was asked, and the ranks' agreement."""

    def __init__(self, dist: DistInfo, device: torch.device):
        self.dist, self.device = dist, device
        self._installed: contextlib.ExitStack | None = None
        SIGNALS.starting()  # a new trainer: nothing asked of it yet (one process, many runs)

    def __enter__(self) -> PreemptionFlag:
        self._installed = contextlib.ExitStack()
        self._installed.enter_context(SIGNALS.installed())
        return self

    def __exit__(self, *exc_info) -> None:
        self.say_what_arrived()
        if self._installed is not None:
            self._installed.close()
            self._installed = None

    def starting_at(self, step: int) -> None:
        SIGNALS.starting_at(step)

    def defer(self) -> None:
        """A step is done: a signal from now on stops the run at a step boundary."""
        SIGNALS.defer()

    def trained(self, step: int) -> None:
        """Training is over, every checkpoint on disk: a signal stops the run at once again."""
        SIGNALS.trained(step)

    @property
    def requested(self) -> bool:
        return SIGNALS.requested

    @requested.setter
    def requested(self, value: bool) -> None:  # tests stop the loop the way a signal does
        SIGNALS.requested = value

    @property
    def interrupted(self) -> bool:
        return SIGNALS.interrupted

    def say_what_arrived(self) -> None:
        while SIGNALS.notes:
            log.warning(SIGNALS.notes.pop(0))

    def stop(self, step: int) -> Preempted:
        """The exception that ends the run once the checkpoint at `step` is saved."""
        self.say_what_arrived()
        kind = Interrupted if SIGNALS.interrupted else Preempted
        how = "interrupted (Ctrl-C)" if SIGNALS.interrupted else "preempted"
        return kind(f"{how} at step {step}; resume with resume=auto")

    def agreed(self, every_step: bool = True) -> bool:
        """True when any rank was asked to stop: the signal may reach ranks at different steps,
        so they stop together or not at all. Under DDP agreeing is a collective and a host read,
        so the loop asks only at log lines (every_step=False in between)."""
        if SIGNALS.notes:
            self.say_what_arrived()
        if not self.dist.enabled:
            return SIGNALS.requested
        if not every_step:
            return False
        import torch

        from kiln.engine.distributed import all_reduce_sum

        flag = torch.tensor(float(SIGNALS.requested), device=self.device)
        return bool(all_reduce_sum(flag) > 0)
