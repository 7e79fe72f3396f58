"""Exceptions for user mistakes at inference time. Each message says what was expected, what
arrived and how to fix it, so the CLI and the server can show it as it is."""

from __future__ import annotations

from kiln.errors import UserError
from kiln.preprocessing.errors import InputError  # noqa: F401  (raw inputs; raised there)


class InferenceError(UserError, ValueError):
    """Base class: a request or a checkpoint that inference cannot use."""


class UnsupportedCheckpointError(InferenceError):
    """A checkpoint kiln can train but not (yet) serve, e.g. a detector."""


class CheckpointPolicyError(InferenceError):
    """A checkpoint refused by the run's env profile (env.require_best_checkpoint)."""


class CheckpointMismatchError(InferenceError):
    """The weights in a checkpoint do not fit the model its config records (a key missing or
    unexpected, a tensor of another shape)."""


class NonFiniteWeightsError(InferenceError):
    """A checkpoint whose weights hold NaN or Inf: every answer from it would be garbage."""
