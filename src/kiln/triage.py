"""`kiln triage <run dir>`: read a failed or suspicious run's own files (summary.json,
metrics.jsonl, nan_batch_stats.json, .hydra/config.yaml) and rank the likely causes, each with
its evidence and the override to try."""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kiln.logging.jsonl import read_jsonl
from kiln.logging.summary import read_summary


@dataclass
class Cause:
    score: float  # higher: more likely
    title: str
    evidence: str
    try_: str  # the override (or action) to try


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    steps: list[dict[str, Any]]  # logged training intervals
    evals: list[dict[str, Any]]  # logged evaluations
    config: dict[str, Any]
    batch_stats: dict[str, Any] | None

    @classmethod
    def read(cls, path: Path) -> Run:
        metrics = read_jsonl(path / "metrics.jsonl") if (path / "metrics.jsonl").is_file() else []
        config = run_config(path)
        stats_file = path / "nan_batch_stats.json"
        return cls(
            path=path,
            summary=read_summary(path),
            steps=[m for m in metrics if "loss" in m],
            evals=[m for m in metrics if any(k.startswith("val_") for k in m)],
            config=config or {},
            batch_stats=json.loads(stats_file.read_text()) if stats_file.is_file() else None,
        )

    def key(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(m["step"], float(m[name])) for m in self.steps if _finite(m.get(name))]

    @property
    def error(self) -> str:
        return self.summary.get("error") or ""

    @property
    def went_nonfinite(self) -> bool:
        return (
            "loss NaN" in self.error
            or "loss Inf" in self.error
            or bool(self.summary.get("nonfinite_skipped"))
        )


def run_config(path: Path) -> dict[str, Any]:
    """The run's config: Hydra's copy, or (for runs started in-process) the checkpoint's."""
    config_file = path / ".hydra" / "config.yaml"
    if config_file.is_file():
        return yaml.safe_load(config_file.read_text()) or {}
    from kiln.checkpoint import CheckpointError, candidates, load_checkpoint

    for candidate in candidates(path / "checkpoints"):
        try:
            return load_checkpoint(candidate).get("config", {})
        except CheckpointError:
            continue
    return {}


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def exploding_gradients(run: Run) -> Cause | None:
    norms = run.series("grad_norm_max") or run.series("grad_norm")
    if not run.went_nonfinite or len(norms) < 2:
        return None
    first, last = norms[0], norms[-1]
    growth = last[1] / max(first[1], 1e-12)
    if growth < 5:
        return None
    lr = run.key("optimizer.lr", 0.0)
    return Cause(
        3 + min(math.log10(growth), 5),
        "exploding gradients before the loss went non-finite",
        f"grad norm rose from {first[1]:.3g} (step {first[0]}) to {last[1]:.3g} (step "
        f"{last[0]}), x{growth:.3g}, then: {run.error or 'non-finite steps were skipped'}",
        f"optimizer.lr={lr / 10:g} trainer.gradient_clip_val=1.0",
    )


def fp16_overflow(run: Run) -> Cause | None:
    skipped = run.series("scaler_skipped")
    total = run.summary.get("scaler_skipped") or (skipped[-1][1] if skipped else 0)
    if not total:
        return None
    growing = len(skipped) >= 2 and skipped[-1][1] > skipped[0][1]
    return Cause(
        4 if growing else 2,
        "fp16 overflow: GradScaler keeps skipping steps",
        f"scaler_skipped reached {int(total)}"
        + (f" (from {int(skipped[0][1])} at step {skipped[0][0]})" if growing else ""),
        "precision=bf16 (fp32's range, no scaler)",
    )


def nonfinite_inputs(run: Run) -> Cause | None:
    if not run.batch_stats:
        return None
    bad = {
        name: stats
        for name, stats in run.batch_stats.get("batch", {}).items()
        if stats.get("nan") or stats.get("inf")
    }
    if not bad:
        return None
    shown = "; ".join(f"{n}: {s.get('nan', 0)} NaN, {s.get('inf', 0)} Inf" for n, s in bad.items())
    return Cause(
        6,
        "non-finite values in the input batch",
        f"the batch of the failing step holds {shown} ({run.path / 'nan_batch_stats.json'})",
        "fix the data; trainer.check_inputs=true stops at the first bad batch, naming the tensor",
    )


