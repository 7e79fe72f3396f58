"""`python train.py ...` / `kiln-train ...`: check the config, let Hydra make the run directory,
train, and leave a summary.json. A user mistake ends with one `error: ...` line (exit 2); a
failed run ends with one greppable [FAIL] line (exit 1); a preempted one exits 75."""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kiln.cli.paths import (
    CONF_DIR,
    config_overrides,
    is_multirun,
    with_ddp_run_dir,
    with_env_profile,
)
from kiln.cli.resume import with_resume_run_dir
from kiln.config import load_config, register_configs, to_typed
from kiln.errors import UserError
from kiln.registry import load_plugins

log = logging.getLogger("kiln")

EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: requeue me (with resume=auto)
HELP_FLAGS = ("-h", "--help", "--describe")


def fail_line(cfg, distributed: bool, kind: str, step: int) -> str:
    from kiln.engine.distributed import run_mode

    mixed = cfg.precision.name != "fp32"
    mode = run_mode(cfg.trainer, distributed)  # single | DDP | FSDP
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


def user_error(err: BaseException) -> SystemExit:
    """One line on stderr; the traceback only when asked for (HYDRA_FULL_ERROR=1)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        import traceback

        traceback.print_exception(err)
    print(f"error: {err}", file=sys.stderr, flush=True)
    return SystemExit(EXIT_USER_ERROR)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_main(raw_cfg: DictConfig) -> float | None:
    import torch

    from kiln.engine.distributed import env_dist_info, teardown
    from kiln.engine.preemption import Preempted
    from kiln.engine.run import train
    from kiln.engine.trainer import NonFiniteLossError

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    dist = env_dist_info()
    try:
        cfg = to_typed(raw_cfg)
        if cfg.env.quiet:
            quiet_console()
        summary = train(cfg, run_dir)
    except NonFiniteLossError as err:
        if dist.is_main:
            record_nonfinite(cfg, run_dir, err, dist.enabled)
        if multirun:
            raise  # Hydra records the failed job and the sweep goes on
        raise SystemExit(EXIT_FAILED) from None
    except Preempted as err:
        log.warning("%s", err)
        raise SystemExit(EXIT_PREEMPTED) from None
    except UserError as err:
        if multirun:
            raise
        raise user_error(err) from None
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


def plugin_modules(argv: list[str]) -> list[str]:
    """The modules named by a plugins=[...] override, before Hydra parses anything."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = [a for a in argv if a.split("=", 1)[0].lstrip("+~") == "plugins"]
    if not found:
        return []
    value = OverridesParser.create().parse_overrides(found[-1:])[0].value()
    return [str(v) for v in (value if isinstance(value, list) else [value])]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = with_env_profile(argv)
    try:
        load_plugins(plugin_modules(argv))
        if any(arg in HELP_FLAGS for arg in argv):
            from kiln.cli.help import describe, overview

            targets = [a for a in argv if a not in HELP_FLAGS and not a.startswith("plugins=")]
            print(describe(targets[0]) if targets else overview())
            return
        register_configs()
        if not is_multirun(argv):  # a sweep's jobs are checked one by one as they start
            cfg = load_config(config_overrides(argv))  # a mistake fails here, before any work
            argv = with_resume_run_dir(argv, cfg.name)
    except (UserError, ImportError, KeyError) as err:
        raise user_error(err) from None
    argv = with_ddp_run_dir(argv)
    sys.argv = [sys.argv[0], *argv]
    hydra_main()
