"""Where kiln keeps what it can compute again: $XDG_CACHE_HOME/kiln (else ~/.cache/kiln), one
folder per kind (digits, text, images, probes). Each cache is keyed by what it depends on; a
missing or unwritable one costs only the work again."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kiln" / kind
