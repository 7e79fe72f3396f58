"""SIGTERM/SIGUSR1 ask the run to stop: the loop checkpoints at the next step boundary and exits
with code 75 (requeue with resume=auto). Ctrl-C (SIGINT) is the same preemption, reported as an
interruption (exit 130); a second Ctrl-C stops at once (KeyboardInterrupt, no checkpoint at that
step). Under DDP the ranks agree before anyone stops."""

from __future__ import annotations

import contextlib
import logging
import signal

import torch

from kiln.engine.distributed import DistInfo, all_reduce_sum

log = logging.getLogger(__name__)

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):  # noqa: N818  (a control-flow signal, not an error)
    """A preemption signal arrived; a checkpoint was saved at the step boundary."""


class Interrupted(Preempted):
    """Ctrl-C: a preemption the user asked for at the keyboard."""


class PreemptionFlag:
    """Installs the signal handlers for the duration of a `with` block."""

    def __init__(self, dist: DistInfo, device: torch.device):
        self.dist, self.device = dist, device
        self.requested = False
        self.interrupted = False  # the request came from Ctrl-C
        self._previous: dict = {}
        self._notes: list[str] = []  # what the handlers saw, logged by the loop

    def __enter__(self) -> PreemptionFlag:
        with contextlib.suppress(ValueError):  # not in the main thread: no handlers
            for sig in PREEMPT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._request)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def __exit__(self, *exc_info) -> None:
        self.say_what_arrived()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    # The handlers log nothing themselves: one runs between two bytecodes of the main thread,
    # perhaps in the middle of a log line's write to the same stream, and writing there fails
    # ("reentrant call inside <_io.BufferedWriter>", printed as a logging error). The loop
    # says what they saw at its next check (`agreed`).
    def _request(self, signum, frame) -> None:
        self._notes.append(f"received signal {signum}: checkpointing at the next step boundary")
        self.requested = True

    def _interrupt(self, signum, frame) -> None:
        if self.interrupted:  # the second Ctrl-C: stop now, wherever the run is
            raise KeyboardInterrupt
        self._notes.append(
            "Ctrl-C: checkpointing at the next step boundary (Ctrl-C again stops at once)"
        )
        self.interrupted = self.requested = True

    def say_what_arrived(self) -> None:
        while self._notes:
            log.warning(self._notes.pop(0))

    def stop(self, step: int) -> Preempted:
        """The exception that ends the run once the checkpoint at `step` is saved."""
        self.say_what_arrived()
        kind = Interrupted if self.interrupted else Preempted
        how = "interrupted (Ctrl-C)" if self.interrupted else "preempted"
        return kind(f"{how} at step {step}; resume with resume=auto")

    def agreed(self, every_step: bool = True) -> bool:
        """True when any rank was asked to stop: the signal may reach ranks at different steps,
        so they stop together or not at all. Under DDP agreeing is a collective and a host read,
        so the loop asks only at log lines (every_step=False in between)."""
        if self._notes:
            self.say_what_arrived()
        if not self.dist.enabled:
            return self.requested
        if not every_step:
            return False
        flag = torch.tensor(float(self.requested), device=self.device)
        return bool(all_reduce_sum(flag) > 0)
