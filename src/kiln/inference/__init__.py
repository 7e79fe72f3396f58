"""Inference from kiln checkpoints: rebuild the model, repeat the training preprocessing, predict;
export to ONNX with a parity check. Needs no optimizer, scheduler or trainer."""

from kiln.inference.errors import (
    CheckpointPolicyError,
    InferenceError,
    InputError,
    UnsupportedCheckpointError,
)
from kiln.inference.export import ExportParityError, export
from kiln.inference.predictor import Predictor

__all__ = [
    "CheckpointPolicyError",
    "ExportParityError",
    "InferenceError",
    "InputError",
    "Predictor",
    "UnsupportedCheckpointError",
    "export",
]
