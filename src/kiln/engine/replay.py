"""Replay a failed run's failing step, deterministically, and bisect it (what `kiln triage` ranks
causes from). From the run's own config, the newest full checkpoint before the failing step (or
the initial weights, which the seed makes again) is restored and the steps up to it are run
again through the same loader, recording each update's size lr·|g|/|w| per parameter group. The
failing step then runs on the batch the run saved (nan_batch.pt), checked against the one the
loader gives, under tracing:

- are the inputs finite?
- the first operation whose output is non-finite while its inputs are finite, with the module
  it ran in, its input statistics and dtype (a TorchDispatchMode sees every op);
- the first module whose forward output is non-finite; which loss terms are;
- whether the same forward in fp32 is finite (an fp16 overflow, when it is);
- the first parameter whose gradient is non-finite; the update that step would make.

A non-finite evaluation replays the evaluation from the checkpoint written after it: the first
validation batch that goes non-finite, the module, and the same batch in train mode. A run
stopped before step 1 by a probe replays the probes."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf

from kiln import checkpoint as files
from kiln.config import GROUP_SCHEMAS, KilnConfig, option_from_dict
from kiln.config.base import composable, frozen, thaw
from kiln.engine.batches import move_to
from kiln.engine.distributed import DistInfo
from kiln.engine.environment import run_environment
from kiln.engine.run_end import FAILING_BATCHES
from kiln.errors import attempt
from kiln.findings import Finding, finding_of
from kiln.guards.no_trace import untouched
from kiln.guards.numerics import (
    FirstNonFinite,
    FirstOp,
    ModuleStack,
    nonfinite_count,
    tensor_summary,
)
from kiln.guards.tree import iter_tensors
from kiln.registry import GROUP_REGISTRIES, load_plugins

log = logging.getLogger(__name__)

MAX_REPLAY_STEPS = (
    5000  # beyond this many steps to re-run, the failing step runs from the checkpoint
)


@dataclass
class StepRecord:
    """One replayed optimizer step."""

    step: int
    loss: float
    grad_norm: float
    update: list[dict]  # per parameter group: lr, grad_norm, weight_norm, ratio (lr·|g|/|w|)


@dataclass
class Replay:
    failing_step: int | None = None
    what: str = ""  # "loss NaN", "val_loss NaN", "probe"
    start: str = ""  # where the replay started
    steps: list[StepRecord] = field(default_factory=list)
    batch_matches: bool | None = None  # the loader's batch at the failing step equals the saved
    reproduced: bool | None = None  # the failure happened again
    nonfinite_inputs: dict[str, dict] = field(default_factory=dict)  # tensor path -> counts
    first_op: FirstOp | None = None
    first_module: tuple[str, str] | None = None  # (path, class) of the first non-finite output
    bad_terms: list[str] = field(default_factory=list)
    fp32_finite: bool | None = None  # the same forward without autocast: finite?
    autocast_dtype: str | None = None
    first_bad_grad: str | None = None
    update: list[dict] = field(default_factory=list)  # the failing step's, per group
    eval_batch: int | None = None  # the first non-finite validation batch
    train_mode_finite: bool | None = None  # that batch in train mode
    buffers: dict[str, str] = field(default_factory=dict)  # the failing module's buffers
    probe_error: str = ""  # a run stopped by a probe: its message, replayed
    probe_check: tuple[str, str] = ("", "")  # (the check's name, the module it named), replayed
    probe_finding: Finding | None = None  # what the replayed check found, as data
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the run's parts


def config_from_plain(plain: dict) -> KilnConfig:
    """A run's typed config from its plain record (.hydra/config.yaml or a checkpoint)."""
    load_plugins(plain.get("plugins", []))
    groups = {
        group: option_from_dict(group, plain[group]) for group in GROUP_REGISTRIES if group in plain
    }
    for group, schema in GROUP_SCHEMAS.items():
        if group in plain:
            merged = OmegaConf.merge(OmegaConf.structured(composable(schema)), plain[group])
            groups[group] = frozen(OmegaConf.to_object(merged))
    top = {f.name for f in dataclasses.fields(KilnConfig)}
    node = OmegaConf.structured(composable(KilnConfig))
    for group, typed in groups.items():
        node[group] = OmegaConf.structured(thaw(typed))
    node = OmegaConf.merge(node, {k: v for k, v in plain.items() if k in top and k not in groups})
    return frozen(OmegaConf.to_object(node))


