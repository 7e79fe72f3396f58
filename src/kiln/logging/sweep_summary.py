"""Summarise a Hydra multirun: one row per run, one column per swept key, then the run's metrics.

A run directory is any directory under the sweep holding `summary.json` or `.hydra/config.yaml`.
A run that died before writing summary.json still gets a row: status "failed", error
"no summary.json". Override keys whose value is the same in every run (e.g. the
trainer.max_epochs=1 that `make sweep` passes to all) are not swept and are left out.

    python scripts/summarize_sweep.py multirun/2026-01-01/12-00-00
    -> prints the table, writes summary.md and summary.png into that directory
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from kiln.atomic import atomic_file, write_text
from kiln.commands import infer, plugin_override, run_config, shown
from kiln.logging.summary import SUMMARY_FILE, SUMMARY_KEYS, read_summary
from kiln.sorting import natural_key

OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
CONFIG_FILE = Path(".hydra") / "config.yaml"
METRIC_COLUMNS = list(SUMMARY_KEYS)
# The "final metric" plotted per run: the first of these a sweep reports.
FINAL_METRICS = ("val_acc", "val_map50", "val_loss")


def find_run_dirs(sweep_dir: Path) -> list[Path]:
    """Run directories under `sweep_dir` in natural order (2 before 10)."""
    markers = [*sweep_dir.rglob(SUMMARY_FILE), *sweep_dir.rglob(str(CONFIG_FILE))]
    run_dirs = {
        marker.parent if marker.name == SUMMARY_FILE else marker.parent.parent for marker in markers
    }
    return sorted(run_dirs, key=lambda path: natural_key(path.relative_to(sweep_dir).as_posix()))


def read_overrides(run_dir: Path) -> dict[str, str]:
    """The run's command-line overrides ("key=value" strings) as {key: value}."""
    path = run_dir / OVERRIDES_FILE
    if not path.is_file():
        return {}
    overrides = {}
    for item in yaml.safe_load(path.read_text()) or []:
        key, _, value = str(item).partition("=")
        overrides[key.lstrip("+~")] = value  # "+key" / "++key" add keys; same column
    return overrides


def collect_runs(sweep_dir: str | Path) -> pd.DataFrame:
    """One row per run: `run` (its path in the sweep), the swept keys, then METRIC_COLUMNS and any
    other keys the summaries hold."""
    sweep_dir = Path(sweep_dir)
    rows, override_keys, extra_keys = [], {}, {}
    for run_dir in find_run_dirs(sweep_dir):
        overrides = read_overrides(run_dir)
        summary = read_summary(run_dir)
        override_keys.update(dict.fromkeys(overrides))
        extra_keys.update(dict.fromkeys(k for k in summary if k not in METRIC_COLUMNS))
        rows.append({"run": run_dir.relative_to(sweep_dir).as_posix(), **overrides, **summary})
    swept = [key for key in override_keys if _varies(rows, key)]
    columns = ["run", *swept, *METRIC_COLUMNS, *extra_keys]
    frame = pd.DataFrame(rows, columns=columns)
    frame["status"] = frame["status"].fillna("failed")
    return frame


def _varies(rows: list[dict[str, Any]], key: str) -> bool:
    # With one run there is nothing to compare against: keep every override.
    return len(rows) < 2 or len({str(row.get(key)) for row in rows}) > 1


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):  # steps read back as float when a failed run has none
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"
    text = str(value)
    if len(text) > 8:  # a sampled 0.0016834549246003507 reads as 0.001683; other text stays
        text = _short(text)
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table (pandas' to_markdown would need tabulate)."""
    lines = [
        "| " + " | ".join(str(column) for column in frame.columns) + " |",
        "|" + "|".join("---" for _ in frame.columns) + "|",
    ]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(value) for value in row) + " |")
    return "\n".join(lines) + "\n"


def swept_columns(frame: pd.DataFrame) -> list[str]:
    """The swept override keys: collect_runs puts them between `run` and `status`."""
    return list(frame.columns[1 : frame.columns.get_loc("status")])


def _bar_value(value: float) -> str:
    """43,995 rather than 4.399e+04; 0.9694 for metrics."""
    return f"{value:,.0f}" if abs(value) >= 10_000 else f"{value:.4g}"


