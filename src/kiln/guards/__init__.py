"""Antibodies: checks that make a broken model or batch fail early with a message that starts
with the rule it enforces and says what to fix (rule 1: shapes from inputs; rule 2: loss branches;
rule 3: train and eval agree; devices; non-finite values)."""

from kiln.guards.branches import LossBranchError, check_every_parameter_learns, check_loss_branches
from kiln.guards.devices import DeviceMismatchError, diagnose, is_device_mismatch
from kiln.guards.input_sizes import ShapeInferenceError, check_sizes_follow_inputs
from kiln.guards.numerics import NonFiniteInputError, assert_finite_inputs, tensor_stats
from kiln.guards.outputs import ProbabilitiesNotLogitsError, check_logits
from kiln.guards.shape_check import ShapeContractError, check_train_eval_agreement
from kiln.guards.tree import describe

__all__ = [
    "DeviceMismatchError",
    "LossBranchError",
    "NonFiniteInputError",
    "ProbabilitiesNotLogitsError",
    "ShapeContractError",
    "ShapeInferenceError",
    "assert_finite_inputs",
    "check_every_parameter_learns",
    "check_logits",
    "check_loss_branches",
    "check_sizes_follow_inputs",
    "check_train_eval_agreement",
    "describe",
    "diagnose",
    "is_device_mismatch",
    "tensor_stats",
]
