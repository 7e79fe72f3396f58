"""trainer=fsdp (FSDP2 over gloo on CPU): the same training as one process and as DDP, sharded
checkpoints written with torch.distributed.checkpoint, exact resume, resume on another number of
ranks, and the collective decisions (NaN, preemption) of the contract.

Tolerances: in fp32 a sharded step is the same arithmetic as one process with the same global
batch, up to the order of float sums, so losses agree to 1e-5 (relative) and weights within the
DDP test's rtol=1e-4, atol=1e-5. Under bf16, FSDP gathers parameters in bf16 and DDP casts them
per op, so the two follow each other to 2% of the loss."""

from __future__ import annotations

import logging
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.checkpoint import DCP_METADATA, SHARDS_DIR, load_checkpoint, named_shard_folders
from kiln.cli.paths import REPO_ROOT
from kiln.config import ConfigError
from kiln.engine.distributed import teardown
from kiln.engine.precision import resolve_precision

from .conftest import (
    DIVERGING,
    SUBPROCESS_ENV,
    compose_config,
    python_process,
    read_metrics,
    read_summary,
    run_python,
    run_train,
    train_in_process,
)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# Three hidden blocks of the digits MLP that the size policy shards one by one (each holds more
# than 5,000 parameters; the 970 of the head stay with the root).
BLOCKS = ("model.hidden_dims=[96,96,96]", "trainer.fsdp.min_block_params=5000")
# No dropout (ranks draw different masks than one process), accumulation over 2 micro-batches
# and a clip threshold below every step's gradient norm, so both are exercised under sharding.
SAME_RUN = (
    "model.hidden_dims=[96,96,96]",
    "model.dropout=0.0",
    "trainer.max_steps=4",
    "trainer.accumulate_grad_batches=2",
    "trainer.gradient_clip_val=0.1",
    "trainer.log_every_n_steps=1",
    "env.progress_bar=false",
)
LOSS_RTOL = 1e-5


@pytest.fixture
def in_process_group():
    """In-process trainer=fsdp runs make a group of one in this process; leave none behind."""
    yield
    teardown()


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5)


def shard_folders_on_disk(run_dir: Path) -> set[Path]:
    return {p.resolve() for p in (run_dir / "checkpoints" / SHARDS_DIR).iterdir()}


def named_folders(run_dir: Path) -> set[Path]:
    """The shard folders that the run's checkpoint files name."""
    return {p.resolve() for p in named_shard_folders(run_dir / "checkpoints")}


def folder_of(checkpoint: Path) -> Path:
    return Path(load_checkpoint(checkpoint, consolidate=False)["sharded"]["folder"])


# ------------------------------------------------------------------------------- fast tests


def test_fsdp_on_two_ranks_trains_as_one_process_and_writes_sharded_checkpoints(tmp_path):
    single_dir, fsdp_dir = tmp_path / "single", tmp_path / "fsdp"
    train_in_process(single_dir, *SAME_RUN, "data.batch_size=32", "logger=none")
    fsdp = ("trainer=fsdp", *BLOCKS, "data.batch_size=16")
    result = run_train(fsdp_dir, *SAME_RUN, *fsdp, launcher=TORCHRUN)
    assert result.returncode == 0, result.stderr[-3000:]

    assert (
        "FSDP: 3 blocks + root over 2 ranks (size policy)" in (fsdp_dir / "train.log").read_text()
    )
    fsdp_metrics = [m for m in read_metrics(fsdp_dir) if "loss" in m]
    assert all(m["grad_norm"] > 0.1 for m in fsdp_metrics)  # clipping was active at every step
    assert losses(fsdp_dir) == pytest.approx(losses(single_dir), rel=LOSS_RTOL)
    assert len(fsdp_metrics) == 4

    # last.pt commits a folder of shards, one file per rank, and holds no weights itself.
    pointer = load_checkpoint(fsdp_dir / "checkpoints" / "last.pt", consolidate=False)
    assert "model" not in pointer and "optimizer" not in pointer
    folder = Path(pointer["sharded"]["folder"])
    assert folder.parent == (fsdp_dir / "checkpoints" / SHARDS_DIR).resolve()
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (folder / DCP_METADATA).is_file()
    assert pointer["state"]["global_step"] == 4
    assert shard_folders_on_disk(fsdp_dir) == named_folders(fsdp_dir)

    # Consolidated on load (what infer.py and the export read): the single run's weights.
    expected = load_checkpoint(single_dir / "checkpoints" / "last.pt")["model"]
    assert_same_weights(load_checkpoint(fsdp_dir / "checkpoints" / "last.pt")["model"], expected)
    assert_same_weights(load_checkpoint(folder)["model"], expected)  # the folder alone, too


