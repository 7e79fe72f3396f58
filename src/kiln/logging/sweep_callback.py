"""A Hydra callback (conf/config.yaml, hydra.callbacks.sweep_summary): a multirun, plain -m or an
Optuna search, keeps its summary table and plot up to date in the sweep directory (summary.md,
summary.png; history.png for a search), rewritten as each job ends, so a sweep that stops on a
failed job has them too; the table is printed when the sweep ends. It also keeps Optuna's and
alembic's own chatter off the console."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode

log = logging.getLogger("kiln")


def write_sweep_summary(sweep_dir: Path, hydra_cfg: Any) -> list[Path]:
    from kiln.logging.sweep_summary import collect_runs, plot_history, write_summary

    runs = collect_runs(sweep_dir)
    if runs.empty:
        return []
    written = list(write_summary(runs, sweep_dir))
    sweeper = str(hydra_cfg.get("sweeper", {}).get("_target_", ""))
    if "optuna" in sweeper.lower():
        direction = str(hydra_cfg.sweeper.get("direction", "maximize"))
        history = plot_history(runs, sweep_dir / "history.png", direction)
        written += [history] if history else []
    return written


class SweepSummary(Callback):
    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        logging.getLogger("alembic").setLevel(logging.WARNING)
        try:
            import optuna

            optuna.logging.disable_default_handler()  # its coloured handler: Hydra's logs suffice
            optuna.logging.set_verbosity(optuna.logging.WARNING)
        except ImportError:
            pass

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            return
        try:
            write_sweep_summary(Path(hydra_cfg.sweep.dir), hydra_cfg)
        except Exception:  # a summary must never be why a sweep fails
            log.warning("could not write the sweep summary", exc_info=True)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from kiln.logging.sweep_summary import best_run, collect_runs, to_markdown

        sweep_dir = Path(config.hydra.sweep.dir)
        written = write_sweep_summary(sweep_dir, config.hydra)
        if written:
            runs = collect_runs(sweep_dir)
            print(to_markdown(runs), flush=True)
            print("\n".join(best_run(runs, sweep_dir)), flush=True)
            print("sweep summary: " + ", ".join(str(p) for p in written), flush=True)
