"""<run>/curves.png: a run's curves against optimizer step: training and validation loss, the
learning rate, the grad norm (each step's largest in the interval too), and the validation
metrics. Redrawn as the run goes (at an evaluation, off the training thread) and at its end.

A run started from the command line draws in a painter process started with it
(`start_painter`): matplotlib's import (0.3-0.7 s) and every draw (0.15 s and up) run beside the
run, on another core, and never hold its interpreter lock. The painter imports matplotlib when
the run logs its first training loss (`Painter.warm`): a run refused at start-up or stopped
before its first step neither pays for the import nor waits for it at its exit. Elsewhere (a
run inside a Python session, or when the painter is gone) a thread of the run draws, rarely
enough that the lock it holds costs the steps about 2%."""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from kiln.atomic import atomic_file
from kiln.errors import DiskFullError, disk_full

log = logging.getLogger(__name__)

FIRST_DRAW_AFTER_S = 10.0  # a run of seconds draws once, at its end: a redraw before is thrown away
MIN_SECONDS_BETWEEN_DRAWS = 5.0
# The drawing thread takes the interpreter lock from the steps' thread while it draws (0.3-0.8 s
# a picture, matplotlib's import the first time): the next redraw waits 1/DRAW_SHARE times as long.
DRAW_SHARE = 0.02


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [
        (m["step"], float(m[key]))
        for m in history
        if isinstance(m.get(key), int | float) and math.isfinite(float(m[key]))
    ]
    return [p[0] for p in points], [p[1] for p in points]


def drawable(history: list[dict]) -> bool:
    """Whether there is anything to draw yet: a row with a training loss."""
    return any("loss" in m for m in history)