def test_size_policy_takes_blocks_bottom_up_and_never_the_root():
    # kiln.engine.fsdp is imported in the tests that use it: torch.distributed.fsdp's import
    # (1 CPU-s) was paid by every xdist worker's collection.
    from kiln.engine.fsdp import blocks_by_size

    model = nn.Sequential(
        nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)),  # 110 + 110
        nn.Linear(10, 100),  # 1100
        nn.Linear(100, 2),  # 202
    )
    assert blocks_by_size(model, 1000) == [model[1]]
    assert blocks_by_size(model, 100) == [model[0][0], model[0][1], model[1], model[2]]
    # Two Linear(10, 10) of 110 parameters each make one block of 220 at their parent.
    assert blocks_by_size(model, 200) == [model[0], model[1], model[2]]
    assert blocks_by_size(model, 220) == [model[0], model[1]]
    assert blocks_by_size(model, 10**6) == []


def test_a_model_can_name_its_own_blocks():
    from kiln.engine.fsdp import fsdp_blocks

    class TwoTowers(nn.Module):
        def __init__(self):
            super().__init__()
            self.left, self.right = nn.Linear(4, 4), nn.Linear(4, 4)

        def fsdp_blocks(self):
            return [self.right]

    model = TwoTowers()
    assert fsdp_blocks(model, min_block_params=1) == [model.right]


@pytest.mark.parametrize(
    ("precision", "param_dtype"),
    [("fp32", None), ("bf16", torch.bfloat16), ("amp", torch.bfloat16)],  # amp is bf16 on CPU
)
def test_mixed_precision_policy_follows_precision(precision, param_dtype):
    from kiln.engine.fsdp import mixed_precision_policy

    policy = mixed_precision_policy(resolve_precision(precision, torch.device("cpu")))
    assert policy.param_dtype == param_dtype
    assert policy.reduce_dtype == (torch.float32 if param_dtype else None)


def test_strategy_fsdp_needs_a_distributed_trainer():
    with pytest.raises(ConfigError, match=r"trainer.strategy.*use trainer=fsdp"):
        compose_config("trainer.strategy=fsdp")
    assert compose_config("trainer=fsdp").trainer.distributed


def test_a_checkpoint_naming_incomplete_shards_is_skipped_and_stray_folders_removed(
    tmp_path, caplog, in_process_group
):
    """One plain process under trainer=fsdp (a group of one). A shard folder without its
    .metadata is what a kill during a write leaves: resume must never pick it."""
    run_dir = tmp_path / "run"
    settings = (
        "trainer=fsdp",
        *BLOCKS,
        "scheduler=none",
        "trainer.limit_train_batches=3",
        "trainer.keep_last_k=2",
        "env.progress_bar=false",
        "logger=none",
    )
    train_in_process(run_dir, *settings, "trainer.max_epochs=3")
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.pt")) == [
        "best.pt",
        "epoch-2.pt",
        "epoch-3.pt",
        "last.pt",
    ]
    # Replaced and pruned checkpoints took their folders with them.
    assert shard_folders_on_disk(run_dir) == named_folders(run_dir)

    assert folder_of(checkpoints / "last.pt") == folder_of(checkpoints / "epoch-3.pt")
    (folder_of(checkpoints / "last.pt") / DCP_METADATA).unlink()  # so both are broken
    stray = checkpoints / SHARDS_DIR / "step-99999999-deadbeef"
    shutil.copytree(folder_of(checkpoints / "epoch-2.pt"), stray)

    with caplog.at_level(logging.INFO):
        summary = train_in_process(run_dir, *settings, "trainer.max_epochs=4", "resume=auto")
    assert "names the shard folder" in caplog.text and "never completed" in caplog.text
    assert re.search(r"resumed from \S+epoch-2\.pt at epoch 2, step 6", caplog.text), caplog.text
    assert summary["epochs"] == 4 and summary["steps"] == 12
    assert not stray.exists()
    assert shard_folders_on_disk(run_dir) == named_folders(run_dir)


