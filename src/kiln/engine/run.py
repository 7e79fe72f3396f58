"""The composition root: a typed KilnConfig in, a Trainer built from its parts, a run directory
out (metrics.jsonl, summary.json, checkpoints/) as the contract describes. The CLI calls `train`;
tests call it in-process with `load_config([...])`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Subset

import kiln
from kiln.config import KilnConfig, to_plain
from kiln.data import DataBundle, build_data, build_dataloaders, example_batch
from kiln.device import resolve_device
from kiln.engine.batches import move_to
from kiln.engine.checkpointer import Checkpointer
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
from kiln.engine.optim import build_optimizer, build_scheduler, total_optimizer_steps
from kiln.engine.precision import resolve_precision
from kiln.engine.preemption import Preempted
from kiln.engine.seeding import seed_everything, set_deterministic
from kiln.engine.sharded_checkpoint import ShardedWriter
from kiln.engine.trainer import Trainer, TrainingParts, batches_per_epoch
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
    criterion_cfg = cfg.loss
    want_aux = getattr(cfg.model, "aux_head", False) or criterion_cfg.aux_head
    want_aux = want_aux or criterion_cfg.force_all_branches
    model = build_model(bundle.spec, cfg.model, aux_head=want_aux).to(device)
    if cfg.trainer.log_activations:
        from kiln.guards.activations import ActivationMonitor

        recorder.activations = ActivationMonitor(model)
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
    precision = resolve_precision(cfg.precision.name, device)
    wrapped = wrap_model(model, cfg.trainer, dist, device, precision)  # FSDP shards in place
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)  # of the sharded parameters
    evaluator = build_evaluator(bundle.spec.task, precision=precision, device=device, dist=dist)
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
        probe_batch=move_to(
            example_batch(bundle, min(cfg.data.batch_size, PROBE_BATCH_SIZE), seed=cfg.seed),
            device,
        ),
        batch_metrics=bundle.batch_metrics,
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
    seed_everything(cfg.seed + dist.rank)  # distinct dropout streams per rank
    trainer = Trainer(
        cfg.trainer,
        parts,
        checkpointer=checkpointer,
        on_metrics=recorder,
        dist=dist,
        device=device,
        seed=cfg.seed,
        record=checkpoint_record(cfg, bundle),
        progress_bar=cfg.env.progress_bar,
    )
    trainer.state.planned_steps = planned_steps
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


def resume_if_asked(trainer: Trainer, resume: str | None) -> Path | None:
    found = trainer.checkpointer.resume_source(resume)
    if found is None:
        return None
    path, checkpoint = found
    trainer.load_state_dict(checkpoint)
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
    device = resolve_device(str(cfg.device), int(os.environ.get("LOCAL_RANK", 0)))
    dist = init_distributed(cfg.trainer.distributed, str(cfg.trainer.backend), device)
    trainer, recorder, summary = None, None, None
    try:
        recorder = RunRecorder(
            cfg.logger, run_dir, run_name=cfg.name, config=to_plain(cfg), is_main=dist.is_main
        )
        trainer = build_trainer(cfg, run_dir, dist, device, recorder)
        resume_if_asked(trainer, resume_after_restart(cfg.resume, run_dir / "checkpoints"))
        final = trainer.fit()
        summary = summarize(trainer, final, status="ok", error=None)
        if cfg.trainer.overfit_batches:
            summary.update(check_overfit(recorder.history))
        return summary
    except BaseException as err:
        status = "preempted" if isinstance(err, Preempted) else "failed"
        last_eval = trainer.last_eval if trainer is not None else {}
        summary = summarize(trainer, last_eval, status=status, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        if recorder is not None:
            recorder.close()
        if dist.is_main and summary is not None:
            write_summary(run_dir, summary)