def draw(history: list[dict], path: Path, title: str) -> Path | None:
    """Write the figure; None when there is nothing to draw yet."""
    if not drawable(history):
        return None
    # The Figure API, not pyplot: no GUI backend to pick (files only, any thread), no global
    # figure registry to close, and a second less to import.
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, MaxNLocator

    val_metrics = sorted(
        {k for m in history for k in m if k.startswith("val_") and k != "val_loss"}
    )
    # Fixed margins: the constrained layout engine took over half of every draw.
    figure = Figure(figsize=(11, 7))
    figure.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.9, wspace=0.22, hspace=0.4)
    axes = figure.subplots(2, 2)
    loss, lr, norm, metrics = axes.flat
    loss.plot(*_series(history, "loss"), label="train loss (interval mean)")
    if _series(history, "val_loss")[0]:
        loss.plot(*_series(history, "val_loss"), "o-", label="val_loss")
    loss.set_title("loss")
    loss.legend()
    lr.plot(*_series(history, "lr"), color="tab:green")
    lr.set_title("learning rate (the value each step used)")
    lr.yaxis.set_major_formatter(EngFormatter())
    steps, norms = _series(history, "grad_norm_max")
    if norms:
        norm.plot(steps, norms, color="tab:red", label="largest in the interval")
    norm.plot(*_series(history, "grad_norm"), color="tab:orange", label="at the log line")
    if norms and max(norms) > 50 * max(min(norms), 1e-12):
        norm.set_yscale("log")  # so an explosion and the normal range both stay readable
    norm.set_title("grad norm (before clipping)")
    norm.legend()
    for name in val_metrics:
        steps, values = _series(history, name)
        metrics.plot(steps, values, "o-", label=name)
        if values:
            # Below-left of the last point: inside the axes whatever the scale.
            metrics.annotate(
                f"{values[-1]:.4g}",
                (steps[-1], values[-1]),
                ha="right",
                va="top",
                textcoords="offset points",
                xytext=(-4, -6),
            )
    metrics.set_title("validation metrics" if val_metrics else "validation metrics (none yet)")
    if val_metrics:
        metrics.legend()
    for axis in axes.flat:
        axis.set_xlabel("optimizer step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    with atomic_file(path) as f:  # a viewer never sees half a file
        figure.savefig(f, format="png", dpi=90)
    return path


KILN_ROOT = str(Path(__file__).resolve().parents[2])  # where `import kiln` finds this kiln


class Painter:
    """A process that draws curves.png files for this one: one job at a time, a line of JSON
    each way. A job names the file and sends the history rows the painter does not have yet
    (rows never change once appended); the answer says drawn, a full disk, or another error."""

    def __init__(self):
        paths = os.environ.get("PYTHONPATH", "")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kiln.logging.curves"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            # Its own session: a Ctrl-C at the terminal is the run's to handle, and the run
            # still wants its last picture after one.
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (KILN_ROOT, paths)))},
        )
        # path: (its first row, rows sent); one path, as the painter keeps one run's rows
        self.sent: dict[str, tuple[object, int]] = {}
        self.busy = False
        self.warmed = False

    def warm(self) -> None:
        """Have it import matplotlib now, ahead of the first job (no answer comes)."""
        if not self.warmed:
            self.process.stdin.write(json.dumps({"warm": True}) + "\n")
            self.process.stdin.flush()
            self.warmed = True

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, history: list[dict], path: Path, title: str) -> None:
        if str(path) not in self.sent:  # another run: the painter forgets the last one
            self.sent.clear()
        first, count = self.sent.get(str(path), (None, 0))
        if not history or history[0] is not first or count > len(history):
            count = 0  # a new file, or rows put before the ones sent (a resumed run's past)
        job = {"path": str(path), "title": title, "from": count, "rows": history[count:]}
        self.process.stdin.write(json.dumps(job, default=str) + "\n")
        self.process.stdin.flush()
        self.sent[str(path)] = (history[0] if history else None, len(history))
        self.busy = True

    def answer(self, timeout: float | None) -> dict | None:
        """The answer to the job sent, or None when none came in `timeout` s (None: wait)."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.process.stdout.readline()
        if not line:
            raise BrokenPipeError("the painter process ended")
        self.busy = False
        return json.loads(line)

    def close(self) -> None:
        try:
            self.process.stdin.close()  # it ends at the end of its input
            self.process.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()


_painter: Painter | None = None


def start_painter() -> None:
    """Start this process's painter (once; a no-op where select cannot wait on a pipe)."""
    global _painter
    if _painter is None and os.name == "posix":
        try:
            _painter = Painter()
        except OSError as err:
            log.debug("no painter process (%s): curves.png is drawn on a thread", err)
            return
        atexit.register(_painter.close)


def _failure_of(answer: dict, path: Path) -> BaseException | None:
    if answer.get("disk_full"):
        return disk_full(path)
    if answer.get("error"):
        return RuntimeError(answer["error"])
    return None


