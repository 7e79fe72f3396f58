"""The model contract as one set of checks any registered model can be put through (the test
suite runs it over every registered model and every dataset whose inputs it accepts; use it for
your own): rule 1 at other batch and input sizes, rule 2 with every loss branch on, rule 3 in both
modes, device diagnosis with one layer left on another device, and the behaviour checks of the
probe plan (determinism, batch independence, purity, finite values, live gradients, parameters
used only in some steps as DDP would see them, the device and fp16 probes, the learn probe,
padding), and after one real step, every trainable parameter held by the optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.data import DataBundle
from kiln.data.extremes import probe_batches
from kiln.guards.branches import check_loss_branches
from kiln.guards.devices import DeviceMismatchError, diagnose, is_device_mismatch
from kiln.guards.input_sizes import EpochPlan, plan_probes, run_size_probe, size_probes
from kiln.guards.outputs import check_logits
from kiln.guards.probes import (
    ProbePlan,
    ProbeReport,
    ProbeSubject,
    classifier_output_problems,
    run_probe_plan,
)
from kiln.guards.shape_check import check_train_eval_agreement

Build = Callable[[Any], nn.Module]  # DataSpec -> a fresh model


def _batch(bundle: DataBundle, size: int) -> Any:
    """The data's extremes first (the longest texts, an image with no box...), never sampled."""
    return probe_batches(bundle, size, size).base


def check_rule1(
    build: Build,
    criterion,
    bundle: DataBundle,
    batch_sizes=(1, 3),
    plan: EpochPlan | None = None,
    backward_every_probe: bool = True,
) -> None:
    """Forward and backward at each batch size, at a second input size and at the data's
    extremes (and, when `plan` ends its epoch with one, a batch of 1 in train mode), on a new
    model built for each spec: the probes of one spec take it in turn, as a run's steps do;
    outputs must fit the batch and the spec. `backward_every_probe=False`: the probes as a run
    takes them (backward only where a run's probe has it: a new input size, the plan's last
    batch), not also a backward at each batch size."""
    models = {bundle.spec: build(bundle.spec)}
    fixed = getattr(models[bundle.spec], "fixed_input_size", False)
    data = probe_batches(bundle, 4, plan.batch_size if plan is not None else 4)
    if plan is not None and plan.last_batch == 1:
        batch_sizes = [n for n in batch_sizes if n != 1]
    probes = plan_probes(plan, data.base, bundle.spec, data.cases)
    for probe in probes + size_probes(data.base, bundle.spec, batch_sizes, fixed_input_size=fixed):
        if probe.spec not in models:
            models[probe.spec] = build(probe.spec)
        model = models[probe.spec]
        run_size_probe(model, probe, criterion.forward, classifier_output_problems)
        # The suite runs backward on every probe too (a new size's probe already has).
        if backward_every_probe and not (probe.backward or probe.new_size):
            probe = dataclasses.replace(probe, backward=True)
            run_size_probe(model, probe, criterion.forward, classifier_output_problems)


def check_rule2(
    build: Build, criterion, bundle: DataBundle, size: int = 4
) -> dict[str, torch.Tensor]:
    """One step of `size` items with the criterion's branches (build it with
    force_all_branches=True)."""
    return check_loss_branches(build(bundle.spec), criterion, _batch(bundle, size))


def check_rule3(build: Build, criterion, bundle: DataBundle, size: int = 4) -> None:
    """Train and eval forwards of `size` items agree in structure and shapes, and are finite."""
    check_train_eval_agreement(
        build(bundle.spec), _batch(bundle, size), criterion.forward, finite=True
    )


def check_outputs_are_logits(build: Build, criterion, bundle: DataBundle) -> None:
    """A classifier's outputs are logits (its criterion applies log_softmax), not probabilities."""
    if getattr(criterion, "expects_logits", False):
        check_logits(build(bundle.spec), _batch(bundle, 4), criterion.forward)