def for_replay(cfg: KilnConfig) -> KilnConfig:
    """One process, no probes, no loggers, no workers: the steps themselves, as the run took
    them (the probes and evaluations leave no trace on the training state)."""
    trainer = dataclasses.replace(
        cfg.trainer,
        probe_sizes=False,
        shape_check=False,
        compile=False,
        distributed=False,
        find_batch_size=False,
        log_activations=False,
    )
    data = dataclasses.replace(cfg.data, num_workers=0)
    logger = dataclasses.replace(cfg.logger, backends=[])
    return dataclasses.replace(cfg, trainer=trainer, data=data, logger=logger, resume=None)


class NoRecorder:
    activations = None

    def __init__(self):
        self.history: list[dict] = []

    def __call__(self, metrics: dict, step: int) -> None:
        self.history.append({"step": step, **metrics})


def failing_step(run_dir: Path, summary: dict) -> tuple[int | None, str]:
    """(step, what) from the run's record: the saved batch, else its error line."""
    saved = run_dir / FAILING_BATCHES
    if saved.is_file():
        record = torch.load(saved, map_location="cpu", weights_only=True)
        return int(record["step"]), str(record.get("kind", "loss NaN"))
    error = summary.get("error") or ""
    found = re.search(r"(\S+ (?:NaN|Inf)) @ step (\d+)", error)
    if found:
        return int(found.group(2)), found.group(1)
    stopped_before_step_1 = error and not summary.get("steps")  # a probe (or start-up) refused it
    return (0, "probe") if stopped_before_step_1 else (None, "")


def start_checkpoint(run_dir: Path, before: int, at_most: bool = False):
    """The newest full-state checkpoint of the run before step `before` (at it, `at_most`)."""
    best = None
    for path in files.candidates(run_dir / "checkpoints"):
        try:
            ckpt = files.load_checkpoint(path, consolidate=False)
        except files.CheckpointError:
            continue
        if "optimizer" not in ckpt:
            continue
        step = ckpt["state"]["global_step"]
        if (step <= before if at_most else step < before) and (best is None or step > best[2]):
            best = (path, ckpt, step)
    return best


# ------------------------------------------------------------------------------ instruments


def _norm(tensors: list[torch.Tensor]) -> float:
    return (
        float(torch.linalg.vector_norm(torch.stack([t.norm() for t in tensors])))
        if tensors
        else 0.0
    )


def group_updates(optimizer: torch.optim.Optimizer) -> list[dict]:
    """lr·|g|/|w| per learning rate, from the gradients the step is about to apply. Groups that
    share a learning rate are measured together: kiln splits a classifier's head into its own
    group (for optimizer.head_lr_mult), and a small head alone would read as an oversized update
    that the model as a whole does not take."""
    by_lr: dict[float, list[int]] = {}
    for i, group in enumerate(optimizer.param_groups):
        by_lr.setdefault(float(group["lr"]), []).append(i)
    found = []
    for lr, indices in by_lr.items():
        params = [p for i in indices for p in optimizer.param_groups[i]["params"]]
        g = _norm([p.grad.detach().float() for p in params if p.grad is not None])
        w = _norm([p.detach().float() for p in params])
        found.append(
            {
                "group": indices[0] if len(indices) == 1 else indices,
                "lr": lr,
                "grad_norm": g,
                "weight_norm": w,
                "ratio": lr * g / max(w, 1e-12),
            }
        )
    return found


# --------------------------------------------------------------------------------- the replay


def replay(run_dir: Path, summary: dict, plain_config: dict) -> Replay:
    run_dir = Path(run_dir)
    found = Replay()
    step, what = failing_step(run_dir, summary)
    found.failing_step, found.what = step, what
    if step is None:
        return found
    # The run's own environment variables: a plugin may read them (kiln.engine.environment).
    with (
        run_environment(run_dir) as notes,
        tempfile.TemporaryDirectory(prefix="kiln-replay-") as scratch,
    ):
        found.notes += notes
        run_cfg = config_from_plain(plain_config)
        if run_cfg.trainer.distributed:
            found.notes.append(
                "a distributed run, replayed in one process: rank 0's saved batch at the failing "
                "step, the steps before it on one rank's share of the data"
            )
        cfg = for_replay(run_cfg)
        if what == "probe":
            ddp = run_cfg.trainer.distributed and run_cfg.trainer.strategy == "ddp"
            fatal = ddp and not run_cfg.trainer.find_unused_parameters
            return _replay_probes(cfg, Path(scratch), found, conditional_is_fatal=fatal)
        evaluation = what.startswith("val_")
        # An evaluation replays from the checkpoint written after its step, a step from before it
        start = _start_state(run_dir, step, found, at_most=evaluation)
        trainer = _build(cfg, Path(scratch), restore=start)
        if evaluation:
            return _replay_evaluation(trainer, found)
        return _replay_steps(trainer, run_dir, step, found)


