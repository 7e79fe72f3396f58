"""eval/confusion_matrix.png: true classes down, predicted across, each cell's count written in
it and coloured by its share of the true class (the row), so a rare class's mistakes show as
plainly as a common one's. The figure and its fonts scale with the class count, so 50 class
names stay readable (x labels rotated)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.atomic import atomic_file

CELL_INCHES = 0.36  # per class: room for a 4-digit count at the smallest font
MIN_SIDE_INCHES = 6.0
MAX_NAME_CHARS = 28  # longer class names are shortened with "..." (the full ones are in JSON)
DPI = 100


def font_sizes(num_classes: int) -> tuple[float, float]:
    """(tick label size, cell count size) in points: smaller as classes grow, never below 8 and
    7 (a cell is CELL_INCHES = 36 px at DPI: room for an 8-point name and a 4-digit count)."""
    tick = float(np.clip(13 - num_classes / 10, 8, 11))
    count = float(np.clip(11 - num_classes / 12, 7, 10))
    return tick, count


def short_name(name: str) -> str:
    return name if len(name) <= MAX_NAME_CHARS else name[: MAX_NAME_CHARS - 3] + "..."


def confusion_figure(counts: np.ndarray, class_names: list[str], title: str):
    """The matplotlib Figure (not yet saved): counts (K, K), rows true, columns predicted."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    k = len(class_names)
    longest = max(len(short_name(n)) for n in class_names)
    tick_size, count_size = font_sizes(k)
    # The names take room beside the cells: about 0.6 of a point-size per character.
    margin = longest * tick_size * 0.6 / 72 + 1.2
    side = max(MIN_SIDE_INCHES, k * CELL_INCHES + margin)
    figure, axis = plt.subplots(figsize=(side + 1.2, side), dpi=DPI, layout="constrained")
    totals = counts.sum(axis=1, keepdims=True)
    shares = np.divide(counts, totals, out=np.zeros(counts.shape, float), where=totals > 0)
    image = axis.imshow(
        shares, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto"
    )
    bar = figure.colorbar(image, ax=axis, fraction=0.04, pad=0.02)
    bar.set_label("share of the true class (row)")
    names = [short_name(n) for n in class_names]
    axis.set_xticks(
        range(k),
        names,
        rotation=90 if k > 8 else 45,
        ha="center" if k > 8 else "right",
        fontsize=tick_size,
    )
    axis.set_yticks(range(k), names, fontsize=tick_size)
    axis.set_xlabel("predicted")
    axis.set_ylabel("true")
    axis.set_title(title)
    for row, col in zip(*np.nonzero(counts), strict=True):  # zeros stay blank: less clutter
        colour = "white" if shares[row, col] > 0.5 else "black"
        axis.text(
            col,
            row,
            str(counts[row, col]),
            ha="center",
            va="center",
            color=colour,
            fontsize=count_size,
        )
    return figure


def write_confusion_matrix(counts: np.ndarray, class_names: list[str], path: Path, title: str):
    import matplotlib.pyplot as plt

    figure = confusion_figure(counts, class_names, title)
    with atomic_file(path) as f:  # a viewer never sees half a file
        figure.savefig(f, format="png", dpi=DPI)
    plt.close(figure)
    return path


def write_per_class_bars(per_class: dict[str, dict], path: Path, title: str) -> Path:
    """eval/per_class.png of a multi-label model (which has no confusion matrix: a sample's
    classes are judged one by one): precision, recall and F1 per class, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(per_class)
    x = np.arange(len(names))
    figure, axis = plt.subplots(
        figsize=(max(6.0, 0.5 * len(names) + 2), 4), dpi=DPI, layout="constrained"
    )
    for offset, key in ((-0.27, "precision"), (0.0, "recall"), (0.27, "f1")):
        axis.bar(x + offset, [per_class[n][key] for n in names], 0.27, label=key)
    axis.set_xticks(
        x,
        [short_name(n) for n in names],
        rotation=45 if len(names) > 6 else 0,
        ha="right" if len(names) > 6 else "center",
    )
    axis.set_ylim(0, 1)
    axis.set_title(title, fontsize=10)
    axis.legend()
    with atomic_file(path) as f:
        figure.savefig(f, format="png", dpi=DPI)
    plt.close(figure)
    return path
