"""The checks a run makes before its first step, as one plan (ProbePlan), each check its own
module: rule 1 at other batch and input sizes and at the data's extremes (input_sizes), rule 3
in train and eval mode (shape_check), logits (outputs), determinism in eval (determinism), batch
independence (batch_independence), one observed training step on a copy for purity (purity),
finite values (numerics) and live gradients (live_gradients), parameters used only in some steps
(conditional_params), the learn probe (learn_probe), the device probe on the meta device
(devices) and the fp16 probe (fp16). They leave no trace: RNG states, the model's weights,
buffers, modes and gradients are as before (what must train works on copies), so a resumed run
still equals an uninterrupted one."""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.guards.input_sizes import EpochPlan, plan_probes, run_size_probe, size_probes, take
from kiln.guards.no_trace import untouched
from kiln.guards.numerics import NumericsError
from kiln.guards.outputs import check_logits
from kiln.guards.shape_check import check_train_eval_agreement
from kiln.guards.tree import copy_batch
from kiln.models import logits_of
from kiln.rng import forked

log = logging.getLogger(__name__)

Forward = Callable[[nn.Module, Any, bool], Any]


@dataclass(frozen=True)
class ProbePlan:
    """Which checks run before step 1 (the composition root derives it from the config)."""

    sizes: bool = True  # rule 1 (trainer.probe_sizes)
    modes: bool = True  # rule 3 (trainer.shape_check)
    logits: bool = False  # the criterion takes logits: outputs must not be probabilities
    skip: frozenset[str] = frozenset()  # behaviour checks left out (trainer.skip_checks)
    learn_steps: int = 0  # the learn probe's steps (0: off; trainer.learn_probe)
    fp16: bool = False  # the fp16 probe (precision=amp, or trainer.fp16_check)
    conditional_is_fatal: bool = False  # DDP without trainer.find_unused_parameters

    def runs(self, check: str) -> bool:
        return check not in self.skip

    @property
    def anything(self) -> bool:
        behaviour = {"batch dependence", "determinism", "purity", "numerics", "dead gradients"}
        return self.sizes or self.modes or bool(behaviour - self.skip) or self.learn_steps > 0


@dataclass
class ProbeSubject:
    """The run's model and how it is called, with the batches the probes take."""

    model: nn.Module  # the run's own (unwrapped): left as it was
    build: Callable[[Any], nn.Module] | None  # a new model for a spec (rule 1's other sizes)
    criterion: Any  # (model, batch) -> (loss, terms); .forward(model, batch, train_mode)
    batch: Any  # real training samples on the device, the data's extremes first
    spec: Any
    batch_sizes: Iterable[int] = ()  # rule 1's batch sizes besides the training one
    mode_batch_size: int = 8  # samples the mode and behaviour checks take
    epoch_plan: EpochPlan | None = None
    cases: list = field(default_factory=list)  # (label, batch): the data's extremes
    optimizer_for: Callable[[nn.Module, float], torch.optim.Optimizer] | None = None
    flag_for_unused: Callable[[list[str]], str | None] | None = None
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclass
class ProbeReport:
    seconds: dict[str, float] = field(default_factory=dict)  # per check, in the order run
    mostly_dead: dict[str, str] = field(default_factory=dict)  # ReLU layers mostly off

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


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
        with forked():  # initialising weights draws random numbers: not ours
            return build(spec)
    return copy.deepcopy(model)


def probe_batch_sizes(batch_size: int, samples_per_rank: int) -> list[int]:
    """1, an odd size other than the batch size, and the epoch's last partial batch."""
    odd = 3 if batch_size != 3 else 5
    sizes = {1, odd, samples_per_rank % batch_size}
    return sorted(n for n in sizes if 0 < n < batch_size)


def run_probe_plan(plan: ProbePlan, subject: ProbeSubject) -> ProbeReport:
    """Runs the plan's checks in order; raises the first check's error (a ProbeFailure naming
    its check and module). Returns the seconds each took."""
    report = ProbeReport()
    model, forward = subject.model, subject.criterion.forward
    mode_batch = take(subject.batch, subject.mode_batch_size)
    with untouched(model):
        with _timed(report, "rule 1"), subject.autocast():
            if plan.sizes and subject.build is not None:
                _rule1(plan, subject, mode_batch)
        with _timed(report, "rule 3"), subject.autocast():
            if plan.modes:
                check_train_eval_agreement(model, mode_batch, forward, finite=plan.runs("numerics"))
            if plan.logits and (plan.sizes or plan.modes):
                check_logits(model, mode_batch, forward)
        _behaviour(plan, subject, mode_batch, report)
        with _timed(report, "loss terms"), subject.autocast():  # last, as the first step's was
            _terms_reach_the_model(subject, mode_batch)
    return report


def _terms_reach_the_model(subject: ProbeSubject, batch: Any) -> None:
    """Rule 2 in every run: each term of the loss a training step computes needs a gradient (a
    throwaway train-mode forward on a copy, with grad, as the first step's)."""
    from kiln.guards.branches import check_terms_reach_the_model

    scratch = copy_or_build(subject.model, subject.build, subject.spec)
    scratch.train()
    _, terms = subject.criterion(scratch, copy_batch(batch))
    check_terms_reach_the_model(terms)


