"""The error raw inputs raise when they do not match what the model was trained on."""

from __future__ import annotations

from kiln.errors import UserError


class InputError(UserError, ValueError):
    """Raw inputs that do not match the training data (shape, type, value range). `index` is
    the offending item's position in the batch, when one item is to blame."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


def describe_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"
