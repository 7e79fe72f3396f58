"""Shared fixtures: the real config, composed and shrunk; the real train.py in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kiln.cli.paths import CONF_DIR, REPO_ROOT
from kiln.config import register_configs

register_configs()

# Keep CPU work predictable on the 2-core machines tests run on.
SUBPROCESS_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "PYTHONUNBUFFERED": "1",
}


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def cfg_factory():
    return compose_config


def run_train(
    run_dir: Path,
    *overrides: str,
    cwd: Path | None = None,
    timeout: int = 300,
    launcher=None,
    explicit_run_dir: bool = True,
    env_overrides: dict | None = None,
):
    """Run the real `python train.py` with hydra.run.dir=run_dir; returns CompletedProcess."""
    cmd = [*(launcher or [sys.executable]), str(REPO_ROOT / "train.py")]
    cmd += [f"hydra.run.dir={run_dir}"] if explicit_run_dir else []
    cmd += overrides
    return subprocess.run(
        cmd,
        cwd=cwd or run_dir.parent,
        env={**SUBPROCESS_ENV, **(env_overrides or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_wandb_records(run_dir: Path) -> tuple[Path, list[dict]]:
    """The offline W&B run under run_dir, read by wandb's own reader (`wandb leet inspect`)."""
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return run_file, [json.loads(line) for line in out.splitlines() if line.strip()]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# A learning rate that drives the digits MLP to a non-finite loss within a few steps.
DIVERGING = ("optimizer=sgd", "optimizer.lr=1e12", "scheduler=none")

# Settings that make a real training run take seconds: tiny data, few steps, no progress bar.
FAST = (
    "trainer.max_epochs=1",
    "trainer.log_every_n_steps=1",
    "env.progress_bar=false",
)