def _short(value: Any) -> str:
    """A setting as a label: numbers to 4 significant digits (1e-03 not 0.0010000000000000002)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f"{number:.4g}"


def run_labels(frame: pd.DataFrame) -> list[str]:
    """A short label per run: its swept settings, or its directory when nothing was swept."""
    swept = swept_columns(frame)
    labels = []
    for _, row in frame.iterrows():
        parts = [
            f"{key.rsplit('.', 1)[-1]}={_short(row[key])}" for key in swept if pd.notna(row[key])
        ]
        labels.append(", ".join(parts) or str(row["run"]))
    return labels


def final_metric(frame: pd.DataFrame) -> str | None:
    for name in FINAL_METRICS:
        if name in frame.columns and frame[name].notna().any():
            return name
    return None


# Runs that trained to their end: a run at chance (status at_chance) has real metrics and
# checkpoints, it is ranked with the rest; failed, interrupted and preempted runs are not.
FINISHED = ("ok", "at_chance")


def finished(frame: pd.DataFrame) -> pd.Series:
    return frame["status"].isin(FINISHED)


def best_index(frame: pd.DataFrame, metric: str | None) -> int | None:
    """The row of the best finished run (loss-like metrics: the smallest)."""
    if metric is None:
        return None
    values = pd.to_numeric(frame[metric], errors="coerce").where(finished(frame))
    if values.notna().sum() == 0:
        return None
    return int(values.idxmin() if metric.endswith("loss") else values.idxmax())


def _axis_range(values: pd.Series) -> tuple[float, float] | None:
    """Limits that show the differences: not from 0 when the values sit close together."""
    finite = values.dropna()
    if finite.empty:
        return None
    low, high = float(finite.min()), float(finite.max())
    spread = high - low or abs(high) * 0.05 or 1.0
    if low >= 0 and low < 0.5 * high:  # far apart: 0 is an honest origin
        return 0.0, high + 0.15 * spread
    return low - 0.6 * spread, high + 0.35 * spread


def plot_summary(frame: pd.DataFrame, path: Path) -> None:
    """Horizontal bars per run: throughput, data-time fraction and the final metric, with each
    value written on its bar and the best run (by the final metric) marked."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    metric = final_metric(frame)
    panels = [("samples_per_s", "samples/s"), ("data_time_frac", "data-time fraction")]
    if metric:
        panels.append((metric, metric))
    best = best_index(frame, metric)
    labels = [("★ " if i == best else "") + label for i, label in enumerate(run_labels(frame))]
    failed = ~finished(frame)
    height = max(2.8, 0.5 * len(frame) + 1.4)
    figure, axes = plt.subplots(
        1, len(panels), figsize=(5.2 * len(panels), height), sharey=True, squeeze=False
    )
    for axis, (column, title) in zip(axes[0], panels, strict=True):
        values = pd.to_numeric(frame[column], errors="coerce")
        colours = [
            "tab:red" if bad else ("tab:green" if i == best else "tab:blue")
            for i, bad in enumerate(failed)
        ]
        limits = _axis_range(values)
        base = limits[0] if limits else 0.0
        axis.barh(range(len(frame)), (values - base).fillna(0.0), left=base, color=colours)
        for y, (value, bad) in enumerate(zip(values, failed, strict=True)):
            if pd.isna(value):
                axis.text(base, y, " failed" if bad else " n/a", va="center", color="tab:red")
            else:
                axis.text(value, y, f" {_bar_value(value)}", va="center", fontsize=9)
        if limits:
            axis.set_xlim(limits[0], limits[1] + 0.12 * (limits[1] - limits[0]))
        axis.set_title(title + (" (★ best)" if column == metric and best is not None else ""))
        axis.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(frame)), labels)
    axes[0][0].invert_yaxis()  # first run on top, as in the table
    figure.tight_layout()
    with atomic_file(path, unique=True) as f:  # jobs of a parallel sweep may draw it too
        figure.savefig(f, format="png", dpi=100)
    plt.close(figure)


def plot_history(frame: pd.DataFrame, path: Path, direction: str = "maximize") -> Path | None:
    """A search's optimisation history: each trial's value in the order it ran, and the best so
    far."""
    metric = final_metric(frame)
    if metric is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = pd.to_numeric(frame[metric], errors="coerce").where(finished(frame))
    trials = list(range(len(frame)))
    best = values.cummax() if direction == "maximize" else values.cummin()
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(trials, values, "o", label=f"trial {metric}")
    axis.plot(trials, best.ffill(), "-", color="tab:green", label="best so far")
    for trial, value in zip(trials, values, strict=True):
        if pd.notna(value):
            axis.annotate(
                f"{value:.4g}",
                (trial, value),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
    limits = _axis_range(values)
    if limits:
        axis.set_ylim(*limits)
    axis.set_xlabel("trial")
    axis.set_ylabel(metric)
    axis.set_title(f"optimisation history ({direction} {metric})")
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def best_run(frame: pd.DataFrame, sweep_dir: str | Path) -> list[str]:
    """The best run's folder and the commands that export and serve it (as a Markdown code
    block, which is also how they read on a console)."""
    metric = final_metric(frame)
    best = best_index(frame, metric)
    if best is None:
        return []
    run_dir = Path(sweep_dir) / frame["run"].iloc[best]
    lines = [f"Best {metric}: {frame[metric].iloc[best]:.4g} in {shown(run_dir)}"]
    ckpt = run_dir / "checkpoints" / "best.pt"
    if ckpt.is_file():
        args = f"ckpt={shown(ckpt)}", *plugin_override(run_config(run_dir))
        lines[0] += ":"
        lines += [
            "",
            f"    {infer('mode=export', *args)}   # ONNX, parity-checked",
            f"    {infer('mode=serve', *args)}   # HTTP on 127.0.0.1:8000",
        ]
    return lines


def write_summary(frame: pd.DataFrame, sweep_dir: str | Path) -> tuple[Path, Path]:
    """Write summary.md and summary.png into `sweep_dir`; returns their paths."""
    sweep_dir = Path(sweep_dir)
    markdown_path, png_path = sweep_dir / "summary.md", sweep_dir / "summary.png"
    num_failed = int((~finished(frame)).sum())
    best = best_run(frame, sweep_dir) or [""]
    header = "\n".join(
        [f"# Sweep summary: {sweep_dir}", "", f"{len(frame)} runs, {num_failed} failed. {best[0]}"]
        + best[1:]
    ).rstrip()
    # Jobs of a parallel sweep may write it at the same time.
    write_text(markdown_path, header + "\n\n" + to_markdown(frame), unique=True)
    plot_summary(frame, png_path)
    return markdown_path, png_path
