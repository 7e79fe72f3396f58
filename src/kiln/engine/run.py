"""The composition root: a typed KilnConfig in, a Trainer built from its parts, a run directory
out (metrics.jsonl, summary.json, checkpoints/) as the contract describes. The CLI calls `train`;
tests call it in-process with `load_config([...])`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.utils.data import Subset

import kiln
from kiln import run_lock
from kiln.checkpoint import EMBEDDED_SHA256, embedded_hashes, plain_record
from kiln.config import KilnConfig, to_plain
from kiln.data import DataBundle, build_data, build_dataloaders, example_batch
from kiln.data.degenerate import check_inputs_vary
from kiln.data.extremes import probe_batches
from kiln.data.loaders import stop_workers
from kiln.data.split_hygiene import checked_splits
from kiln.device import resolve_device
from kiln.engine.batches import move_to, to_channels_last
from kiln.engine.checkpointer import Checkpointer, ResumeError
from kiln.engine.distributed import (
    DistInfo,
    grad_scaler,
    init_distributed,
    is_sharded,
    resume_after_restart,
    wrap_model,
)
from kiln.engine.environment import write_environment
from kiln.engine.evaluators import build_evaluator
from kiln.engine.finetune import FreezePlan, WeightAverage, frozen_parameter_names, parameter_groups
from kiln.engine.host_memory import keep_freed_host_memory
from kiln.engine.loss import build_criterion
from kiln.engine.optim import (
    apply_hyperparameters,
    build_optimizer,
    build_scheduler,
    schedule_at,
    settle_sparse_gradients,
    total_optimizer_steps,
)
from kiln.engine.precision import resolve_precision
from kiln.engine.preemption import SIGNALS, Preempted, PreemptedBeforeStart
from kiln.engine.rank_watch import RankWatch, post_stop, reporting_failure
from kiln.engine.resume import Contract, check, data_fingerprint, flatten, judge, map_position
from kiln.engine.run_end import (
    check_overfit,
    close_run,
    keep_findings,
    report_baseline,
    report_test_split,
    save_failing_batches,
)
from kiln.engine.seeding import set_deterministic
from kiln.engine.sharded_checkpoint import ShardedWriter
from kiln.engine.throughput import peak_flops
from kiln.engine.trainer import (
    NonFiniteLossError,
    Trainer,
    TrainingParts,
    batches_per_epoch,
    loop_settings,
)
from kiln.errors import attempt
from kiln.findings import finding_of
from kiln.guards.input_sizes import EpochPlan
from kiln.guards.learn_probe import STEPS as LEARN_PROBE_STEPS
from kiln.guards.probe_cache import ProbeKey
from kiln.guards.probes import ProbeBudget, ProbePlan, ProbeSubject, probe_batch_sizes
from kiln.logging.recorder import RunRecorder
from kiln.logging.summary import stopped_summary, summarize, write_json, write_summary
from kiln.models import (
    build_model,
    has_lazy_parameters,
    materialise,
    spec_example,
    without_weights,
)
from kiln.preprocessing.pretrained import (
    PretrainedInput,
    PretrainedText,
    pretrained_input,
    recorded_pretrained,
)
from kiln.registry import config_dirs, plugin_packages, plugin_sources
from kiln.rng import forked, seed_everything
from kiln.startup import StartupClock, run_clock
from kiln.threads import BusyElsewhere

log = logging.getLogger(__name__)

PROBE_BATCH_SIZE = 8  # the probes' batch: a real batch of at most this many samples
# ... and of a detector's images, each large and slow to step: the checks need two.
PROBE_IMAGE_LIST_SIZE = 2


def load_data(cfg: KilnConfig, pretrained: PretrainedInput | None = None) -> DataBundle:
    """`pretrained`: the model's weights' preprocessing, for the datasets that follow it."""
    data_cfg = cfg.data
    if cfg.loss.force_all_branches and hasattr(data_cfg, "with_all_branches"):
        data_cfg = data_cfg.with_all_branches()  # e.g. MixUp and CutMix: the data's branches
    bundle = build_data(data_cfg, pretrained=pretrained)
    where = f"data={data_cfg.name}"
    check_inputs_vary(bundle.train, f"the training split of {where}")
    bundle = checked_splits(bundle, data_cfg.max_split_overlap, where)  # leaks, class maps
    if cfg.trainer.overfit_batches:  # the same few batches, for training and validation alike
        count = min(cfg.trainer.overfit_batches * cfg.data.batch_size, len(bundle.train))
        few = Subset(bundle.train, range(count))
        bundle = dataclasses.replace(bundle, train=few, val=few, baseline=None)
    return bundle


@dataclasses.dataclass(frozen=True)
class BuiltRun:
    """What build_run hands out: a Trainer ready to fit (at the checkpoint's position when the
    run resumes), and the config it was built from."""

    trainer: Trainer
    cfg: KilnConfig  # as built: resume as resume_after_restart left it, data.batch_size as found
    resumed_from: Path | None  # the checkpoint cfg.resume continues (its metrics.jsonl goes on)


def build_run(
    cfg: KilnConfig,
    run_dir: Path,
    dist: DistInfo,
    device: torch.device,
    recorder,
    startup: StartupClock | None = None,
    *,
    conditional_is_fatal: bool = False,
    restore: dict | None = None,
    on_built: Callable[[Trainer], Any] | None = None,
) -> BuiltRun:
    """The run as `cfg` asks for it: its Trainer built (fresh_trainer), then, when cfg.resume
    names a checkpoint, the config differences judged and the saved state loaded, all before
    anyone holds the Trainer. `conditional_is_fatal`: parameters used in only some steps stop
    the run even in one process (kiln triage replays a DDP run's probes so). `restore`: a
    checkpoint of this same run, loaded as it is, unjudged (kiln triage replays its steps).
    `on_built`: told of the Trainer before the resume is judged, for failure reports only (a
    refused resume's summary and findings still describe the run as built)."""
    # After torchrun restarted the group: this run's newest checkpoint, whatever cfg.resume says
    resume = resume_after_restart(cfg.resume, run_dir / "checkpoints")
    cfg = dataclasses.replace(cfg, resume=resume)  # a new value: the caller's stays
    assert restore is None or cfg.resume is None, "a replay restores its own checkpoint"
    trainer, cfg = fresh_trainer(
        cfg, run_dir, dist, device, recorder, startup, conditional_is_fatal
    )
    if on_built is not None:
        on_built(trainer)
    if restore is not None:
        trainer.load_state_dict(restore)
    resumed_from = resume_if_asked(trainer, cfg)
    return BuiltRun(trainer=trainer, cfg=cfg, resumed_from=resumed_from)


def fresh_trainer(
    cfg: KilnConfig,
    run_dir: Path,
    dist: DistInfo,
    device: torch.device,
    recorder,
    startup: StartupClock | None = None,
    conditional_is_fatal: bool = False,
) -> tuple[Trainer, KilnConfig]:
    """The run's parts from `cfg`, in the order that draws the same random numbers every time
    (initial weights, then the data's and the probes'), as a Trainer at step 0. What it derives
    -- a found batch size, the plan of the probes -- is passed on as new values (`cfg` is frozen):
    returns the Trainer and the config with data.batch_size as found. `startup`: the run's
    start-up clock (kiln.startup), lapped here and said by the Trainer after the first step."""
    cpu_watch = BusyElsewhere()  # what other processes keep busy while this run starts
    seed_everything(cfg.seed)  # the same initial weights on every rank and in single runs
    recorded = recorded_pretrained(cfg.model, cfg.init_from)  # init_from's tokenizer, config
    if recorded is not None:
        log.info(
            "init_from: the tokenizer and config.json recorded in %s (of %s); model.arch is not "
            "read again",
            cfg.init_from,
            recorded.source,
        )
    # else: checks a zoo model's arch and weights first
    pretrained = recorded if recorded is not None else pretrained_input(cfg.model)
    if startup is not None:
        startup.lap("build")  # the run's set-up: device, process group, loggers
    bundle = load_data(cfg, pretrained)
    if startup is not None:
        startup.lap("data")
    want_aux = bool(getattr(cfg.model, "aux_head", False) or cfg.loss.aux_head)
    want_aux = want_aux or cfg.loss.force_all_branches
    model, freeze = build_run_model(cfg, bundle.spec, device, dist, run_dir, want_aux, recorded)
    if cfg.trainer.log_activations:
        from kiln.guards.activations import ActivationMonitor

        recorder.activations = ActivationMonitor(model)
    precision = resolve_precision(cfg.precision.name, device)
    if cfg.trainer.find_batch_size:
        found = find_batch_size(cfg, bundle, model, precision, dist, device)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=found))
    train_loader, val_loader = build_dataloaders(
        bundle,
        cfg.data,
        seed=cfg.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        cuda=device.type == "cuda",
    )
    batches = batches_per_epoch(train_loader, cfg.trainer.limit_train_batches)
    planned_steps = total_optimizer_steps(
        batches, cfg.trainer.max_epochs, cfg.trainer.accumulate_grad_batches, cfg.trainer.max_steps
    )
    patience = early_stopping_patience(cfg.trainer.early_stopping, bundle.spec)
    warmup_end, warmup_start = checked_schedule(cfg, planned_steps, batches, patience)

    def wrap() -> torch.nn.Module:  # again when frozen parameters thaw under DDP
        wrapped = wrap_model(model, cfg.trainer, dist, device, precision)  # FSDP shards in place
        if cfg.trainer.compile:  # the loop calls the compiled module; checkpoints, guards the eager
            wrapped = torch.compile(wrapped, mode=str(cfg.trainer.compile_mode))
        return wrapped

    wrapped = wrap()
    groups = parameter_groups(model, cfg.optimizer, cfg.model.name)
    optimizer = build_optimizer(groups, cfg.optimizer)  # of the sharded parameters
    settings = {"threshold": bundle.spec.threshold} if bundle.spec.multi_label else {}
    evaluator = build_evaluator(
        bundle.spec.task, precision=precision, device=device, dist=dist, **settings
    )
    subject = probe_subject(cfg, bundle, train_loader, model, precision, device, want_aux, recorded)
    plan = probe_plan(cfg, subject.criterion, dist, warmup_start, conditional_is_fatal)
    scheduler = build_scheduler(optimizer, cfg.scheduler, planned_steps)
    parts = TrainingParts(
        model=wrapped,
        raw_model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=grad_scaler(cfg.trainer, device, precision),
        precision=precision,
        criterion=subject.criterion,
        evaluator=evaluator,
        train_loader=train_loader,
        val_loader=val_loader,
        batch_metrics=bundle.batch_metrics,
        peak_flops=peak_flops(device, precision, cfg.trainer.peak_tflops),
        freeze=freeze if freeze.names else None,
        rewrap=wrap if dist.enabled and freeze.unfreeze_at_epoch is not None else None,
        ema=WeightAverage(model, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None,
        data=bundle,
        probe_plan=plan,
        probe_subject=subject,
        probe_key=probe_key(cfg, subject, plan, device),
        cpu_watch=cpu_watch,
        early_stopping=patience,
        warmup_end=warmup_end,
    )
    if bundle.report is not None and dist.is_main:
        write_json(run_dir / "data_report.json", bundle.report)
    monitor = evaluator.monitor if cfg.trainer.monitor == "auto" else cfg.trainer.monitor
    checkpointer = Checkpointer(
        run_dir / "checkpoints",
        cfg.trainer,
        monitor=monitor,
        monitor_mode=cfg.trainer.monitor_mode,
        is_main=dist.is_main,
        sharded=sharded_writer(cfg, run_dir, dist),
        background=True,  # a host copy, then written while training goes on
    )
    contract = run_contract(cfg, bundle, planned_steps, dist, has_schedule=scheduler is not None)
    seed_everything(cfg.seed + dist.rank)  # distinct dropout streams per rank
    trainer = Trainer(
        loop_settings(cfg.trainer),
        parts,
        checkpointer=checkpointer,
        on_metrics=recorder,
        dist=dist,
        device=device,
        seed=cfg.seed,
        record={**checkpoint_record(cfg, bundle, pretrained), "contract": contract.to_dict()},
        progress_bar=cfg.env.progress_bar,
        planned_steps=planned_steps,
        contract=contract,
        startup=startup,
    )
    return trainer, cfg


def build_run_model(
    cfg: KilnConfig,
    spec,
    device: torch.device,
    dist: DistInfo,
    run_dir: Path,
    want_aux: bool,
    recorded: PretrainedText | None = None,
) -> tuple[torch.nn.Module, FreezePlan]:
    """The run's model on its device, with its weights (init_from's unless the run resumes),
    model.freeze applied (before DDP registers the parameters it reduces) and its memory
    format; returns it with the freeze plan. `recorded`: init_from's own tokenizer and
    config.json (recorded_pretrained): the model is built from them, its weights init_from's."""
    model_cfg = without_weights(cfg.model) if recorded is not None else cfg.model
    model = build_model(spec, model_cfg, aux_head=want_aux, pretrained=recorded).to(device)
    if has_lazy_parameters(model):  # nn.LazyLinear & co: sized before the optimizer sees them
        materialise(model, spec_example(spec, device))
    if cfg.init_from is not None and not will_resume(cfg, run_dir):
        from kiln.models.weights import init_from

        init_from(model, cfg.init_from)  # weights only: a new run from them
    # What the model froze itself (model=hf's parameters its forward never reaches) stays
    # frozen: trainer.unfreeze_at_epoch thaws only what model.freeze froze.
    fixed = {name for name, p in model.named_parameters() if not p.requires_grad}
    freeze = FreezePlan(
        frozen_parameter_names(model, getattr(cfg.model, "freeze", None), cfg.model.name) - fixed,
        cfg.trainer.unfreeze_at_epoch,
    )
    freeze.apply(model, epoch=0)  # before DDP registers the parameters it reduces
    several_ranks = dist.enabled or is_sharded(cfg.trainer)
    if settle_sparse_gradients(model, cfg.optimizer, dense=several_ranks or cfg.trainer.compile):
        log.info("embedding tables take sparse gradients: each step updates the rows it touched")
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, freeze


def probe_subject(
    cfg: KilnConfig,
    bundle: DataBundle,
    train_loader,
    model,
    precision,
    device,
    want_aux: bool,
    recorded: PretrainedText | None = None,
) -> ProbeSubject:
    """What the probes before step 1 run on (kiln.guards.probes): the run's model and criterion,
    real batches of the data's extremes on the device, the other batch sizes rule 1 must survive,
    and how to build a model for another input size or the run's optimizer for the learn probe."""
    batch_size = cfg.data.batch_size
    plan = epoch_plan(train_loader, cfg)
    sizes = probe_batch_sizes(batch_size, plan.samples if not plan.drop_last else 0)
    largest = PROBE_IMAGE_LIST_SIZE if bundle.spec.input_kind == "image_list" else PROBE_BATCH_SIZE
    mode_size = min(batch_size, largest)
    # The data's own extremes, never a sample: the same probes whatever the seed.
    probes = probe_batches(bundle, max([mode_size, *sizes]), batch_size)
    criterion = build_criterion(model, cfg.loss, bundle.spec.multi_label)

    def build_fresh(spec) -> torch.nn.Module:  # what rule 1's probes build: no weights to load
        fresh = build_model(
            spec, without_weights(cfg.model), aux_head=want_aux, pretrained=recorded
        )
        return fresh.to(device)

    def parameter_shapes(spec) -> dict[str, tuple]:  # a build on the meta device: no memory
        with torch.device("meta"), forked():
            built = build_model(
                spec, without_weights(cfg.model), aux_head=want_aux, pretrained=recorded
            )
        return {name: tuple(p.shape) for name, p in built.named_parameters()}

    def optimizer_for(copy: torch.nn.Module, lr_scale: float) -> torch.optim.Optimizer:
        """The run's optimizer for another model (the learn probe's copy), lr scaled."""
        scaled = dataclasses.replace(cfg.optimizer, lr=cfg.optimizer.lr * lr_scale)
        return build_optimizer(parameter_groups(copy, scaled, cfg.model.name), scaled)

    def on_device(batch):
        batch = move_to(batch, device)
        return to_channels_last(batch) if cfg.trainer.channels_last else batch

    return ProbeSubject(
        model=model,
        build=build_fresh,
        criterion=criterion,
        batch=on_device(probes.base),
        spec=bundle.spec,
        batch_sizes=tuple(sizes),
        mode_batch_size=mode_size,
        epoch_plan=plan,
        cases=[(label, on_device(batch)) for label, batch in probes.cases],
        padding=on_device(probes.padding) if probes.padding is not None else None,
        optimizer_for=optimizer_for,
        flag_for_unused=lambda names: option_behind(names, bundle.spec, cfg, want_aux),
        # Under the run's autocast, as training and evaluation run: a path that breaks only
        # in bf16/fp16 is caught here, not at the first evaluation.
        autocast=precision.autocast,
        full_precision=precision.autocast_dtype is None,
        parameter_shapes=parameter_shapes,
    )


def probe_key(cfg: KilnConfig, subject: ProbeSubject, plan: ProbePlan, device) -> ProbeKey | None:
    """What the probes' outcome depends on (kiln.guards.probe_cache): None under
    trainer.probe_cache=false or where the model's code cannot be read."""
    if not cfg.trainer.probe_cache:
        return None
    from kiln.guards.probe_cache import batch_shapes, digest, fingerprint

    checks = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    for left_out in ("budget", "passed"):  # how much runs now, not what a pass means
        del checks[left_out]
    epoch = subject.epoch_plan
    data = {
        "spec": {k: v for k, v in subject.spec.to_dict().items() if k != "tokens"},
        "batch": batch_shapes(subject.batch),
        "cases": [(label, batch_shapes(batch)) for label, batch in subject.cases],
        "padding": batch_shapes(subject.padding) if subject.padding is not None else None,
        "epoch": dataclasses.asdict(epoch) if epoch is not None else None,
        "batch_sizes": list(subject.batch_sizes),
        "mode_batch_size": subject.mode_batch_size,
        "model": to_plain(cfg.model),
        "loss": to_plain(cfg.loss),
        "precision": cfg.precision.name,
        "channels_last": cfg.trainer.channels_last,
        "device": device.type,
    }
    model = fingerprint(subject.model, subject.criterion, checks, data)
    if model is None:
        return None
    return ProbeKey(model, (("learn probe", digest(to_plain(cfg.optimizer))),))


def run_contract(
    cfg: KilnConfig, bundle: DataBundle, planned_steps: int, dist: DistInfo, has_schedule: bool
) -> Contract:
    """What a resume must agree with (kiln.engine.resume), as this run starts."""
    return Contract(
        config=flatten(to_plain(cfg)),
        planned_steps=planned_steps,
        batch_size=cfg.data.batch_size,
        world_size=dist.world_size,
        accumulate=cfg.trainer.accumulate_grad_batches,
        data_fingerprint=data_fingerprint(
            # spec.tokens come from the recipe's tokenizer, fingerprinted with the recipe (and
            # a checkpoint made before the spec held them resumes as before)
            {k: v for k, v in bundle.spec.to_dict().items() if k != "tokens"},
            bundle.recipe.to_dict(),
            (len(bundle.train), len(bundle.val)),
        ),
        has_schedule=has_schedule,
    )


def probe_plan(
    cfg: KilnConfig,
    criterion,
    dist: DistInfo,
    warmup_start: float = 1.0,
    conditional_is_fatal: bool = False,
) -> ProbePlan:
    """Which checks run before step 1, from the config (kiln.guards.probes); `warmup_start`:
    the schedule's first lr as a share of optimizer.lr (the learn probe tries it);
    `conditional_is_fatal`: as under DDP, whatever this process's ranks (build_run says why)."""
    t = cfg.trainer
    # DDP without find_unused_parameters fails a step whose backward skips a parameter
    ddp_fails = dist.enabled and not is_sharded(t) and not t.find_unused_parameters
    return ProbePlan(
        sizes=t.probe_sizes,
        modes=t.shape_check,
        logits=getattr(criterion, "expects_logits", False),
        skip=frozenset(name.replace("_", " ") for name in t.skip_checks),
        learn_steps=LEARN_PROBE_STEPS if t.learn_probe else 0,
        warmup_start=warmup_start,
        fp16=t.fp16_check or cfg.precision.name == "amp",  # amp is fp16 on CUDA
        conditional_is_fatal=conditional_is_fatal or ddp_fails,
        budget=ProbeBudget(**dataclasses.asdict(t.probe_budget)),
    )


def checked_schedule(
    cfg: KilnConfig, planned_steps: int, batches: int, patience
) -> tuple[int, float]:
    """The run's lr schedule read at sampled steps (kiln.engine.schedule_check): a warm-up
    longer than the run, an lr off for most of it, or early stopping set to stop before the
    warm-up ends is one error line. Returns the step the warm-up ends at (1: none), which
    trainer.early_stopping=auto waits for, and the first step's lr as a share of optimizer.lr
    (below 1 under a warm-up: what the learn probe tries where the configured lr diverges)."""
    from kiln.engine.schedule_check import check_schedule, lr_curve

    curve = lr_curve(lambda opt, n: build_scheduler(opt, cfg.scheduler, n), planned_steps)
    check_schedule(
        curve,
        scheduler=cfg.scheduler.name,
        lr=cfg.optimizer.lr,
        steps_per_epoch=math.ceil(batches / cfg.trainer.accumulate_grad_batches),
        patience=patience,
        patience_set=cfg.trainer.early_stopping != "auto",
    )
    if curve is None:
        return 1, 1.0
    return curve.warmup_end, min(curve.points[0][1], 1.0)


TEXT_PATIENCE = 2  # trainer.early_stopping=auto on text data: text models overfit within epochs


def early_stopping_patience(setting, spec) -> int | None:
    """trainer.early_stopping resolved: auto is TEXT_PATIENCE epochs for text (token) data,
    where the default run would otherwise train past its best, and off for the rest."""
    if setting == "auto":
        return TEXT_PATIENCE if spec.input_kind == "tokens" else None
    return setting


def will_resume(cfg: KilnConfig, run_dir: Path) -> bool:
    """Whether this run continues from a checkpoint (then init_from is not applied: the
    checkpoint's weights win)."""
    from kiln.checkpoint import candidates

    if cfg.resume is None:
        return False
    return cfg.resume != "auto" or bool(candidates(run_dir / "checkpoints"))


def epoch_plan(train_loader, cfg: KilnConfig) -> EpochPlan:
    """One rank's epoch as batches: a partial last batch is trained on unless data.drop_last,
    trainer.limit_train_batches or trainer.max_steps ends the epoch (or the run) before it."""
    samples, batch_size = train_loader.sampler.num_samples, cfg.data.batch_size
    batches = math.ceil(samples / batch_size)
    limit, max_steps = cfg.trainer.limit_train_batches, cfg.trainer.max_steps
    cut = 0 < limit < batches
    stops_first = 0 < max_steps * cfg.trainer.accumulate_grad_batches < batches
    return EpochPlan(samples, batch_size, drop_last=cfg.data.drop_last or cut or stops_first)


def option_behind(names: list[str], spec, cfg: KilnConfig, want_aux: bool) -> str | None:
    """The override that removes the parameters `names` (rule 2's message): each boolean model
    option now on, and the auxiliary head the flags ask for, switched off in a build on the meta
    device (no memory, no random numbers drawn)."""
    candidates = []
    if want_aux:
        on = [g for g in ("model", "loss") if getattr(getattr(cfg, g), "aux_head", False)]
        flags = " ".join(f"{g}.aux_head=false" for g in on) or "loss.force_all_branches=false"
        candidates.append((flags, cfg.model, False))
    for f in dataclasses.fields(cfg.model):
        if getattr(cfg.model, f.name) is True and f.name != "aux_head":
            off = dataclasses.replace(cfg.model, **{f.name: False})
            candidates.append((f"model.{f.name}=false", off, want_aux))
    for override, model_cfg, aux in candidates:
        built, err = attempt(_meta_parameter_names, spec, model_cfg, aux)
        if err is None and not built & set(names):  # err: an option this builder cannot switch
            return override
    return None


def _meta_parameter_names(spec, model_cfg, aux: bool) -> set[str]:
    with torch.device("meta"), forked():
        return {name for name, _ in build_model(spec, model_cfg, aux_head=aux).named_parameters()}


def sharded_writer(cfg: KilnConfig, run_dir: Path, dist: DistInfo) -> ShardedWriter | None:
    """Under trainer=fsdp every rank writes its shards of each checkpoint (DCP)."""
    if not is_sharded(cfg.trainer):
        return None
    return ShardedWriter(run_dir / "checkpoints", is_main=dist.is_main)


def checkpoint_record(
    cfg: KilnConfig, bundle: DataBundle, pretrained: PretrainedInput | None = None
) -> dict[str, Any]:
    """What every checkpoint carries besides the training state: enough to rebuild the model and
    repeat its preprocessing, as plain data. "pretrained": what the model's weights expect
    (the data may have followed it: an image recipe's own `pretrained` says so). The files
    the preprocessing embeds (tokenizer.json, config.json, the record itself) are hashed, so
    inference refuses one edited since (kiln.checkpoint.check_embedded)."""
    preprocessing = plain_record(bundle.recipe.to_dict(), "preprocessing")
    return {
        "config": to_plain(cfg),
        "preprocessing": preprocessing,
        EMBEDDED_SHA256: embedded_hashes(preprocessing),
        "pretrained": pretrained.to_dict() if pretrained is not None else None,
        "data_spec": plain_record(bundle.spec.to_dict(), "data_spec"),
        "model_name": cfg.model.name,
        "kiln_version": kiln.__version__,
        "plugins": {
            "sources": plugin_sources(cfg.plugins),
            "config_dirs": config_dirs(),
            "packages": plugin_packages(cfg.plugins),  # which distribution to install again
        },
    }


def find_batch_size(cfg: KilnConfig, bundle, model, precision, dist, device) -> int:
    """The largest per-device batch that fits (trainer.find_batch_size), on real steps."""
    from kiln.engine.batch_size import largest_that_fits, trial_step

    if cfg.resume is not None:
        log.info("find_batch_size: resuming, so data.batch_size=%d stays", cfg.data.batch_size)
        return cfg.data.batch_size
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    criterion = build_criterion(model, cfg.loss, bundle.spec.multi_label)
    limit = len(bundle.train)
    fits = trial_step(
        model, optimizer, criterion, lambda n: move_to(example_batch(bundle, n), device), precision
    )
    found = largest_that_fits(fits, start=cfg.data.batch_size, limit=limit)
    if dist.enabled:  # every rank trains with the same batch: the smallest any rank fits
        found_t = torch.tensor(found, device=device)
        torch.distributed.all_reduce(found_t, op=torch.distributed.ReduceOp.MIN)
        found = int(found_t)
    log.info("find_batch_size: data.batch_size=%d fits (searched up to %d)", found, limit)
    return found


def resume_if_asked(trainer: Trainer, cfg: KilnConfig) -> Path | None:
    """Continue from the checkpoint cfg.resume names, after judging every config difference
    (kiln.engine.resume); approved changes are applied for real. build_run calls it on the
    Trainer it has just built, before handing it out. Returns the checkpoint, or None."""
    found = trainer.checkpointer.resume_source(cfg.resume)
    if found is None:
        return None
    path, checkpoint = found
    if "contract" not in checkpoint:
        raise ResumeError(f"{path} has no resume contract (an older kiln wrote it); start anew")
    saved = Contract.from_dict(checkpoint["contract"])
    judgement = judge(saved, trainer.contract, list(cfg.resume_override))
    check(judgement, str(path))
    trainer.load_state_dict(checkpoint)
    if path.resolve().parent != trainer.checkpointer.directory.resolve():
        trainer.checkpointer.adopt_best(path, trainer.state)  # resumed into a new directory
    elif trainer.checkpointer.best_set_aside:
        trainer.state.best_metric = None  # the next evaluation writes best.pt again
    if any(d.key.startswith(("optimizer.", "scheduler.")) for d in judgement.changes):
        apply_hyperparameters(trainer.optimizer, cfg.optimizer)
        trainer.scheduler = schedule_at(
            trainer.optimizer, cfg.scheduler, trainer.state.planned_steps, trainer.state.global_step
        )
    now = trainer.contract  # data.batch_size as found (trainer.find_batch_size) or set
    moved = (saved.batch_size, saved.world_size) != (now.batch_size, now.world_size)
    if moved and trainer.state.batch_in_epoch:
        trainer.state.batch_in_epoch = map_position(
            trainer.state.batch_in_epoch, saved, trainer.contract, str(path)
        )
    s = trainer.state
    log.info(
        "resumed from %s at epoch %d, step %d (batch %d of the epoch)",
        path,
        s.epoch,
        s.global_step,
        s.batch_in_epoch,
    )
    return path


def run_of(checkpoint: Path) -> Path:
    """The run directory of a checkpoint file or sharded folder (above its checkpoints/)."""
    path = Path(checkpoint).resolve()
    return next((p.parent for p in path.parents if p.name == "checkpoints"), path.parent)


def train(
    cfg: KilnConfig, run_dir: Path, report_failure: Callable[[BaseException], Any] | None = None
) -> dict[str, Any]:
    """Train per `cfg` (typed: kiln.config.load_config) in `run_dir`. summary.json is written on
    every exit, failures included. Under DDP a rank watch (kiln.engine.rank_watch) reports a
    failure the main thread cannot (stuck in a collective a failed rank never joins):
    summary.json, then `report_failure(err)` (train.py's [FAIL] line and failures.log)."""
    SIGNALS.starting()  # a signal from here to step 1 stops the run at once
    startup = run_clock()
    startup.lap("config")  # train.py: the typed config; in-process: nothing yet
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    set_deterministic(cfg.trainer.deterministic)
    keep_freed_host_memory(cfg.trainer.host_malloc)  # glibc: no page faults on every step
    torch.set_float32_matmul_precision(str(cfg.trainer.matmul_precision))
    torch.backends.cudnn.allow_tf32 = str(cfg.trainer.matmul_precision) != "highest"
    device = resolve_device(str(cfg.device), int(os.environ.get("LOCAL_RANK", 0)))
    dist = init_distributed(cfg.trainer.distributed, str(cfg.trainer.backend), device)
    if dist.is_main:  # one writer per run directory; refused before anything is written
        run_lock.acquire(run_dir)
    trainer, recorder, summary, at_once, failing = None, None, None, False, False
    if dist.is_main and not (run_dir / ".hydra" / "config.yaml").is_file():
        # Hydra writes this for train.py runs; in-process runs leave the same record.
        (run_dir / ".hydra").mkdir(exist_ok=True)
        OmegaConf.save(OmegaConf.create(to_plain(cfg)), run_dir / ".hydra" / "config.yaml")
    built: list[Trainer] = []  # for the rank watch, which may report before train() returns

    def report(err: BaseException) -> None:  # from the rank watch's thread
        stuck = built[0] if built else None
        last = stuck.last_eval if stuck is not None else {}
        summary = summarize(stuck, last, status="failed", error=f"{type(err).__name__}: {err}")
        summary["failed_check"] = {"what": getattr(err, "what", ""), "module": ""}
        write_summary(run_dir, summary)
        if report_failure is not None:
            report_failure(err)

    def last_word(stop: Preempted) -> None:  # the process ends in a native call (preemption)
        if dist.is_main:
            write_summary(run_dir, stopped_summary(built[0] if built else None, stop))
            stop.summary_written = True

    if dist.is_main:  # what the run's own environment was, for kiln triage's replay
        write_environment(run_dir)
    watch = RankWatch(dist, step=lambda: built[0].current_step if built else 0, report=report)
    stack = contextlib.ExitStack()
    try:
        watch.__enter__()
        stack.enter_context(SIGNALS.last_word(last_word))
        recorder = RunRecorder(
            cfg.logger, run_dir, run_name=cfg.name, config=to_plain(cfg), is_main=dist.is_main
        )
        run = build_run(cfg, run_dir, dist, device, recorder, startup, on_built=built.append)
        trainer, cfg = run.trainer, run.cfg
        if run.resumed_from is not None:
            recorder.carry_on(run_of(run.resumed_from) / "metrics.jsonl", trainer.state.global_step)
        startup.lap("build")
        final = trainer.fit()
        trainer.checkpointer.check_pointed_files()  # no run ends ok pointing at a bad file
        status, at_chance = trainer.outcome()
        summary = summarize(trainer, final, status=status, error=None)
        if at_chance is not None:
            summary["at_chance"] = at_chance  # the console gets it with the run's end
        summary.update(report_test_split(trainer, cfg, run_dir, device))
        summary.update(report_baseline(trainer, cfg, run_dir, device))
        if cfg.trainer.overfit_batches:
            summary.update(check_overfit(recorder.history))
        if dist.is_main:
            keep_findings(run_dir, trainer)
        return summary
    except BaseException as err:  # every way a run ends early is reported, then re-raised
        trainer = built[0] if built else None  # also when the build's resume was refused
        reporting_failure()  # a SIGTERM now (torchrun's, after a rank died) waits for the report
        if trainer is not None and not hasattr(err, "step"):
            err.kiln_step = trainer.current_step  # where the failure line says it happened
        # A second Ctrl-C, or a stop before step 1: no last picture of curves nobody drew.
        at_once = isinstance(err, KeyboardInterrupt | PreemptedBeforeStart)
        summary = stopped_summary(trainer, err)
        err.summary_written = dist.is_main  # below, in close_run
        finding = finding_of(err, getattr(err, "step", getattr(err, "kiln_step", 0)) or 0)
        if finding is not None:  # a check's finding: what kiln triage reads (findings.json)
            summary["failed_check"] = {
                "what": err.what,
                "module": finding.module,
                "kind": finding.kind,
                "fix": finding.fix,
            }
        if dist.is_main:  # what stopped it, and what the checks said before
            keep_findings(run_dir, trainer, finding)
        failing = True
        if trainer is not None:  # what was asked before the failure, whole on disk
            trainer.finish_writes_quietly()
        if isinstance(err, PreemptedBeforeStart):
            post_stop(dist, err)  # a rank waiting for this one in step 1 stops too
        if isinstance(err, NonFiniteLossError) and err.batches and dist.is_main:
            save_failing_batches(run_dir, err)  # kiln triage replays the step with them
        raise
    finally:
        if built:  # not at the next garbage collection, seconds each (kiln.data.loaders)
            stop_workers(built[0].train_loader, built[0].val_loader)
        stack.close()
        watch.__exit__(None, None, None)
        full = close_run(run_dir, recorder, summary if dist.is_main else None, draw=not at_once)
        if dist.is_main:
            run_lock.release(run_dir)
        if full is not None and not failing:  # the run's last write found the disk full
            raise full
