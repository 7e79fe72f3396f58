"""Speed features on CPU: model FLOPs and MFU, channels_last, matmul precision, torch.compile
(with resume and DDP in make test-all), and OOM as a first-class failure with a batch-size finder
(a simulated memory limit stands in for a GPU's)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from kiln.cli.failures import record_failure
from kiln.engine.batch_size import largest_that_fits
from kiln.engine.run import train
from kiln.registry import MODELS

from .conftest import compose_config, read_metrics, read_summary, run_train, train_in_process

QUIET = ("env.progress_bar=false", "logger=none")


def test_model_flops_per_sample_are_counted_and_mfu_follows_the_peak(tmp_path):
    summary = train_in_process(
        tmp_path / "run",
        *QUIET,
        "trainer.max_steps=3",
        "trainer.peak_tflops=0.1",
        "trainer.log_every_n_steps=1",
    )
    # digits mlp 64-256-128-10: forward 2*(64*256+256*128+128*10) MACs-as-FLOPs, backward the
    # weight gradients (the same again) and the input gradients of the last two layers.
    forward = 2 * (64 * 256 + 256 * 128 + 128 * 10)
    expected = forward + forward + 2 * (256 * 128 + 128 * 10)
    assert summary["model_flops_per_sample"] == expected
    logged = [m for m in read_metrics(tmp_path / "run") if "loss" in m]
    for m in logged:
        assert m["mfu"] == pytest.approx(m["model_tflops_per_s"] / 0.1)
        assert m["model_tflops_per_s"] == pytest.approx(expected * m["samples_per_s"] / 1e12)


def test_channels_last_reaches_the_model_and_matmul_precision_is_set(tmp_path):
    seen = []
    cfg = compose_config(
        *QUIET,
        "model=resnet18",
        "data=synthetic_images",
        "data.num_train=32",
        "data.num_val=16",
        "data.image_size=16",
        "trainer.max_steps=2",
        "trainer.channels_last=true",
        "trainer.matmul_precision=high",
    )

    original = MODELS.entry("resnet18").load()

    def spying_builder(spec, model_cfg, *, aux_head=False):
        model = original(spec, model_cfg, aux_head=aux_head)
        model.register_forward_pre_hook(
            lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
        )
        return model

    MODELS.register("resnet18_spied", config=type(cfg.model), inputs=("image",))(spying_builder)
    try:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name="resnet18_spied"))
        assert train(cfg, tmp_path / "run")["status"] in ("ok", "at_chance")  # a few steps
    finally:
        del MODELS._entries["resnet18_spied"]
    assert seen and all(seen)  # every forward got NHWC images
    assert torch.get_float32_matmul_precision() == "high"
    torch.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("limit", [1, 5, 37, 64, 100, 1000])
@pytest.mark.parametrize("start", [1, 8, 64])
def test_the_batch_size_search_finds_the_largest_that_fits(limit, start):
    tried = []

    def fits(n):
        tried.append(n)
        return n <= limit

    found = largest_that_fits(fits, start=start, limit=512)
    assert found == min(limit, 512)
    assert len(tried) <= 2 * 10 + 2  # doubling then bisecting: logarithmic


class MemoryLimited(nn.Module):
    """An MLP on a 'device' that holds at most `max_batch` samples (raises CUDA's OOM error)."""

    max_batch = 40

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(spec.channels * math.prod(spec.image_size), spec.num_classes)

    def forward(self, x):
        if x.shape[0] > self.max_batch:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated at batch {x.shape[0]})")
        return self.fc(x.flatten(1))


@pytest.fixture
def memory_limited(tmp_path):
    from kiln.config.model import MlpConfig

    MODELS.register("memory_limited", config=MlpConfig)(MemoryLimited)
    yield
    del MODELS._entries["memory_limited"]


def limited_config(*overrides):
    cfg = compose_config(*QUIET, "trainer.max_epochs=1", *overrides)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name="memory_limited"))


def test_find_batch_size_trains_with_the_largest_batch_that_fits(tmp_path, memory_limited):
    cfg = limited_config("trainer.find_batch_size=true", "data.batch_size=4")
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "ok"  # the config stays as composed (frozen): the steps tell
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 36  # 1437/40


def test_an_oom_ends_the_run_with_its_line_the_batch_shapes_and_what_to_try(
    tmp_path, memory_limited
):
    run_dir = tmp_path / "run"
    cfg = limited_config(
        "data.batch_size=64",
        "trainer.probe_sizes=false",
        "trainer.shape_check=false",
        f"output_root={tmp_path}",
    )
    with pytest.raises(torch.OutOfMemoryError) as info:
        train(cfg, run_dir)
    line = record_failure(cfg, run_dir, info.value, distributed=False)  # as train.py does
    assert line == f"[FAIL] {cfg.name} | single | amp=False | OOM @ step 1"
    report = json.loads((run_dir / "oom.json").read_text())
    assert report["batch_shapes"][0] == [64, 1, 8, 8]
    assert "data.batch_size=32 trainer.accumulate_grad_batches=2" in report["advice"]
    assert "precision=bf16" in report["advice"]
    assert read_summary(run_dir)["status"] == "failed"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_compiled_training_resumes_exactly_and_keeps_raw_keys(tmp_path):
    settings = (
        "trainer.compile=true",
        "trainer.deterministic=true",
        "trainer.max_epochs=2",
        "model.dropout=0.0",
        *QUIET,
    )
    reference = tmp_path / "reference"
    train_in_process(reference, *settings)
    interrupted = tmp_path / "interrupted"
    train_in_process(interrupted, *settings, "trainer.max_epochs=1", "scheduler=none")
    first = torch.load(reference / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert not any("_orig_mod" in k for k in first)  # checkpoints hold the eager model's keys
    resumed = tmp_path / "resumed"
    train_in_process(
        resumed, *settings, f"resume={reference}/checkpoints/epoch-1.pt"
    )  # continue the reference's own epoch-1 checkpoint to the end, compiled
    a = torch.load(reference / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(resumed / "checkpoints" / "last.pt", weights_only=True)["model"]
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_compiled_training_under_ddp_matches_one_process(tmp_path):
    import sys

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    same = (
        "trainer.compile=true",
        "trainer.max_steps=6",
        "model.dropout=0.0",
        "scheduler=none",
        "trainer.deterministic=true",
        *QUIET,
    )
    single = run_train(tmp_path / "single", *same, "data.batch_size=32", timeout=1200)
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = run_train(
        tmp_path / "ddp",
        *same,
        "trainer=ddp",
        "data.batch_size=16",
        launcher=torchrun,
        timeout=1200,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    a = torch.load(tmp_path / "single" / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "ddp" / "checkpoints" / "last.pt", weights_only=True)["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)
