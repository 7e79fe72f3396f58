"""Past one torchrun agent: two agents ("nodes") meeting through c10d rendezvous on loopback, and
elastic restarts (`torchrun --max-restarts`) after a rank is killed with SIGKILL mid-epoch."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln.checkpoint import load_checkpoint
from kiln.cli.paths import REPO_ROOT

from .conftest import (
    SUBPROCESS_ENV,
    read_metrics,
    read_summary,
    run_train,
    start_process,
    train_in_process,
)
from .test_ddp import SAME_RUN  # the DDP test's settings: 5 steps well inside the first epoch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(port: int, *overrides: str) -> list[str]:
    """What each machine runs (docs/distributed.md: "Several machines"), here both on 127.0.0.1."""
    return [
        *(sys.executable, "-m", "torch.distributed.run"),
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=kiln-loopback",
        str(REPO_ROOT / "train.py"),
        *overrides,
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_torchrun_agents_on_loopback_match_one_process_with_the_same_global_batch(tmp_path):
    single_dir = tmp_path / "single"
    train_in_process(single_dir, *SAME_RUN, "data.batch_size=32", "logger=none")

    command = node_command(free_port(), *SAME_RUN, "trainer=ddp", "data.batch_size=16")
    nodes = [
        subprocess.Popen(
            command,
            cwd=tmp_path,
            env=SUBPROCESS_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    for node in nodes:
        _, stderr = node.communicate(timeout=500)
        assert node.returncode == 0, stderr.decode()[-3000:]

    # One run directory for both nodes, named by the rendezvous id, with one .hydra.
    run_dirs = [p.parent for p in (tmp_path / "outputs").glob("**/summary.json")]
    assert run_dirs == [tmp_path / "outputs" / "ddp" / "kiln-loopback"]
    assert len(list((tmp_path / "outputs").glob("**/.hydra"))) == 1
    (run_dir,) = run_dirs
    log = (run_dir / "train.log").read_text()
    assert log.count("step 5 loss") == 1  # only rank 0 logs

    expected = load_checkpoint(single_dir / "checkpoints" / "last.pt")["model"]
    actual = load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5)
    assert read_summary(run_dir)["steps"] == 5


# Long epochs of small batches, so that a kill right after the first step checkpoint lands
# mid-epoch; deterministic kernels and no dropout (a restarted rank other than 0 reseeds its
# RNG), so an interrupted run can reach the uninterrupted run's weights exactly.
RESTARTABLE = (
    "model.dropout=0.0",
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=40",
    "trainer.deterministic=true",
    "trainer.checkpoint_every_n_steps=10",
    "trainer.log_every_n_steps=1",
    "data.batch_size=8",
    "env.progress_bar=false",
)
ELASTIC = [
    *(sys.executable, "-m", "torch.distributed.run"),
    "--standalone",
    "--nproc_per_node=2",
    "--max-restarts=1",
    "--monitor-interval=0.1",
]


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [*ELASTIC, str(REPO_ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
    return start_process(cmd, run_dir.parent)


def worker(agent: subprocess.Popen, rank: int):
    import psutil

    (found,) = [
        p for p in psutil.Process(agent.pid).children() if p.environ().get("RANK") == str(rank)
    ]
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("trainer", ["ddp", "fsdp"])
def test_a_rank_killed_mid_epoch_is_restarted_and_the_run_continues_from_its_checkpoint(
    tmp_path, trainer
):
    settings = (*RESTARTABLE, f"trainer={trainer}")
    reference = tmp_path / "reference"
    result = run_train(reference, *settings, launcher=ELASTIC)
    assert result.returncode == 0, result.stderr[-3000:]

    run_dir = tmp_path / "run"
    agent = start(run_dir, *settings)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "last.pt").exists():
        assert agent.poll() is None, f"run ended before a checkpoint: {agent.stderr.read()}"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    worker(agent, rank=1).send_signal(signal.SIGKILL)
    _, stderr = agent.communicate(timeout=600)
    assert agent.returncode == 0, stderr[-3000:]  # the agent restarted the group, which finished

    saved = load_checkpoint(run_dir / "checkpoints" / "last.pt", consolidate=False)
    log = (run_dir / "train.log").read_text()
    assert "torchrun restart 1: continuing from the newest checkpoint" in log
    resumed_at = log.split("torchrun restart 1")[1]
    assert "resumed from" in resumed_at and "at epoch 0, step " in resumed_at  # mid-epoch
    assert saved["state"]["global_step"] == read_summary(reference)["steps"]

    expected = load_checkpoint(reference / "checkpoints" / "last.pt")["model"]
    actual = load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs after the restart"
    steps = [m["step"] for m in read_metrics(run_dir) if "loss" in m]
    assert sorted(set(steps)) == list(range(1, saved["state"]["global_step"] + 1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_slurm_recipe_runs_torchrun_inside_a_submitit_job(tmp_path):
    """scripts/slurm_torchrun.py on submitit's local executor (one node, two ranks): the job runs
    torchrun, whose ranks train into outputs/slurm/<job id>."""
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "slurm_torchrun.py")]
        + ["--cluster", "local", "--procs-per-node", "2", "--wait", "--"]
        + ["trainer=ddp", "trainer.max_steps=3", "env.progress_bar=false"],
        cwd=tmp_path,
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = Path(result.stdout.split("finished: ")[1].strip())
    assert run_dir.parent == tmp_path / "outputs" / "slurm"
    summary = read_summary(run_dir)
    assert summary["status"] == "ok" and summary["steps"] == 3
    assert "resume=auto: no checkpoint" in (run_dir / "train.log").read_text()  # a first attempt