# ------------------------------------------------------------------------------- slow tests


def start(run_dir: Path, *overrides: str, launcher=None) -> subprocess.Popen:
    cmd = [*(launcher or [sys.executable]), str(REPO_ROOT / "train.py"), f"hydra.run.dir={run_dir}"]
    return python_process([*cmd, *overrides], run_dir.parent)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("precision", "loss_rtol"), [("fp32", LOSS_RTOL), ("bf16", 0.02)])
def test_fsdp_follows_the_ddp_loss_curve_and_exports(tmp_path, precision, loss_rtol):
    ddp_dir, fsdp_dir = tmp_path / "ddp", tmp_path / "fsdp"
    same = (*SAME_RUN, "data.batch_size=16", f"precision={precision}")
    ddp = run_train(ddp_dir, *same, "trainer=ddp", launcher=TORCHRUN)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    fsdp = run_train(fsdp_dir, *same, "trainer=fsdp", *BLOCKS, launcher=TORCHRUN)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]

    assert losses(fsdp_dir) == pytest.approx(losses(ddp_dir), rel=loss_rtol)
    assert abs(read_summary(fsdp_dir)["val_acc"] - read_summary(ddp_dir)["val_acc"]) < 0.02
    if precision != "fp32":
        return
    expected = load_checkpoint(ddp_dir / "checkpoints" / "last.pt")["model"]
    assert_same_weights(load_checkpoint(fsdp_dir / "checkpoints" / "last.pt")["model"], expected)
    # The ONNX export reads the sharded checkpoint through infer.py, unchanged.
    infer = [sys.executable, str(REPO_ROOT / "infer.py"), "mode=export"]
    export = run_python([*infer, f"ckpt={fsdp_dir / 'checkpoints' / 'best.pt'}"], tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    assert (fsdp_dir / "checkpoints" / "model.onnx").is_file()
    assert "parity batch=64" in export.stdout + export.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("ranks_before", "ranks_after"), [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_fsdp_resumes_on_another_number_of_ranks(tmp_path, ranks_before, ranks_after):
    """The same global batch of 32 on 1 or 2 ranks: DCP reshards the model and optimizer."""
    settings = (*BLOCKS, "model.dropout=0.0", "scheduler=none", "env.progress_bar=false")
    settings += ("trainer.log_every_n_steps=1", "trainer=fsdp")
    reference = tmp_path / "reference"
    reference_settings = (BLOCKS[0], "model.dropout=0.0", "scheduler=none", "data.batch_size=32")
    train_in_process(reference, *reference_settings, "trainer.max_steps=12", "logger=none")

    def launch(ranks: int, *overrides: str):
        launcher = TORCHRUN[:-1] + [f"--nproc_per_node={ranks}"] if ranks > 1 else None
        per_rank_batch = f"data.batch_size={32 // ranks}"
        return run_train(run_dir, *settings, per_rank_batch, *overrides, launcher=launcher)

    run_dir = tmp_path / "run"
    first = launch(ranks_before, "trainer.max_steps=6")
    assert first.returncode == 0, first.stderr[-3000:]
    second = launch(ranks_after, "trainer.max_steps=12", "resume=auto")
    assert second.returncode == 0, second.stderr[-3000:]

    log = (run_dir / "train.log").read_text()
    assert f"over {ranks_after} ranks" in log and "at epoch 0, step 6 (batch 6 of the epoch)" in log
    assert read_summary(run_dir)["steps"] == 12
    expected = load_checkpoint(reference / "checkpoints" / "last.pt")["model"]
    assert_same_weights(load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"], expected)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_while_shards_are_written_keeps_the_previous_checkpoint_and_resume_is_exact(
    tmp_path,
):
    """One process under trainer=fsdp, killed while a checkpoint's shards are being written (a
    model large enough for the write to take a while), resumes to an uninterrupted run's
    weights exactly; dropout stays on, so the RNG state must come back too."""
    settings = (
        "trainer=fsdp",
        "model.hidden_dims=[1024,1024]",
        "trainer.fsdp.min_block_params=100000",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=60",
        "trainer.checkpoint_every_n_steps=10",
        "trainer.deterministic=true",
        "data.batch_size=8",
        "model.dropout=0.2",
        "env.progress_bar=false",
        "logger=none",
    )
    reference = tmp_path / "reference"
    assert run_train(reference, *settings).returncode == 0

    run_dir = tmp_path / "run"
    shards = run_dir / "checkpoints" / SHARDS_DIR
    proc = start(run_dir, *settings)
    deadline = time.monotonic() + 300
    committed: set[Path] = set()
    while True:  # wait for the second checkpoint's folder to appear, then kill at once
        assert proc.poll() is None, f"run ended before the kill: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline
        folders = set(shards.iterdir()) if shards.is_dir() else set()
        if not committed and (run_dir / "checkpoints" / "last.pt").exists():
            committed = named_folders(run_dir)
        if committed and {p.resolve() for p in folders} - committed:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    proc.wait(timeout=60)

    unnamed = shard_folders_on_disk(run_dir) - named_folders(run_dir)
    # The kill landed before the commit: the new folder is on disk but nothing names it, and
    # last.pt still names a complete one.
    assert unnamed, "the kill came after the commit; the write was too quick to catch"
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt", consolidate=False)
    assert (Path(last["sharded"]["folder"]) / DCP_METADATA).is_file()

    resumed = run_train(run_dir, *settings, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {last['state']['global_step']} (batch" in (run_dir / "train.log").read_text()
    expected = load_checkpoint(reference / "checkpoints" / "last.pt")["model"]
    actual = load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs after resume"
    assert not unnamed & shard_folders_on_disk(run_dir)  # the half-written folder is gone


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_to_one_rank_checkpoints_every_shard_and_exits_75(tmp_path):
    import psutil

    run_dir = tmp_path / "run"
    settings = (
        "trainer=fsdp",
        *BLOCKS,
        "trainer.max_epochs=50",
        "data.batch_size=8",
        "trainer.checkpoint_every_n_steps=10",
        "env.progress_bar=false",
    )
    proc = start(run_dir, *settings, launcher=TORCHRUN)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "last.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.01)
    (rank1,) = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
    rank1.send_signal(signal.SIGTERM)  # only one rank hears it; the decision is collective
    _, stderr = proc.communicate(timeout=300)
    # torchrun reports the first rank to exit (with 75) and stops the other, often before it exits.
    assert "exitcode  : 75" in stderr, stderr[-3000:]

    # Rank 0 heard no signal, yet stopped at the same step: summary.json is its own.
    summary = read_summary(run_dir)
    assert summary["status"] == "preempted" and "resume=auto" in summary["error"]
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt", consolidate=False)
    assert last["state"]["global_step"] == summary["steps"] > 10
    assert len(list(Path(last["sharded"]["folder"]).glob("*.distcp"))) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nonfinite_loss_under_fsdp_stops_every_rank_with_one_fail_line(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(
        run_dir,
        "trainer=fsdp",
        *BLOCKS,
        *DIVERGING,
        "env.progress_bar=false",
        f"output_root={tmp_path}/outputs",
        launcher=TORCHRUN,
    )
    assert result.returncode != 0
    fails = [line for line in result.stderr.splitlines() if line.startswith("[FAIL]")]
    pattern = r"^\[FAIL\] digits-mlp \| FSDP \| amp=False \| loss (NaN|Inf) @ step \d+$"
    assert len(fails) == 1 and re.match(pattern, fails[0]), result.stderr[-2000:]
    assert (tmp_path / "outputs" / "failures.log").read_text().splitlines()[0] == fails[0]
    assert read_summary(run_dir)["status"] == "failed"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_script_reports_half_the_parameter_and_optimizer_bytes_on_two_ranks():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "fsdp_memory.py")]
        + ["--width", "256", "--blocks", "2"],
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ratio = re.search(r"FSDP / DDP per-rank params\+optimizer: ([\d.]+)", result.stdout)
    assert ratio and float(ratio.group(1)) == pytest.approx(0.5, abs=0.01), result.stdout