def check_behaviour(
    build: Build,
    criterion,
    bundle: DataBundle,
    optimizer_for: Callable[[nn.Module, float], torch.optim.Optimizer] | None = None,
    *,
    fp16: bool = True,
) -> ProbeReport:
    """The behaviour checks a run makes before step 1, on a model built for the data and 8 of
    its items (the extremes first): determinism, batch independence, one observed step (purity,
    a finite loss, live gradients, parameters used only in some steps, fatal as under DDP), the
    device probe, the fp16 probe and, given the run's optimizer (`optimizer_for(model,
    lr_scale)`), the learn probe."""
    from kiln.guards.learn_probe import STEPS

    plan = ProbePlan(
        sizes=False,
        modes=False,
        learn_steps=STEPS if optimizer_for is not None else 0,
        fp16=fp16,
        conditional_is_fatal=True,
    )
    probes = probe_batches(bundle, 8, 8)
    subject = ProbeSubject(
        model=build(bundle.spec),
        build=build,
        criterion=criterion,
        batch=probes.base,
        spec=bundle.spec,
        optimizer_for=optimizer_for,
        padding=probes.padding,
    )
    return run_probe_plan(plan, subject)


def check_optimizer_sees_every_parameter(
    build: Build,
    criterion,
    bundle: DataBundle,
    optimizer_for: Callable[[nn.Module, float], torch.optim.Optimizer] | None = None,
) -> None:
    """One training step as a run takes it -- torch's lazy layers sized by a dry forward, the
    run's optimizer built (`optimizer_for(model, 1.0)`), a forward, loss, backward and update --
    then every trainable parameter must be one the optimizer holds (a layer built in forward,
    a parameter replaced there: kiln.guards.optimizer_coverage)."""
    from kiln.guards.optimizer_coverage import check_optimizer_coverage
    from kiln.models import has_lazy_parameters, materialise, spec_example

    model = build(bundle.spec)
    if has_lazy_parameters(model):
        materialise(model, spec_example(bundle.spec))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_for(model, 1.0) if optimizer_for else torch.optim.SGD(trainable, lr=1e-3)
    model.train()
    loss, _ = criterion(model, _batch(bundle, 4))
    loss.backward()
    optimizer.step()
    check_optimizer_coverage(model, optimizer, step=1)


def last_layer_with_weights(model: nn.Module) -> str:
    """The head, usually. (On CPU a convolution with `meta` weights quietly returns a CPU
    tensor, so the first layer, often a convolution, would not stand in for another device.)"""
    names = [name for name, m in model.named_modules() if list(m.parameters(recurse=False))]
    return names[-1]


def check_device_diagnosis(build: Build, criterion, bundle: DataBundle) -> str:
    """With one layer left on the `meta` device (standing in for a second device), the forward
    must fail with a diagnosis naming that layer. Returns the message."""
    model = build(bundle.spec)
    layer = last_layer_with_weights(model)
    model.get_submodule(layer).to("meta")
    batch = _batch(bundle, 2)
    model.train()
    try:
        with torch.no_grad():
            criterion(model, batch)  # the loss too: a meta tensor may flow until it meets one
        # On CPU a convolution with `meta` weights quietly returns a CPU tensor (a real second
        # device would raise): diagnose from the recorded devices all the same.
        err = RuntimeError(f"{layer} is on meta and the batch on cpu (no error raised)")
    except RuntimeError as raised:
        if not is_device_mismatch(raised):
            raise
        err = raised
    with torch.no_grad():
        found = diagnose(err, model, lambda: criterion(model, batch), batch)
    if found.module != layer:
        raise AssertionError(
            f"devices: the diagnosis named {found.module!r}, not the layer left on meta "
            f"({layer!r}):\n{found}"
        )
    return str(found)


__all__ = [
    "DeviceMismatchError",
    "check_behaviour",
    "check_device_diagnosis",
    "check_optimizer_sees_every_parameter",
    "check_outputs_are_logits",
    "check_rule1",
    "check_rule2",
    "check_rule3",
]
