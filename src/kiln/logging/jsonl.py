"""metrics.jsonl: the run record the engine always writes, whatever logger backends are chosen.

One JSON object per line, flushed as it is written, so a crashed run still leaves every line it
logged and each line parses on its own. JSON has no NaN or Infinity, so non-finite floats are
written as the strings "NaN", "Infinity" and "-Infinity" (not null: a diverged loss must stay
visible as what it was). `read_jsonl` turns them back into floats.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.errors import UserError, disk_full, is_disk_full

_NON_FINITE_TO_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_TEXT_TO_NON_FINITE = {text: float(name) for name, text in _NON_FINITE_TO_TEXT.items()}


def to_jsonable(value: Any) -> Any:
    """A JSON-safe copy of `value`: non-finite floats become strings, scalars from numpy/torch
    (anything with `.item()`) become Python numbers, paths and other objects become strings."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _NON_FINITE_TO_TEXT[repr(value)]
    if isinstance(value, Mapping):
        return {str(key): to_jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(item) for item in value]
    item = getattr(value, "item", None)
    if callable(item):  # numpy scalars, 0-d torch tensors
        try:
            return to_jsonable(item())
        except (TypeError, ValueError, RuntimeError):  # not a scalar after all
            pass
    return str(value)


def _ends_mid_line(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            file.seek(0, 2)
            if file.tell() == 0:
                return False
            file.seek(-1, 2)
            return file.read(1) != b"\n"
    except OSError:
        return False


class JsonlWriter:
    """Appends one JSON object per `write` call to `path` (created with its parent directory).

    Appending (not truncating) lets a resumed run continue the record of the run it resumes.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut = _ends_mid_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        if cut:  # a killed run's last line, cut off: the next record starts a line of its own
            self._file.write("\n")

    def write(self, record: Mapping[str, Any]) -> None:
        try:  # plain numbers and strings, every float finite: as they are (a log line's case)
            line = json.dumps(record, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError):  # a NaN, a tensor, a path: made JSON-safe first
            line = json.dumps(to_jsonable(record), allow_nan=False, ensure_ascii=False)
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as err:
            if is_disk_full(err):
                raise disk_full(self.path) from None
            raise

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError as err:  # the line that could not be flushed was reported already
                if not is_disk_full(err):
                    raise

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _restore_non_finite(value: Any) -> Any:
    if isinstance(value, str):
        return _TEXT_TO_NON_FINITE.get(value, value)
    return value


class MetricsFileError(UserError, ValueError):
    """A metrics.jsonl line that is not a JSON object (cut off by a kill, or not kiln's)."""


def read_jsonl(path: str | Path, *, damaged: list[str] | None = None) -> list[dict[str, Any]]:
    """Every record in a metrics.jsonl; "NaN", "Infinity" and "-Infinity" become floats again.
    A line that is not a JSON object -- the last line of a killed run, cut mid-record, or a line
    another tool wrote -- is a MetricsFileError naming the file and the line; with `damaged` (a
    list) it is skipped and described there instead."""
    records = []
    path = Path(path)
    with path.open(encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                cut = "" if line.endswith("\n") else ", cut off mid-record (a killed run leaves so)"
                problem = f"line {number} is not JSON ({err.msg}{cut})"
            else:
                if isinstance(record, dict):
                    records.append({key: _restore_non_finite(v) for key, v in record.items()})
                    continue
                problem = f"line {number} is a JSON {type(record).__name__}, not an object"
            if damaged is None:
                raise MetricsFileError(
                    f"{path}: {problem}: kiln's metrics.jsonl holds one JSON object per line; "
                    f"delete that line to read the rest"
                )
            damaged.append(problem)
    return records
