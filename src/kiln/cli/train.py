"""`python train.py ...` / `kiln-train ...`: compose the config with Hydra, train, and leave a
summary.json; a failed run ends with one greppable [FAIL] line."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kiln.cli.paths import CONF_DIR, with_ddp_run_dir, with_env_profile
from kiln.cli.resume import with_resume_run_dir
from kiln.config import register_configs

log = logging.getLogger("kiln")

EXIT_FAILED = 1
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: requeue me (with resume=auto)


def fail_line(cfg, distributed: bool, kind: str, step: int) -> str:
    mixed = cfg.precision.name != "fp32"
    mode = "DDP" if distributed else "single"
    return f"[FAIL] {cfg.name} | {mode} | amp={mixed} | loss {kind} @ step {step}"


def record_nonfinite(cfg, run_dir: Path, err, distributed: bool) -> None:
    """The [FAIL] line on stderr and in outputs/failures.log, the batch statistics beside it."""
    line = fail_line(cfg, distributed, err.kind, err.step)
    print(line, file=sys.stderr, flush=True)
    root = Path(cfg.output_root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "failures.log", "a") as f:
        f.write(line + "\n")
    stats = {
        "failure": line,
        "run_dir": str(run_dir),
        "nonfinite_terms": err.bad_terms,
        "batch": err.batch_stats,
    }
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    stats_dir = root / "failures"
    stats_dir.mkdir(exist_ok=True)
    for path in (
        run_dir / "nan_batch_stats.json",
        stats_dir / f"{stamp}-{cfg.name}-step{err.step}.json",
    ):
        path.write_text(json.dumps(stats, indent=2) + "\n")


def record_oom(run_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        (run_dir / "cuda_memory_summary.txt").write_text(torch.cuda.memory_summary())


def quiet_console() -> None:
    """Only warnings on the console; train.log keeps every line."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> float | None:
    import torch

    from kiln.engine.distributed import env_dist_info, teardown
    from kiln.engine.run import train
    from kiln.engine.trainer import NonFiniteLossError, Preempted

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    dist = env_dist_info()
    if cfg.env.quiet:
        quiet_console()
    try:
        summary = train(cfg, run_dir)
    except NonFiniteLossError as err:
        if dist.is_main:
            record_nonfinite(cfg, run_dir, err, dist.enabled)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # Hydra records the failed job and the sweep goes on
        raise SystemExit(EXIT_FAILED) from None
    except Preempted as err:
        log.warning("%s", err)
        raise SystemExit(EXIT_PREEMPTED) from None
    except torch.cuda.OutOfMemoryError:
        record_oom(run_dir)
        raise
    finally:
        teardown()
    if dist.is_main:
        print(f"run directory: {run_dir}", flush=True)
        log.info("summary: %s", json.dumps(summary))
    value = summary.get(summary.get("monitor") or "", None)
    return float(value) if value is not None else None  # what Optuna optimises


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = with_env_profile(argv)
    argv = with_ddp_run_dir(argv)
    register_configs()  # before anything composes the config (resume=auto does, to find the run)
    argv = with_resume_run_dir(argv)
    sys.argv = [sys.argv[0], *argv]
    hydra_main()
