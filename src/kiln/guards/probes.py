"""The checks a run makes before its first step: one table (CHECKS), one runner, one budget.

Each check is one small idea in its own module: rule 1 at other batch and input sizes and at the
data's extremes (input_sizes), rule 3 in train and eval mode (shape_check), logits (outputs),
one observed training step (step_probe) read for purity (purity), finite values (numerics), live
gradients (live_gradients) and parameters used only in some steps (conditional_params),
determinism in eval (determinism), batch independence (batch_independence), the learn probe
(learn_probe), the device probe (devices), the fp16 probe (fp16) and rule 2's loss terms
(branches).

They run on the run's own model, never a copy: every check leaves the weights, buffers, modes,
gradients and RNG states as it found them (kiln.guards.no_trace), so a resumed run still equals
an uninterrupted one. The two that must step the weights (the learn probe, and the second step of
a zero-initialised model) keep the weights aside meanwhile (`weights_kept`: a GPU model's on the
host, a CPU model's in a file) and put them back bitwise: the model's memory is never doubled
where it lives. (A sharded FSDP model, whose forward and step are its ranks' collectives, is
probed on a new unsharded build.)

The budget (trainer.probe_budget, `ProbeBudget`): the observed step runs first and is timed; each
other check's cost is estimated in such steps, and the first epoch's time from the step (per
sample, times the epoch's samples). The checks then run in the table's order while their
estimates fit in a share of that epoch (at least `min_s`, at most `max_s`); one that does not fit
is skipped and named -- in the log and in summary.json, never silently -- except the learn probe,
which then reads the first real steps instead (kiln.guards.first_steps), and a zero-initialised
model's second step, which step 2 of the run confirms. What costs nothing (it reads the observed
step) always runs. The order is the order of the findings, as when every check runs."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.errors import attempt
from kiln.findings import Finding
from kiln.guards.input_sizes import EpochPlan, plan_probes, run_size_probe, size_probes, take
from kiln.guards.no_trace import untouched, weights_kept
from kiln.guards.numerics import NumericsError
from kiln.guards.outputs import check_logits
from kiln.guards.shape_check import check_train_eval_agreement
from kiln.guards.step_probe import StepObservation, observe_step, restore_batch
from kiln.guards.tree import copy_batch
from kiln.models import logits_of
from kiln.rng import forked

log = logging.getLogger(__name__)

Forward = Callable[[nn.Module, Any, bool], Any]

# The cost of a forward without grad, in observed steps (a forward and its backward): a backward
# costs about twice its forward.
FORWARD = 1 / 3


@dataclass(frozen=True)
class ProbeBudget:
    """What the checks before step 1 may cost (trainer.probe_budget): `share_of_epoch` of the
    first epoch's estimated time, at least `min_s` (a small run checks everything), at most
    `max_s` (None: no cap). `enforce=False`: every check runs, whatever it costs."""

    share_of_epoch: float = 0.02
    min_s: float = 1.0
    max_s: float | None = 15.0
    enforce: bool = True

    def seconds(self, epoch_s: float) -> float:
        if not self.enforce:
            return math.inf
        allowed = max(self.min_s, self.share_of_epoch * epoch_s)
        return allowed if self.max_s is None else min(allowed, self.max_s)

    def explain(self, epoch_s: float) -> str:
        """How the budget was set, for the log line."""
        if not self.enforce:
            return "no budget (trainer.probe_budget.enforce=false)"
        share = self.share_of_epoch * epoch_s
        why = f"{self.share_of_epoch:.0%} of the first epoch's estimated {epoch_s:.3g} s"
        if share < self.min_s:
            why = f"trainer.probe_budget.min_s; {why} is less"
        elif self.max_s is not None and share > self.max_s:
            why = f"trainer.probe_budget.max_s; {why} is more"
        return f"budget {self.seconds(epoch_s):.3g} s ({why})"


@dataclass(frozen=True)
class ProbePlan:
    """Which checks run before step 1 (the composition root derives it from the config)."""

    sizes: bool = True  # rule 1 (trainer.probe_sizes)
    modes: bool = True  # rule 3 (trainer.shape_check)
    logits: bool = False  # the criterion takes logits: outputs must not be probabilities
    skip: frozenset[str] = frozenset()  # behaviour checks left out (trainer.skip_checks)
    learn_steps: int = 0  # the learn probe's steps (0: off; trainer.learn_probe)
    warmup_start: float = 1.0  # the schedule's first lr as a share of optimizer.lr (learn probe)
    fp16: bool = False  # the fp16 probe (precision=amp, or trainer.fp16_check)
    conditional_is_fatal: bool = False  # DDP without trainer.find_unused_parameters
    budget: ProbeBudget = ProbeBudget(enforce=False)  # the model contract checks everything
    passed: frozenset[str] = frozenset()  # checks this model passed before (the probe cache)

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
    padding: Any = None  # texts: the shortest padded beside the longest (kiln.guards.padding)
    optimizer_for: Callable[[nn.Module, float], torch.optim.Optimizer] | None = None
    flag_for_unused: Callable[[list[str]], str | None] | None = None
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    full_precision: bool = True  # the autocast above is a no-op (fp32): a loss is the learn
    # probe's own measure
    # The shapes of the parameters a model built for a spec has (a build on the meta device):
    # where they equal the run's model's, rule 1's second input size runs on the run's model.
    parameter_shapes: Callable[[Any], dict[str, tuple]] | None = None


@dataclass
class ProbeReport:
    seconds: dict[str, float] = field(default_factory=dict)  # per check, in the order run
    mostly_dead: dict[str, str] = field(default_factory=dict)  # ReLU layers mostly off
    skipped: dict[str, float] = field(default_factory=dict)  # check -> its estimate (s)
    passed: list[str] = field(default_factory=list)  # the checks that ran and passed
    budget_s: float | None = None
    epoch_estimate_s: float | None = None
    budget_note: str = ""  # how the budget was set
    batch_size: int = 0  # samples the checks took (the probe batch, cut to fit the budget)
    learn_reading: Any = None  # kiln.guards.first_steps.LearnReading: the learn probe, deferred
    findings: list[Finding] = field(default_factory=list)  # what the checks said, not fatal
    pending_zero: list[str] = field(default_factory=list)  # zero gradients to confirm at step 2

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


@dataclass
class Probe:
    """One run of the plan: the subject, the batch the checks share, and the observed step."""

    plan: ProbePlan
    subject: ProbeSubject
    batch: Any  # the mode batch: every check that takes "a real batch" takes this one
    report: ProbeReport
    seen: StepObservation | None = None
    step_error: BaseException | None = None  # the observed step's forward or loss raised
    step_changes: list[str] = field(default_factory=list)  # what the step changed in its batch
    used_sometimes: frozenset[str] = frozenset()  # parameters some samples reach, others not
    step_s: float = 0.0  # seconds of the observed step: the unit of every estimate
    started: float = field(default_factory=time.perf_counter)

    @property
    def spent_s(self) -> float:
        return time.perf_counter() - self.started

    def fits(self, seconds: float) -> bool:
        """Whether `seconds` more stay within the budget."""
        budget = self.report.budget_s
        return budget is None or self.spent_s + seconds <= budget

    @property
    def model(self) -> nn.Module:
        return self.subject.model

    @property
    def forward(self) -> Forward:
        return self.subject.criterion.forward

    @property
    def size(self) -> int:
        return len(self.batch[0])


@dataclass(frozen=True)
class Check:
    """One entry of the table: its name (the log's, summary.json's probe_times_s), whether the
    plan asks for it, its cost in observed steps, what it does and needs, and the kinds of
    finding it writes (what each means and what to do: kiln.findings.KINDS)."""

    name: str
    wanted: Callable[[Probe], bool]
    cost: Callable[[Probe], float]
    run: Callable[[Probe], None]
    required: Callable[[Probe], bool] = lambda probe: False  # never left out by the budget
    under_autocast: bool = True  # the run's autocast, as training runs it
    needs: str = ""  # what it runs, in words (docs/checks.md)
    cost_class: str = ""  # its cost in observed steps, in words (docs/checks.md)
    finds: tuple[str, ...] = ()  # the kinds of finding it writes (kiln.findings.KINDS)


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


def is_sharded(model: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    return fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())


def probe_model(model: nn.Module, build: Callable[[Any], nn.Module] | None, spec: Any):
    """The model a check runs on: the run's own, or for a sharded FSDP model (whose forward
    and step are its ranks' collectives) a new unsharded build of the same architecture."""
    if build is None or not is_sharded(model):
        return model
    with forked():  # initialising weights draws random numbers: not ours
        return build(spec)