def _build(
    cfg: KilnConfig,
    scratch: Path,
    conditional_is_fatal: bool = False,
    restore: dict | None = None,
):
    """The run's Trainer, built in one process as train() builds it (kiln.engine.run.build_run),
    at the state of `restore` when given."""
    from kiln.engine.run import build_run
    from kiln.engine.seeding import set_deterministic

    set_deterministic(cfg.trainer.deterministic)
    device = torch.device(
        "cuda" if torch.cuda.is_available() and str(cfg.device) != "cpu" else "cpu"
    )
    built = build_run(
        cfg,
        scratch,
        DistInfo(),
        device,
        NoRecorder(),
        conditional_is_fatal=conditional_is_fatal,
        restore=restore,
    )
    return built.trainer


def _start_state(run_dir: Path, before: int, found: Replay, at_most: bool = False) -> dict | None:
    """The checkpoint the replay starts from (start_checkpoint), said in found.start; None: the
    initial weights, which the run's seed builds again."""
    start = start_checkpoint(run_dir, before, at_most)
    if start is None:
        found.start = "the initial weights (step 0: the run's seed builds them again)"
        return None
    path, ckpt, step = start
    found.start = f"{path} (step {step})"
    return ckpt


def _epochs(trainer) -> Iterator[Iterator]:
    """Each epoch's batch iterator from the trainer's position, as fit draws them (an epoch
    ended moves the position to the next one)."""
    s = trainer.state
    while True:
        if s.batch_in_epoch >= trainer.batches_per_epoch:
            s.epoch, s.batch_in_epoch = s.epoch + 1, 0
        yield trainer.epoch_batches()


def _replay_steps(trainer, run_dir: Path, step: int, found: Replay) -> Replay:
    """The steps up to the failing `step` from the trainer's state (found.start), then that
    step bisected on the batch the run saved."""
    s = trainer.state
    updates: list[list[dict]] = []
    hook = trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: updates.append(group_updates(opt))
    )
    if step - 1 - s.global_step > MAX_REPLAY_STEPS:
        found.notes.append(
            f"{step - 1 - s.global_step} steps lie between {found.start} and step {step}: the "
            "failing step runs from that checkpoint, not from the state it really had"
        )
    try:  # the steps before the failing one, as fit ran them (none past MAX_REPLAY_STEPS)
        epochs = _epochs(trainer)
        batches = next(epochs)
        replaying = step - 1 - s.global_step <= MAX_REPLAY_STEPS
        while replaying and s.global_step < step - 1:
            for result in trainer.epoch_steps(batches):
                found.steps.append(
                    StepRecord(
                        s.global_step,
                        float(result.loss),
                        float(result.grad_norm) if result.grad_norm is not None else math.nan,
                        updates[-1] if updates else [],
                    )
                )
                updates.clear()
                if s.global_step >= step - 1:
                    break
            if s.batch_in_epoch >= trainer.batches_per_epoch:  # the next step opens an epoch
                batches = next(epochs)
        window = trainer.window_size()
        loader_batches = [move_to(next(batches), trainer.device) for _ in range(window)]
    finally:
        hook.remove()
    saved = _saved_batches(run_dir, trainer.device)
    if saved is not None:
        found.batch_matches = _same(saved, loader_batches)
        micro_batches = saved
    else:
        found.notes.append("no saved batch (nan_batch.pt): the loader's batch at the step is used")
        micro_batches = loader_batches
    _bisect(trainer, micro_batches, found)
    return found


def _saved_batches(run_dir: Path, device) -> list | None:
    path = run_dir / FAILING_BATCHES
    if not path.is_file():
        return None
    record = torch.load(path, map_location="cpu", weights_only=True)
    return [move_to(batch, device) for batch in record["batches"]]


def _same(a: list, b: list) -> bool:
    flat_a = [t for batch in a for _, t in iter_tensors(batch)]
    flat_b = [t for batch in b for _, t in iter_tensors(batch)]
    return len(flat_a) == len(flat_b) and all(
        x.shape == y.shape and torch.equal(x.cpu(), y.cpu())
        for x, y in zip(flat_a, flat_b, strict=True)
    )


