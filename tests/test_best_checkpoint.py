"""best.pt: a tie on the monitored metric is broken by the validation loss (lower wins), the
tie-break value is part of the saved training state, and checkpoints written before it existed
still resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kiln.config.run import TrainerConfig
from kiln.engine.checkpointer import Checkpointer
from kiln.engine.trainer import TrainState

from .conftest import read_metrics, train_in_process

# One batch of 16 digits, trained and validated on: val_acc reaches 1.0 within a few epochs
# and stays there while val_loss keeps falling -- the ties the rule is for.
SATURATING = (
    "trainer.overfit_batches=1",
    "data.batch_size=16",
    "optimizer.lr=0.02",
    "scheduler=none",
    "env.progress_bar=false",
    "logger=none",
    "device=cpu",
)


def checkpointer(directory: Path) -> Checkpointer:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainerConfig(name="t"))))
    return Checkpointer(directory, cfg, monitor="val_acc", monitor_mode="max", is_main=True)


def evaluate(ckpt: Checkpointer, state: TrainState, val_acc: float, val_loss: float, tag: int):
    state.global_step += 1
    ckpt.after_evaluation(
        {"val_acc": val_acc, "val_loss": val_loss},
        state,
        lambda: {"model": {"tag": torch.tensor(tag)}, "state": state.as_dict()},
        epoch_end=False,
    )


def best_tag(directory: Path) -> int:
    return int(torch.load(directory / "best.pt", weights_only=True)["model"]["tag"])


def test_a_tie_on_the_metric_goes_to_the_lower_validation_loss(tmp_path):
    ckpt, state = checkpointer(tmp_path), TrainState()
    evaluate(ckpt, state, 1.0, 0.30, tag=1)
    evaluate(ckpt, state, 1.0, 0.10, tag=2)  # tie, lower loss: replaces
    assert best_tag(tmp_path) == 2 and state.best_tiebreak == pytest.approx(0.10)
    evaluate(ckpt, state, 1.0, 0.20, tag=3)  # tie, higher loss: kept
    evaluate(ckpt, state, 1.0, float("nan"), tag=4)  # a non-finite loss never wins a tie
    assert best_tag(tmp_path) == 2
    evaluate(ckpt, state, 0.9, 0.01, tag=5)  # the metric still decides first
    assert best_tag(tmp_path) == 2 and state.best_metric == 1.0
    # The tie-break survives a save and load of the state (what resume does).
    restored = TrainState(**torch.load(tmp_path / "last.pt", weights_only=True)["state"])
    assert restored.best_tiebreak == pytest.approx(0.10)
    evaluate(ckpt, restored, 1.0, 0.15, tag=6)  # higher than the restored best: kept
    assert best_tag(tmp_path) == 2


def test_a_state_saved_before_the_tiebreak_existed_still_loads(tmp_path):
    old = TrainState(epoch=3, global_step=30, best_metric=0.9).as_dict()
    del old["best_tiebreak"]
    state = TrainState(**old)
    assert state.best_tiebreak is None and state.best_metric == 0.9
    ckpt = checkpointer(tmp_path)
    evaluate(ckpt, state, 0.9, 0.5, tag=7)  # unknown before: a finite loss wins the tie
    assert best_tag(tmp_path) == 7 and state.best_tiebreak == 0.5


def _evaluations(run_dir: Path) -> list[dict]:
    return [m for m in read_metrics(run_dir) if "val_acc" in m]


def _rule_pick(evaluations: list[dict]) -> int:
    """The step best.pt must come from: the highest val_acc, ties to the lowest val_loss."""
    return min(evaluations, key=lambda m: (-m["val_acc"], m["val_loss"]))["step"]


def test_a_later_epoch_with_the_same_val_acc_and_a_lower_loss_becomes_best(tmp_path):
    """The issue's case: val_acc 1.0 at an early epoch must not keep that checkpoint. An
    interrupted and resumed run picks the same best.pt, bit for bit."""
    whole = tmp_path / "whole"
    train_in_process(whole, *SATURATING, "trainer.max_epochs=8")
    evaluations = _evaluations(whole)
    best = torch.load(whole / "checkpoints" / "best.pt", weights_only=True)
    first_top = next(
        m for m in evaluations if m["val_acc"] == max(e["val_acc"] for e in evaluations)
    )
    assert best["state"]["global_step"] == _rule_pick(evaluations) != first_top["step"]
    assert best["state"]["best_tiebreak"] == pytest.approx(
        min(m["val_loss"] for m in evaluations if m["val_acc"] == first_top["val_acc"])
    )
    resumed = tmp_path / "resumed"
    train_in_process(resumed, *SATURATING, "trainer.max_epochs=5")
    train_in_process(resumed, *SATURATING, "trainer.max_epochs=8", "resume=auto")
    again = torch.load(resumed / "checkpoints" / "best.pt", weights_only=True)
    assert again["state"]["global_step"] == best["state"]["global_step"]
    assert again["state"]["best_tiebreak"] == best["state"]["best_tiebreak"]
    for name, tensor in best["model"].items():
        assert torch.equal(tensor, again["model"][name]), name
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["best"] == best["state"]["best_metric"]
