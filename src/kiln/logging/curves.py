"""<run>/curves.png: a run's curves against optimizer step: training and validation loss, the
learning rate, the grad norm (each step's largest in the interval too), and the validation
metrics. Redrawn as the run goes (at each evaluation, at most every few seconds) and at its end."""

from __future__ import annotations

import math
import time
from pathlib import Path

from kiln.errors import disk_full, is_disk_full

MIN_SECONDS_BETWEEN_DRAWS = 5.0


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
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    val_metrics = sorted(
        {k for m in history for k in m if k.startswith("val_") and k != "val_loss"}
    )
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
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
    finally:
        plt.close(figure)
    tmp.replace(path)  # a viewer never sees half a file
    return path


class CurvesFile:
    """Redraws curves.png when an evaluation arrives (throttled) and when asked at the end."""

    def __init__(self, path: Path, title: str):
        self.path, self.title = path, title
        self.drawn_at = 0.0

    def update(self, history: list[dict], force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.drawn_at >= MIN_SECONDS_BETWEEN_DRAWS:
            draw(history, self.path, self.title)
            self.drawn_at = now
