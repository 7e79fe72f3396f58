"""Experiments you can trust: real train runs read back by TensorBoard's and W&B's own readers,
multirun sweeps with their summary, env profiles, debug tools and init schemes."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from kiln.cli.paths import REPO_ROOT, with_env_profile
from kiln.engine.distributed import DistInfo
from kiln.engine.run import build_run, train
from kiln.guards.activations import ActivationMonitor
from kiln.logging.sweep_summary import collect_runs
from kiln.models.init import apply_init

from .conftest import (
    SUBPROCESS_ENV,
    compose_config,
    read_metrics,
    read_summary,
    read_wandb_records,
    run_python,
    train_main_here,
)

QUICK = ("trainer.max_steps=4", "trainer.log_every_n_steps=1", "env.progress_bar=false")


def run_in_process(run_dir, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    return train(compose_config(*overrides), run_dir)


def run_sweep(sweep_dir, *overrides):
    """The real train.py as a Hydra multirun writing into sweep_dir."""
    # Flags such as -m must come before the overrides, so the sweep dir goes last.
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), *overrides, f"hydra.sweep.dir={sweep_dir}"]
    return run_python(cmd, sweep_dir.parent, timeout=600)


def test_tensorboard_and_wandb_receive_every_step_metric_and_eval(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    run_in_process(run_dir, *QUICK, "logger.backends=[csv,tensorboard,wandb]", "loss.z_loss=true")
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    jsonl = {m["step"]: m for m in read_metrics(run_dir) if "loss" in m}
    for key in (
        "loss",
        "loss/main",
        "loss/z_loss",
        "lr",
        "grad_norm",
        "samples_per_s",
        "data_time_frac",
        "memory_mb",
    ):
        scalars = {e.step: e.value for e in events.Scalars(key)}
        assert sorted(scalars) == [1, 2, 3, 4], key
        assert scalars[4] == pytest.approx(jsonl[4][key], rel=1e-5), key
    assert [e.step for e in events.Scalars("val_acc")] == [4]
    _, records = read_wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [h["loss"] for h in history if "loss" in h] == pytest.approx(
        [jsonl[s]["loss"] for s in (1, 2, 3, 4)], rel=1e-6
    )
    assert any("val_acc" in h for h in history)


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    settings = (*QUICK, "logger=wandb", "trainer.max_epochs=1")
    run_in_process(run_dir, *settings)
    run_in_process(run_dir, *settings, "resume=auto")
    run_files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 2
    run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    assert {path.name for path in run_files} == {f"run-{run_id}.wandb"}


def test_multirun_sweep_and_its_summary_include_failed_runs(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_sweep(
        sweep,
        "-m",
        "trainer.accumulate_grad_batches=1,2",
        "optimizer=sgd",
        "scheduler=none",
        "optimizer.lr=0.05,1e12",
        *QUICK,
        f"output_root={tmp_path}/outputs",
    )
    assert result.returncode != 0  # two jobs failed; Hydra reports it after running all four
    assert result.stderr.count("[FAIL]") == 2
    # The multirun kept its summary up to date itself (a Hydra callback), failed jobs included.
    table = collect_runs(sweep)
    assert len(table) == 4
    failed = table[table["status"] == "failed"]
    assert [float(lr) for lr in failed["optimizer.lr"]] == [1e12, 1e12]
    # lr 1e12: the learn probe stops it before step 1 (or, with the probe off, a NaN @ step N)
    assert all("cannot learn" in error or "@ step" in error for error in failed["error"])
    trained = table[table["status"].isin(["ok", "at_chance"])]  # a few steps may learn nothing
    assert len(trained) == 2 and (trained["samples_per_s"] > 0).all()
    assert (sweep / "summary.md").read_text().count("failed") >= 2
    assert (sweep / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_make_sweep_runs_the_documented_grid(tmp_path):
    result = subprocess.run(
        ["make", "-C", str(REPO_ROOT), "sweep", "ARGS=trainer.max_steps=3"],
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "summary.md" in result.stdout


def test_kiln_env_picks_the_profile_unless_env_is_given(monkeypatch):
    monkeypatch.setenv("KILN_ENV", "production")
    assert with_env_profile(["model=mlp"]) == ["model=mlp", "env=production"]
    assert with_env_profile(["env=experiment"]) == ["env=experiment"]
    monkeypatch.delenv("KILN_ENV")
    assert with_env_profile(["model=mlp"]) == ["model=mlp"]


def test_production_profile_through_kiln_env(tmp_path, capfd, monkeypatch):
    run_dir = tmp_path / "run"
    env = {**SUBPROCESS_ENV, "KILN_ENV": "production"}
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), f"hydra.run.dir={run_dir}", *QUICK]
    result = run_python(cmd, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "name: production" in config and "deterministic: true" in config
    assert "step 4 loss" not in result.stdout  # quiet console: no per-step log lines
    assert "step 4 loss" in (run_dir / "train.log").read_text()  # the file keeps them
    monkeypatch.setenv("KILN_ENV", "production")  # the refusal: train.py's main, here
    code, stderr = train_main_here(capfd, f"hydra.run.dir={tmp_path / 'r2'}", "debug=activations")
    assert code != 0 and "not allowed in env=production" in stderr


def test_fast_dev_run_is_one_train_and_one_val_batch(tmp_path):
    summary = run_in_process(tmp_path / "run", "debug=fast_dev_run", "env.progress_bar=false")
    assert summary["steps"] == 1 and summary["status"] == "ok"
    assert not list((tmp_path / "run" / "checkpoints").glob("epoch-*.pt"))


def test_overfit_batch_drives_the_loss_down(tmp_path):
    summary = run_in_process(
        tmp_path / "run",
        "debug=overfit_batch",
        "trainer.max_steps=30",
        "env.progress_bar=false",
        "model.dropout=0.0",
    )
    assert summary["steps"] == 30
    assert summary["overfit_loss_last"] < 0.2 * summary["overfit_loss_first"]


def test_activations_debug_logs_layer_statistics(tmp_path):
    run_in_process(tmp_path / "run", "debug=activations", *QUICK)
    first = read_metrics(tmp_path / "run")[0]
    assert "act/body.0/mean" in first and "act/head/std" in first
    assert first["act/body.1/mean"] >= 0  # after the ReLU


def test_activation_monitor_flags_dead_and_exploding_layers():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with torch.no_grad():
        model[0].bias.fill_(-1e4)  # every ReLU output is 0: dead
        model[2].weight.fill_(0.0)
        model[2].bias.fill_(1e5)  # exploding
    monitor = ActivationMonitor(model)
    model.train()
    model(torch.randn(8, 4))
    flagged = monitor.flagged()
    assert flagged["1"].startswith("dead") and flagged["2"].startswith("exploding")
    assert "0" not in flagged or not flagged["0"].startswith("dead")
    monitor.close()
    assert not model[0]._forward_hooks


@pytest.mark.parametrize(
    ("scheme", "expected_std"),
    [("kaiming", math.sqrt(2 / 256)), ("xavier", math.sqrt(2 / (256 + 256)))],
)
def test_init_schemes_set_the_weight_scale(scheme, expected_std):
    torch.manual_seed(0)
    layer = nn.Linear(256, 256)
    apply_init(layer, scheme)
    assert layer.weight.std().item() == pytest.approx(expected_std, rel=0.05)
    assert torch.count_nonzero(layer.bias) == 0


@pytest.mark.parametrize(("scheme", "gain"), [("kaiming", math.sqrt(2)), ("xavier", None)])
def test_init_scheme_from_config_reaches_the_models_weights(tmp_path, scheme, gain):
    """model.init=<scheme> on the command line sets the weights the trainer starts from."""
    cfg = compose_config(f"model.init={scheme}", "model.hidden_dims=[512,256]")
    trainer = build_run(cfg, tmp_path, DistInfo(), torch.device("cpu"), lambda m, s: None).trainer
    layer = trainer.raw_model.body[3]  # Linear(512, 256)
    fan_in, fan_out = layer.in_features, layer.out_features
    expected = gain / math.sqrt(fan_in) if gain else math.sqrt(2 / (fan_in + fan_out))
    assert layer.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert torch.count_nonzero(layer.bias) == 0
    default = build_run(
        compose_config("model.hidden_dims=[512,256]"),
        tmp_path,
        DistInfo(),
        torch.device("cpu"),
        lambda m, s: None,
    ).trainer.raw_model.body[3]
    assert default.weight.std().item() != pytest.approx(expected, rel=0.2)  # the default differs


def test_optuna_search_optimises_the_metric_train_returns(tmp_path):
    sweep = tmp_path / "search"
    result = run_sweep(sweep, "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2", *QUICK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"sweep summary: {sweep}/summary.md, {sweep}/summary.png" in result.stdout
    best = (sweep / "optimization_results.yaml").read_text()
    for picture in ("summary.png", "history.png"):  # written when the search ended
        assert (sweep / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "\x1b[" not in result.stdout + result.stderr  # no colour codes
    assert "alembic" not in result.stdout + result.stderr
    values = [
        read_summary(d)["val_acc"] for d in sorted(p.parent for p in sweep.glob("*/summary.json"))
    ]
    assert len(values) == 2
    assert f"best_value: {max(values)}" in best
