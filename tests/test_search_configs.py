"""The sweep configs compose against the real schema, and the Optuna search and the joblib
launcher actually run (a stand-in task function replaces training to keep this fast)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.types import RunMode

from kiln.config import register_configs

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def _compose(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def test_optuna_search_composes_with_its_search_space():
    # Imported here: optuna's import (1-3 CPU-s) was paid by every xdist worker's collection.
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
    from optuna.distributions import CategoricalDistribution, LogUniformDistribution

    cfg = _compose(["hparams_search=digits_optuna"])
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper")
    assert cfg.hydra.mode == RunMode.MULTIRUN
    assert (sweeper.direction, sweeper.storage, sweeper.n_trials) == ("maximize", None, 6)
    # Parse the params exactly as the sweeper will.
    distributions, fixed = create_params_from_overrides(
        [f"{key}={value}" for key, value in sweeper.params.items()]
    )
    assert fixed == {}
    assert distributions["optimizer.lr"] == LogUniformDistribution(0.0003, 0.03)
    assert distributions["data.batch_size"] == CategoricalDistribution((32, 64, 128))


def test_a_trial_config_composes():
    # The keys the search samples exist in the schema with the right types.
    cfg = _compose(["hparams_search=digits_optuna", "optimizer.lr=0.001", "data.batch_size=128"])
    assert (cfg.optimizer.lr, cfg.data.batch_size) == (0.001, 128)


def test_slurm_launcher_composes():
    launcher = _compose(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"]).hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.partition == "gpu"
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes) == (1, 1, 1)
    assert launcher.timeout_min > 0


def test_joblib_launcher_composes():
    launcher = _compose(["hydra/launcher=joblib_local"]).hydra.launcher
    assert launcher._target_.endswith("JoblibLauncher")
    assert launcher.n_jobs == 2


# A Hydra app on the real conf/ whose "training" returns a made-up val_acc, best at lr=3e-3, and
# fails (as a diverged run would) at batch size 128.
STAND_IN_APP = textwrap.dedent(
    """
    import math, sys
    import hydra
    from kiln.config import register_configs

    register_configs()

    @hydra.main(config_path=sys.argv.pop(1), config_name="config", version_base="1.3")
    def main(cfg) -> float:
        if cfg.data.batch_size == 128:
            raise FloatingPointError("loss NaN @ step 3")
        return 1.0 - abs(math.log10(cfg.optimizer.lr) - math.log10(3e-3)) / 10

    main()
    """
)


def _run_app(tmp_path: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    app = tmp_path / "app.py"
    app.write_text(STAND_IN_APP)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, str(app), str(CONF), *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def test_optuna_search_runs_in_memory(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = _run_app(tmp_path, ["hparams_search=digits_optuna", f"hydra.sweep.dir={sweep_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"optimizer.lr", "data.batch_size"}
    assert 0.0003 <= best["best_params"]["optimizer.lr"] <= 0.03
    trial_overrides = [
        yaml.safe_load(path.read_text()) for path in sweep_dir.glob("*/.hydra/overrides.yaml")
    ]
    assert len(trial_overrides) == 6  # a failed trial did not end the search
    assert any("data.batch_size=128" in overrides for overrides in trial_overrides)
    assert best["best_params"]["data.batch_size"] != 128
    assert all(any(item.startswith("optimizer.lr=") for item in o) for o in trial_overrides)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_joblib_launcher_runs_two_jobs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = _run_app(
        tmp_path,
        [
            "-m",
            "hydra/launcher=joblib_local",
            "optimizer.lr=0.001,0.003",
            f"hydra.sweep.dir={sweep_dir}",
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.parent.parent.name for path in sweep_dir.glob("*/.hydra/config.yaml")) == [
        "0",
        "1",
    ]