def data_bottleneck(run: Run) -> Cause | None:
    frac = run.summary.get("data_time_frac")
    if not _finite(frac) or frac < 0.3:
        return None
    workers = run.key("data.num_workers", 0)
    return Cause(
        1 + 3 * frac,
        "data loading is the bottleneck",
        f"data_time_frac {frac:.0%}: the model waited for batches that long (num_workers "
        f"{workers})",
        f"data.num_workers={max(2, 2 * workers)} data.pin_memory=true (on CUDA)",
    )


def train_eval_disagreement(run: Run) -> Cause | None:
    if "rule 3" not in run.error and "ShapeContractError" not in run.error:
        return None
    return Cause(
        7,
        "the model's train and eval modes disagree (rule 3)",
        run.error.splitlines()[0][:300],
        "fix the model's eval path (branches on self.training, modules forced into train mode)",
    )


def flat_loss(run: Run) -> Cause | None:
    losses = [v for _, v in run.series("loss")]
    if len(losses) < 5:
        return None
    change = abs(losses[-1] - losses[0]) / max(abs(losses[0]), 1e-12)
    if change > 0.02:
        return None
    lr = run.key("optimizer.lr", 0.0)
    return Cause(
        5,
        "the loss is flat from the first step",
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} logged intervals "
        f"({change:.2%} change) at optimizer.lr={lr:g}",
        f"optimizer.lr={lr * 100:g} (and check the labels: shuffled or constant labels "
        "look like this too)",
    )


def validation_far_below_training(run: Run) -> Cause | None:
    if not run.evals or not run.steps:
        return None
    val = run.evals[-1].get("val_loss")
    train = statistics.fmean(v for _, v in run.series("loss")[-3:]) if run.series("loss") else None
    if not (_finite(val) and _finite(train)) or val < 2 * train + 0.1:
        return None
    return Cause(
        4,
        "validation far below training",
        f"val_loss {val:.3f} against a training loss of {train:.3f} at step "
        f"{run.steps[-1]['step']}: the model does much worse on data it did not train on",
        "check the split for leakage or mismatched labels, and the eval path (BatchNorm or "
        "dropout behaving differently in eval mode); trainer.overfit_batches=1 shows whether "
        "the model can fit at all",
    )


CHECKS = (
    exploding_gradients,
    fp16_overflow,
    nonfinite_inputs,
    data_bottleneck,
    train_eval_disagreement,
    flat_loss,
    validation_far_below_training,
)


def triage(path: Path) -> tuple[Run, list[Cause]]:
    run = Run.read(Path(path))
    causes = [cause for check in CHECKS if (cause := check(run)) is not None]
    return run, sorted(causes, key=lambda c: c.score, reverse=True)


def report(path: Path) -> str:
    run, causes = triage(path)
    status = run.summary.get("status", "unknown")
    lines = [f"triage of {path}: status {status}" + (f" ({run.error})" if run.error else "")]
    if not causes:
        lines.append("no known cause found in the run's files; see train.log")
    for rank, cause in enumerate(causes, start=1):
        lines += [
            f"{rank}. {cause.title}",
            f"   evidence: {cause.evidence}",
            f"   try: {cause.try_}",
        ]
    fixes = [(rank, found) for rank, c in enumerate(causes, 1) if (found := overrides_in(c.try_))]
    if fixes:  # the run's own command line (plugins and search path included) with the fix
        from kiln.commands import RunCommand

        rank, fix = fixes[0]
        command = RunCommand.of_run(path).train(*fix)
        lines.append(f"next: {command}   # a new run with the override of cause {rank}")
    return "\n".join(lines)


def overrides_in(advice: str) -> list[str]:
    """The key=value overrides an advice starts with ("optimizer.lr=0.001 (and ...)")."""
    found = []
    for word in advice.split():
        if not re.fullmatch(r"[a-z_][\w.]*=[^\s;,()]+", word):
            break
        found.append(word)
    return found
