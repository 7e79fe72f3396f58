"""The `csv` backend: <run_dir>/metrics.csv, a flat (wide) table for pandas or a spreadsheet.

Layout: one row per `log_metrics` call, columns `step` then every metric key in the order it first
appeared; a key a row did not log is an empty cell (NaN in pandas). Train and eval metrics logged
at the same step are two rows with the same `step`.

Keys that appear later (val_loss at the first eval, a loss branch switched on) would break a
plain append-only CSV, so when a row brings a new key the file is rewritten once with the widened
header (to a temporary file, then an atomic rename). The file on disk is therefore a valid table
after every call, also when the run crashes. New keys are rare (the first few logs), so the
rewrite costs nothing in the steady state. A resumed run appends to the existing file.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from pathlib import Path

from kiln.atomic import atomic_file
from kiln.errors import disk_full, is_disk_full

STEP_COLUMN = "step"


def _format_value(value: float) -> str:
    # repr keeps full precision; pandas reads "nan", "inf" and "-inf" back as floats.
    value = float(value)
    return repr(value) if math.isfinite(value) else str(value)


def _read_header(path: Path) -> list[str]:
    with path.open(newline="", encoding="utf-8") as file:
        return next(csv.reader(file), [])


class CsvLogger:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        exists = self.path.exists() and self.path.stat().st_size > 0
        self._columns: list[str] = _read_header(self.path) if exists else [STEP_COLUMN]
        if not exists:
            self._rewrite_with_header(self._columns)
        self._file = self.path.open("a", newline="", encoding="utf-8")

    def log_config(self, config: dict) -> None:
        """Nothing to do: the composed config is kept in the run's .hydra/ directory."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        try:
            self._log_metrics(metrics, step)
        except OSError as err:
            if is_disk_full(err):
                raise disk_full(self.path) from None
            raise

    def _log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        new_keys = [key for key in metrics if key not in self._columns]
        if new_keys:
            self._file.close()
            self._columns = self._columns + new_keys
            self._rewrite_with_header(self._columns)
            self._file = self.path.open("a", newline="", encoding="utf-8")
        row = {STEP_COLUMN: str(int(step))}
        row.update({key: _format_value(value) for key, value in metrics.items()})
        csv.writer(self._file).writerow([row.get(column, "") for column in self._columns])
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError as err:  # a full disk, reported when the row failed
                if not is_disk_full(err):
                    raise

    def _rewrite_with_header(self, columns: list[str]) -> None:
        """Rewrite the file under `columns`, padding existing rows with empty cells."""
        rows: list[list[str]] = []
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open(newline="", encoding="utf-8") as file:
                rows = list(csv.reader(file))[1:]  # drop the old header
        with atomic_file(self.path, "w", newline="", encoding="utf-8") as file:
            writer = csv.writer(file)  # readers never see a half-written table
            writer.writerow(columns)
            writer.writerows(row + [""] * (len(columns) - len(row)) for row in rows)
