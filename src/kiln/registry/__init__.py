"""Registries are a dict plus a decorator: a duplicate name raises, a failed lookup lists names."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError):
    """A name that is not in a registry; the message lists the known names."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable.
        return str(self.args[0])


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._entries, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._entries))}.{hint}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


MODELS: Registry = Registry("model")
DATASETS: Registry = Registry("dataset")
register_model = MODELS.register
register_dataset = DATASETS.register
