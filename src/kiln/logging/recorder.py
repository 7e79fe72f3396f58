"""RunRecorder: where a run's metrics go. metrics.jsonl always, the configured logger backends
too, on the main rank only; a resumed run continues its W&B run."""

from __future__ import annotations

import logging
from pathlib import Path

from kiln.config.run import LoggerConfig
from kiln.errors import DiskFullError
from kiln.logging import JsonlWriter, build_loggers

log = logging.getLogger(__name__)

WANDB_ID_FILE = "wandb_run_id.txt"


class RunRecorder:
    def __init__(
        self, cfg: LoggerConfig, run_dir: Path, *, run_name: str, config: dict, is_main: bool
    ):
        self.enabled = is_main
        self.history: list[dict] = []
        self.activations = None  # an ActivationMonitor when trainer.log_activations is on
        if not self.enabled:
            return
        from kiln.logging.curves import CurvesFile

        self.curves = (
            CurvesFile(run_dir / "curves.png", title=f"{run_name}: {run_dir.name}")
            if cfg.curves
            else None
        )
        self.jsonl = JsonlWriter(run_dir / "metrics.jsonl")
        wandb_id_file = run_dir / WANDB_ID_FILE
        self.loggers = build_loggers(
            list(cfg.backends),
            run_dir,
            run_name=run_name,
            wandb_project=cfg.wandb_project,
            wandb_mode=str(cfg.wandb_mode),
            wandb_entity=cfg.wandb_entity,
            resume_id=wandb_id_file.read_text().strip() if wandb_id_file.is_file() else None,
        )
        if "wandb" in self.loggers.backends:
            wandb_id_file.write_text(self.loggers.backends["wandb"].run_id + "\n")
        self.loggers.log_config(config)

    def carry_on(self, metrics_file: Path, step: int) -> None:
        """A resumed run's curves show the whole run: its history up to the resumed step, from
        the metrics.jsonl of the run it resumes (its own, or the one it was copied from)."""
        from kiln.logging.jsonl import read_jsonl

        if metrics_file.is_file():
            damaged: list[str] = []
            records = read_jsonl(metrics_file, damaged=damaged)
            for problem in damaged:  # a killed run's last line, cut off: its curves do without
                log.warning("%s: %s; left out of the curves", metrics_file, problem)
            step_of = lambda m: m.get("step") if isinstance(m.get("step"), int) else 0  # noqa: E731
            self.history[:0] = [m for m in records if step_of(m) <= step]

    def __call__(self, metrics: dict, step: int) -> None:
        if self.activations is not None and "loss" in metrics:
            metrics = {**metrics, **self.activations.metrics()}
            for layer, problem in self.activations.flagged().items():
                log.warning("activation check: layer %s is %s", layer, problem)
        self.history.append({"step": step, **metrics})
        if self.enabled:
            self.jsonl.write({"step": step, **metrics})
            self.loggers.log_metrics(metrics, step)
            evaluated = any(key.startswith("val_") for key in metrics)
            if evaluated and self.curves is not None:  # redraw, on a thread of its own
                self.curves.update(self.history)

    def close(self, draw: bool = True) -> None:
        """`draw=False`: no last redraw of curves.png (a second Ctrl-C stops at once)."""
        if self.activations is not None:
            self.activations.close()
        if self.enabled:
            full = None
            try:
                if self.curves is not None:
                    self.curves.finish(self.history, draw_now=draw)
            except DiskFullError as err:  # a full disk ends the run, whatever write found it
                full = err
            except Exception:  # a picture must never be why a run fails
                log.warning("could not draw %s", self.curves.path, exc_info=True)
            self.loggers.close()
            self.jsonl.close()
            if full is not None:
                raise full
