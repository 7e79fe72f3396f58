"""Rule 1: shapes come from inputs, never from literals in `forward`.

`check_sizes_follow_inputs` runs a model built for each case on batches of several sizes, forward
and backward. At train time `size_probes` derives the cases from one real batch: batch sizes that
differ from the training batch (1, an odd size, the epoch's last partial batch) and a second input
size where the data kind allows one (image side, sequence length, mixed detection sizes)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import attempt
from kiln.guards.numerics import nonfinite_grads
from kiln.guards.rules import DEAD, LAYOUT, NUMERICS, RULE_1, ProbeFailure
from kiln.guards.trace import failing_call
from kiln.guards.tree import describe, iter_tensors, same_container

log = logging.getLogger(__name__)

BN_SINGLE_SAMPLE = "Expected more than 1 value per channel when training"
VIEW_MARKER = "view size is not compatible with input tensor's size and stride"
DETACHED_MARKER = "does not require grad and does not have a grad_fn"


class ShapeInferenceError(ProbeFailure):
    """A model failed on an input size it should handle: a shape is hard-coded somewhere."""

    what = "shapes"


class MemoryLayoutError(ShapeInferenceError):
    """A .view of memory it cannot view (a transposed, permuted or channels-last tensor): no
    literal size is wrong, the memory layout is."""

    kind = "memory layout"


def probe_error(
    model: nn.Module, label: str, inputs: Any, err: BaseException, trace, fix: str = ""
) -> ProbeFailure:
    """A probe's exception, named by what it is: a .view on memory it cannot view (memory
    layout), a value the dtype cannot hold (numerics), else a size that does not follow the
    input (rule 1)."""
    from kiln.guards.numerics import NumericsError, is_overflow

    call = trace.innermost_open if trace is not None else None
    module = call.path if call is not None else ""
    where = f" in {call.where} (its inputs {call.inputs})" if call else ""
    name, shapes = type(model).__name__, describe(inputs)
    if VIEW_MARKER in str(err):
        return MemoryLayoutError(
            f"{LAYOUT}: {name} failed on {label} (input shapes {shapes}){where}: {err}. The "
            "sizes are right but the memory is not contiguous (a transposed or permuted tensor, "
            "channels-last images): use .reshape(...) there (or .contiguous().view(...)); "
            "this is no size written as a literal",
            module=module,
        )
    if DETACHED_MARKER in str(err):
        from kiln.guards.live_gradients import DeadGradientError

        return DeadGradientError(
            f"{DEAD}: {name} on {label} (input shapes {shapes}){where}: {err}. The output is "
            "detached from the graph (a .detach(), torch.no_grad(), or a trip through "
            ".item()/.numpy() in forward): no gradient reaches any parameter",
            module=module,
        )
    if is_overflow(err):
        return NumericsError(
            f"{NUMERICS}: {name} failed on {label} (input shapes {shapes}){where}: {err}. A "
            "constant beyond the range of the tensor's dtype (masked_fill(mask, -1e9) on a "
            "float16 tensor): take it from the dtype (torch.finfo(x.dtype).min)",
            module=module,
        )
    return ShapeInferenceError(
        _failure(model, label, inputs, err, trace, fix), module=module, fix=fix
    )


@dataclass
class SizeProbe:
    label: str  # "batch 1", "the epoch's last batch (29)", "images 12x12", ...
    spec: Any  # the DataSpec to build the model for
    batch: Any  # (inputs, targets), collated as the loader would
    new_size: bool = False  # a second input size: a model is built for it, and backward runs
    backward: bool = False  # backward too (an extreme of the data, at the data's own spec)
    train_only: bool = False  # the plan trains on it: no eval-mode retry for BatchNorm
    fix: str = ""  # what to change when it fails (a batch of 1 in the plan: data.drop_last=true)


@dataclass(frozen=True)
class EpochPlan:
    """How one rank's epoch is cut into batches: what the probes must survive."""

    samples: int  # training samples per rank and epoch
    batch_size: int  # per rank
    drop_last: bool = False  # data.drop_last: the last partial batch is not trained on

    @property
    def last_batch(self) -> int:
        """Samples in the epoch's last batch when it is partial (0: every batch is full)."""
        return 0 if self.drop_last else self.samples % self.batch_size

    def other_batch_size(self) -> int:
        """The batch size nearest the current one that leaves no batch of 1."""
        for step in range(1, self.batch_size + self.samples):
            for size in (self.batch_size + step, self.batch_size - step):
                if size >= 2 and self.samples % size != 1:
                    return size
        return self.batch_size