def _rule1(plan: ProbePlan, subject: ProbeSubject, mode_batch: Any) -> None:
    batch_sizes, epoch = subject.batch_sizes, subject.epoch_plan
    if epoch is not None and epoch.last_batch == 1:  # probed in train mode below
        batch_sizes = [n for n in batch_sizes if n != 1]
    # The data's extremes first: a failure there is named by the extreme it met.
    fixed = getattr(subject.model, "fixed_input_size", False)
    probes = plan_probes(epoch, subject.batch, subject.spec, subject.cases)
    probes += size_probes(subject.batch, subject.spec, batch_sizes, fixed_input_size=fixed)
    for probe in probes:
        # Another batch size runs a copy of the model; another input size a new build.
        subject_model = (
            subject.build(probe.spec)
            if probe.new_size
            else copy_or_build(subject.model, subject.build, subject.spec)
        )
        try:
            run_size_probe(
                subject_model,
                probe,
                subject.criterion.forward,
                classifier_output_problems,
                finite=plan.runs("numerics"),
            )
        except NumericsError as err:
            # NaN at a smaller batch where the training batch is finite: statistics over the
            # batch (a std of one sample) are the cause to name, when they are.
            if len(probe.batch[0]) < len(mode_batch[0]) and plan.runs("batch dependence"):
                from kiln.guards.batch_independence import check_batch_independence

                with subject.autocast():
                    check_batch_independence(subject.model, mode_batch, subject.criterion.forward)
            raise err


def _behaviour(plan: ProbePlan, subject: ProbeSubject, batch: Any, report: ProbeReport) -> None:
    """The behaviour checks, cheapest first; the ones that train or move weights on a copy."""
    from kiln.guards.batch_independence import check_batch_independence
    from kiln.guards.determinism import check_eval_determinism

    model, forward = subject.model, subject.criterion.forward
    step_checks = ("purity", "numerics", "dead gradients")
    scratch = None
    if any(plan.runs(c) for c in step_checks) or plan.learn_steps:
        scratch = copy_or_build(model, subject.build, subject.spec)
        with _timed(report, "step probe"), subject.autocast():  # first: a batch it changes
            _observed_step(plan, subject, scratch, batch, report)  # would mislead the others
    with _timed(report, "determinism"), subject.autocast():
        if plan.runs("determinism"):
            check_eval_determinism(model, batch, forward)
    with _timed(report, "batch dependence"), subject.autocast():
        if plan.runs("batch dependence"):
            check_batch_independence(model, batch, forward)
    if plan.learn_steps and subject.optimizer_for is not None:
        from kiln.guards.learn_probe import check_can_learn

        with _timed(report, "learn probe"):  # fp32: no loss scaling to skip a step
            check_can_learn(
                scratch,
                subject.optimizer_for,
                subject.criterion,
                batch,
                steps=plan.learn_steps,
                dead_layers=report.mostly_dead,
            )
    if plan.runs("device"):
        from kiln.guards.devices import check_devices_follow

        with _timed(report, "device"):
            check_devices_follow(model, batch, forward)
    if plan.fp16:
        from kiln.guards.fp16 import check_fp16

        with _timed(report, "fp16"):
            check_fp16(model, batch, forward)


def _observed_step(
    plan: ProbePlan, subject: ProbeSubject, scratch: nn.Module, batch: Any, report: ProbeReport
) -> None:
    from kiln.guards.conditional_params import (
        conditional_error,
        find_conditional_parameters,
        probe_backward_reached,
    )
    from kiln.guards.live_gradients import check_live_gradients, still_zero
    from kiln.guards.numerics import check_finite
    from kiln.guards.purity import check_purity
    from kiln.guards.step_probe import observe_step, restore_batch

    criterion, forward = subject.criterion, subject.criterion.forward
    fresh = lambda: copy_batch(batch)  # noqa: E731
    seen = observe_step(scratch, criterion, fresh())
    try:
        if plan.runs("purity"):
            check_purity(seen, criterion, forward, fresh=fresh)
    finally:
        restore_batch(seen)
    if plan.runs("numerics") and seen.loss is not None:
        check_finite(
            scratch, seen.loss, probe="the probe step's loss (train mode, with grad)",
            batch=seen.batch, rerun=lambda: criterion(scratch, seen.batch),
        )  # fmt: skip
    if plan.runs("dead gradients"):
        # Parameters some samples reach and others not first: under DDP that is fatal, and one
        # that the whole batch leaves without a gradient is then no unused branch (rule 2).
        whole = probe_backward_reached(scratch)
        varied = find_conditional_parameters(scratch, criterion, seen.batch, whole)
        if varied is not None:
            first = next(iter(sorted(varied[1])), "")
            error = conditional_error(scratch, varied[0], first.rpartition(".")[0])
            if plan.conditional_is_fatal:
                raise error
            log.warning("%s", error)
        # The probe step's gradients again: the second step breaks a zero initialisation's tie.
        for name, p in scratch.named_parameters():
            p.grad = seen.grads.get(name)
        optimizer = (
            subject.optimizer_for(scratch, 1.0)
            if subject.optimizer_for is not None
            else torch.optim.SGD([p for p in scratch.parameters() if p.requires_grad], lr=0.1)
        )
        report.mostly_dead = check_live_gradients(
            seen,
            subject.flag_for_unused,
            used_sometimes=varied[1] if varied else frozenset(),
            second_step=lambda zero: still_zero(seen, zero, optimizer, criterion),
        )
    for p in scratch.parameters():
        p.grad = None


@contextlib.contextmanager
def _timed(report: ProbeReport, check: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - started
        if elapsed > 1e-4:
            report.seconds[check] = report.seconds.get(check, 0.0) + elapsed
