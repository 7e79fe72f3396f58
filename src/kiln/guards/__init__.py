"""Antibodies: checks that make a broken model or batch fail early with a message saying what to
fix (shape contracts, non-finite values, device mismatches)."""

from kiln.guards.devices import DeviceMismatchError, explain_device_mismatch
from kiln.guards.numerics import NonFiniteInputError, assert_finite_inputs, tensor_stats
from kiln.guards.shape_check import ShapeContractError, check_train_eval_agreement, describe

__all__ = [
    "DeviceMismatchError",
    "NonFiniteInputError",
    "ShapeContractError",
    "assert_finite_inputs",
    "check_train_eval_agreement",
    "describe",
    "explain_device_mismatch",
    "tensor_stats",
]
