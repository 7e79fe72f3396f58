"""The `wandb` backend: a Weights & Biases run, offline by default.

Offline runs land in <run_dir>/wandb/offline-run-<time>-<id>/ and never contact a server; upload
them later with `wandb sync <that dir>`. Online needs wandb_mode="online" *and* WANDB_API_KEY in
the environment; wandb reads the key from there itself, so kiln never holds, prints or logs it.
Console capture is off (W&B would otherwise copy stdout/stderr into the run), and git state and
code are not collected.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

WANDB_MODES = ("offline", "online")
API_KEY_ENV = "WANDB_API_KEY"


def check_wandb_mode(mode: str) -> None:
    """Raise ValueError unless `mode` is usable here (online also needs WANDB_API_KEY)."""
    if mode not in WANDB_MODES:
        raise ValueError(f"logger.wandb_mode={mode!r} is not valid; choose one of: offline, online")
    if mode == "online" and not os.environ.get(API_KEY_ENV):
        raise ValueError(
            f"logger.wandb_mode=online needs the {API_KEY_ENV} environment variable "
            "(W&B reads it; kiln never stores it); set it, or use logger.wandb_mode=offline and "
            "`wandb sync` the run later"
        )


class WandbLogger:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        run_name: str,
        project: str = "kiln",
        mode: str = "offline",
        entity: str | None = None,
        resume_id: str | None = None,
    ):
        check_wandb_mode(mode)
        import wandb  # here, so runs without this backend never pay wandb's import time

        settings = wandb.Settings(
            console="off",  # no copy of stdout/stderr (and anything echoed there) in the run
            disable_git=True,
            save_code=False,
            quiet=True,  # keep the "synced/offline run at ..." lines, drop the banner
        )
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            mode=mode,
            dir=str(self.run_dir),
            project=project,
            entity=entity,
            name=run_name,
            # Reusing the id of a resumed run continues its history; None: wandb generates one.
            id=resume_id,
            resume="allow",
            # Each logger owns its run: a second run in the same process (a Hydra multirun job)
            # must not be handed the previous, possibly unfinished, one.
            reinit="create_new",
            settings=settings,
        )
        self._closed = False

    @property
    def run_id(self) -> str:
        """Pass this as resume_id when resuming, to continue the same W&B run."""
        return self._run.id

    def log_config(self, config: dict) -> None:
        self._run.config.update(config, allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log({key: float(value) for key, value in metrics.items()}, step=int(step))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._run.finish()
