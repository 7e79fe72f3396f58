"""Fine-tuning: init_from (weights only, non-strict, reported), model.freeze with
trainer.unfreeze_at_epoch, optimizer.head_lr_mult and the EMA of the weights -- each through the
real run, and exact resume with all of them on at once."""

from __future__ import annotations

import logging
import signal

import pytest
import torch
from safetensors.torch import save_file

from kiln.checkpoint import load_checkpoint
from kiln.data import build_data
from kiln.models.weights import WeightsError, init_from, read_state_dict

from .conftest import (
    compose_config,
    read_metrics,
    read_summary,
    run_train,
    train_in_process,
    train_main_here,
)
from .test_resume import final_weights, start_train, wait_for

QUICK = ("trainer.max_epochs=1", "env.progress_bar=false", "logger=none")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A finished digits MLP run (10 classes): the weights fine-tuning starts from."""
    run_dir = tmp_path_factory.mktemp("source") / "run"
    train_in_process(run_dir, *QUICK)
    return run_dir


def test_init_from_a_kiln_checkpoint_reports_the_head_it_reinitialises(
    digits_run, tmp_path, caplog
):
    source = digits_run / "checkpoints" / "best.pt"
    # Same 8x8 one-channel images, 5 classes: the body fits, the head does not.
    other = (
        "data=synthetic_images",
        "data.image_size=8",
        "data.channels=1",
        "data.num_classes=5",
        "data.num_train=64",
        "data.num_val=32",
    )
    with caplog.at_level(logging.INFO):
        summary = train_in_process(
            tmp_path / "run",
            *QUICK,
            *other,
            f"init_from={source}",
            "trainer.max_steps=1",
            "optimizer=sgd",
            "optimizer.lr=1e-9",
            "scheduler=none",
            "trainer.learn_probe=false",  # lr 1e-9 on purpose: the loaded weights barely move
        )
    # It ran its step (one step at lr 1e-9 learns nothing: at_chance says so, not an error).
    assert summary["error"] is None and summary["steps"] == 1
    text = caplog.text
    assert f"init_from {source}: 4 tensors loaded" in text
    assert (
        "shape-mismatched, re-initialised (2): head.weight (10, 128) in the file vs (5, 128)"
        in text
    )
    saved = load_checkpoint(source)["model"]
    tuned = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert tuned["state"]["global_step"] == 1  # a new run: its own step count and schedule
    for key in ("body.0.weight", "body.3.bias"):  # lr 1e-9: one step leaves the loaded weights
        torch.testing.assert_close(tuned["model"][key], saved[key], rtol=0, atol=1e-6)


def test_init_from_plain_state_dicts_and_safetensors(tmp_path):
    from kiln.models.mlp import MLP

    model = MLP(64, [32], 10, 0.0, aux_head=False)
    reference = {f"module.{k}": v.clone() for k, v in model.state_dict().items()}  # a DDP save
    torch.save({"state_dict": reference}, tmp_path / "weights.pth")
    save_file({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "w.safetensors")
    for path in (tmp_path / "weights.pth", tmp_path / "w.safetensors"):
        fresh = MLP(64, [32, 16], 10, 0.0, aux_head=False)
        match = init_from(fresh, path)
        assert sorted(match.loaded) == ["body.0.bias", "body.0.weight", "head.bias"]
        assert [k for k, _, _ in match.mismatched] == ["head.weight"]  # (10, 32) vs (10, 16)
        assert "body.3.weight" in match.missing and not match.unexpected
        assert torch.equal(fresh.body[0].weight, model.body[0].weight)


def test_init_from_that_matches_nothing_is_one_error_line(tmp_path, capfd):
    save_file({"encoder.weight": torch.zeros(3, 3)}, tmp_path / "other.safetensors")
    with pytest.raises(WeightsError, match="no tensor matches the model"):
        init_from(torch.nn.Linear(3, 3), tmp_path / "other.safetensors")
    with pytest.raises(WeightsError, match="does not exist"):
        read_state_dict(tmp_path / "missing.pt")
    code, stderr = train_main_here(
        capfd,
        f"hydra.run.dir={tmp_path / 'run'}",
        *QUICK,
        f"init_from={tmp_path / 'other.safetensors'}",
    )
    assert code == 2, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "no tensor matches the model by name and shape" in lines[0]


def test_freeze_until_an_epoch_then_train_everything(tmp_path):
    run_dir = tmp_path / "run"
    summary = train_in_process(
        run_dir,
        "trainer.max_epochs=3",
        "env.progress_bar=false",
        "logger=none",
        "model.freeze=[body]",
        "trainer.unfreeze_at_epoch=2",
        "trainer.keep_last_k=3",
    )
    assert summary["status"] == "ok"
    epoch = {
        n: load_checkpoint(run_dir / "checkpoints" / f"epoch-{n}.pt")["model"] for n in (1, 2, 3)
    }
    for key in ("body.0.weight", "body.3.weight"):  # frozen in epochs 0 and 1, trained in 2
        assert torch.equal(epoch[1][key], epoch[2][key])
        assert not torch.equal(epoch[2][key], epoch[3][key])
    assert not torch.equal(epoch[1]["head.weight"], epoch[2]["head.weight"])


def test_freeze_backbone_and_head_lr(tmp_path):
    from kiln.config import load_config
    from kiln.engine.distributed import DistInfo
    from kiln.engine.run import build_run
    from kiln.logging.recorder import RunRecorder

    cfg = load_config(["model.freeze=backbone", "optimizer.head_lr_mult=10", *QUICK])
    recorder = RunRecorder(cfg.logger, tmp_path, run_name="t", config={}, is_main=True)
    trainer = build_run(cfg, tmp_path, DistInfo(), torch.device("cpu"), recorder).trainer
    groups = trainer.optimizer.param_groups
    # backbone then head, each split into decayed weights and undecayed biases
    assert [(g["group"], g["decay"]) for g in groups] == [
        ("backbone", True),
        ("backbone", False),
        ("head", True),
        ("head", False),
    ]
    backbone, head = groups[0], groups[2]
    assert head["lr"] == pytest.approx(10 * backbone["lr"])
    assert [g["weight_decay"] for g in groups] == [cfg.optimizer.weight_decay, 0.0] * 2
    trainable = {n for n, p in trainer.raw_model.named_parameters() if p.requires_grad}
    assert trainable == {"head.weight", "head.bias"}


def test_freeze_names_a_prefix_that_matches_nothing(tmp_path):
    from kiln.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"no parameter of model=mlp is under 'encoder'.*body, head"
    ):
        train_in_process(tmp_path / "run", *QUICK, "model.freeze=[encoder]")


def test_ema_is_evaluated_beside_the_weights_and_can_become_best(tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        summary = train_in_process(
            run_dir,
            "trainer.max_epochs=2",
            "env.progress_bar=false",
            "logger=none",
            "trainer.ema_decay=0.9",
        )
    evals = [m for m in read_metrics(run_dir) if "val_acc" in m]
    assert evals and all("ema_val_acc" in m and "ema_val_loss" in m for m in evals)
    assert summary["status"] == "ok" and "ema_val_acc" in summary
    assert "best.pt candidate: the" in caplog.text
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert "ema" in last and last["ema"].keys() == last["model"].keys()
    assert not torch.equal(last["ema"]["head.weight"], last["model"]["head.weight"])


def test_best_checkpoint_takes_the_ema_weights_when_they_evaluate_better(tmp_path):
    from kiln.config import load_config
    from kiln.engine.checkpointer import Checkpointer
    from kiln.engine.trainer import TrainState

    checkpointer = Checkpointer(
        tmp_path, load_config([]).trainer, monitor="val_acc", monitor_mode="max", is_main=True
    )
    snapshot = {"model": {"w": torch.zeros(2)}, "ema": {"w": torch.ones(2)}, "config": {}}
    checkpointer.after_evaluation(
        {"val_acc": 0.9}, TrainState(), lambda: snapshot, False, best_weights="ema"
    )
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["weights"] == "ema" and torch.equal(best["model"]["w"], torch.ones(2))
    assert torch.equal(load_checkpoint(tmp_path / "last.pt")["model"]["w"], torch.zeros(2))


FINETUNE_RESUMABLE = (
    "trainer.deterministic=true",
    "trainer.max_epochs=2",
    "trainer.checkpoint_every_n_steps=10",
    "trainer.log_every_n_steps=1",
    "data.batch_size=8",
    "model.dropout=0.2",
    "env.progress_bar=false",
    "model.freeze=backbone",
    "trainer.unfreeze_at_epoch=1",
    "optimizer.head_lr_mult=5",
    "trainer.ema_decay=0.95",
)


def test_sigkill_mid_epoch_resume_is_exact_with_init_from_freeze_head_lr_and_ema(
    digits_run, tmp_path
):
    settings = (*FINETUNE_RESUMABLE, f"init_from={digits_run / 'checkpoints' / 'best.pt'}")
    reference = tmp_path / "reference"  # in this process: the processes are the other two
    train_in_process(reference, *settings)

    interrupted = tmp_path / "interrupted"
    proc = start_train(interrupted, *settings)
    wait_for(interrupted / "checkpoints" / "last.pt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    saved = load_checkpoint(interrupted / "checkpoints" / "last.pt")["state"]
    assert saved["epoch"] == 0 and saved["batch_in_epoch"] > 0  # killed mid-epoch, still frozen

    resumed = run_train(interrupted, *settings, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, actual = (
        load_checkpoint(r / "checkpoints" / "last.pt") for r in (reference, interrupted)
    )
    for part in ("model", "ema"):
        for name, value in expected[part].items():
            assert torch.equal(value, actual[part][name]), f"{part}.{name} differs after resume"
    assert read_summary(interrupted)["steps"] == read_summary(reference)["steps"]
    assert final_weights(reference).keys() == final_weights(interrupted).keys()


@pytest.mark.parametrize("library", ["torchvision", "timm"])
def test_init_from_the_librarys_own_file_loads_into_the_zoo_model(tmp_path, library, caplog):
    """A torchvision or timm state dict (resnet18-*.pth, model.safetensors) keyed by the
    library's names loads into model=torchvision|timm as it does into the library's network."""
    from kiln.models import build_model

    cfg = compose_config(
        "data=synthetic_images", "data.image_size=32", f"model={library}", "model.arch=resnet18"
    )
    if library == "timm":
        import timm

        net, path = timm.create_model("resnet18"), tmp_path / "model.safetensors"
        save_file(net.state_dict(), str(path))
    else:
        import torchvision

        net, path = torchvision.models.resnet18(), tmp_path / "resnet18.pth"
        torch.save(net.state_dict(), path)
    model = build_model(build_data(cfg.data).spec, cfg.model)
    with caplog.at_level("INFO", logger="kiln.models.weights"):
        match = init_from(model, path)
    assert len(match.loaded) == 120 and not match.missing and not match.unexpected
    assert sorted(k for k, _, _ in match.mismatched)[-1].endswith("weight")  # only the head
    assert len(match.mismatched) == 2
    conv = next(v for k, v in model.state_dict().items() if k.endswith("conv1.weight"))
    assert torch.equal(conv, net.state_dict()["conv1.weight"])
    assert "re-initialised (2)" in caplog.text
