"""Turn a composed config into a Trainer, run it, and leave the run directory the contract
describes (metrics.jsonl, summary.json, checkpoints/). The CLI calls `train`."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Subset

import kiln
from kiln.config.schema import validate
from kiln.data import build_data, build_dataloaders, example_batch
from kiln.engine import checkpoint as ckpt
from kiln.engine.distributed import DistInfo, init_distributed
from kiln.engine.loss import LossBranches
from kiln.engine.optim import build_optimizer, build_scheduler, total_optimizer_steps
from kiln.engine.precision import resolve_precision
from kiln.engine.seeding import seed_everything, set_deterministic
from kiln.engine.trainer import LoopSettings, Preempted, Trainer, batches_per_epoch, move_to
from kiln.guards.activations import ActivationMonitor
from kiln.models import build_model

log = logging.getLogger(__name__)

WANDB_ID_FILE = "wandb_run_id.txt"


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device=cuda but torch.cuda.is_available() is False; run kiln-doctor")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def loop_settings(cfg, task: str) -> LoopSettings:
    t = cfg.trainer
    monitor = (
        t.monitor if t.monitor != "auto" else ("val_map50" if task == "detection" else "val_acc")
    )
    settings = dict(
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        accumulate=t.accumulate_grad_batches,
        clip_norm=t.gradient_clip_val,
        nan_policy=t.nan_policy,
        check_inputs=t.check_inputs,
        shape_check=t.shape_check,
        checkpoint_every_n_steps=t.checkpoint_every_n_steps,
        checkpoint_every_epoch=t.checkpoint_every_epoch,
        keep_last_k=t.keep_last_k,
        monitor=monitor,
        monitor_mode=t.monitor_mode,
        log_every_n_steps=t.log_every_n_steps,
        limit_train_batches=t.limit_train_batches,
        limit_val_batches=t.limit_val_batches,
        progress_bar=cfg.env.progress_bar,
    )
    if cfg.debug.name == "fast_dev_run":  # one train step and one val batch, end to end
        settings.update(
            max_epochs=1,
            max_steps=1,
            limit_val_batches=1,
            limit_train_batches=t.accumulate_grad_batches,
            checkpoint_every_epoch=False,
        )
    if cfg.debug.name == "overfit_batch":  # the same single batch, step after step
        steps = cfg.debug.overfit_steps
        settings.update(
            max_epochs=steps,
            max_steps=steps,
            accumulate=1,
            log_every_n_steps=1,
            checkpoint_every_epoch=False,
        )
    return LoopSettings(**settings)


class RunRecorder:
    """metrics.jsonl (always) plus the configured logger backends, on the main rank only."""

    def __init__(self, cfg, run_dir: Path, dist: DistInfo):
        from kiln.logging import JsonlWriter, build_loggers

        self.enabled = dist.is_main
        self.history: list[dict] = []
        self.activations: ActivationMonitor | None = None
        if not self.enabled:
            return
        self.jsonl = JsonlWriter(run_dir / "metrics.jsonl")
        # A resumed run continues its W&B run rather than starting a second one.
        wandb_id_file = run_dir / WANDB_ID_FILE
        self.loggers = build_loggers(
            list(cfg.logger.backends),
            run_dir,
            run_name=cfg.name,
            wandb_project=cfg.logger.wandb_project,
            wandb_mode=cfg.logger.wandb_mode,
            wandb_entity=cfg.logger.wandb_entity,
            resume_id=wandb_id_file.read_text().strip() if wandb_id_file.is_file() else None,
        )
        if "wandb" in self.loggers.backends:
            wandb_id_file.write_text(self.loggers.backends["wandb"].run_id + "\n")
        self.loggers.log_config(OmegaConf.to_container(cfg, resolve=True))

    def __call__(self, metrics: dict, step: int) -> None:
        if self.activations is not None and "loss" in metrics:
            metrics = {**metrics, **self.activations.metrics()}
            for layer, problem in self.activations.flagged().items():
                log.warning("activation check: layer %s is %s", layer, problem)
        self.history.append({"step": step, **metrics})
        if self.enabled:
            self.jsonl.write({"step": step, **metrics})
            self.loggers.log_metrics(metrics, step)

    def close(self) -> None:
        if self.activations is not None:
            self.activations.close()
        if self.enabled:
            self.loggers.close()
            self.jsonl.close()


def detection_evaluator(model, batches, trainer: Trainer) -> dict:
    from kiln.engine.detection_eval import mean_average_precision

    predictions, targets = [], []
    for images, batch_targets in batches:
        predictions += [{k: v.cpu() for k, v in p.items()} for p in model(images)]
        targets += [{k: v.cpu() for k, v in t.items()} for t in batch_targets]
    if trainer.dist.enabled:
        gathered = [None] * trainer.dist.world_size
        torch.distributed.all_gather_object(gathered, (predictions, targets))
        predictions = [p for part in gathered for p in part[0]]
        targets = [t for part in gathered for t in part[1]]
    return {"val_map50": mean_average_precision(predictions, targets, iou_threshold=0.5)}


def build_trainer(cfg, run_dir: Path, dist: DistInfo, device: torch.device, recorder) -> Trainer:
    seed_everything(cfg.seed)  # the same initial weights on every rank and in single runs
    bundle = build_data(cfg.data)
    if cfg.debug.name == "overfit_batch":
        one_batch = Subset(bundle.train, range(min(cfg.data.batch_size, len(bundle.train))))
        bundle.train, bundle.val = one_batch, one_batch
    branches = LossBranches.from_config(cfg.loss)
    model = build_model(
        bundle.spec, cfg.model, aux_head=cfg.model.aux_head or branches.wants_aux_head
    )
    model.to(device)
    if cfg.debug.name == "activations":
        recorder.activations = ActivationMonitor(model)
    train_loader, val_loader = build_dataloaders(
        bundle,
        cfg.data,
        seed=cfg.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        cuda=device.type == "cuda",
    )
    settings = loop_settings(cfg, bundle.spec.task)
    total_steps = total_optimizer_steps(
        batches_per_epoch(train_loader, settings.limit_train_batches),
        settings.max_epochs,
        settings.accumulate,
        settings.max_steps,
    )
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.scheduler, total_steps)
    precision = resolve_precision(cfg.precision.name, device)
    wrapped = model
    if dist.enabled:
        wrapped = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    seed_everything(cfg.seed + dist.rank)  # distinct dropout streams per rank
    extra = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "preprocessing": bundle.preprocessing,
        "data_spec": bundle.spec.to_dict(),
        "model_name": cfg.model.name,
        "kiln_version": kiln.__version__,
    }
    return Trainer(
        model=wrapped,
        raw_model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=torch.amp.GradScaler(device.type, enabled=precision.use_grad_scaler),
        train_loader=train_loader,
        val_loader=val_loader,
        example_batch=_to(
            example_batch(bundle, min(cfg.data.batch_size, 8), seed=cfg.seed), device
        ),
        precision=precision,
        device=device,
        dist=dist,
        settings=settings,
        loss_branches=branches,
        seed=cfg.seed,
        checkpoint_dir=run_dir / "checkpoints",
        checkpoint_extra=extra,
        on_metrics=recorder,
        evaluate_fn=detection_evaluator if bundle.spec.task == "detection" else None,
    )


def _to(batch, device):
    return move_to(batch, device, non_blocking=False)


def resume_if_asked(trainer: Trainer, resume: str | None, run_dir: Path) -> Path | None:
    if resume is None:
        return None
    if resume == "auto":
        if not ckpt.candidates(run_dir / "checkpoints"):
            log.info("resume=auto: no checkpoint in %s, starting fresh", run_dir)
            return None
        path, checkpoint = ckpt.load_newest_valid(run_dir / "checkpoints")
    else:
        path, checkpoint = Path(resume), ckpt.load_checkpoint(Path(resume))
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
            f"debug=overfit_batch: loss did not fall on a single batch ({losses[:1]} -> "
            f"{losses[-1:]}); check the model, the loss and the learning rate"
        )
    return {"overfit_loss_first": losses[0], "overfit_loss_last": losses[-1]}


def train(cfg, run_dir: Path) -> dict[str, Any]:
    """Train per `cfg` in `run_dir`. summary.json is written on every exit, failures included."""
    validate(cfg)
    set_deterministic(cfg.trainer.deterministic)
    device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
    dist = init_distributed(cfg.trainer.distributed, cfg.trainer.backend, device)
    trainer, recorder, summary = None, None, None
    try:
        recorder = RunRecorder(cfg, run_dir, dist)
        trainer = build_trainer(cfg, run_dir, dist, device, recorder)
        resume_if_asked(trainer, cfg.resume, run_dir)
        final = trainer.fit()
        summary = summarize(trainer, final, status="ok", error=None)
        if cfg.debug.name == "overfit_batch":
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


def summarize(trainer: Trainer | None, final: dict, *, status: str, error: str | None) -> dict:
    s = trainer.state if trainer is not None else None
    return {
        "status": status,
        "val_acc": final.get("val_acc"),
        "val_loss": final.get("val_loss"),
        **{k: v for k, v in final.items() if k not in ("val_acc", "val_loss", "epoch")},
        "monitor": trainer.settings.monitor if trainer else None,
        "best": s.best_metric if s else None,
        "steps": s.global_step if s else 0,
        "epochs": s.epoch if s else 0,
        "samples_per_s": trainer.samples_per_s if trainer else None,
        "data_time_frac": trainer.data_time_frac if trainer else None,
        "nonfinite_skipped": s.nonfinite_skipped if s else 0,
        "scaler_skipped": s.scaler_skipped if s else 0,
        "error": error,
    }


def write_summary(run_dir: Path, summary: dict) -> None:
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tmp.replace(run_dir / "summary.json")
