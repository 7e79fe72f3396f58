"""The composition root: a typed KilnConfig in, a Trainer built from its parts, a run directory
out (metrics.jsonl, summary.json, checkpoints/) as the contract describes. The CLI calls `train`;
tests call it in-process with `load_config([...])`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.utils.data import Subset

import kiln
from kiln.config import KilnConfig, to_plain
from kiln.data import DataBundle, build_data, build_dataloaders, example_batch
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
from kiln.engine.evaluators import build_evaluator
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
from kiln.engine.preemption import Preempted
from kiln.engine.resume import Contract, check, data_fingerprint, flatten, judge, map_position
from kiln.engine.seeding import seed_everything, set_deterministic
from kiln.engine.sharded_checkpoint import ShardedWriter
from kiln.engine.throughput import peak_flops
from kiln.engine.trainer import Trainer, TrainingParts, batches_per_epoch
from kiln.guards.probes import probe_batch_sizes
from kiln.logging.recorder import RunRecorder
from kiln.logging.summary import summarize, write_json, write_summary
from kiln.models import build_model

log = logging.getLogger(__name__)

PROBE_BATCH_SIZE = 8  # rule 3's probe: a real batch of at most this many samples


def load_data(cfg: KilnConfig) -> DataBundle:
    bundle = build_data(cfg.data)
    if cfg.trainer.overfit_batches:  # the same few batches, for training and validation alike
        count = min(cfg.trainer.overfit_batches * cfg.data.batch_size, len(bundle.train))
        bundle.train = bundle.val = Subset(bundle.train, range(count))
    return bundle


def build_trainer(
    cfg: KilnConfig, run_dir: Path, dist: DistInfo, device: torch.device, recorder
) -> Trainer:
    seed_everything(cfg.seed)  # the same initial weights on every rank and in single runs
    bundle = load_data(cfg)
    want_aux = getattr(cfg.model, "aux_head", False) or cfg.loss.aux_head
    want_aux = want_aux or cfg.loss.force_all_branches

    def build_fresh(spec) -> torch.nn.Module:  # also what rule 1's probes build
        return build_model(spec, cfg.model, aux_head=want_aux).to(device)

    model = build_fresh(bundle.spec)
    several_ranks = dist.enabled or is_sharded(cfg.trainer)
    if settle_sparse_gradients(model, cfg.optimizer, dense=several_ranks or cfg.trainer.compile):
        log.info("embedding tables take sparse gradients: each step updates the rows it touched")
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.trainer.log_activations:
        from kiln.guards.activations import ActivationMonitor

        recorder.activations = ActivationMonitor(model)
    precision = resolve_precision(cfg.precision.name, device)
    if cfg.trainer.find_batch_size:
        cfg.data.batch_size = find_batch_size(cfg, bundle, model, precision, dist, device)
    train_loader, val_loader = build_dataloaders(
        bundle,
        cfg.data,
        seed=cfg.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        cuda=device.type == "cuda",
    )
    planned_steps = total_optimizer_steps(
        batches_per_epoch(train_loader, cfg.trainer.limit_train_batches),
        cfg.trainer.max_epochs,
        cfg.trainer.accumulate_grad_batches,
        cfg.trainer.max_steps,
    )
    wrapped = wrap_model(model, cfg.trainer, dist, device, precision)  # FSDP shards in place
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)  # of the sharded parameters
    if cfg.trainer.compile:  # the loop calls the compiled module; checkpoints and guards the eager
        wrapped = torch.compile(wrapped, mode=str(cfg.trainer.compile_mode))
    evaluator = build_evaluator(bundle.spec.task, precision=precision, device=device, dist=dist)
    batch_size = cfg.data.batch_size
    probe_sizes = probe_batch_sizes(batch_size, train_loader.sampler.num_samples)
    if cfg.trainer.limit_train_batches > 0:  # then the epoch's last batch is a full one
        probe_sizes = [n for n in probe_sizes if n in (1, 3, 5)]
    mode_probe_size = min(batch_size, PROBE_BATCH_SIZE)
    pool = max([mode_probe_size, *probe_sizes])
    probe_batch = move_to(example_batch(bundle, pool, seed=cfg.seed), device)
    if cfg.trainer.channels_last:
        probe_batch = to_channels_last(probe_batch)
    parts = TrainingParts(
        model=wrapped,
        raw_model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.scheduler, planned_steps),
        scaler=grad_scaler(cfg.trainer, device, precision),
        precision=precision,
        criterion=build_criterion(model, cfg.loss),
        evaluator=evaluator,
        train_loader=train_loader,
        val_loader=val_loader,
        probe_batch=probe_batch,
        spec=bundle.spec,
        build_fresh=build_fresh,
        probe_batch_sizes=tuple(probe_sizes),
        mode_probe_size=mode_probe_size,
        batch_metrics=bundle.batch_metrics,
        peak_flops=peak_flops(device, precision, cfg.trainer.peak_tflops),
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
    )
    contract = Contract(
        config=flatten(to_plain(cfg)),
        planned_steps=planned_steps,
        batch_size=cfg.data.batch_size,
        world_size=dist.world_size,
        accumulate=cfg.trainer.accumulate_grad_batches,
        data_fingerprint=data_fingerprint(
            bundle.spec.to_dict(), bundle.recipe.to_dict(), (len(bundle.train), len(bundle.val))
        ),
        has_schedule=parts.scheduler is not None,
    )
    seed_everything(cfg.seed + dist.rank)  # distinct dropout streams per rank
    trainer = Trainer(
        cfg.trainer,
        parts,
        checkpointer=checkpointer,
        on_metrics=recorder,
        dist=dist,
        device=device,
        seed=cfg.seed,
        record={**checkpoint_record(cfg, bundle), "contract": contract.to_dict()},
        progress_bar=cfg.env.progress_bar,
    )
    trainer.state.planned_steps = planned_steps
    trainer.contract = contract
    return trainer


def sharded_writer(cfg: KilnConfig, run_dir: Path, dist: DistInfo) -> ShardedWriter | None:
    """Under trainer=fsdp every rank writes its shards of each checkpoint (DCP)."""
    if not is_sharded(cfg.trainer):
        return None
    return ShardedWriter(run_dir / "checkpoints", is_main=dist.is_main)


def checkpoint_record(cfg: KilnConfig, bundle: DataBundle) -> dict[str, Any]:
    """What every checkpoint carries besides the training state: enough to rebuild the model and
    repeat its preprocessing, as plain data."""
    return {
        "config": to_plain(cfg),
        "preprocessing": bundle.recipe.to_dict(),
        "data_spec": bundle.spec.to_dict(),
        "model_name": cfg.model.name,
        "kiln_version": kiln.__version__,
    }


def find_batch_size(cfg: KilnConfig, bundle, model, precision, dist, device) -> int:
    """The largest per-device batch that fits (trainer.find_batch_size), on real steps."""
    from kiln.engine.batch_size import largest_that_fits, trial_step

    if cfg.resume is not None:
        log.info("find_batch_size: resuming, so data.batch_size=%d stays", cfg.data.batch_size)
        return cfg.data.batch_size
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    criterion = build_criterion(model, cfg.loss)
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
    (kiln.engine.resume); approved changes are applied for real."""
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
    if any(d.key.startswith(("optimizer.", "scheduler.")) for d in judgement.changes):
        apply_hyperparameters(trainer.optimizer, cfg.optimizer)
        trainer.scheduler = schedule_at(
            trainer.optimizer, cfg.scheduler, trainer.state.planned_steps, trainer.state.global_step
        )
    moved = (saved.batch_size, saved.world_size) != (cfg.data.batch_size, trainer.dist.world_size)
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


