"""A run directory and its process: one writer at a time, Ctrl-C as a preemption, and a full disk
ending in one line. Real processes, real signals, a real full filesystem."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kiln import checkpoint as files
from kiln.cli.paths import REPO_ROOT

from .conftest import SUBPROCESS_ENV, read_summary, run_train, start_process, train_main_here

QUIET = ("env.progress_bar=false", "logger=none", "trainer.log_every_n_steps=1")
LONG = ("scheduler=none", "trainer.max_epochs=1000")  # runs until the test stops it


def train_py(run_dir, *overrides):
    return [sys.executable, str(REPO_ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides]


def wait_for(predicate, timeout=180.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended early ({proc.returncode}): {err[-3000:]}")
        time.sleep(0.2)
    raise AssertionError("timed out")


def steps_logged(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]


def test_a_second_process_on_a_running_run_refuses_at_once_naming_the_first(tmp_path, capfd):
    """The second and third commands are train.py's main in the test's own process: another
    process than the first run's, which is what the lock tells apart."""
    run_dir = tmp_path / "run"
    first = start_process(train_py(run_dir, *QUIET, *LONG, "resume=auto"), cwd=tmp_path)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "last.pt").is_file(), proc=first)
        started = time.monotonic()
        code, stderr = train_main_here(
            capfd, f"hydra.run.dir={run_dir}", *QUIET, *LONG, "resume=auto"
        )
        took = time.monotonic() - started
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert code == 2, stderr[-2000:]
    (line,) = stderr.strip().splitlines()
    assert line.startswith(f"error: run directory {run_dir} is in use by process {first.pid} (")
    assert "one run directory has one writer" in line and f"kill {first.pid}" in line
    assert took < 30  # at once: before any data or model is built
    steps = steps_logged(run_dir)
    assert steps == sorted(set(steps))  # no step written twice
    assert read_summary(run_dir)["status"] == "preempted"  # the first run's own record

    # The lock went with the process: the same command now resumes.
    overrides = (*QUIET, "scheduler=none", "trainer.max_epochs=1", "resume=auto")
    code, stderr = train_main_here(capfd, f"hydra.run.dir={run_dir}", *overrides)
    assert code == 0, stderr[-2000:]
    assert read_summary(run_dir)["status"] == "ok"


# ---------------------------------------------------------------------------------------------
# Ctrl-C is a preemption

SLOW_PLUGIN = '''
import math, os, time
from torch import nn
from kiln.config.model import MlpConfig
from kiln.registry import register_model


class SlowWhenAsked(nn.Module):
    """Each training forward takes 10 s once the marker file exists."""

    def __init__(self, spec):
        super().__init__()
        self.fc = nn.Linear(spec.channels * math.prod(spec.image_size), spec.num_classes)

    def forward(self, x):
        if self.training and os.path.exists(os.environ["SLOW_MARKER"]):
            time.sleep(10)
        return self.fc(x.flatten(1))


@register_model("slow_mlp", config=MlpConfig)
def build(spec, cfg, *, aux_head=False):
    return SlowWhenAsked(spec)
'''


def ctrl_c(proc) -> None:
    """What a terminal does: SIGINT to the whole foreground process group."""
    os.killpg(proc.pid, signal.SIGINT)


def start_in_own_group(cmd, cwd, env=None):
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**SUBPROCESS_ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_ctrl_c_checkpoints_at_the_step_exits_130_and_prints_the_resume_command(tmp_path):
    run_dir = tmp_path / "run"
    cmd = train_py(run_dir, *QUIET, *LONG, "data.num_workers=1")  # a worker shares the group
    proc = start_in_own_group(cmd, tmp_path)
    wait_for(lambda: len(steps_logged(run_dir)) >= 30, proc=proc)
    ctrl_c(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted"
    state = files.load_checkpoint(run_dir / "checkpoints" / "last.pt")["state"]
    assert state["global_step"] == summary["steps"] == steps_logged(run_dir)[-1]  # nothing lost
    assert "run interrupted (Ctrl-C); its state is in" in out
    (line,) = [line[len("next: ") :] for line in out.splitlines() if line.startswith("next: ")]
    command, _, comment = line.partition("   # ")
    # train.py as the test typed it (an absolute path), the run's overrides, resume=auto
    assert command == f"python {REPO_ROOT / 'train.py'} {' '.join(cmd[3:])} resume=auto"
    assert comment == f"continue it from that state, in {run_dir}"


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    (tmp_path / "slow_parts.py").write_text(SLOW_PLUGIN)
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "slow_mlp.yaml").write_text("dropout: 0.0\n")
    marker, run_dir = tmp_path / "slow-now", tmp_path / "run"
    cmd = train_py(
        run_dir,
        *QUIET,
        *LONG,
        "plugins=[slow_parts]",
        "model=slow_mlp",
        f"hydra.searchpath=[file://{tmp_path}/conf]",
    )
    env = {"SLOW_MARKER": str(marker)}  # plugins=[...] imports from the working directory
    proc = start_in_own_group(cmd, tmp_path, env)
    wait_for(lambda: (run_dir / "checkpoints" / "last.pt").is_file(), proc=proc)
    marker.touch()  # every step now takes 10 s
    time.sleep(2)
    # Read once the slow step is under way: a checkpoint the fast steps asked for just before
    # it (written by the background writer) is on disk by now, and none can follow it.
    before = files.load_checkpoint(run_dir / "checkpoints" / "last.pt")["state"]["global_step"]
    ctrl_c(proc)  # the first asks for a checkpoint at the end of this step...
    time.sleep(0.5)
    ctrl_c(proc)  # ...the second stops now
    stopped = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - stopped < 6, "it waited for the step to end"
    assert proc.returncode == 130, err[-3000:]
    assert read_summary(run_dir)["status"] == "interrupted"
    assert "run interrupted (Ctrl-C), stopped at once; the newest checkpoint is " in err
    assert "Traceback" not in err
    after = files.load_checkpoint(run_dir / "checkpoints" / "last.pt")["state"]["global_step"]
    assert after == before  # intact, and no checkpoint of the half-done step