def _bisect(trainer, micro_batches: list, found: Replay) -> None:
    """The failing step, traced: inputs, forward, loss, fp32 forward, backward, update."""
    model, criterion = trainer.raw_model, trainer.criterion
    for i, batch in enumerate(micro_batches):
        for path, t in iter_tensors(batch):
            if t.is_floating_point() and not torch.isfinite(t).all():
                found.nonfinite_inputs[f"micro-batch {i}: {path}" if i else path] = {
                    "nan": int(torch.isnan(t).sum()),
                    "inf": int(torch.isinf(t).sum()),
                    "shape": list(t.shape),
                }
    precision = trainer.precision
    found.autocast_dtype = (
        str(precision.autocast_dtype).removeprefix("torch.") if precision.autocast_dtype else None
    )
    model.train()
    order: list[str] = []
    names = {p: n for n, p in model.named_parameters()}
    grad_hooks = [
        p.register_post_accumulate_grad_hook(lambda p: order.append(names[p]))
        for p in model.parameters()
        if p.requires_grad
    ]
    modules = ModuleStack(model)
    tracer = FirstNonFinite(modules)
    window = len(micro_batches)
    try:
        with tracer:
            for batch in micro_batches:
                with precision.autocast():
                    loss, terms = criterion(model, batch)
                found.bad_terms += [n for n, t in terms.items() if not torch.isfinite(t).all()]
                found.reproduced = bool(found.reproduced) or not bool(torch.isfinite(loss))
                tracer.backward = True
                with contextlib.suppress(RuntimeError):
                    (loss / window).backward()
                tracer.backward = False
    finally:
        modules.close()
        for handle in grad_hooks:
            handle.remove()
    found.first_op, found.first_module = tracer.found, modules.first_bad
    found.bad_terms = list(dict.fromkeys(found.bad_terms))
    params = dict(model.named_parameters())
    bad = [n for n in order if params[n].grad is not None and not params[n].grad.isfinite().all()]
    found.first_bad_grad = bad[0] if bad else None
    found.update = group_updates(trainer.optimizer)
    trainer.optimizer.zero_grad(set_to_none=True)
    if precision.autocast_dtype is not None and found.first_op is not None:
        with torch.no_grad():
            outputs = [criterion(model, batch)[0] for batch in micro_batches]
        found.fp32_finite = all(bool(torch.isfinite(o)) for o in outputs)
    if found.first_module is not None:
        path = found.first_module[0]
        module = model.get_submodule(path) if path else model
        found.buffers = {
            name: _describe_values(b) for name, b in module.named_buffers(recurse=False)
        }


def _describe_values(t: torch.Tensor) -> str:
    stats = tensor_summary(t)
    if t.numel() and stats.get("zeros") == t.numel():
        return "all zeros"
    return f"min {stats.get('min', math.nan):.3g}, max {stats.get('max', math.nan):.3g}"


def _replay_evaluation(trainer, found: Replay) -> Replay:
    """The evaluation of the trainer's state: the failing step's (found.start: the checkpoint
    written after it)."""
    model, forward = trainer.raw_model, trainer.criterion.forward
    model.eval()
    bad_batch = None
    with torch.no_grad():
        for i, batch in enumerate(trainer.val_batches()):
            with trainer.precision.autocast():
                output = forward(model, batch, False)
            if nonfinite_count(output):
                found.eval_batch, bad_batch = i, batch
                break
    if bad_batch is None:
        found.reproduced = False
        return found
    found.reproduced = True
    modules = ModuleStack(model)
    tracer = FirstNonFinite(modules)
    try:
        with torch.no_grad(), tracer, trainer.precision.autocast():
            forward(model, bad_batch, False)
    finally:
        modules.close()
    found.first_op, found.first_module = tracer.found, modules.first_bad
    with untouched(model), torch.no_grad(), trainer.precision.autocast():
        model.train()
        found.train_mode_finite = not nonfinite_count(forward(model, bad_batch, True))
    if found.first_module is not None:
        path = found.first_module[0]
        module = model.get_submodule(path) if path else model
        found.buffers = {n: _describe_values(b) for n, b in module.named_buffers(recurse=False)}
    return found


