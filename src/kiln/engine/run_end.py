"""The end of a run, after training: the test split's report and the text baseline (each a
failure logged, never raised: training succeeded), what the checks found (findings.json), the
failing step's batches for `kiln triage`, and the last writes (curves, logs, summary.json)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from kiln.config import KilnConfig
from kiln.engine.batches import move_to
from kiln.engine.trainer import NonFiniteLossError, Trainer
from kiln.errors import DiskFullError
from kiln.findings import Finding, write_findings
from kiln.logging.summary import write_summary

log = logging.getLogger("kiln")
T = TypeVar("T")


def check_overfit(history: list[dict]) -> dict:
    losses = [m["loss"] for m in history if "loss" in m]
    if len(losses) < 2 or not losses[-1] < losses[0]:
        raise RuntimeError(
            f"trainer.overfit_batches: the loss did not fall on the same batches "
            f"({losses[:1]} -> {losses[-1:]}); check the model, the loss and the learning rate"
        )
    return {"overfit_loss_first": losses[0], "overfit_loss_last": losses[-1]}


def after_training(what: str, error_key: str, work: Callable[[], T]) -> tuple[T | None, dict]:
    """(work(), {}), or (None, {error_key: its error}) when it fails: a report after training
    is logged when it fails, never raised (the training result stands)."""
    try:
        return work(), {}
    except Exception as err:  # noqa: BLE001 -- reported, never raised: training succeeded
        error = f"{type(err).__name__}: {err}"
        log.error("the %s failed (training itself finished): %s", what, error, exc_info=True)
        return None, {error_key: error}


def report_test_split(
    trainer: Trainer, cfg: KilnConfig, run_dir: Path, device: torch.device
) -> dict[str, Any]:
    """When the data has a test split: the evaluation report of best.pt on it (<run>/eval/),
    written by the main rank; returns the headline numbers for summary.json (test_acc,
    test_macro_f1, ...). The training result stands whatever happens here: a failure is logged
    and recorded as summary.json's test_eval_error, and the run still ends ok."""
    bundle = trainer.parts.data
    if bundle is None or bundle.test is None or not trainer.dist.is_main:
        return {}
    from kiln.inference.evaluate import EVAL_DIR, evaluate_split

    report, failed = after_training(
        "test-split report",
        "test_eval_error",
        lambda: evaluate_split(
            run_dir / "checkpoints" / "best.pt",
            bundle.test,
            split="test",
            directory=run_dir / EVAL_DIR,
            data={"dataset": cfg.data.name},
            sources=(bundle.sources or {}).get("test"),
            collate_fn=bundle.collate_fn,
            device=device.type,
            batch_size=trainer.contract.batch_size,  # data.batch_size as found or set
            num_workers=trainer.train_loader.num_workers,  # data.num_workers resolved
        ),
    )
    if failed:
        return failed
    for line in report.lines():
        log.info("test split: %s", line)
    return report.headline("test_")


BASELINE_FILE = "baseline.json"


def report_baseline(
    trainer: Trainer, cfg: KilnConfig, run_dir: Path, device: torch.device
) -> dict[str, Any]:
    """Text data with a baseline sample (data.baseline_rows): TF-IDF + LinearSVC fitted on the
    training split's sample and scored on the validation sample, beside best.pt's scores on
    the same texts (<run>/baseline.json, its lines in the log); returns summary.json's
    baseline_* keys. Like the test split's report, a failure here is logged, never raised."""
    bundle = trainer.parts.data
    if bundle is None or bundle.baseline is None or not trainer.dist.is_main:
        return {}
    from torch.utils.data import Subset

    from kiln.atomic import write_json
    from kiln.inference import baseline
    from kiln.inference.evaluate import predict_split
    from kiln.inference.predictor import Predictor

    sample = bundle.baseline

    def compare() -> dict[str, Any]:
        predictor = Predictor.from_checkpoint(
            run_dir / "checkpoints" / "best.pt", "torch", device.type
        )
        probs, targets = predict_split(
            predictor,
            Subset(bundle.val, sample.val_positions),
            collate_fn=bundle.collate_fn,
            batch_size=trainer.contract.batch_size,
        )
        return baseline.compare(
            sample.train_texts,
            sample.train_labels,
            sample.val_texts,
            targets,
            probs,
            bundle.spec.class_names,
        )

    result, failed = after_training("linear baseline", "baseline_error", compare)
    if failed:
        return failed
    override, why = baseline.try_instead(cfg.model.name, cfg.trainer.max_epochs)
    result |= {"split": "val", "val_total": sample.val_total, "override": override, "why": why}
    write_json(run_dir / BASELINE_FILE, result, indent=2)
    for line in baseline.lines(result, "validation texts", override):
        (log.warning if line.startswith("the model is below") else log.info)("%s", line)
    return baseline.summary_keys(result) | (
        {"baseline_override": override} if result["below"] else {}
    )


FAILING_BATCHES = "nan_batch.pt"  # beside nan_batch_stats.json


def save_failing_batches(run_dir: Path, err: NonFiniteLossError) -> None:
    """The failing step's micro-batches, on the CPU, as plain tensors (weights_only loads
    them): what `kiln triage` replays. Best effort: the failure is what counts."""
    from kiln import checkpoint as files

    record = {
        "step": err.step,
        "kind": f"loss {err.kind}",
        "bad_micro": err.bad_micro,
        "batches": [move_to(batch, torch.device("cpu")) for batch in err.batches],
    }
    try:
        files.atomic_save(record, run_dir / FAILING_BATCHES)
    except (files.CheckpointError, DiskFullError):
        log.warning("could not save the failing batch to %s", run_dir / FAILING_BATCHES)


def keep_findings(run_dir: Path, trainer: Trainer | None, fatal: Finding | None = None) -> None:
    """What the checks found, as data (findings.json, read by kiln triage): what they said and
    the run went on, and what stopped it. Nothing found: no file."""
    said = list(trainer.parts.data.findings) if trainer is not None and trainer.parts.data else []
    said += list(trainer.probe_report.findings) if trainer is not None else []
    found = said + ([fatal] if fatal is not None else [])
    if found:
        try:
            write_findings(run_dir, found)
        except (OSError, DiskFullError) as err:  # the run's own outcome is what is reported
            log.warning("findings.json not written: %s", err)


def close_run(run_dir: Path, recorder, summary: dict | None, draw: bool) -> DiskFullError | None:
    """The last writes of a run (curves, logs, summary.json), each tried even when one finds
    the disk full; returns that error (a run already failing keeps its own)."""
    full = None
    if recorder is not None:
        try:
            recorder.close(draw=draw)
        except DiskFullError as err:
            full = err
    if summary is not None:
        try:
            write_summary(run_dir, summary)
        except DiskFullError as err:
            full = full or err
    return full