# ---------------------------------------------------------------------------------------------
# A full disk anywhere is one line. /dev/full answers every write with ENOSPC, as a full disk
# does: a file linked to it is a file on a full disk. A small tmpfs is the whole disk full
# (mounting needs root; those tests skip without it).


def on_a_full_disk(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to("/dev/full")


@pytest.mark.parametrize(
    ("file", "overrides"),
    [
        ("metrics.jsonl", ()),
        (".curves.png.tmp", ("trainer.max_epochs=1", "logger.curves=true")),  # their temp file
        (".summary.json.tmp", ("trainer.max_steps=2",)),  # the very last write
    ],
    ids=["metrics", "curves", "summary"],
)
def test_a_full_disk_under_any_writer_is_one_disk_full_error(tmp_path, file, overrides):
    from kiln.engine.run import train
    from kiln.errors import DiskFullError

    from .conftest import compose_config

    run_dir = tmp_path / "run"
    on_a_full_disk(run_dir / file)
    with pytest.raises(DiskFullError) as info:
        train(compose_config(*QUIET, *overrides), run_dir)
    message = str(info.value)
    assert message.startswith("no space left on the device writing ") and file.split(".")[1] in (
        message
    )
    assert "free space on that disk, or run with hydra.run.dir on another one" in message
    for checkpoint in (run_dir / "checkpoints").glob("*.pt"):
        files.load_checkpoint(checkpoint)  # whatever was written is whole


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def test_train_log_on_a_full_disk_is_one_line_and_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    on_a_full_disk(run_dir / "train.log")
    result = run_train(run_dir, *QUIET, "trainer.max_steps=3")
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result)
    assert "no space left on the device writing train.log" in line
    assert "the checkpoints are intact (none written yet)" in line


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a few MiB mounted for the test (root only), unmounted after."""
    mount = tmp_path / "disk"
    mount.mkdir()

    def make(size_kib: int):
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
        return mount

    yield make
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_disk_almost_full_at_the_start_is_one_line(tmp_path, small_disk):
    disk = small_disk(2048)
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (2048 - 16) * 1024)  # 16 KiB left
    result = run_train(disk / "run", *QUIET, "trainer.max_steps=3")
    assert result.returncode == 2
    line = one_error_line(result)
    assert f"no room for a run in {disk / 'run'} (" in line and "KiB free on its disk)" in line


def test_a_disk_that_fills_during_the_run_is_one_line_and_the_checkpoints_load(
    tmp_path, small_disk
):
    disk = small_disk(1536)  # room for the first epochs' checkpoints, not for ten
    run_dir = disk / "run"
    result = run_train(run_dir, *QUIET, "trainer.log_every_n_steps=5")
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result)
    assert line.startswith("error: no space left on the device writing "), line
    assert "the checkpoints are intact (newest: " in line and line.count("intact") == 1
    loaded = [files.load_checkpoint(p) for p in (run_dir / "checkpoints").glob("*.pt")]
    assert loaded, "no checkpoint was written before the disk filled"
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))  # no half-written file left


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_handler_writes_nothing_and_the_loop_says_what_arrived(signum, caplog):
    """A handler runs between two bytecodes of the main thread, perhaps in the middle of a log
    line's write to the same stream, where a second write fails ("reentrant call", printed as a
    '--- Logging error ---' traceback); so it only records, and the loop's next check logs it."""
    import logging

    import torch

    from kiln.engine.distributed import DistInfo
    from kiln.engine.preemption import PreemptionFlag

    flag = PreemptionFlag(DistInfo(), torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="kiln.engine.preemption"), flag:
        flag.defer()  # training: a signal asks for a checkpoint at the step boundary
        signal.raise_signal(signum)  # the handler runs here, as it would mid-step
        assert flag.requested and caplog.records == []
        assert flag.agreed() is True
        (record,) = caplog.records
    assert "checkpointing at the next step boundary" in record.getMessage()
    assert ("Ctrl-C" in record.getMessage()) == (signum == signal.SIGINT)
