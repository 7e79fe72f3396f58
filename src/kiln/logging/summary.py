"""summary.json: the one-file record of how a run ended, written on every exit, failures
included. Its keys are defined here once; the sweep summary reads the same ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.atomic import write_json

SUMMARY_FILE = "summary.json"
# The contract's keys first (../shared/INTERFACE.md), in this order; a run's evaluation metrics
# (val_map50, ...) and the counters follow.
SUMMARY_KEYS = (
    "status",
    "val_acc",
    "val_loss",
    "steps",
    "samples_per_s",
    "data_time_frac",
    "error",
)


def summarize(trainer, final: dict[str, Any], *, status: str, error: str | None) -> dict:
    """The summary of a run that ended with `status`; `trainer` is None when it never started."""
    s = trainer.state if trainer is not None else None
    return {
        "status": status,
        "val_acc": final.get("val_acc"),
        "val_loss": final.get("val_loss"),
        **_chance(trainer),
        **{k: v for k, v in final.items() if k not in ("val_acc", "val_loss", "epoch")},
        "monitor": trainer.checkpointer.monitor if trainer else None,
        "best": s.best_metric if s else None,
        "best_epoch": s.best_epoch if s else None,  # the epochs done when best.pt was written
        "best_step": s.best_step if s else None,  # its step: its evaluation in metrics.jsonl
        "stopped_early": trainer.stopped_early if trainer else False,
        "steps": s.global_step if s else 0,
        "epochs": s.epoch if s else 0,
        "samples_per_s": trainer.samples_per_s if trainer else None,
        "data_time_frac": trainer.data_time_frac if trainer else None,
        "nonfinite_skipped": s.nonfinite_skipped if s else 0,
        "scaler_skipped": s.scaler_skipped if s else 0,
        "probe_time_s": trainer.probe_time_s if trainer else None,  # the probes before step 1
        "probe_times_s": dict(trainer.probe_report.seconds) if trainer else {},  # per check
        **(_probe_budget(trainer) if trainer else {}),
        "startup_s": trainer.startup_s if trainer else None,  # process start to step 1, by phase
        "threads": trainer.threads if trainer else None,  # torch's intra-op threads
        "num_workers": getattr(trainer.train_loader, "num_workers", None) if trainer else None,
        "model_flops_per_sample": trainer.flops_per_sample if trainer else None,
        **(trainer.utilisation(trainer.samples_per_s) if trainer else {}),
        "train_time_s": s.step_time_s if s else None,
        "error": error,
    }


def _probe_budget(trainer) -> dict:
    """What the probe budget allowed and left out, and what a cached pass spared."""
    report, cached = trainer.probe_report, trainer.probes_cached
    return {
        "probe_budget_s": report.budget_s,  # null: no probes ran
        "probe_epoch_estimate_s": report.epoch_estimate_s,
        "probe_skipped": dict(report.skipped),  # check -> its estimated seconds
        "probe_first_steps": (["learn probe"] if report.learn_reading is not None else [])
        + (["dead gradients (second step)"] if report.pending_zero else []),
        "probe_cached": sorted(cached.passed) if cached is not None else [],  # passed before
    }


def stopped_summary(trainer, err: BaseException) -> dict:
    """The summary of a run that ended with `err`: preempted or interrupted (its `status`,
    kiln.engine.preemption), interrupted (a second Ctrl-C) or failed. It imports nothing: a stop
    may have cut an import short (torch's, say), and a module half imported cannot be imported
    again in the same process."""
    status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
    status = getattr(err, "status", status)
    last_eval = trainer.last_eval if trainer is not None else {}
    return summarize(trainer, last_eval, status=status, error=f"{type(err).__name__}: {err}")


def _chance(trainer) -> dict:
    """The monitored metric's chance level, as the evaluator measured it (kiln.engine.chance)."""
    chance = trainer.chance() if trainer is not None else None
    if chance is None:
        return {}
    return {
        "chance": {
            "metric": chance.metric,
            "value": chance.value,
            "margin": chance.margin,
            "what": chance.what,
        }
    }


def write_summary(run_dir: Path, summary: dict) -> None:
    write_json(Path(run_dir) / SUMMARY_FILE, summary)


def read_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json as a dict; a missing or unreadable one makes the run failed with that error."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        return {"status": "failed", "error": f"no {SUMMARY_FILE}"}
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return {"status": "failed", "error": f"unreadable {SUMMARY_FILE}: {error}"}
    if not isinstance(summary, dict):
        return {"status": "failed", "error": f"{SUMMARY_FILE} is not a JSON object"}
    return summary