def probe_batch_sizes(batch_size: int, samples_per_rank: int) -> list[int]:
    """1, an odd size other than the batch size, and the epoch's last partial batch."""
    odd = 3 if batch_size != 3 else 5
    sizes = {1, odd, samples_per_rank % batch_size}
    return sorted(n for n in sizes if 0 < n < batch_size)


# ------------------------------------------------------------------------------------ runner


def run_probe_plan(plan: ProbePlan, subject: ProbeSubject) -> ProbeReport:
    """Runs the table's checks the plan asks for, in order, within its budget; raises the
    first check's error (a ProbeFailure naming its check and module). Returns what each took,
    what the budget left out, and what the first real steps must still read."""
    report = ProbeReport()
    probe = Probe(plan, subject, take(subject.batch, subject.mode_batch_size), report)
    due = [c for c in CHECKS if c.name not in plan.passed and c.wanted(probe)]
    try:
        _run_due(probe, due)
    except BaseException as err:  # Ctrl-C too: the report rides on the error, re-raised
        err.probe_report = report  # what ran, and what each took, until the check that failed
        raise
    return report


def _run_due(probe: Probe, due: list[Check]) -> None:
    subject, report = probe.subject, probe.report
    with untouched(subject.model):
        per_sample = _fit_probe_batch(probe) if due else None
        if due:
            backward = any(c.name in NEEDS_A_STEP for c in due)
            with _timed(report, "step probe" if backward else "loss terms"), subject.autocast():
                _observe(probe, backward)
        # A step's cost, the unit of every estimate: warm where it was measured (the observed
        # step is the process's first backward, and pays its first calls).
        probe.step_s = per_sample * probe.size if per_sample else probe.spent_s
        _set_budget(probe)
        for check in due:
            units = check.cost(probe)
            estimate = units * probe.step_s
            if units and not probe.fits(estimate) and not check.required(probe):
                _leave_out(probe, check, estimate)
                continue
            autocast = subject.autocast() if check.under_autocast else contextlib.nullcontext()
            with _timed(report, check.name), autocast, untouched(subject.model):
                check.run(probe)
            report.passed.append(check.name)
            _learn_rate(probe, units, report.seconds.get(check.name, 0.0))


