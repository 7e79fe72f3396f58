"""The `tensorboard` backend: event files under <run_dir>/tensorboard/ (`tensorboard --logdir`).

Metric names with "/" (loss/z_loss) become TensorBoard's tag groups. The config is shown as text
(the TEXT tab) as a fenced YAML block, which TensorBoard renders as Markdown.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

from kiln.logging.jsonl import to_jsonable

CONFIG_TAG = "config"


class TensorBoardLogger:
    def __init__(self, run_dir: str | Path):
        # Imported here so runs without this backend never load tensorboard.
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self._closed = False

    def log_config(self, config: dict) -> None:
        text = yaml.safe_dump(to_jsonable(config), sort_keys=False, default_flow_style=False)
        self._writer.add_text(CONFIG_TAG, f"```yaml\n{text}```", global_step=0)
        self._writer.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), global_step=int(step))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()  # flushes pending events