class CurvesFile:
    """curves.png as the run goes: an evaluation starts a redraw in the painter process, or on
    a thread of its own (one at a time, the first FIRST_DRAW_AFTER_S into the run, each next one
    1/DRAW_SHARE times the last one's duration later), so the step's thread never waits for a
    picture; `finish` draws the whole run before it returns."""

    # The longest `finish` waits for the painter before drawing here instead.
    PAINTER_WAIT_S = 120.0

    def __init__(self, path: Path, title: str, painter: Painter | None = None):
        """`painter`: the process that draws (default: this process's, if started and alive;
        else a thread)."""
        self.path, self.title = path, title
        self.due_at = time.monotonic() + FIRST_DRAW_AFTER_S
        self._drawing: threading.Thread | None = None
        self._failure: BaseException | None = None  # a background draw's, raised on our thread
        painter = painter or _painter
        self._painter = painter if painter is not None and painter.alive() else None
        self._sent_at = 0.0

    def update(self, history: list[dict]) -> None:
        self._raise_failure()
        if self._painter is not None:
            self._paint(history, wait=False)
            return
        now = time.monotonic()
        busy = self._drawing is not None and self._drawing.is_alive()
        if busy or now < self.due_at:
            return
        # A copy of the list: the step's thread appends to it while the picture is drawn (the
        # entries themselves are never changed once appended).
        self._drawing = threading.Thread(
            target=self._draw_in_background, args=(list(history),), name="kiln-curves", daemon=True
        )
        self._drawing.start()

    def finish(self, history: list[dict], draw_now: bool = True) -> None:
        """At the end: waits for a redraw in progress, then draws the whole run (`draw_now`);
        without `draw_now` (a second Ctrl-C) it waits for nothing."""
        if not draw_now:
            return
        if self._painter is not None and self._paint(history, wait=True):
            self._raise_failure()
            return
        if self._drawing is not None:
            self._drawing.join()
        self._raise_failure()
        draw(history, self.path, self.title)

    def _paint(self, history: list[dict], wait: bool) -> bool:
        """The painter's part: collect its answer, send the next job when due (at once when
        `wait`, then wait for it). False when the painter is gone (the thread takes over)."""
        painter = self._painter
        try:
            if not painter.warmed and drawable(history):
                painter.warm()  # matplotlib's import, while the run goes on
            if painter.busy:
                self._collect(wait)
            if painter.busy:  # still drawing
                return True
            if not history or not (wait or time.monotonic() >= self.due_at):
                return True
            self._sent_at = time.monotonic()
            painter.send(history, self.path, self.title)
            if wait:
                self._collect(wait)
            return True
        except (OSError, ValueError) as err:  # it ended, or its pipe did
            log.debug("the painter process is gone (%s): curves.png is drawn on a thread", err)
            self._painter = None
            return False

    def _collect(self, wait: bool) -> None:
        """The painter's answer, if in (waiting for it when `wait`: stuck, it raises)."""
        answer = self._painter.answer(self.PAINTER_WAIT_S if wait else 0)
        if answer is None:
            if wait:  # stuck: drawn here instead
                raise TimeoutError(f"no answer in {self.PAINTER_WAIT_S:.0f} s")
            return
        self._next_draw_after(time.monotonic() - self._sent_at)
        self._failure = _failure_of(answer, self.path) or self._failure

    def _next_draw_after(self, took: float) -> None:
        self.due_at = time.monotonic() + max(MIN_SECONDS_BETWEEN_DRAWS, took / DRAW_SHARE)

    def _draw_in_background(self, history: list[dict]) -> None:
        started = time.monotonic()
        try:
            draw(history, self.path, self.title)
        except BaseException as err:  # noqa: BLE001 -- handed to the caller's thread
            self._failure = err
        finally:
            self._next_draw_after(time.monotonic() - started)

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if isinstance(failure, DiskFullError):  # a full disk ends the run, whatever write found it
            raise failure
        if failure is not None:  # a picture must never be why a run fails
            log.warning("could not draw %s: %s: %s", self.path, type(failure).__name__, failure)


def paint_jobs() -> None:
    """The painter process: jobs from stdin, answers to stdout, until stdin ends."""
    os.nice(5)  # behind the run it draws for, on a busy machine
    histories: dict[str, list[dict]] = {}
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("warm"):  # the run has a first row: the import, paid before the first job
            from matplotlib.figure import Figure  # noqa: F401

            continue
        if job["path"] not in histories:  # another run's file: the last run's rows go
            histories.clear()
        history = histories.setdefault(job["path"], [])
        del history[job["from"] :]
        history.extend(job["rows"])
        try:
            draw(history, Path(job["path"]), job["title"])
            answer = {}
        except DiskFullError:
            answer = {"disk_full": True}
        except Exception as err:  # noqa: BLE001 -- reported to the run, which carries on
            answer = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(answer), flush=True)
    # Nothing is left to write: an interpreter's teardown with matplotlib loaded (0.15 s) would
    # only keep the run, which waits for this process to end, from ending.
    os._exit(0)


if __name__ == "__main__":
    paint_jobs()
