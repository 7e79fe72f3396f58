"""What keeps the training thread from waiting: checkpoints copied to the host and written by a
thread (each file still atomic, a failure still raised), curves.png drawn by a painter process
or on a thread, and glibc keeping freed host memory for the next step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from kiln import checkpoint as files
from kiln.config.run import TrainerConfig
from kiln.engine import checkpointer as checkpointer_module
from kiln.engine.checkpointer import Checkpointer, host_copy
from kiln.errors import DiskFullError
from kiln.logging import curves as curves_module
from kiln.logging.curves import CurvesFile, Painter

from .conftest import train_main_here


def checkpointer(directory, background=True) -> Checkpointer:
    cfg = TrainerConfig(name="default")
    return Checkpointer(
        directory, cfg, monitor="val_acc", monitor_mode="max", is_main=True, background=background
    )


def state_of(weight: torch.Tensor) -> dict:
    model = OrderedDict(weight=weight)
    model._metadata = {"": {"version": 2}}
    return {"model": model, "state": {"global_step": 3}, "rng": (1, [2.0])}


def test_host_copy_is_the_state_as_of_the_save():
    weight = torch.ones(4)
    state = state_of(weight)
    copied = host_copy(state)
    weight.add_(1)  # the next step changes the parameters in place
    state["state"]["global_step"] = 4
    assert torch.equal(copied["model"]["weight"], torch.ones(4))
    assert copied["state"]["global_step"] == 3 and copied["rng"] == (1, [2.0])
    assert copied["model"]._metadata == {"": {"version": 2}}  # load_state_dict reads versions


@pytest.mark.parametrize("serialized_up_to", [16 << 20, 0], ids=["bytes", "host-copy"])
def test_background_saves_are_whole_in_order_and_a_second_name_is_a_link(
    tmp_path, monkeypatch, serialized_up_to
):
    # A small state is serialized on the training thread, a large one copied to the host and
    # serialized by the writer: both are the state as of the save.
    monkeypatch.setattr(checkpointer_module, "SERIALIZE_ON_THE_STEP_BYTES", serialized_up_to)
    weight = torch.arange(6.0)
    ckpt = checkpointer(tmp_path)
    snapshot = state_of(weight)
    ckpt.save("last.pt", snapshot)
    ckpt.save("epoch-1.pt", snapshot)  # the same snapshot: one write, two names
    weight.mul_(0)  # training goes on before the writer is done
    ckpt.flush()
    last, epoch = tmp_path / "last.pt", tmp_path / "epoch-1.pt"
    assert os.stat(last).st_ino == os.stat(epoch).st_ino
    for path in (last, epoch):
        loaded = files.load_checkpoint(path)
        assert torch.equal(loaded["model"]["weight"], torch.arange(6.0))
    ckpt.save("last.pt", state_of(weight))  # a new snapshot replaces last.pt, not epoch-1.pt
    ckpt.flush()
    assert os.stat(last).st_ino != os.stat(epoch).st_ino
    assert torch.equal(files.load_checkpoint(last)["model"]["weight"], torch.zeros(6))
    assert torch.equal(files.load_checkpoint(epoch)["model"]["weight"], torch.arange(6.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-1.pt", "last.pt"]  # no temps


def test_a_failed_background_write_is_raised_and_nothing_after_it_is_written(tmp_path):
    ckpt = checkpointer(tmp_path)
    ckpt.save("last.pt", state_of(torch.ones(2)))
    ckpt.flush()
    (tmp_path / "sub").write_text("a file where the checkpoint's folder should be")
    ckpt.save("sub/best.pt", state_of(torch.zeros(2)))
    with pytest.raises(OSError):  # on this thread: at the next save or at the flush
        ckpt.save("last.pt", state_of(torch.zeros(2)))  # asked after the failure: not written
        ckpt.flush()
    ckpt.flush()  # raised once
    assert torch.equal(
        files.load_checkpoint(tmp_path / "last.pt")["model"]["weight"], torch.ones(2)
    )


HISTORY = [{"step": 1, "loss": 2.0, "lr": 0.1}, {"step": 2, "loss": 1.0, "val_loss": 1.5}]


def test_curves_are_drawn_on_a_thread_and_a_full_disk_there_still_ends_the_run(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(curves_module, "_painter", None)  # none started in this process
    history = [dict(row) for row in HISTORY]
    curves = CurvesFile(tmp_path / "curves.png", title="t")
    curves.update(history)
    assert curves._drawing is None  # the run's first seconds: no picture yet
    curves.due_at = 0.0
    curves.update(history)
    assert curves._drawing is not None and curves._drawing.name == "kiln-curves"
    curves._drawing.join()
    assert curves.due_at >= time.monotonic() + 4  # the next redraw: not before 5 s, 50 draws
    curves.finish(history)
    assert (tmp_path / "curves.png").stat().st_size > 0
    (tmp_path / ".curves.png.tmp").symlink_to("/dev/full")
    curves.due_at = 0.0
    curves.update(history)
    curves._drawing.join()
    with pytest.raises(DiskFullError):
        curves.update(history)  # the next call on the run's thread raises it


@pytest.fixture
def painter():
    painter = Painter()
    yield painter
    painter.close()


def _not_here(*args, **kwargs):
    raise AssertionError("drawn in the run's process")


def test_the_painter_process_draws_the_curves_and_answers_a_full_disk(
    tmp_path, painter, monkeypatch
):
    monkeypatch.setattr(curves_module, "draw", _not_here)  # only the painter can draw
    history = [dict(row) for row in HISTORY]
    curves = CurvesFile(tmp_path / "curves.png", title="t", painter=painter)
    curves.update(history)
    assert not painter.busy  # the run's first seconds: no picture yet
    curves.due_at = 0.0
    curves.update(history)
    assert painter.busy  # sent; the step's thread goes on
    history.append({"step": 3, "loss": 0.5, "val_loss": 1.0})  # only this row is sent next
    curves.finish(history)  # waits for the redraw in progress, then draws the whole run
    assert not painter.busy and painter.sent[str(tmp_path / "curves.png")][1] == 3
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert curves.due_at >= time.monotonic() + 4  # as on a thread: not before 5 s
    other = CurvesFile(tmp_path / "other.png", title="next run", painter=painter)
    other.finish(HISTORY)  # the next run of the process: the painter keeps its rows alone
    assert list(painter.sent) == [str(tmp_path / "other.png")]
    assert (tmp_path / "other.png").stat().st_size > 0
    (tmp_path / ".curves.png.tmp").symlink_to("/dev/full")
    with pytest.raises(DiskFullError):
        curves.finish(history)


def matplotlib_loaded(process: subprocess.Popen) -> bool:
    """Whether the painter process has imported matplotlib (its font library is mapped)."""
    return "ft2font" in (Path("/proc") / str(process.pid) / "maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc/<pid>/maps")
def test_the_painter_imports_matplotlib_only_once_there_is_a_loss_to_draw(tmp_path, painter):
    """A run refused at start-up or stopped before its first step has no curves: its painter
    never imports matplotlib (a second of CPU that the run waited for at its exit)."""
    curves = CurvesFile(tmp_path / "curves.png", title="t", painter=painter)
    before_step_1 = [{"step": 0, "probe_time_s": 0.1}]
    curves.update(before_step_1)
    curves.finish(before_step_1)  # its answer: every line sent before it was read
    assert not painter.warmed and not matplotlib_loaded(painter.process)
    assert not (tmp_path / "curves.png").exists()
    curves.update(HISTORY)  # the first loss: the import starts, nothing is drawn yet
    assert painter.warmed and not painter.busy
    curves.finish(HISTORY)
    assert matplotlib_loaded(painter.process)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_whose_painter_died_draws_its_curves_itself(tmp_path, painter):
    curves = CurvesFile(tmp_path / "curves.png", title="t", painter=painter)
    painter.process.kill()
    painter.process.wait()
    curves.due_at = 0.0
    curves.update(HISTORY)  # the pipe is broken: a thread takes over
    assert curves._painter is None
    curves.finish(HISTORY)
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert CurvesFile(tmp_path / "other.png", title="t", painter=painter)._painter is None


def test_logger_curves_false_draws_nothing_and_starts_no_painter(tmp_path, capsys, monkeypatch):
    """train.py with logger.curves=false: no painter process, no curves.png; the same run with
    it true has both (KILN_OVERRIDES, which the suite sets to false, is emptied so that the
    command line decides)."""
    monkeypatch.setenv("KILN_OVERRIDES", "")
    short = ("trainer.max_steps=2", "trainer.learn_probe=false", "env.progress_bar=false")
    for curves in (False, True):
        monkeypatch.setattr(curves_module, "_painter", None)  # this process's, as at its start
        run_dir = tmp_path / str(curves)
        code, _ = train_main_here(
            capsys, f"hydra.run.dir={run_dir}", f"logger.curves={str(curves).lower()}", *short
        )
        assert code == 0
        assert (curves_module._painter is not None) is curves
        assert (run_dir / "curves.png").is_file() is curves


FAULTS = textwrap.dedent(
    """
    import resource, sys
    from kiln.engine.host_memory import keep_freed_host_memory
    applied = keep_freed_host_memory(sys.argv[1] == "on")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):  # a step's worth of large blocks, freed and asked for again
        blocks = [bytearray(4 << 20) for _ in range(4)]
        del blocks
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_host_memory_is_reused_instead_of_faulted_in_again():
    def faults(mode: str, **env) -> tuple[str, int]:
        env = {**os.environ, **env}
        out = subprocess.run(
            [sys.executable, "-c", FAULTS, mode],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout.split()
        return out[0], int(out[1])

    applied, kept = faults("on")
    _, default = faults("off")
    assert applied == "True" and default > 10 * max(kept, 100)  # each block faulted in anew
    assert faults("on", KILN_HOST_MALLOC="default")[0] == "False"  # the switch
