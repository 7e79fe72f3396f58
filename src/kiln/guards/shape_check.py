"""Rule 3: before the first step and before every evaluation, a no-grad forward in train mode and
in eval mode must agree on the output's structure and shapes. Models whose outputs differ by
design between modes (detectors) declare a contract per mode via
`check_output(mode, output) -> list[str]` instead.

An eval-mode forward must not change any buffer (BatchNorm statistics leaking in eval mode). A
NaN/Inf met here (before step 1) is a numerics fault, not a shape error (NumericsError).
The check leaves no trace: parameters' gradients (no-grad forward), BatchNorm running statistics
and every other buffer, the RNG states and the model's mode are exactly as before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.guards.no_trace import changed_buffers, restore, untouched
from kiln.guards.rules import NUMERICS, RULE_3, ProbeFailure
from kiln.guards.tree import describe


class ShapeContractError(ProbeFailure):
    """Train-mode and eval-mode outputs disagree, or an output breaks its declared contract."""

    what = "shapes"


def first_difference(train: Any, eval_: Any, path: str = "output") -> str | None:
    if isinstance(train, dict) and isinstance(eval_, dict):
        if set(train) != set(eval_):
            return f"{path}: keys differ: train {sorted(train)} vs eval {sorted(eval_)}"
        for key in train:
            found = first_difference(train[key], eval_[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(train, list) and isinstance(eval_, list):
        if len(train) != len(eval_):
            return f"{path}: length differs: train {len(train)} vs eval {len(eval_)}"
        for i, (a, b) in enumerate(zip(train, eval_, strict=True)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    if type(train) is not type(eval_):
        return f"{path}: structure differs: train {_kind(train)} vs eval {_kind(eval_)}"
    if train != eval_:
        return f"{path}: shape differs: train {train} vs eval {eval_}"
    return None


def _kind(described: Any) -> str:
    return "tensor of shape " + str(described) if isinstance(described, tuple) else str(described)


def run_mode(model: nn.Module, batch: Any, forward, train_mode: bool) -> Any:
    """One no-grad forward in a mode; an exception becomes a rule-3 error naming the mode, the
    module that raised and the shapes going into it (a device mismatch is diagnosed instead)."""
    from kiln.guards.devices import diagnose, is_device_mismatch
    from kiln.guards.trace import failing_call

    mode = "train" if train_mode else "eval"
    model.train(train_mode)
    outputs = []
    err, trace = failing_call(model, lambda: outputs.append(forward(model, batch, train_mode)))
    if err is None:
        return outputs[0]
    if is_device_mismatch(err):
        model.train(train_mode)
        raise diagnose(err, model, lambda: forward(model, batch, train_mode), batch) from err
    call = trace.innermost_open
    if trace.fused_only:
        where = (
            "in a fused kernel (the same forward runs with module hooks attached, which switch "
            "fused paths such as the Transformer encoder's eval fast path off)"
        )
    else:
        where = f"in {call.where} with inputs {call.inputs}" if call else "before any module ran"
    from kiln.guards.input_sizes import MemoryLayoutError, probe_error
    from kiln.guards.numerics import NumericsError

    named = probe_error(model, f"rule 3's {mode}-mode forward", batch[0], err, trace)
    if isinstance(named, MemoryLayoutError | NumericsError):
        raise named from err
    raise ShapeContractError(
        f"{RULE_3}: the {mode}-mode forward raised {type(err).__name__} {where}: {err}. Both "
        "modes must run on the same batch; look for code that only runs in one mode "
        "(branches on self.training).",
        module=call.path if call else "",
    ) from err


def check_train_eval_agreement(
    model: nn.Module,
    batch: Any,
    forward: Callable[[nn.Module, Any, bool], Any],
    *,
    finite: bool = False,
) -> None:
    """`forward(model, batch, train_mode)` calls the model the way the engine does. With
    `finite` (before step 1) an eval-mode output with NaN/Inf where the train-mode output of the
    same batch has none is a disagreement too."""
    name = type(model).__name__
    with untouched(model) as saved, torch.no_grad():
        outputs = {"train": run_mode(model, batch, forward, True)}
        restore(model, saved)
        outputs["eval"] = run_mode(model, batch, forward, False)
        changed = changed_buffers(model, saved)
    if changed:
        raise ShapeContractError(
            f"{RULE_3}: {name}: an eval-mode forward changed buffers {', '.join(changed)}. "
            "Statistics leak in eval mode: a BatchNorm (or similar) layer is still updating its "
            "running statistics; check for modules forced into train mode or a train() override."
        )
    if finite:
        check_eval_is_finite(model, batch, forward, outputs)
    if hasattr(model, "check_output"):
        problems = [
            f"{mode} mode: {p}" for mode in outputs for p in model.check_output(mode, outputs[mode])
        ]
        if not problems:
            problems = _eval_with_grad_differs(model, batch, forward, outputs["eval"])
        if problems:
            raise ShapeContractError(
                f"{RULE_3}: {name} breaks its declared output contract:\n  "
                + "\n  ".join(problems)
                + f"\n{name}'s two modes differ by design (check_output): rule 3 holds each "
                "mode's output to the contract it declares and an eval-mode forward with grad "
                "to the same forward without, instead of comparing the two modes' structures."
            )
        return
    difference = first_difference(describe(outputs["train"]), describe(outputs["eval"]))
    if difference:
        raise ShapeContractError(
            f"{RULE_3}: {name}: train-mode and eval-mode outputs disagree at {difference} (what "
            "varied: the mode, train vs eval, no grad in both; the first module whose output "
            f"differs: {_mode_divergence(model, batch, forward)}). A model must return the same "
            "structure and shapes in both modes (or declare check_output for outputs that "
            "differ by design); look for branches on self.training in forward."
        )


def _eval_with_grad_differs(model: nn.Module, batch: Any, forward, no_grad_output) -> list[str]:
    """For a model with a declared contract (train and eval outputs differ by design): the
    eval-mode output with autograd on must have the structure and shapes of the no-grad one
    (a branch on torch.is_grad_enabled() would change what training's evaluation sees)."""
    with untouched(model), torch.enable_grad():
        with_grad = run_mode(model, batch, forward, False)
    difference = first_difference(describe(with_grad), describe(no_grad_output))
    if difference is None:
        return []
    return [
        "eval mode with grad vs without: "
        + difference.replace("train ", "with grad ").replace("eval ", "without ")
    ]


def _mode_divergence(model: nn.Module, batch: Any, forward) -> str | None:
    from kiln.guards.varied import first_divergence, module_outputs

    with untouched(model) as saved, torch.no_grad():
        calls = {}
        for mode in ("train", "eval"):
            train_mode = mode == "train"
            model.train(train_mode)
            calls[mode] = module_outputs(model, lambda t=train_mode: forward(model, batch, t))
            restore(model, saved)
    return first_divergence(calls["train"], calls["eval"], ("train-mode", "eval-mode"))


def check_eval_is_finite(model: nn.Module, batch: Any, forward, outputs: dict) -> None:
    """An eval-only NaN (running statistics never updated, a division by a buffer): the eval
    forward of the same batch is non-finite where the train forward is not. A numerics fault
    (NumericsError), named by rule 3's probe; a train-mode NaN is the numerics probe's too."""
    from kiln.guards.numerics import (
        NumericsError,
        check_finite,
        first_nonfinite_module,
        nonfinite_count,
    )

    with untouched(model):
        model.train()
        check_finite(
            model,
            outputs["train"],
            probe="rule 3's train-mode forward (no grad)",
            batch=batch,
            rerun=lambda: forward(model, batch, True),
        )
    bad = nonfinite_count(outputs["eval"])
    if not bad:
        return
    with untouched(model), torch.no_grad():
        model.eval()
        found = first_nonfinite_module(model, lambda: forward(model, batch, False))
    where = f"{found[0] or '<model>'} ({found[1]})" if found else "the model's own forward"
    raise NumericsError(
        f"{NUMERICS}: {type(model).__name__}: the eval-mode output is non-finite ({bad} NaN/Inf "
        f"values) where the train-mode output of the same batch is finite (rule 3's probe; what "
        f"varied: the mode, train vs eval, no grad in both); the first module whose eval-mode "
        f"output is non-finite: {where}. Look for what only evaluation uses: running statistics "
        "never updated, a division by a buffer, a branch on self.training",
        module=found[0] if found else "",
    )
