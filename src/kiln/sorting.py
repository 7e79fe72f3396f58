"""Natural sort order: "2" before "10", "run-2" before "run-10"."""

from __future__ import annotations

import re

_PARTS = re.compile(r"(\d+(?:\.\d+)?)")


def natural_key(text: str) -> tuple:
    """Numbers inside `text` compare as numbers, the rest as text (numbers first)."""
    parts = _PARTS.split(str(text))
    return tuple((0, float(p), "") if i % 2 else (1, 0.0, p) for i, p in enumerate(parts) if p)