def _replay_probes(
    cfg: KilnConfig, scratch: Path, found: Replay, conditional_is_fatal: bool = False
) -> Replay:
    """A run stopped before step 1: its probes again (they take the data's extremes, never a
    sample, so they fail again the same way; parameters used only in some steps stop a run
    that was distributed, as they stopped it)."""
    # Every check, whatever it costs and whatever a cache says the model passed.
    trainer_cfg = dataclasses.replace(
        cfg.trainer,
        probe_sizes=True,
        shape_check=True,
        probe_cache=False,
        probe_budget=dataclasses.replace(cfg.trainer.probe_budget, enforce=False),
    )
    trainer = _build(
        dataclasses.replace(cfg, trainer=trainer_cfg),
        scratch,
        conditional_is_fatal=conditional_is_fatal,
    )
    _, err = attempt(trainer.run_probes)
    if err is not None:  # the probe's own message is the evidence
        found.probe_error, found.reproduced = f"{type(err).__name__}: {err}", True
        found.probe_check = (getattr(err, "what", "") or "", getattr(err, "module", "") or "")
        found.probe_finding = finding_of(err)
        if found.probe_check[0] == "numerics":
            _bisect_probe(trainer, found, fp16=getattr(err, "kind", "") == "fp16 overflow")
    else:
        found.reproduced = False
    return found


def _bisect_probe(trainer, found: Replay, fp16: bool) -> None:
    """A NaN/Inf a probe met, traced: the probe batch's own values, then the first operation
    that made NaN/Inf out of finite inputs in a training forward and loss (the batch, then one
    sample of it), under the run's autocast (fp16's when the fp16 probe met it), and whether the
    same forward is finite in fp32."""
    from kiln.guards.input_sizes import take

    parts, criterion = trainer.parts, trainer.criterion
    batch = take(parts.probe_subject.batch, parts.probe_subject.mode_batch_size)
    for path, t in iter_tensors(batch):
        if t.is_floating_point() and not torch.isfinite(t).all():
            found.nonfinite_inputs[path] = {
                "nan": int(torch.isnan(t).sum()),
                "inf": int(torch.isinf(t).sum()),
                "shape": list(t.shape),
            }
    if found.nonfinite_inputs:
        return
    model = copy.deepcopy(trainer.raw_model)
    model.train()
    device = next((t.device.type for _, t in iter_tensors(batch)), "cpu")
    autocast = (
        (lambda: torch.autocast(device, dtype=torch.float16))
        if fp16
        else trainer.precision.autocast
    )
    for candidate in (batch, take(batch, 1)):
        modules = ModuleStack(model)
        tracer = FirstNonFinite(modules)
        try:
            terms, err = attempt(_loss_terms, criterion, model, candidate, tracer, autocast)
        finally:
            modules.close()
        terms = terms if err is None else {}  # err: what was traced up to it stands
        if tracer.found is not None:
            found.first_op, found.first_module = tracer.found, modules.first_bad
            found.bad_terms = [n for n, t in terms.items() if not torch.isfinite(t).all()]
            with torch.no_grad():
                found.fp32_finite = bool(torch.isfinite(criterion(model, candidate)[0]))
            return


def _loss_terms(criterion, model, batch, tracer, autocast) -> dict:
    with torch.no_grad(), tracer, autocast():
        return criterion(model, batch)[1]


# ------------------------------------------------------------------ checking a suggested fix

LEARNING_KEYS = ("optimizer.", "scheduler.", "trainer.gradient_clip_val", "model.", "loss.")


def changes_learning(overrides: list[str]) -> bool:
    return any(o.split("=", 1)[0].startswith(LEARNING_KEYS) for o in overrides)


def check_override(
    run_dir: Path, plain_config: dict, overrides: list[str]
) -> tuple[bool, str, float | None]:
    """Whether the run with `overrides` (key=value) lowers the loss: the learn probe's steps on
    the run's own probe batch, on a model built as the run built it. Returns (whether it fell,
    what it saw, the lr whose first step would be a healthy one); raises when it cannot run."""
    from kiln.guards.input_sizes import take
    from kiln.guards.learn_probe import STEPS, learn

    plain = copy.deepcopy(plain_config)
    for override in overrides:
        key, _, value = override.partition("=")
        node = plain
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    with (
        run_environment(run_dir),
        tempfile.TemporaryDirectory(prefix="kiln-check-") as scratch,
    ):
        cfg = for_replay(config_from_plain(plain))
        trainer = _build(cfg, Path(scratch))
        parts = trainer.parts
        model = copy.deepcopy(trainer.raw_model)
        batch = take(parts.probe_subject.batch, parts.probe_subject.mode_batch_size)
        result = learn(
            model, parts.probe_subject.optimizer_for(model, 1.0), trainer.criterion, batch, STEPS
        )
    saw = (
        f"{STEPS} steps with {' '.join(overrides)} on one fixed batch of {len(batch[0])}: its "
        f"loss {result.shown}"
    )
    return result.fell, saw, result.healthy_lr
