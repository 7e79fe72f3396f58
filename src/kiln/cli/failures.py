"""How a run that dies says so: one greppable line on stderr, the same grammar for every way to
die, appended to outputs/failures.log with its detail on the next line, and the traceback in
train.log.

    [FAIL] <name> | <single|DDP> | amp=<True|False> | <what> @ step <N>
      <detail: non-finite branches and batch statistics, the module where devices mix, ...>
    run directory: <path>
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from datetime import datetime
from pathlib import Path

from kiln.commands import shown

log = logging.getLogger("kiln")


def what_failed(err: BaseException) -> tuple[str, str]:
    """(the line's <what>, a one-line detail) for an exception that ended a run."""
    from kiln.engine.trainer import NonFiniteEvalError, NonFiniteLossError, TooManySkippedSteps

    first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if isinstance(err, NonFiniteLossError):
        terms = ", ".join(err.bad_terms) or "none"
        return f"loss {err.kind}", f"non-finite terms: {terms}"
    if isinstance(err, NonFiniteEvalError):
        return f"{err.metric} {err.kind}", first_line.split(": ", 1)[-1]
    if isinstance(err, TooManySkippedSteps):
        return f"{err.skipped} non-finite steps skipped (limit {err.limit})", first_line
    if type(err).__name__ == "OutOfMemoryError":
        return "OOM", "out of memory; " + oom_advice(cfg_of(err))
    what = getattr(err, "what", None)  # a check's name (shapes, numerics, ...), a rank stopped
    if isinstance(what, str) and what:
        return what, first_line
    return type(err).__name__, first_line


def cfg_of(err: BaseException):
    return getattr(err, "kiln_cfg", None)


def oom_advice(cfg) -> str:
    """What to try, keeping the global batch where the config allows."""
    if cfg is None:
        return "try a smaller data.batch_size, precision=bf16 or amp"
    batch, accumulate = cfg.data.batch_size, cfg.trainer.accumulate_grad_batches
    tips = []
    if batch > 1:
        tips.append(
            f"data.batch_size={batch // 2} trainer.accumulate_grad_batches={accumulate * 2} "
            "(the same global batch)"
        )
    if cfg.precision.name == "fp32":
        tips.append("precision=bf16 (or amp)")
    if hasattr(cfg.data, "max_length"):
        tips.append(f"shorter sequences (data.max_length={max(1, cfg.data.max_length // 2)})")
    tips.append("trainer.find_batch_size=true finds the largest batch that fits")
    return "try " + "; or ".join(tips)


def write_oom_report(run_dir: Path, err: BaseException, cfg) -> Path:
    """The batch's shapes, the advice and CUDA's memory summary beside the run."""
    import torch

    report = {
        "batch_shapes": getattr(err, "batch_shapes", None),
        "advice": oom_advice(cfg),
        "error": str(err),
    }
    path = run_dir / "oom.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if torch.cuda.is_available():
        (run_dir / "cuda_memory_summary.txt").write_text(torch.cuda.memory_summary())
    return path


def fail_line(name: str, mode: str, precision: str, what: str, step: int) -> str:
    return f"[FAIL] {name} | {mode} | amp={precision != 'fp32'} | {what} @ step {step}"


def log_to_file(message: str, err: BaseException) -> None:
    """The traceback into train.log only: the console shows the one line."""
    record = log.makeRecord(
        log.name, logging.ERROR, __file__, 0, message, (), (type(err), err, err.__traceback__)
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def record_failure(cfg, run_dir: Path, err: BaseException, distributed: bool) -> str:
    """Print and file the failure; returns the [FAIL] line."""
    err.kiln_cfg = cfg
    what, detail = what_failed(err)
    if what == "OOM":
        detail += f"; report: {write_oom_report(run_dir, err, cfg)}"
    step = getattr(err, "step", None)
    step = getattr(err, "kiln_step", 0) if step is None else step
    from kiln.engine.distributed import run_mode

    mode = run_mode(cfg.trainer, distributed)  # single | DDP | FSDP
    line = fail_line(cfg.name, mode, cfg.precision.name, what, step)
    stats_path = None
    if hasattr(err, "batch_stats"):
        stats_path = write_batch_stats(cfg, run_dir, err, line)
        detail += f"; batch statistics: {shown(stats_path)}"
    print(f"{line}\n  {detail}\nrun directory: {shown(run_dir)}", file=sys.stderr, flush=True)
    root = Path(cfg.output_root)
    with contextlib.suppress(OSError):  # best effort: the line above is what counts
        root.mkdir(parents=True, exist_ok=True)
        with open(root / "failures.log", "a") as f:
            f.write(f"{line}\n  {detail}\n")
    log_to_file(f"{line}\n  {detail}", err)
    return line


def write_batch_stats(cfg, run_dir: Path, err, line: str) -> Path:
    """The offending batch's statistics beside the run and under outputs/failures/."""
    stats = {
        "failure": line,
        "run_dir": str(run_dir),
        "nonfinite_terms": err.bad_terms,
        "batch": err.batch_stats,
    }
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    stats_dir = Path(cfg.output_root) / "failures"
    stats_dir.mkdir(parents=True, exist_ok=True)
    paths = (
        run_dir / "nan_batch_stats.json",
        stats_dir / f"{stamp}-{cfg.name}-step{err.step}.json",
    )
    for path in paths:
        path.write_text(json.dumps(stats, indent=2) + "\n")
    return paths[0]
