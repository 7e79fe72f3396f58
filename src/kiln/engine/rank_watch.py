"""Under DDP a run ends in one [FAIL] line, summary.json and failures.log however a rank stops:
also when the main rank's own thread is stuck in a collective that will never complete (a peer
raised before reaching it, or died in C++: gloo aborts the whole process on a collective
mismatch, and no Python handler runs there).

Each rank runs a RankWatch thread beside training. Through the process group's store (TCPStore:
its client serialises operations, so a second thread may use it) every rank beats a heartbeat,
and a rank that fails posts why before it stops (`post_failure`). The lowest live rank's watch:

- reports a failure another rank posted, when its own thread has not reported within a moment
  (it is waiting in a collective the failed rank will never join);
- after SIGTERM (torchrun stops every worker once one died), reports a stopped run when its own
  thread has not moved for STALL_S (it is stuck in a collective): "rank N stopped", naming the
  ranks whose heartbeat ended.

Any rank's watch also ends its rank when a peer stopped before step 1 (`post_stop`: a
preemption, kiln.engine.preemption), as that peer did: this rank may wait for it in a
collective of the probes or of the first step, and nothing was trained.

Then it leaves at once (os._exit), as it does on SIGTERM once the run is reported: the stuck
thread would only wait for torchrun's SIGKILL. One report per run: the first to claim it
(`claim_report`, shared with the main thread's own failure path) writes it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from kiln.engine.distributed import DistInfo, group_store
from kiln.engine.preemption import SIGNALS, PreemptedBeforeStart

log = logging.getLogger(__name__)

POLL_S = 1.0  # between two looks at the store
STALL_S = 10.0  # a thread whose Python frame has not moved this long is stuck in C++
ANSWER_S = 3.0  # how long the main thread may take to report a peer's failure itself
DEAD_S = 5.0  # a heartbeat older than this: the rank is gone
EXIT_FAILED = 1

_claim = threading.Lock()
_claimed = False


def reporting_failure() -> None:
    """The run is failing: its report is written from here on, and a stop signal waits for it
    (kiln.engine.preemption): torchrun sends SIGTERM to every rank once one died, often while
    the main rank writes the [FAIL] line and summary.json."""
    SIGNALS.reporting_failure()


def open_report() -> None:
    """A new run in this process (each job of a Hydra multirun): its report is unclaimed."""
    global _claimed
    with _claim:
        _claimed = False


def claim_report() -> bool:
    """True for the first caller in this process (the one that writes the run's report)."""
    global _claimed
    with _claim:
        if _claimed:
            return False
        _claimed = True
        return True


def post_stop(dist: DistInfo, stop: PreemptedBeforeStart) -> None:
    """Tell the other ranks this rank stopped before step 1: one that had begun step 1 waits in
    its first collective for this rank; its watch ends it the same way (nothing was trained)."""
    store = group_store()
    if store is None or not dist.enabled:
        return
    with contextlib.suppress(Exception):  # the store went away: nobody left to tell
        store.set(f"kiln/stopped/{dist.rank}", stop.status)


class RankFailed(RuntimeError):
    """A failure another rank posted, or a rank that stopped without a word."""

    def __init__(self, message: str, what: str, step: int):
        super().__init__(message)
        self.what, self.step = what, step


def post_failure(dist: DistInfo, what: str, message: str) -> None:
    """Tell the other ranks why this rank stops (before it raises)."""
    store = group_store()
    if store is None or not dist.enabled:
        return
    with contextlib.suppress(Exception):
        store.set(f"kiln/failed/{dist.rank}", f"{what}\n{message}")


class RankWatch:
    """The watch thread of one rank (a no-op on one process). `step()` reads the step in
    progress; `report(err)` writes the run's failure record (summary.json, the [FAIL] line,
    failures.log) for `err`, a RankFailed."""

    def __init__(
        self,
        dist: DistInfo,
        step: Callable[[], int],
        report: Callable[[BaseException], None],
    ):
        self.dist, self.step, self.report = dist, step, report
        self.stop = threading.Event()
        self.main_thread = threading.main_thread().ident
        self.thread: threading.Thread | None = None

    def __enter__(self) -> RankWatch:
        if not self.dist.enabled or group_store() is None:
            return self
        self.thread = threading.Thread(target=self._run, name="kiln-rank-watch", daemon=True)
        self.thread.start()
        SIGNALS.ranks_watched = True  # a rank held in a collective is this watch's to end
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        SIGNALS.ranks_watched = False
        if self.thread is not None:
            self.thread.join(timeout=2 * POLL_S)

    # ------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        store, rank, world = group_store(), self.dist.rank, self.dist.world_size
        sigterm_at, frame, still_since = None, None, time.monotonic()
        posted_at: dict[int, float] = {}
        while not self.stop.wait(POLL_S):
            now = time.monotonic()
            try:
                store.set(f"kiln/alive/{rank}", str(time.time()))
                self._stop_with_a_peer(store, world)
                if sigterm_at is None and self._sigterm():
                    sigterm_at = now
                current = self._main_frame()
                if current != frame:
                    frame, still_since = current, now
                stuck = now - still_since >= STALL_S
                if sigterm_at is not None and store.check(["kiln/reported"]):
                    os._exit(EXIT_FAILED)  # reported: waiting for a collective helps no one
                if not self._reporter(store, world):
                    continue
                for other in range(world):
                    key = f"kiln/failed/{other}"
                    if other == rank or not store.check([key]):
                        continue
                    posted_at.setdefault(other, now)
                    if now - posted_at[other] >= ANSWER_S:  # this rank's thread did not answer
                        what, _, message = store.get(key).decode().partition("\n")
                        failed = RankFailed(f"rank {other}: {message}", what, self.step())
                        self._report(store, failed)
                if sigterm_at is not None and stuck:
                    gone = self._gone(store, world)
                    message = (
                        f"torchrun stopped the run while rank {rank} waited in a collective at "
                        f"step {self.step()}: rank(s) {', '.join(map(str, gone)) or '?'} stopped "
                        "without a word (their own output above says why: a collective mismatch "
                        "aborts gloo; a parameter used only in some steps mismatches the "
                        "gradient reduction, see trainer.find_unused_parameters)"
                    )
                    what = f"rank {gone[0]} stopped" if gone else "a rank stopped"
                    self._report(store, RankFailed(message, what, self.step()))
            except Exception as err:  # noqa: BLE001 -- the store went away: nothing to watch
                log.debug("rank watch: %s: %s", type(err).__name__, err)
                return

    def _report(self, store, err: RankFailed) -> None:
        """Write the run's report and leave; when this process's own thread already claimed it
        (it is reporting its own failure), leave that to it."""
        if not claim_report():
            self.stop.set()
            return
        try:
            self.report(err)
        finally:
            with contextlib.suppress(Exception):
                store.set("kiln/reported", "1")
            sys.stderr.flush()
            os._exit(EXIT_FAILED)

    def _stop_with_a_peer(self, store, world: int) -> None:
        """A peer stopped before step 1 (post_stop): this rank, which may wait for it in a
        collective, ends as it would have (unless its own thread is already on its way)."""
        for other in range(world):
            key = f"kiln/stopped/{other}"
            if other != self.dist.rank and store.check([key]):
                SIGNALS.end_now(SIGNALS.stop_now(store.get(key).decode() == "interrupted"))

    @staticmethod
    def _sigterm() -> bool:
        """Whether SIGTERM (the one torchrun sends) arrived: seen by the stop signals' watch as
        it arrives, also while the main thread is held in a collective."""
        return signal.SIGTERM in SIGNALS.seen

    def _main_frame(self):
        frame = sys._current_frames().get(self.main_thread)
        return (id(frame), frame.f_lasti) if frame is not None else None

    def _reporter(self, store, world: int) -> bool:
        """Whether this rank is the lowest one still alive (the main rank while it lives)."""
        return all(other in self._gone(store, world) for other in range(self.dist.rank))

    @staticmethod
    def _gone(store, world: int) -> list[int]:
        now, gone = time.time(), []
        for other in range(world):
            key = f"kiln/alive/{other}"
            if store.check([key]) and now - float(store.get(key).decode()) > DEAD_S:
                gone.append(other)
        return gone
