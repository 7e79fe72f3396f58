"""Architecture names checked against the library's own list, and the data a zoo model takes."""

from __future__ import annotations

from collections.abc import Iterable

from kiln.config.base import ConfigError
from kiln.errors import did_you_mean

NUM_SUGGESTIONS = 3


def check_arch(arch: str, names: Iterable[str], library: str, listing: str) -> str:
    names = list(names)
    if arch in names:
        return arch
    raise ConfigError(
        f"{library} has no architecture {arch!r}",
        "model.arch",
        f"list them with {listing}{did_you_mean(arch, names, most=NUM_SUGGESTIONS, cutoff=0.5)}",
    )


def check_image_spec(spec, cfg) -> None:
    if spec.input_kind != "image":
        raise ValueError(f"model {cfg.name} needs image data, got {spec.input_kind} ({spec})")