# The checks that read the observed step, or whose cost is estimated in such steps: with none of
# them due, the step is a forward only (for rule 2's loss terms) and nothing is estimated.
NEEDS_A_STEP = {
    "rule 1",
    "rule 3",
    "purity",
    "numerics",
    "conditional parameters",
    "dead gradients",
    "learn probe",
}


def _fit_probe_batch(probe: Probe) -> float | None:
    """Under a budget, the probe batch is cut to what it allows: one sample's eval forward (no
    grad) is timed twice -- the first pays the process's first calls, the second is what a step
    costs warm, three forwards a sample -- the epoch and the budget estimated from it, and the
    batch halved (8, 4, 2) until its observed step takes at most a third of the budget (two
    samples are the least: batch dependence compares them). Returns a step's warm cost per
    sample (None where it was not measured)."""
    plan, subject, report = probe.plan, probe.subject, probe.report
    report.batch_size = probe.size
    if not plan.budget.enforce or subject.epoch_plan is None:
        return None
    seconds, err = attempt(_warm_forward_seconds, probe, take(probe.batch, 1))
    if err is not None:  # a timing, not a check: the checks name what fails
        return None
    per_sample = seconds / FORWARD
    budget = plan.budget.seconds(per_sample * subject.epoch_plan.samples)
    size = probe.size
    while size > 2 and per_sample * size > budget / 3:
        size = max(2, size // 2)
    if size < probe.size:
        probe.batch = take(probe.batch, size)
        report.batch_size = size
    return per_sample


def _warm_forward_seconds(probe: Probe, one: Any) -> float:
    """The second of two eval forwards (no grad) of one sample, the model's state put back."""
    with untouched(probe.model), torch.no_grad(), probe.subject.autocast():
        probe.model.eval()
        for _ in range(2):
            started = time.perf_counter()
            probe.forward(probe.model, one, False)
    return time.perf_counter() - started


def _set_budget(probe: Probe) -> None:
    """The first epoch's time, estimated from the observed step at the training batch size,
    and the budget it sets."""
    report, epoch, budget = probe.report, probe.subject.epoch_plan, probe.plan.budget
    if epoch is not None and probe.size:  # per sample, times the epoch's samples
        report.epoch_estimate_s = probe.step_s / probe.size * epoch.samples
    estimate = report.epoch_estimate_s or 0.0
    report.budget_s = budget.seconds(estimate)
    report.budget_note = budget.explain(estimate)


def _learn_rate(probe: Probe, units: float, seconds: float) -> None:
    """The observed step ran first and cold (the first call of every kernel, the first touch of
    its memory): a check that ran warm tells the cost of a step better. The step's cost, the
    epoch's estimate and the budget follow the cheapest rate seen."""
    if units >= 0.5 and 0 < seconds / units < probe.step_s:
        probe.step_s = seconds / units
        _set_budget(probe)


def _leave_out(probe: Probe, check: Check, estimate: float) -> None:
    """A check the budget has no room for: the learn probe moves into the first real steps;
    the others are named (log and summary.json)."""
    if check.name == "learn probe":
        from kiln.guards.first_steps import LearnReading

        subject, seen = probe.subject, probe.seen
        # The observed step's loss is the reference where it was measured as the learn probe
        # measures (seeded alike, in fp32); else one more forward.
        before = None
        if subject.full_precision and seen is not None and seen.loss is not None:
            before = float(seen.loss.detach())
        with _timed(probe.report, "learn probe (reference loss)"), untouched(probe.model):
            probe.report.learn_reading = LearnReading.start(
                probe.model,
                subject.criterion,
                probe.batch,
                subject.optimizer_for,
                steps=probe.plan.learn_steps,
                dead_layers=probe.report.mostly_dead,
                before=before,
            )
        return
    probe.report.skipped[check.name] = estimate


@contextlib.contextmanager
def _timed(report: ProbeReport, check: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - started
        if elapsed > 1e-4:
            report.seconds[check] = report.seconds.get(check, 0.0) + elapsed


# ---------------------------------------------------------------------- the observed step


def _observe(probe: Probe, backward: bool) -> None:
    """One training step's forward, loss and (`backward`) backward on the probe batch (train
    mode, seeded as the learn probe's first forward), observed; its verdicts come at their
    checks. Its gradients are kept aside; the model's own are put back."""
    from kiln.guards.learn_probe import MEASURE_SEED

    subject = probe.subject
    model = probe_model(subject.model, subject.build, subject.spec)
    batch = copy_batch(probe.batch)

    with untouched(model), forked(seed=MEASURE_SEED):
        # what it raised is raised at its check, after rules 1 and 3
        probe.seen, probe.step_error = attempt(
            observe_step, model, subject.criterion, batch, backward
        )
    if probe.seen is not None:  # a model that changed its batch must not change the rest
        from kiln.guards.purity import changed

        probe.step_changes = changed(probe.seen.batch, probe.seen.before)
        restore_batch(probe.seen)


def _step_seen(probe: Probe) -> StepObservation:
    """The observed step, for a check that reads it; its own error where it could not run."""
    if probe.step_error is not None:
        raise probe.step_error
    assert probe.seen is not None
    return probe.seen


# --------------------------------------------------------------------------------- checks


def _rule1_probes(probe: Probe, new_size: bool) -> list:
    subject = probe.subject
    batch_sizes, epoch = subject.batch_sizes, subject.epoch_plan
    if epoch is not None and epoch.last_batch == 1:  # probed in train mode below
        batch_sizes = [n for n in batch_sizes if n != 1]
    fixed = getattr(subject.model, "fixed_input_size", False)
    # The data's extremes first: a failure there is named by the extreme it met.
    probes = plan_probes(epoch, subject.batch, subject.spec, subject.cases)
    probes += size_probes(subject.batch, subject.spec, batch_sizes, fixed_input_size=fixed)
    return [p for p in probes if p.new_size == new_size]


def _rule1_cost(probe: Probe, new_size: bool) -> float:
    """Each probe's inputs, as a share of the probe batch's (its samples and their sizes: the
    longest texts, a larger image side), a forward or a step."""
    whole = _input_size(probe.batch) or 1
    cost = 0.0
    for size_probe in _rule1_probes(probe, new_size):
        grad = size_probe.new_size or size_probe.backward
        cost += _input_size(size_probe.batch) / whole * (1.0 if grad else FORWARD)
    return cost


def _input_size(batch: Any) -> int:
    """Input values of a batch (its first part: a tensor, or a detector's list of images)."""
    inputs = batch[0]
    return sum(t.numel() for t in inputs) if isinstance(inputs, list) else inputs.numel()


def _run_rule1(probe: Probe, new_size: bool) -> None:
    subject, plan = probe.subject, probe.plan
    for size_probe in _rule1_probes(probe, new_size):
        model = _model_for(probe, size_probe.spec) if size_probe.new_size else None
        model = model or probe_model(subject.model, subject.build, subject.spec)
        try:
            with untouched(model):
                run_size_probe(
                    model,
                    size_probe,
                    subject.criterion.forward,
                    classifier_output_problems,
                    finite=plan.runs("numerics"),
                )
        except NumericsError as err:
            # NaN at a smaller batch where the training batch is finite: statistics over the
            # batch (a std of one sample) are the cause to name, when they are.
            if len(size_probe.batch[0]) < probe.size and plan.runs("batch dependence"):
                from kiln.guards.batch_independence import check_batch_independence

                check_batch_independence(subject.model, probe.batch, subject.criterion.forward)
            raise err


def _model_for(probe: Probe, spec: Any) -> nn.Module:
    """The model for another input size: the run's own where a build for that spec has the
    same parameters (on the meta device: nothing allocated), else a new build."""
    subject = probe.subject
    if spec == subject.spec or subject.build is None:
        return subject.model
    if subject.parameter_shapes is not None:
        own = {name: tuple(p.shape) for name, p in subject.model.named_parameters()}
        shapes, failed = attempt(subject.parameter_shapes, spec)  # failed: built below
        same = failed is None and shapes == own
        if same and not is_sharded(subject.model):
            return subject.model
    with forked():  # initialising weights draws random numbers: not ours
        return subject.build(spec)


def _run_rule3(probe: Probe) -> None:
    plan = probe.plan
    if plan.modes:
        check_train_eval_agreement(
            probe.model, probe.batch, probe.forward, finite=plan.runs("numerics")
        )
    if plan.logits:
        check_logits(probe.model, probe.batch, probe.forward)


def _run_purity(probe: Probe) -> None:
    from kiln.guards.purity import check_purity

    seen = _step_seen(probe)
    check_purity(
        seen,
        probe.subject.criterion,
        probe.forward,
        fresh=lambda: copy_batch(seen.batch),
        step_changes=probe.step_changes,
    )


def _run_numerics(probe: Probe) -> None:
    from kiln.guards.numerics import check_finite

    seen, criterion = _step_seen(probe), probe.subject.criterion
    if seen.loss is not None:
        check_finite(
            seen.model,
            seen.loss,
            probe="the probe step's loss (train mode, with grad)",
            batch=seen.batch,
            rerun=lambda: criterion(seen.model, seen.batch),
        )


def _conditional_cost(probe: Probe) -> float:
    """Each sample alone, a forward and its graph read (small batches cost more per sample)."""
    from kiln.guards.conditional_params import SAMPLES

    return min(probe.size, SAMPLES) / max(probe.size, 1) * 1.5 * FORWARD


def _run_conditional(probe: Probe) -> None:
    """Parameters some samples reach and others not: under DDP that is fatal; and one the whole
    batch leaves without a gradient is then no unused branch (rule 2, below)."""
    from kiln.guards.conditional_params import conditional_error, find_conditional_parameters

    seen = _step_seen(probe)
    model = seen.model
    whole = frozenset(name for name, hit in seen.reached.items() if hit)
    varied = find_conditional_parameters(model, probe.subject.criterion, seen.batch, whole)
    if varied is None:
        return
    probe.used_sometimes = varied[1]
    first = next(iter(sorted(varied[1])), "")
    error = conditional_error(model, varied[0], first.rpartition(".")[0])
    if probe.plan.conditional_is_fatal:
        raise error
    log.warning("%s", error)
    probe.report.findings.append(
        Finding(error.kind, str(error), error.module, error.fix, fatal=False)
    )


def _run_dead_gradients(probe: Probe) -> None:
    """The observed step's gradients: none missing, none exactly zero after a second step, no
    layer all of whose units are off (kiln.guards.live_gradients)."""
    from kiln.guards.live_gradients import check_live_gradients

    report = probe.report
    report.mostly_dead = check_live_gradients(
        _step_seen(probe),
        probe.subject.flag_for_unused,
        used_sometimes=probe.used_sometimes,
        second_step=lambda zero: _second_step(probe, zero),
    )
    for path, detail in report.mostly_dead.items():
        said = f"{path}: {detail} on every sample of the probe batch"
        report.findings.append(Finding("dead gradients", said, path, fatal=False))


def _second_step(probe: Probe, zero: list[str]) -> list[str]:
    """The zero-gradient parameters still at zero after one optimizer step from the probe
    step's gradients (kiln.guards.live_gradients.still_zero), stepped in place with the weights
    kept aside (weights_kept). Where the budget has no room for it, step 2 of the run confirms them
    instead (the trainer's GradientPresence reads its real gradients)."""
    from kiln.guards.live_gradients import still_zero

    if not probe.fits(2.0 * probe.step_s):
        probe.report.pending_zero = list(zero)
        return []
    seen, subject = probe.seen, probe.subject
    model = seen.model
    with untouched(model), weights_kept(model):
        optimizer = (
            subject.optimizer_for(model, 1.0)
            if subject.optimizer_for is not None
            else torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        )
        return still_zero(seen, zero, optimizer, subject.criterion)


def _run_determinism(probe: Probe) -> None:
    from kiln.guards.determinism import check_eval_determinism

    check_eval_determinism(probe.model, probe.batch, probe.forward)


def _run_batch_dependence(probe: Probe) -> None:
    from kiln.guards.batch_independence import check_batch_independence

    check_batch_independence(probe.model, probe.batch, probe.forward)


def _batch_dependence_cost(probe: Probe) -> float:
    from kiln.guards.batch_independence import LOCATE_SAMPLES

    if probe.size < 2 or isinstance(probe.batch[0], list):
        return 0.0
    alone = 2 / probe.size * FORWARD
    leak = min(probe.size, LOCATE_SAMPLES) / probe.size  # the train-mode backward
    return 2 * FORWARD + alone + leak


def _run_padding(probe: Probe) -> None:
    from kiln.guards.padding import check_padding

    subject = probe.subject
    check_padding(probe.model, subject.padding, probe.forward, subject.spec.pad_id)


def _padding_cost(probe: Probe) -> float:
    """Three no-grad forwards of one or two texts (the shortest alone, twice, and a pair)."""
    return 4 / max(probe.size, 1) * FORWARD


def _run_learn(probe: Probe) -> None:
    from kiln.guards.learn_probe import check_can_learn

    subject = probe.subject
    warmed = check_can_learn(  # in place: it keeps the weights on the host and puts them back
        probe_model(subject.model, subject.build, subject.spec),
        subject.optimizer_for,
        subject.criterion,
        probe.batch,
        steps=probe.plan.learn_steps,
        dead_layers=probe.report.mostly_dead,
        warmup_start=probe.plan.warmup_start,
    )
    if warmed:  # the configured lr lowered the loss only after a warm-up: said, the run goes on
        log.warning("learn probe: %s", warmed)
        probe.report.findings.append(Finding("learning rate diverges", warmed, fatal=False))


def _run_device(probe: Probe) -> None:
    from kiln.guards.devices import check_devices_follow

    check_devices_follow(probe.model, probe.batch, probe.forward)


def _run_fp16(probe: Probe) -> None:
    from kiln.guards.fp16 import check_fp16, fp16_items

    check_fp16(probe.model, take(probe.batch, fp16_items(probe.batch, probe.size)), probe.forward)


def _fp16_cost(probe: Probe) -> float:
    """A forward of the items it takes, each an emulated one on a CPU (traced again, about 3
    more, only where it overflows: then the finding is what the time bought)."""
    from kiln.guards.fp16 import CPU_FP16_SLOWDOWN, emulated_fp16, fp16_items

    items = fp16_items(probe.batch, probe.size) / max(probe.size, 1)
    return FORWARD * items * (CPU_FP16_SLOWDOWN if emulated_fp16(probe.batch) else 1)


def _run_loss_terms(probe: Probe) -> None:
    """Rule 2 in every run: each term of the loss a training step computes needs a gradient
    (the observed step's terms, as the first step computes them)."""
    from kiln.guards.branches import check_terms_reach_the_model

    check_terms_reach_the_model(_step_seen(probe).terms)


def _behaviour(name: str) -> Callable[[Probe], bool]:
    return lambda probe: probe.plan.runs(name)


def _fatal_conditionals(probe: Probe) -> bool:
    return probe.plan.conditional_is_fatal  # DDP fails at step 2 without this check


# The order is the order of the findings: rule 1 at the data's extremes and other batch sizes
# first (a failure there is named by the case it met), the observed step's verdicts next, the
# checks that cost more later.
CHECKS: tuple[Check, ...] = (
    Check(
        "rule 1",
        wanted=lambda p: p.plan.sizes and p.subject.build is not None,
        cost=lambda p: _rule1_cost(p, new_size=False),
        run=lambda p: _run_rule1(p, new_size=False),
        needs="the data's extremes and other batch sizes: a forward each (and backward where "
        "the epoch trains on it)",
        cost_class="a forward per case (8 samples: about 1 step)",
        finds=("shapes", "memory layout", "numerics"),
    ),
    Check(
        "rule 1 input size",
        wanted=lambda p: p.plan.sizes and p.subject.build is not None,
        cost=lambda p: _rule1_cost(p, new_size=True),
        run=lambda p: _run_rule1(p, new_size=True),
        needs="a batch of 2 at a second input size, forward and backward (a new build only "
        "where the parameters follow the size)",
        cost_class="a step at 2.25x the pixels of 2 samples",
        finds=("shapes", "memory layout", "numerics"),
    ),
    Check(
        "rule 3",
        wanted=lambda p: p.plan.modes or p.plan.logits and p.plan.sizes,
        cost=lambda p: 3 * FORWARD,  # train, eval, and logits' eval forward
        run=_run_rule3,
        needs="a no-grad forward in each mode (and one for the logits)",
        cost_class="3 forwards",
        finds=("shapes", "numerics", "probabilities"),
    ),
    Check(
        "purity",
        _behaviour("purity"),
        cost=lambda p: FORWARD,
        run=_run_purity,
        # The observed step changed its batch: the finding is in hand, whatever the budget
        # (left out, a model that divided its inputs in place ended `ok`).
        required=lambda p: bool(p.step_changes),
        needs="the observed step's batch, and an eval forward",
        cost_class="1 forward",
        finds=("purity",),
    ),
    Check(
        "padding",
        lambda p: p.plan.runs("batch dependence") and p.subject.padding is not None,
        cost=_padding_cost,
        run=_run_padding,
        needs="the data's shortest text alone unpadded, alone padded to the longest, and "
        "beside the longest (eval)",
        cost_class="3 forwards of 1-2 texts",
        finds=("padding", "batch dependence"),
    ),
    Check(
        "numerics",
        _behaviour("numerics"),
        cost=lambda p: 0.0,
        run=_run_numerics,
        needs="the observed step's loss",
        cost_class="free",
        finds=("numerics",),
    ),
    Check(
        "conditional parameters",
        _behaviour("dead gradients"),
        cost=_conditional_cost,
        run=_run_conditional,
        required=_fatal_conditionals,
        needs="each sample alone: a forward, its autograd graph read (no backward)",
        cost_class="a forward per sample alone (about 1.5 forwards)",
        finds=("conditional parameters",),
    ),
    Check(
        "dead gradients",
        _behaviour("dead gradients"),
        cost=lambda p: 0.0,  # the observed step's gradients; a second step pays its own way
        run=_run_dead_gradients,
        needs="the observed step's gradients (a second step where one is exactly zero)",
        cost_class="free (2 steps where a gradient is exactly zero)",
        finds=("dead gradients", "loss branches"),
    ),
    Check(
        "determinism",
        _behaviour("determinism"),
        cost=lambda p: 3 * FORWARD + FORWARD / max(p.size, 1),
        run=_run_determinism,
        needs="three eval forwards of the batch and one of another",
        cost_class="3 forwards",
        finds=("determinism",),
    ),
    Check(
        "batch dependence",
        _behaviour("batch dependence"),
        cost=_batch_dependence_cost,
        run=_run_batch_dependence,
        needs="the batch whole, reversed and its ends alone (eval); a backward of 5 samples",
        cost_class="about 1.5 steps",
        finds=("batch dependence",),
    ),
    Check(
        "learn probe",
        wanted=lambda p: p.plan.learn_steps > 0 and p.subject.optimizer_for is not None,
        cost=lambda p: 2.0 * p.plan.learn_steps + FORWARD,
        run=_run_learn,
        under_autocast=False,  # fp32: no loss scaling to skip a step
        needs="5 optimizer steps on the batch, the weights kept aside (else the first steps)",
        cost_class="11 steps (or a forward at steps 5, 10, 20)",
        finds=("cannot learn", "learning rate diverges"),
    ),
    Check(
        "device",
        _behaviour("device"),
        cost=lambda p: 3 * FORWARD,  # a traced forward: Python's work on every op
        run=_run_device,
        under_autocast=False,  # what a GPU run meets at its first step, in any precision
        needs="a forward traced op by op",
        cost_class="a traced forward (about 3 forwards)",
        finds=("device",),
    ),
    Check(
        "fp16",
        lambda p: p.plan.fp16,
        cost=_fp16_cost,
        run=_run_fp16,
        under_autocast=False,  # under fp16's own autocast
        needs="a forward under fp16 autocast (on a CPU: of two items), traced op by op where "
        "it overflows",
        cost_class="a forward (on a CPU without fp16 kernels, 2 items at 65); 3 more to trace "
        "an overflow",
        finds=("fp16 overflow",),
    ),
    Check(
        "loss terms",
        lambda p: True,
        cost=lambda p: 0.0,
        run=_run_loss_terms,
        needs="the observed step's loss terms",
        cost_class="free",
        finds=("loss branches",),
    ),
)


@dataclass(frozen=True)
class Elsewhere:
    """A check that runs outside the probe plan, where what it reads exists: the data's before
    a model is built, the schedule's once the planned steps are known, the optimizer's after
    step 1, a detector's boxes after the first evaluation (docs/checks.md lists them)."""

    name: str  # its [FAIL] line's <what>
    when: str
    needs: str
    finds: tuple[str, ...]


ELSEWHERE: tuple[Elsewhere, ...] = (
    Elsewhere(
        "split leak",
        "data loaded, before the model (kiln.data.split_hygiene)",
        "every split's items as digests (rows, token ids, file bytes cached by mtime); "
        "class maps compared",
        ("split leak", "class map"),
    ),
    Elsewhere(
        "box convention",
        "data loaded, detection (kiln.data.box_conventions)",
        "every target's boxes and labels, as listed (no image decoded)",
        ("box convention",),
    ),
    Elsewhere(
        "schedule",
        "planned steps known (kiln.engine.schedule_check)",
        "the lr schedule read at 512 sampled steps on a stand-in optimizer",
        ("schedule",),
    ),
    Elsewhere(
        "optimizer coverage",
        "after step 1 (kiln.guards.optimizer_coverage)",
        "the model's trainable parameters against the optimizer's",
        ("optimizer coverage",),
    ),
    Elsewhere(
        "box predictions",
        "after the first evaluation, detection (kiln.guards.box_predictions)",
        "one eval forward of a validation batch",
        ("box predictions",),
    ),
)


def check_names() -> list[str]:
    """The table's checks, in the order they run (docs/antibodies.md lists them)."""
    return [check.name for check in CHECKS]


__all__ = [
    "CHECKS",
    "ELSEWHERE",
    "Check",
    "Elsewhere",
    "ProbeBudget",
    "ProbePlan",
    "ProbeReport",
    "ProbeSubject",
    "check_names",
    "classifier_output_problems",
    "probe_batch_sizes",
    "probe_model",
    "run_probe_plan",
]
