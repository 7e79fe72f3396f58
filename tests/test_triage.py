"""kiln triage on runs made to show each cause: the right cause ranks first, with its evidence
and the override to try."""

from __future__ import annotations

import dataclasses
import re
import sys
import time

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from kiln.cli.failures import record_failure
from kiln.config.data import DigitsConfig
from kiln.config.model import MlpConfig
from kiln.data import build_data
from kiln.engine.distributed import DistInfo
from kiln.engine.run import build_run, train
from kiln.logging.recorder import RunRecorder
from kiln.logging.summary import summarize, write_summary
from kiln.registry import DATASETS, MODELS
from kiln.triage import triage

from .broken_models import BROKEN
from .conftest import PROBES_OFF, compose_config, read_summary, run_python

QUIET = ("env.progress_bar=false", "logger=none", "trainer.log_every_n_steps=1")
# Runs made to reach the loop's own failures: the learn probe would stop them before step 1.
NO_LEARN_PROBE = "trainer.learn_probe=false"


def top_cause(run_dir):
    _, causes = triage(run_dir)
    assert causes, "triage found nothing"
    return causes[0]


@pytest.fixture
def dataset():
    """Register a dataset derived from digits for one test."""
    added = []

    def register(name, change):
        def build(cfg):
            bundle = build_data(DigitsConfig(name="digits", batch_size=cfg.batch_size))
            return change(bundle)

        DATASETS.register(name, config=DigitsConfig, provides="image")(build)
        added.append(name)

    yield register
    for name in added:
        del DATASETS._entries[name]


def config_with_data(name, *overrides):
    cfg = compose_config(*QUIET, *overrides)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, name=name))