def plan_probes(plan: EpochPlan | None, base: Any, spec: Any, cases=()) -> list[SizeProbe]:
    """Probes from the data's own plan: a batch of 1 trained on (when the epoch ends with
    one), and each extreme case of the data (longest sequences, images with no box, ...)."""
    probes = []
    if plan is not None and plan.last_batch == 1:
        other = plan.other_batch_size()
        probes.append(
            SizeProbe(
                f"the epoch's last batch, of 1 sample, in train mode ({plan.samples} samples per "
                f"epoch in batches of {plan.batch_size})",
                spec,
                take(base, 1),
                backward=True,
                train_only=True,
                fix=f"set data.drop_last=true (that sample is left out of each epoch), or "
                f"data.batch_size={other} ({plan.samples} samples leave a last batch of "
                f"{plan.samples % other})",
            )
        )
    fix = (
        "The training data holds such items, so some step of the run meets them: the model "
        "must handle them (read sizes and counts from the input, never assume them)."
    )
    for label, batch in cases:
        probes.append(SizeProbe(label, spec, batch, backward=True, fix=fix))
    return probes


def _scalar_objective(output: Any) -> torch.Tensor:
    tensors = [t for _, t in iter_tensors(output, "output") if t.is_floating_point()]
    return sum(t.float().sum() for t in tensors)


def _failure(
    model: nn.Module, label: str, inputs: Any, err: BaseException, trace, fix: str = ""
) -> str:
    call = trace.innermost_open if trace is not None else None
    where = f" in {call.where} (its inputs {call.inputs})" if call else ""
    todo = (
        f"{fix}"
        if fix
        else "Sizes must be read from the input (x.shape) or the data spec, never "
        "written as literals in forward."
    )
    return (
        f"{RULE_1}: {type(model).__name__} failed on {label} (input shapes {describe(inputs)})"
        f"{where}: {err}. {todo}"
    )


def check_sizes_follow_inputs(
    build: Callable[[], nn.Module],
    cases: Iterable[tuple[str, Any]],
    call: Callable[[nn.Module, Any], Any] = lambda model, inputs: model(inputs),
) -> None:
    """`cases` are (label, inputs) pairs, e.g. ("batch 3 at 40x40", tensor). For each, a fresh
    model runs forward and backward; every parameter that takes part must get a finite grad."""
    for label, inputs in cases:
        model = build()
        model.train()
        err, trace = failing_call(
            model, lambda m=model, x=inputs: _scalar_objective(call(m, x)).backward()
        )
        if err is not None:
            raise probe_error(model, label, inputs, err, trace) from err
        bad = nonfinite_grads(model)
        if bad:
            raise ShapeInferenceError(f"{RULE_1}: {label}: non-finite gradient in {bad[0]}")


# ---------------------------------------------------------------------------------------------
# Probe batches derived from one real batch


def take(batch: Any, n: int) -> Any:
    """The first n samples of a collated (inputs, targets) batch, repeating samples when it has
    fewer."""
    return select(batch, [i % len(batch[0]) for i in range(n)])


def select(batch: Any, index: list[int]) -> Any:
    """The samples `index` of a collated (inputs, targets) batch, in that order (every tensor
    whose first dimension is the batch, every per-sample list entry)."""
    size = len(batch[0])
    return same_container(batch, [_index(part, index, size) for part in batch])


def _index(obj: Any, index: list[int], size: int) -> Any:
    if isinstance(obj, torch.Tensor) and obj.dim() and obj.shape[0] == size:
        return obj[index]
    if isinstance(obj, list) and len(obj) == size:  # one entry per sample (images, targets)
        return [obj[i] for i in index]
    if isinstance(obj, tuple):
        return tuple(_index(o, index, size) for o in obj)
    if isinstance(obj, dict):
        return {k: _index(v, index, size) for k, v in obj.items()}
    return obj


