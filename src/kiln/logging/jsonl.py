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

from kiln.errors import disk_full, is_disk_full

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


class JsonlWriter:
    """Appends one JSON object per `write` call to `path` (created with its parent directory).

    Appending (not truncating) lets a resumed run continue the record of the run it resumes.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

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


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record in a metrics.jsonl; "NaN", "Infinity" and "-Infinity" become floats again."""
    records = []
    with Path(path).open(encoding="utf-8") as file:
        for line in file:
            if line.strip():
                record = json.loads(line)
                records.append({key: _restore_non_finite(v) for key, v in record.items()})
    return records
