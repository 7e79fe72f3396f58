"""Runs that used to end `ok` with nothing said, or died mid-run with a bare PyTorch error: each
is stopped, before step 1 where a probe can see it, with a message that names what to fix."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest
import torch
from torch import nn

from kiln import checkpoint as files
from kiln.config.model import DetectorConfig, MlpConfig, TextBowConfig
from kiln.engine.run import train
from kiln.engine.trainer import NonFiniteEvalError
from kiln.guards import ShapeInferenceError
from kiln.registry import MODELS

from .broken_models import EvalOnlyNaN, SideHeadConfig, UnusedSideHead, features
from .conftest import compose_config, read_metrics

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
        "eval_only_nan",
        EvalOnlyNaN,
        *QUIET,
        "trainer.max_epochs=2",
        "trainer.shape_check=false",
        "trainer.monitor=val_loss",
        "trainer.monitor_mode=min",
    )
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
        "late_eval_nan",
        NaNInEvalAfterTwoEpochs,
        *QUIET,
        "trainer.max_epochs=4",
        "trainer.shape_check=false",
        "trainer.nan_policy=skip",
        "trainer.monitor=val_loss",
        "trainer.monitor_mode=min",
    )
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
    (tmp_path / "conf" / "model" / "mlp_aux.yaml").write_text(
        "defaults:\n  - mlp\n  - _self_\naux_head: true\n"
    )
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
    cfg = dataclasses.replace(cfg, model=SideHeadConfig(name="side_head"))
    with pytest.raises(LossBranchError) as info:
        train(cfg, tmp_path / "run")
    message = str(info.value)
    assert (
        "got no gradient in the probe step before step 1: side.weight, side.bias, in side (Linear)"
        in message
    )
    assert "model.side_head=false turns that branch off" in message
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 0


# ---------------------------------------------------------------------------------------------
# Rule 1 probes the extremes of the data's own plan: catching a bug never depends on the seed


@pytest.fixture
def model_named():
    """Register a model under its own name for one test; returns its config for the data."""
    added = []

    def register(name, builder, schema, inputs, *overrides):
        MODELS.register(name, config=schema, inputs=inputs)(builder)
        added.append(name)
        cfg = compose_config(*QUIET, *overrides)
        return dataclasses.replace(cfg, model=schema(name=name))

    yield register
    for name in added:
        del MODELS._entries[name]


def long_and_short_texts(path):
    """300 short reviews and 3 long ones: a random probe of 8 rarely holds a long one."""
    rows = ["text,label"]
    for i in range(300):
        rows.append(f"item {i} was {'good' if i % 2 else 'bad'} today,{'pos' if i % 2 else 'neg'}")
    for i in range(3):
        rows.append(" ".join(f"word{j}" for j in range(60)) + f" {i},pos")
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("seed", [0, 42])
def test_a_position_table_too_short_is_caught_before_step_1_whatever_the_seed(
    tmp_path, model_named, seed
):
    from .broken_models import PositionTable32

    csv = long_and_short_texts(tmp_path / "reviews.csv")
    cfg = model_named(
        "positions_32",
        PositionTable32,
        TextBowConfig,
        ("tokens",),
        "data=csv_text",
        "model=text_bow",
        f"data.train_path={csv}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.vocab_size=300",
        "data.max_length=64",
        f"seed={seed}",
        "trainer.max_epochs=3",
        "trainer.probe_budget.enforce=false",  # which check catches it: not the machine's load
    )
    with pytest.raises(ShapeInferenceError) as info:
        train(cfg, tmp_path / "run")
    assert "failed on 2 sequences of 64 tokens (spec.max_length" in str(info.value)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 0


@pytest.mark.parametrize("seed", [0, 42])
def test_a_detector_that_assumes_a_box_is_caught_before_step_1_whatever_the_seed(
    tmp_path, model_named, seed
):
    from .broken_models import AssumesABox

    cfg = model_named(
        "assumes_a_box",
        AssumesABox,
        DetectorConfig,
        ("image_list",),
        "data=shapes_detection",
        "model=detector",
        "data.num_train=64",
        "data.num_val=4",
        "data.image_size=48",
        "data.min_image_size=32",
        "data.num_background=3",
        f"seed={seed}",
        "trainer.probe_budget.enforce=false",  # which check catches it: not the machine's load
    )
    with pytest.raises(ShapeInferenceError) as info:
        train(cfg, tmp_path / "run")
    message = str(info.value)
    assert "failed on an image with no box and the image with the most boxes" in message
    assert "index 0 is out of bounds" in message


def test_a_batchnorm_head_and_an_epoch_ending_in_one_sample_names_the_fix(tmp_path, model_named):
    from .broken_models import BatchNormHead

    cfg = model_named(
        "bn_head",
        BatchNormHead,
        MlpConfig,
        ("image",),
        "data.batch_size=4",
        "trainer.max_epochs=1",
    )
    with pytest.raises(ShapeInferenceError) as info:
        train(cfg, tmp_path / "run")
    message = str(info.value)
    assert "failed on the epoch's last batch, of 1 sample, in train mode (1437 samples" in message
    assert "in norm (BatchNorm1d)" in message
    assert "set data.drop_last=true (that sample is left out of each epoch), or " in message
    assert "data.batch_size=5 (1437 samples leave a last batch of 2)" in message
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, drop_last=True))  # the fix
    summary = train(cfg, tmp_path / "fixed")
    assert summary["status"] == "ok" and summary["steps"] == 359  # 1437 // 4 batches


# ---------------------------------------------------------------------------------------------
# Messages say what differed between the runs that disagree, and where


def test_an_output_that_follows_grad_mode_is_blamed_on_grad_mode_not_literals(
    tmp_path, model_named
):
    from .broken_models import GradModeWidth

    cfg = model_named("grad_width", GradModeWidth, MlpConfig, ("image",), "trainer.max_epochs=1")
    with pytest.raises(ShapeInferenceError) as info:
        train(cfg, tmp_path / "run")
    message = str(info.value)
    assert "What varied: grad mode" in message and "never literals" not in message
    assert "the first module whose output differs: head (GradModeHead)" in message
    assert "must not depend on torch.is_grad_enabled()" in message