def resized(batch: Any, spec: Any) -> tuple[Any, Any, str] | None:
    """The batch at a second input size, with the spec a model for it is built from, and a
    label; None where the data kind has no second size."""
    inputs, targets = batch
    if spec.input_kind == "image" and inputs.dim() == 4:
        height, width = inputs.shape[-2:]
        new = (height + max(2, height // 2), width + max(2, width // 2))
        images = F.interpolate(inputs.float(), size=new, mode="bilinear", align_corners=False)
        return (
            (images.to(inputs.dtype), targets),
            dataclasses.replace(spec, image_size=new),
            (f"images {new[0]}x{new[1]} (trained at {height}x{width})"),
        )
    if spec.input_kind == "tokens" and inputs.dim() == 2 and inputs.shape[1] > 1:
        length = inputs.shape[1]
        shorter = inputs[:, : max(1, length // 2)].clone()
        shorter[:, 0] = torch.where(shorter[:, 0] == spec.pad_id, inputs[:, 0], shorter[:, 0])
        return (shorter, targets), spec, f"sequences of {shorter.shape[1]} tokens (not {length})"
    if spec.input_kind == "image_list" and isinstance(inputs, list):
        scaled_images, scaled_targets = [], []
        for i, (image, target) in enumerate(zip(inputs, targets, strict=True)):
            factor = 0.75 if i % 2 == 0 else 1.0  # keep the sizes mixed
            size = [max(16, round(s * factor)) for s in image.shape[-2:]]
            scaled_images.append(F.interpolate(image[None], size=size, mode="bilinear")[0])
            scale = torch.tensor([size[1] / image.shape[-1], size[0] / image.shape[-2]] * 2)
            scaled_targets.append({**target, "boxes": target["boxes"] * scale.to(image.device)})
        return (scaled_images, scaled_targets), spec, "a batch of mixed, rescaled images"
    return None


def size_probes(
    batch: Any, spec: Any, batch_sizes: Iterable[int], *, fixed_input_size: bool = False
) -> list[SizeProbe]:
    """Probes from one real batch: each batch size at the data's size, then a second size
    unless the model declares `fixed_input_size` (a ViT built for one side)."""
    probes = []
    for n in sorted(set(batch_sizes)):
        probes.append(SizeProbe(f"batch {n}", spec, take(batch, n)))
    if fixed_input_size:
        log.info("rule 1: the model takes one input size (fixed_input_size): no second size")
        return probes
    second = resized(take(batch, 2), spec)
    if second is not None:
        other_batch, other_spec, label = second
        probes.append(SizeProbe(f"batch 2 of {label}", other_spec, other_batch, new_size=True))
    return probes


def run_size_probe(
    model: nn.Module,
    probe: SizeProbe,
    forward: Callable[[nn.Module, Any, bool], Any],
    check_output: Callable[[nn.Module, Any, int, Any], list[str]],
    finite: bool = True,
) -> None:
    """`model` (built for the probe's spec, and free to be changed) runs a train-mode forward on
    the probe's batch, and backward too at a new input size; its output must fit the batch and
    (`finite`: the numerics check) hold no NaN or Inf. BatchNorm cannot train on a single
    sample, so such a batch runs in eval mode only."""
    size = len(probe.batch[0])
    model.train()
    outputs = []
    grad = probe.new_size or probe.backward

    def step() -> None:
        with torch.set_grad_enabled(grad):
            output = forward(model, probe.batch, True)
        outputs.append(output)
        if grad:
            _scalar_objective(output).backward()

    err, trace = failing_call(model, step)
    if err is not None and BN_SINGLE_SAMPLE in str(err) and probe.train_only:
        raise probe_error(model, probe.label, probe.batch[0], err, trace, probe.fix) from err
    if err is not None and BN_SINGLE_SAMPLE in str(err):
        model.eval()
        outputs.clear()
        with torch.no_grad():
            err, trace = failing_call(
                model, lambda: outputs.append(forward(model, probe.batch, False))
            )
        if err is not None and BN_SINGLE_SAMPLE in str(err):
            from kiln.guards.rules import RULE_3
            from kiln.guards.shape_check import ShapeContractError

            call = trace.innermost_open
            where = call.where if call else "a module"
            raise ShapeContractError(
                f"{RULE_3}: in eval mode {where} still normalises with the batch's own "
                "statistics (it fails on a single sample): a module is forced into train mode; "
                "check for .train() calls in forward or a train() override"
            ) from err
    if err is not None:
        from kiln.guards.devices import diagnose, is_device_mismatch

        if is_device_mismatch(err):
            raise diagnose(err, model, lambda: forward(model, probe.batch, True), probe.batch)
        fix = probe.fix
        if not grad and model.training and _passes_with_grad(model, probe, forward):
            fix = (
                "What varied: grad mode: the same batch with grad, as training runs it, goes "
                "through; without grad (as evaluation and inference run) it raises. A forward "
                "must not depend on torch.is_grad_enabled()."
            )
        label = probe.label + _grad_note(grad)
        raise probe_error(model, label, probe.batch[0], err, trace, fix) from err
    if finite:
        from kiln.guards.numerics import check_finite

        mode = "train" if model.training else "eval"
        check_finite(
            model,
            outputs[0],
            probe=f"{probe.label} in {mode} mode{_grad_note(grad)}",
            batch=probe.batch,
            rerun=lambda: forward(model, probe.batch, model.training),
        )
    problems = check_output(model, outputs[0], size, probe.spec) if model.training else []
    if problems:
        raise ShapeInferenceError(
            f"{RULE_1}: {type(model).__name__} on {probe.label}{_grad_note(grad)}: "
            + "; ".join(problems)
            + ". "
            + what_varied(model, probe, forward, check_output, grad)
        )


def _grad_note(grad: bool) -> str:
    return " (with grad)" if grad else " (no grad)"


def _passes_with_grad(model: nn.Module, probe: SizeProbe, forward) -> bool:
    def with_grad():
        with torch.enable_grad():
            forward(model, probe.batch, True)

    _, err = attempt(with_grad)
    return err is None  # what it raised: not this size


def what_varied(model: nn.Module, probe: SizeProbe, forward, check_output, grad: bool) -> str:
    """Which of grad mode and batch size the wrong output follows, and the first module whose
    output differs between the two runs; else the output is wrong for this data itself."""
    from kiln.guards.outputs import producer
    from kiln.guards.varied import first_divergence, grad_mode_divergence, in_grad_mode
    from kiln.guards.varied import module_outputs as outputs_of

    size = len(probe.batch[0])
    if not grad:
        with torch.enable_grad():
            correct_with_grad = not check_output(
                model, forward(model, probe.batch, True), size, probe.spec
            )
        if correct_with_grad:
            where = grad_mode_divergence(forward, model, probe.batch)
            return (
                "What varied: grad mode: the same batch with grad, as training runs it, gives "
                "the right output; without grad, as evaluation and inference run, it does not; "
                f"the first module whose output differs: {where}. A forward must not depend on "
                "torch.is_grad_enabled()."
            )
    other = take(probe.batch, size + 2)
    where = first_divergence(
        outputs_of(model, in_grad_mode(forward, model, probe.batch, grad)),
        outputs_of(model, in_grad_mode(forward, model, other, grad)),
        (f"batch-{size}", f"batch-{size + 2}"),
        (size, size + 2),
    )
    if where:
        return (
            f"What varied: the batch size ({size} and {size + 2}); the first module whose "
            f"output does not follow it: {where}. Output sizes must follow the batch and the "
            "data spec, never literals."
        )
    made_by = producer(model, lambda: forward(model, probe.batch, True), _main_output)
    return (
        f"What varied: nothing the output follows: at every batch size it is wrong for this "
        f"data (made by {made_by or '<model>'}). Output sizes must follow the batch and the "
        "data spec (spec.num_classes), never literals."
    )


def _main_output(output: Any) -> Any:
    return output["logits"] if isinstance(output, dict) and "logits" in output else output
