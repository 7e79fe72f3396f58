"""<run>/curves.png: a run's curves against optimizer step: training and validation loss, the
learning rate, the grad norm (each step's largest in the interval too), and the validation
metrics. Redrawn as the run goes (at an evaluation, off the training thread, rarely enough that the
interpreter lock the drawing holds costs the steps about 2%) and at its end."""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

from kiln.errors import DiskFullError, disk_full, is_disk_full

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


def draw(history: list[dict], path: Path, title: str) -> Path | None:
    """Write the figure; None when there is nothing to draw yet."""
    if not any("loss" in m for m in history):
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
            metrics.annotate(f"{values[-1]:.4g}", (steps[-1], values[-1]), ha="right",
                             va="top", textcoords="offset points", xytext=(-4, -6))  # fmt: skip
    metrics.set_title("validation metrics" if val_metrics else "validation metrics (none yet)")
    if val_metrics:
        metrics.legend()
    for axis in axes.flat:
        axis.set_xlabel("optimizer step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        figure.savefig(tmp, dpi=90)
    except OSError as err:
        if is_disk_full(err):
            tmp.unlink(missing_ok=True)
            raise disk_full(path) from None
        raise
    tmp.replace(path)  # a viewer never sees half a file
    return path


class CurvesFile:
    """curves.png as the run goes: an evaluation starts a redraw on a thread of its own (one at a
    time, the first FIRST_DRAW_AFTER_S into the run, each next one 1/DRAW_SHARE times the last
    one's duration later), so the step's thread never waits for a picture; `finish` draws the
    whole run on the caller's thread."""

    def __init__(self, path: Path, title: str):
        self.path, self.title = path, title
        self.due_at = time.monotonic() + FIRST_DRAW_AFTER_S
        self._drawing: threading.Thread | None = None
        self._failure: BaseException | None = None  # a background draw's, raised on our thread

    def update(self, history: list[dict]) -> None:
        self._raise_failure()
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
        if self._drawing is not None:
            self._drawing.join()
        self._raise_failure()
        draw(history, self.path, self.title)

    def _draw_in_background(self, history: list[dict]) -> None:
        started = time.monotonic()
        try:
            draw(history, self.path, self.title)
        except BaseException as err:  # noqa: BLE001 -- handed to the caller's thread
            self._failure = err
        finally:
            took = time.monotonic() - started
            self.due_at = time.monotonic() + max(MIN_SECONDS_BETWEEN_DRAWS, took / DRAW_SHARE)

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if isinstance(failure, DiskFullError):  # a full disk ends the run, whatever write found it
            raise failure
        if failure is not None:  # a picture must never be why a run fails
            log.warning("could not draw %s: %s: %s", self.path, type(failure).__name__, failure)
