"""Runs that used to end `ok` with nothing said, or died mid-run with a bare PyTorch error: each
is stopped, before step 1 where a probe can see it, with a message that names what to fix."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from torch import nn

from kiln import checkpoint as files
from kiln.config.model import MlpConfig
from kiln.engine.run import train
from kiln.engine.trainer import NonFiniteEvalError

from .broken_models import EvalOnlyNaN, SideHeadConfig, UnusedSideHead, features
from .conftest import read_metrics

QUIET = ("env.progress_bar=false", "logger=none", "trainer.log_every_n_steps=5")


class NaNInEvalAfterTwoEpochs(nn.Module):
    """Finite in training; its eval path turns NaN once it has trained for two epochs (a running
    statistic that goes bad late, so the first evaluations are fine)."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), spec.num_classes)
        self.register_buffer("train_calls", torch.zeros(()))

    def forward(self, x):
        logits = self.fc(x.flatten(1))
        if self.training:
            self.train_calls += 1
            return logits
        return logits * (float("nan") if self.train_calls > 30 else 1.0)  # 23 steps an epoch


def test_a_nan_validation_loss_fails_the_run_and_never_picks_best(tmp_path, temporary_model):
    run_dir = tmp_path / "run"
    cfg = temporary_model(
        "eval_only_nan", EvalOnlyNaN, *QUIET, "trainer.max_epochs=2", "trainer.shape_check=false",
        "trainer.monitor=val_loss", "trainer.monitor_mode=min",
    )  # fmt: skip
    with pytest.raises(NonFiniteEvalError) as info:
        train(cfg, run_dir)
    assert str(info.value).startswith("val_loss NaN @ step 23")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["best"] is None
    assert not (run_dir / "checkpoints" / "best.pt").exists()
    from kiln.cli.failures import what_failed

    assert what_failed(info.value)[0] == "val_loss NaN"  # the [FAIL] line's <what>


def test_under_nan_policy_skip_each_nan_evaluation_is_said_and_the_best_kept(
    tmp_path, temporary_model, caplog
):
    run_dir = tmp_path / "run"
    cfg = temporary_model(
        "late_eval_nan", NaNInEvalAfterTwoEpochs, *QUIET, "trainer.max_epochs=4",
        "trainer.shape_check=false", "trainer.nan_policy=skip", "trainer.monitor=val_loss",
        "trainer.monitor_mode=min",
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        summary = train(cfg, run_dir)
    evals = [m for m in read_metrics(run_dir) if "val_loss" in m]
    bad = [m["step"] for m in evals if not math.isfinite(float(m["val_loss"]))]
    assert bad == [46, 69, 92]  # epochs 2, 3, 4
    said = [r.getMessage() for r in caplog.records if "non-finite evaluation" in r.getMessage()]
    assert len(said) == 3 and all("best.pt stays at step 23" in line for line in said), said
    best = files.load_checkpoint(run_dir / "checkpoints" / "best.pt")
    assert best["state"]["global_step"] == 23 and summary["best"] == evals[0]["val_loss"]


def test_an_aux_head_on_in_an_options_yaml_is_refused_at_start_up(tmp_path):
    """The model's own option turns its head on; nothing trains it."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mlp_aux.yaml").write_text("defaults:\n  - mlp\n  - _self_\n"
                                                             "aux_head: true\n")  # fmt: skip
    from kiln.config import ConfigError, load_config
    from kiln.registry import MODELS

    MODELS.declare("mlp_aux", "kiln.models.mlp:build_mlp", config=MlpConfig, inputs=("image",))
    try:
        with pytest.raises(ConfigError) as info:
            load_config(["model=mlp_aux", f"hydra.searchpath=[file://{tmp_path}/conf]"])
    finally:
        del MODELS._entries["mlp_aux"]
    message = str(info.value)
    assert message.startswith("rule 2 (every optional loss branch has a flag and must work)")
    assert "(model.aux_head): set loss.aux_head=true to train it" in message
    assert load_config(["loss.aux_head=true"]).loss.aux_head  # the loss flag builds and trains it


def test_a_parameter_no_loss_reaches_is_named_with_its_flag_before_step_2(
    tmp_path, temporary_model
):
    from kiln.guards import LossBranchError

    cfg = temporary_model("side_head", UnusedSideHead, *QUIET, "trainer.max_epochs=1")
    cfg.model = SideHeadConfig(name="side_head")
    with pytest.raises(LossBranchError) as info:
        train(cfg, tmp_path / "run")
    message = str(info.value)
    assert "got no gradient at step 1: side.weight, side.bias, in side (Linear)" in message
    assert "model.side_head=false turns that branch off" in message
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 0