def check_overfit(history: list[dict]) -> dict:
    losses = [m["loss"] for m in history if "loss" in m]
    if len(losses) < 2 or not losses[-1] < losses[0]:
        raise RuntimeError(
            f"trainer.overfit_batches: the loss did not fall on the same batches "
            f"({losses[:1]} -> {losses[-1:]}); check the model, the loss and the learning rate"
        )
    return {"overfit_loss_first": losses[0], "overfit_loss_last": losses[-1]}


def train(cfg: KilnConfig, run_dir: Path) -> dict[str, Any]:
    """Train per `cfg` (typed: kiln.config.load_config) in `run_dir`. summary.json is written on
    every exit, failures included."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    set_deterministic(cfg.trainer.deterministic)
    torch.set_float32_matmul_precision(str(cfg.trainer.matmul_precision))
    torch.backends.cudnn.allow_tf32 = str(cfg.trainer.matmul_precision) != "highest"
    device = resolve_device(str(cfg.device), int(os.environ.get("LOCAL_RANK", 0)))
    dist = init_distributed(cfg.trainer.distributed, str(cfg.trainer.backend), device)
    trainer, recorder, summary = None, None, None
    if dist.is_main and not (run_dir / ".hydra" / "config.yaml").is_file():
        # Hydra writes this for train.py runs; in-process runs leave the same record.
        (run_dir / ".hydra").mkdir(exist_ok=True)
        OmegaConf.save(OmegaConf.create(to_plain(cfg)), run_dir / ".hydra" / "config.yaml")
    try:
        recorder = RunRecorder(
            cfg.logger, run_dir, run_name=cfg.name, config=to_plain(cfg), is_main=dist.is_main
        )
        trainer = build_trainer(cfg, run_dir, dist, device, recorder)
        cfg.resume = resume_after_restart(cfg.resume, run_dir / "checkpoints")
        resume_if_asked(trainer, cfg)
        final = trainer.fit()
        summary = summarize(trainer, final, status="ok", error=None)
        if cfg.trainer.overfit_batches:
            summary.update(check_overfit(recorder.history))
        return summary
    except BaseException as err:
        if trainer is not None and not hasattr(err, "step"):
            err.kiln_step = trainer.current_step  # where the failure line says it happened
        status = "preempted" if isinstance(err, Preempted) else "failed"
        last_eval = trainer.last_eval if trainer is not None else {}
        summary = summarize(trainer, last_eval, status=status, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        if recorder is not None:
            recorder.close()
        if dist.is_main and summary is not None:
            write_summary(run_dir, summary)
