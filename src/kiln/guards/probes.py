"""The checks a run makes before its first step (trainer.probe_sizes, trainer.shape_check): rule 1
at batch sizes that differ from the training batch and at a second input size, then rule 3 in
train and eval mode. They leave no trace: RNG states, the model's weights, buffers and modes are
as before, so a resumed run still equals an uninterrupted one."""

from __future__ import annotations

import copy
import random
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.guards.input_sizes import EpochPlan, plan_probes, run_size_probe, size_probes, take
from kiln.guards.outputs import check_logits
from kiln.guards.shape_check import check_train_eval_agreement
from kiln.models import logits_of


def classifier_output_problems(model: nn.Module, output: Any, size: int, spec: Any) -> list[str]:
    """What is wrong with a train-mode output for a batch of `size` (empty: nothing)."""
    if hasattr(model, "check_output"):  # models whose outputs differ by design declare them
        return model.check_output("train", output)
    if getattr(model, "computes_own_loss", False):  # a loss dict, checked by rule 3's contract
        return []
    expected = (size, spec.num_classes)
    heads = {"logits": logits_of(output)}
    if isinstance(output, dict) and "aux_logits" in output:
        heads["aux_logits"] = output["aux_logits"]
    problems = []
    for name, head in heads.items():
        if not isinstance(head, torch.Tensor) or tuple(head.shape) != expected:
            got = tuple(head.shape) if isinstance(head, torch.Tensor) else type(head).__name__
            problems.append(f"{name} have shape {got}, expected {expected} (batch, classes)")
    return problems


def copy_or_build(model: nn.Module, build: Callable[[Any], nn.Module], spec: Any) -> nn.Module:
    """A throw-away model to probe: a copy, or (for a sharded FSDP model, which cannot be
    copied) a new unsharded build of the same architecture."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    if fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        with torch.random.fork_rng():  # initialising weights draws random numbers: not ours
            return build(spec)
    return copy.deepcopy(model)


def probe_batch_sizes(batch_size: int, samples_per_rank: int) -> list[int]:
    """1, an odd size other than the batch size, and the epoch's last partial batch."""
    odd = 3 if batch_size != 3 else 5
    sizes = {1, odd, samples_per_rank % batch_size}
    return sorted(n for n in sizes if 0 < n < batch_size)


def run_probes(
    *,
    model: nn.Module,
    build: Callable[[Any], nn.Module],
    forward: Callable[[nn.Module, Any, bool], Any],
    batch: Any,
    spec: Any,
    batch_sizes: Iterable[int],
    mode_batch_size: int,
    sizes: bool,
    modes: bool,
    expects_logits: bool = False,
    plan: EpochPlan | None = None,
    cases: Iterable[tuple[str, Any]] = (),
) -> float:
    """Runs the enabled probes; raises the rule's error; returns the seconds they took. `plan`
    and `cases` are the data's own extremes (kiln.data.extremes): a batch of 1 the epoch trains
    on, the longest sequences, images with no box, ..."""
    started = time.perf_counter()
    rng = _rng_state()
    try:
        if sizes:
            if plan is not None and plan.last_batch == 1:  # probed in train mode below
                batch_sizes = [n for n in batch_sizes if n != 1]
            # The data's extremes first: a failure there is named by the extreme it met.
            fixed = getattr(model, "fixed_input_size", False)
            probes = plan_probes(plan, batch, spec, cases)
            probes += size_probes(batch, spec, batch_sizes, fixed_input_size=fixed)
            for probe in probes:
                # Another batch size runs a copy of the model; another input size a new build.
                subject = build(probe.spec) if probe.new_size else copy_or_build(model, build, spec)
                run_size_probe(subject, probe, forward, classifier_output_problems)
        if modes:
            check_train_eval_agreement(model, take(batch, mode_batch_size), forward, finite=True)
        if expects_logits and (sizes or modes):
            check_logits(model, take(batch, mode_batch_size), forward)
    finally:
        _set_rng_state(rng)
    return time.perf_counter() - started


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    python, numpy_state, torch_state, cuda = state
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