def test_exploding_gradients_before_a_nan(tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose_config(
        *QUIET,
        "optimizer=sgd",
        "optimizer.lr=10",
        "scheduler=none",
        "trainer.max_epochs=1",
        NO_LEARN_PROBE,
    )
    with pytest.raises(RuntimeError, match="loss (NaN|Inf)"):
        train(cfg, run_dir)
    cause = top_cause(run_dir)
    assert cause.title.startswith("exploding gradients")
    assert "grad norm rose from" in cause.evidence
    assert cause.try_ == "optimizer.lr=1 trainer.gradient_clip_val=1.0"


def test_fp16_overflow_shows_as_growing_scaler_skips(tmp_path):
    """Gradients that overflow (to inf, as fp16 gradients do) under a GradScaler for the first
    steps: the scaler skips those steps and backs off."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # The probes run backward on the run's own model: the hook below would see theirs first.
    cfg = compose_config(*QUIET, "trainer.max_steps=20", "scheduler=none", *PROBES_OFF)
    recorder = RunRecorder(cfg.logger, run_dir, run_name=cfg.name, config={}, is_main=True)
    trainer = build_run(cfg, run_dir, DistInfo(), torch.device("cpu"), recorder).trainer
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=True)
    overflowing = iter(range(6))

    def overflow(grad):
        return torch.full_like(grad, float("inf")) if next(overflowing, None) is not None else grad

    trainer.raw_model.head.weight.register_hook(overflow)
    final = trainer.fit()
    recorder.close()
    write_summary(run_dir, summarize(trainer, final, status="ok", error=None))
    cause = top_cause(run_dir)
    assert cause.title.startswith("fp16 overflow") and "precision=bf16" in cause.try_


def test_nonfinite_inputs_from_the_batch_statistics(tmp_path, dataset):
    def poison(bundle):
        x, y = bundle.train.tensors
        x = x.clone()
        x[::3] = float("nan")
        bundle.train = TensorDataset(x, y)
        return bundle

    dataset("digits_with_nans", poison)
    run_dir = tmp_path / "run"
    cfg = config_with_data("digits_with_nans", "trainer.max_epochs=1", f"output_root={tmp_path}")
    with pytest.raises(RuntimeError) as info:
        train(cfg, run_dir)
    record_failure(cfg, run_dir, info.value, distributed=False)  # what train.py does
    cause = top_cause(run_dir)
    assert cause.title == "non-finite values in the input batch"
    assert "batch[0]" in cause.evidence and "NaN" in cause.evidence


class SlowDataset(Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        time.sleep(0.002)
        return self.inner[i]


def test_a_data_bottleneck(tmp_path, dataset):
    def slow(bundle):
        bundle.train = SlowDataset(bundle.train)
        return bundle

    dataset("slow_digits", slow)
    run_dir = tmp_path / "run"
    train(config_with_data("slow_digits", "trainer.max_steps=4"), run_dir)
    cause = top_cause(run_dir)
    assert cause.title == "data loading is the bottleneck" and "data.num_workers=2" in cause.try_


def test_train_eval_disagreement(tmp_path):
    broken = next(b for b in BROKEN if b.name == "eval_structure")
    MODELS.register(broken.name, config=broken.config)(broken.builder)
    try:
        cfg = compose_config(*QUIET, "trainer.max_epochs=1")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=broken.name))
        with pytest.raises(RuntimeError):
            train(cfg, tmp_path / "run")
    finally:
        del MODELS._entries[broken.name]
    assert top_cause(tmp_path / "run").title.startswith("the model's train and eval modes")


def test_a_flat_loss(tmp_path):
    run_dir = tmp_path / "run"
    train(
        compose_config(
            *QUIET, "optimizer.lr=1e-9", "scheduler=none", "trainer.max_steps=12", NO_LEARN_PROBE
        ),
        run_dir,
    )
    assert read_summary(run_dir)["status"] == "at_chance"  # it learned nothing, and says so
    run, causes = triage(run_dir)
    cause = causes[0]
    assert cause.title == "the loss is flat from the first step"
    # The suggestion is checked before it is made: a hundred times the lr (1e-07) still does
    # not lower one batch's loss in the learn probe's steps, the lr whose first step is a
    # healthy size does, and that is the one suggested.
    assert "5 steps with optimizer.lr=1e-07 on one fixed batch of 8" in cause.evidence
    checked = re.search(
        r"; checked: 5 steps with (optimizer\.lr=\S+) on one fixed batch", cause.evidence
    )
    assert checked and cause.try_.startswith(checked.group(1) + " "), cause
    assert float(checked.group(1).split("=")[1]) > 1e-6
    assert any(c.title.startswith("the run learned nothing") for c in causes)


def test_validation_far_below_training(tmp_path, dataset):
    def shuffled_val_labels(bundle):
        x, y = bundle.val.tensors
        bundle.val = TensorDataset(x, y[torch.randperm(len(y), generator=torch.Generator())])
        return bundle

    dataset("digits_bad_val", shuffled_val_labels)
    run_dir = tmp_path / "run"
    train(config_with_data("digits_bad_val", "trainer.max_epochs=4"), run_dir)
    cause = top_cause(run_dir)
    assert cause.title == "validation far below training" and "leakage" in cause.try_


def test_the_command_prints_the_ranked_causes(tmp_path):
    run_dir = tmp_path / "run"
    train(
        compose_config(
            *QUIET, "optimizer.lr=1e-9", "scheduler=none", "trainer.max_steps=12", NO_LEARN_PROBE
        ),
        run_dir,
    )
    result = run_python([sys.executable, "-m", "kiln.cli.main", "triage", str(run_dir)])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"triage of {run_dir}: status at_chance")
    assert lines[1] == "1. the loss is flat from the first step"
    assert lines[2].startswith("   evidence: loss ") and lines[3].startswith("   try: ")
    missing = run_python([sys.executable, "-m", "kiln.cli.main", "triage", str(tmp_path)])
    assert missing.returncode == 2 and "not a run directory" in missing.stderr


# ---------------------------------------------------------------------------------------------
# The replay: the failing step again, from the last good checkpoint with the saved batch,
# bisected. Each run is made to show one cause; the replay must name it first.


@pytest.fixture
def model_named():
    added = []

    def register(name, builder, *overrides):
        MODELS.register(name, config=MlpConfig)(builder)
        added.append(name)
        cfg = compose_config(*QUIET, *overrides)
        return dataclasses.replace(cfg, model=MlpConfig(name=name))

    yield register
    for name in added:
        del MODELS._entries[name]


def fails(cfg, run_dir):
    with pytest.raises(Exception) as info:  # noqa: B017  (whichever error ends the run)
        train(cfg, run_dir)
    return info.value


def test_replay_a_learning_rate_too_high_at_the_first_update(tmp_path):
    run_dir = tmp_path / "run"
    fails(
        compose_config(*QUIET, "optimizer.lr=1e30", "trainer.max_epochs=1", NO_LEARN_PROBE), run_dir
    )
    run, causes = triage(run_dir)
    cause = causes[0]
    assert cause.title == "learning rate too high at the first update", causes
    assert "the update at step 1 was lr·|g|/|w| = " in cause.evidence
    assert cause.try_.startswith("optimizer.lr=")
    assert run.replay.batch_matches is True and run.replay.reproduced is True  # deterministic
    assert run.replay.start.startswith("the initial weights")


def test_replay_log_of_zero_in_a_loss(tmp_path, model_named):
    from .broken_models import LogOfSoftmaxLoss

    run_dir = tmp_path / "run"
    fails(model_named("log_of_softmax", LogOfSoftmaxLoss, "trainer.max_epochs=1"), run_dir)
    cause = top_cause(run_dir)
    assert cause.title == "log(0) in the loss (term 'nll'), computed in LogOfSoftmaxLoss.forward"
    assert "log.default" in cause.evidence and "zero(s)" in cause.evidence
    assert "log_softmax" in cause.try_


def test_replay_a_division_by_zero_in_a_module(tmp_path, model_named, dataset):
    from .broken_models import StandardisesEachImage

    def blank_images(bundle):
        x, y = bundle.train.tensors
        x = x.clone()
        x[-4:-1] = 0.0  # three blank images (none in the first batch of seed 42)
        bundle.train = TensorDataset(x, y)
        return bundle

    dataset("digits_with_blanks", blank_images)
    cfg = model_named("standardise", StandardisesEachImage, "trainer.max_epochs=1")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, name="digits_with_blanks"))
    run_dir = tmp_path / "run"
    err = fails(cfg, run_dir)
    assert err.step > 1  # a later step: the replay re-runs the ones before
    run, causes = triage(run_dir)
    assert causes[0].title == "division by zero in norm (PerSampleStandardise)", causes
    assert "the divisor holds" in causes[0].evidence
    assert run.replay.batch_matches is True and len(run.replay.steps) == err.step - 1


def test_replay_an_fp16_overflow_on_cpu_through_the_amp_path(tmp_path, model_named):
    """fp16 autocast and a GradScaler on the CPU: the code path amp takes on CUDA."""
    from kiln.config.run import PrecisionConfig
    from kiln.engine.precision import Precision
    from kiln.registry import PRECISIONS

    from .broken_models import LoudActivations

    PRECISIONS.register("fp16_cpu", config=PrecisionConfig)(
        lambda device: Precision("amp", torch.float16, True, device.type)
    )
    try:
        cfg = model_named("loud", LoudActivations, "trainer.max_epochs=1", "scheduler=none")
        cfg = dataclasses.replace(cfg, precision=PrecisionConfig(name="fp16_cpu"))
        run_dir = tmp_path / "run"
        fails(cfg, run_dir)
        cause = top_cause(run_dir)
    finally:
        del PRECISIONS._entries["fp16_cpu"]
    assert cause.title == "fp16 overflow in energy (Energy)"
    assert "float16's largest value is 65504" in cause.evidence and "fp32 is finite" in (
        cause.evidence
    )
    assert cause.try_.startswith("precision=bf16")


def test_replay_non_finite_inputs(tmp_path, dataset):
    def poison(bundle):
        x, y = bundle.train.tensors
        x = x.clone()
        x[::3] = float("nan")
        bundle.train = TensorDataset(x, y)
        return bundle

    dataset("digits_nan_inputs", poison)
    run_dir = tmp_path / "run"
    fails(config_with_data("digits_nan_inputs", "trainer.max_epochs=1"), run_dir)
    cause = top_cause(run_dir)  # no nan_batch_stats.json: in-process, the replay finds it
    assert cause.title == "non-finite values in the input batch"
    # The numerics probe meets the NaN before step 1; the replay traces the probes' batch.
    assert (
        "replayed the probes before step 1, then their batch traced: its batch holds batch[0]: "
        in (cause.evidence)
    )


def test_replay_exploding_gradients(tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose_config(
        *QUIET,
        "optimizer=sgd",
        "optimizer.lr=10",
        "scheduler=none",
        "trainer.max_epochs=1",
        NO_LEARN_PROBE,
    )
    fails(cfg, run_dir)
    run, causes = triage(run_dir)
    assert causes[0].title == "exploding gradients before the loss went non-finite"
    assert causes[0].evidence.startswith("replayed: the grad norm rose from ")
    assert not any(c.title == "learning rate too high at the first update" for c in causes)


def test_replay_a_nan_in_evaluation_only(tmp_path, model_named):
    from .broken_models import EvalOnlyNaN

    cfg = model_named("eval_nan", EvalOnlyNaN, "trainer.max_epochs=2", "trainer.shape_check=false")
    run_dir = tmp_path / "run"
    fails(cfg, run_dir)
    cause = top_cause(run_dir)
    assert cause.title == "NaN in evaluation only: norm (UnsetRunningScale)"
    assert "while the same batch in train mode is finite" in cause.evidence
    assert "running_std: all zeros" in cause.evidence


def test_replay_a_softmax_head(tmp_path, model_named):
    from .broken_models import SoftmaxHead

    run_dir = tmp_path / "run"
    fails(model_named("softmax_head", SoftmaxHead, "trainer.max_epochs=1"), run_dir)
    run, causes = triage(run_dir)
    assert causes[0].title.startswith("a softmax head: the model returns probabilities"), causes
    assert "head.1 (Softmax)" in causes[0].try_
    assert "returns probabilities" in run.replay.probe_error  # the probes, replayed


def test_the_command_prints_the_replay_after_the_causes(tmp_path):
    run_dir = tmp_path / "run"
    fails(
        compose_config(*QUIET, "optimizer.lr=1e30", "trainer.max_epochs=1", NO_LEARN_PROBE), run_dir
    )
    result = run_python([sys.executable, "-m", "kiln.cli.main", "triage", str(run_dir)])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == "1. learning rate too high at the first update"
    replay = lines[lines.index(next(x for x in lines if x.startswith("replay: "))) :]
    assert (
        replay[0].startswith("replay: loss ")
        and " at step 2, from the initial weights" in (replay[0])
    )
    assert "  re-ran step 1 through the run's loader" in replay
    assert "  the loader's batch at step 2 equals the saved one" in replay
    assert "  the failure reproduced" in replay


# ---------------------------------------------------------------------------------------------
# The behaviour checks' findings: each broken kind of tests/broken_models.py, stopped before
# step 1, is the first cause triage names, with the module and what to do.

TRIAGE_TITLES = {
    "view_for_transpose": "samples leak across the batch",
    "rnn_batch_first": "samples leak across the batch in rnn",
    "batch_statistics": "samples leak across the batch in norm",
    "state_on_self": "evaluation is not deterministic in centre",
    "eval_dropout": "evaluation is not deterministic",
    "eval_noise": "evaluation is not deterministic in noise",
    "inputs_in_place": "the forward changes the batch in place",
    "targets_in_place": "the forward changes the batch in place",
    "dead_units": "dead gradients in body.0",
    "detached_output": "dead gradients",
    "zero_gradients": "dead gradients in branch.fc",
    "conditional_refine": "samples leak across the batch",  # one process: see test_ddp.py
    "tensor_without_device": "a tensor a GPU run would have on the CPU in position",
    "mask_fill_minus_1e9": "fp16 overflow (found by the fp16 probe) in mask",
    "exp_of_half": "fp16 overflow in attend (HandSoftmax)",
    "view_on_permuted": "a .view of memory it cannot view",
    "tiny_logits": "the model cannot lower the loss of one batch",
}
KINDS = [b for b in BROKEN if b.name in TRIAGE_TITLES]


@pytest.mark.parametrize("broken", KINDS, ids=[b.name for b in KINDS])
def test_triage_ranks_each_behaviour_finding_first(broken, tmp_path):
    from .test_antibodies import broken_parts

    MODELS.register(broken.name, config=broken.config, inputs=broken.inputs)(broken.builder)
    try:
        run_dir = tmp_path / "run"
        fails(broken_parts(broken, *QUIET, "trainer.max_epochs=1"), run_dir)
        run, causes = triage(run_dir)
    finally:
        del MODELS._entries[broken.name]
    assert causes[0].title == TRIAGE_TITLES[broken.name], causes
    assert causes[0].try_ and causes[0].evidence, causes[0]
    assert run.replay.reproduced is True  # the probes, replayed, fail the same way


class ReadsItsEnvironment(torch.nn.Module):
    """A plugin's model that reads a variable of the environment (a debugging switch left on):
    NaN outputs when TRIAGE_DEMO_POISON=1."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = torch.nn.Linear(64, spec.num_classes)

    def forward(self, x):
        import os

        logits = self.fc(x.flatten(1))
        return logits * float("nan") if os.environ.get("TRIAGE_DEMO_POISON") == "1" else logits


def test_the_replay_runs_with_the_runs_environment(tmp_path, model_named, monkeypatch):
    """The run had TRIAGE_DEMO_POISON=1 (a plugin reads it), triage's shell does not: the
    replay sets the run's recorded environment, reproduces the failure and says so. A secret's
    value is never written down (environment.json holds a digest)."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("TRIAGE_DEMO_POISON", "1")
    monkeypatch.setenv("TRIAGE_DEMO_API_TOKEN", "hunter2")
    fails(model_named("reads_env", ReadsItsEnvironment, "trainer.max_epochs=1"), run_dir)
    recorded = (run_dir / "environment.json").read_text()
    assert '"TRIAGE_DEMO_POISON": "1"' in recorded and "hunter2" not in recorded
    monkeypatch.delenv("TRIAGE_DEMO_POISON")
    monkeypatch.setenv("TRIAGE_DEMO_API_TOKEN", "another")
    run, causes = triage(run_dir)
    assert run.replay.reproduced is True, run.replay
    assert any(
        "replayed with the run's environment: " in n and "TRIAGE_DEMO_POISON=1" in n
        for n in run.replay.notes
    ), run.replay.notes
    assert any("differs from the run's in TRIAGE_DEMO_API_TOKEN" in n for n in run.replay.notes)
    assert causes[0].title == "NaN/Inf first appears in ReadsItsEnvironment.forward", causes
    assert "TRIAGE_DEMO_POISON" not in __import__("os").environ  # put back after the replay


def test_triage_reads_the_finding_not_the_message(tmp_path):
    """A check's finding is data (findings.json: kind, evidence, module, fix): triage ranks
    from it, so a message reworded (here: every word of it replaced) loses no advice, and the
    fix the learn probe found for this very case (a learning rate) is the one suggested."""
    import json

    run_dir = tmp_path / "run"
    fails(compose_config(*QUIET, "optimizer.lr=50", "trainer.max_epochs=1"), run_dir)
    found = json.loads((run_dir / "findings.json").read_text())
    fatal = [f for f in found if f["fatal"]]
    assert len(fatal) == 1 and fatal[0]["kind"] == "learning rate diverges", found
    assert fatal[0]["fix"].startswith("optimizer.lr="), fatal[0]
    for record in found:
        record["evidence"] = "reworded beyond recognition"
    (run_dir / "findings.json").write_text(json.dumps(found))
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["error"] = "CannotLearnError: reworded beyond recognition"
    (run_dir / "summary.json").write_text(json.dumps(summary))
    _, causes = triage(run_dir, replay=False)
    assert causes[0].title == "the learning rate diverges on one batch", causes
    assert causes[0].try_ == fatal[0]["fix"]
    assert "reworded beyond recognition" in causes[0].evidence
