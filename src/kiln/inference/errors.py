"""Exceptions for user mistakes at inference time. Each message says what was expected, what
arrived and how to fix it, so the CLI and the server can show it as it is."""

from __future__ import annotations


class InferenceError(ValueError):
    """Base class: a request or a checkpoint that inference cannot use."""


class InputError(InferenceError):
    """Raw inputs that do not match what the model was trained on (shape, type, value range).
    `index` is the offending item's position in the batch, when one item is to blame."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


class UnsupportedCheckpointError(InferenceError):
    """A checkpoint kiln can train but not (yet) serve, e.g. a detector."""


class CheckpointPolicyError(InferenceError):
    """A checkpoint refused by the run's env profile (env.require_best_checkpoint)."""
