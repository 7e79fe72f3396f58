"""Resume checks what it leaves: after resume=auto falls back past an unreadable last.pt and
best.pt, neither is left for the run (or outputs/latest, or a printed command) to point at --
each is moved aside, said, and written again -- and a run never ends ok while its last.pt or
best.pt cannot be read back. Legacy (non-zip) torch.save files are read, not called corrupt."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln import checkpoint as files
from kiln.engine.checkpointer import Checkpointer

from .conftest import compose_config, train_in_process

SETTINGS = ("env.progress_bar=false", "logger=none", "scheduler=none")  # epochs may grow


def damage(path):
    path.write_bytes(path.read_bytes()[:1000])


def test_resume_auto_past_an_unreadable_last_and_best_rewrites_both(tmp_path, caplog):
    run_dir = tmp_path / "run"
    train_in_process(run_dir, *SETTINGS, "trainer.max_epochs=2")
    checkpoints = run_dir / "checkpoints"
    damage(checkpoints / "last.pt")
    damage(checkpoints / "best.pt")
    with caplog.at_level(logging.WARNING):
        summary = train_in_process(run_dir, *SETTINGS, "trainer.max_epochs=3", "resume=auto")
    assert summary["status"] == "ok" and summary["epochs"] == 3
    for name in ("last.pt", "best.pt"):
        assert f"{name} cannot be read" in caplog.text
        assert (checkpoints / f"{name}.corrupt").stat().st_size == 1000  # kept, out of the way
        assert files.unreadable(checkpoints / name) is None  # written again, readable
    best = files.load_checkpoint(checkpoints / "best.pt")
    assert best["state"]["global_step"] > 0 and "resumed from" not in str(best.get("error"))


def test_a_resume_with_nothing_left_to_train_leaves_no_unreadable_best(tmp_path, caplog):
    run_dir = tmp_path / "run"
    train_in_process(run_dir, *SETTINGS, "trainer.max_epochs=1")
    damage(run_dir / "checkpoints" / "best.pt")  # last.pt is fine: resumed from it
    with caplog.at_level(logging.WARNING):
        summary = train_in_process(run_dir, *SETTINGS, "trainer.max_epochs=1", "resume=auto")
    assert summary["status"] == "ok"
    best = run_dir / "checkpoints" / "best.pt"
    assert not best.exists() or files.unreadable(best) is None
    assert (run_dir / "checkpoints" / "best.pt.corrupt").is_file()


def test_a_run_does_not_end_ok_pointing_at_an_unreadable_checkpoint(tmp_path):
    cfg = compose_config(*SETTINGS)
    checkpointer = Checkpointer(
        tmp_path, cfg.trainer, monitor="val_acc", monitor_mode="max", is_main=True
    )
    files.atomic_save({"model": {"w": torch.ones(3)}}, tmp_path / "last.pt")
    checkpointer.check_pointed_files()
    files.atomic_save({"model": {"w": torch.ones(300)}}, tmp_path / "best.pt")
    data = bytearray((tmp_path / "best.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the tensor data: a CRC mismatch
    (tmp_path / "best.pt").write_bytes(bytes(data))
    with pytest.raises(files.CheckpointError, match=r"best.pt cannot be read back at the end"):
        checkpointer.check_pointed_files()


def test_a_legacy_torch_save_file_is_read(tmp_path):
    weights = {"model": {"layer.weight": torch.arange(6.0).view(2, 3)}}
    path = tmp_path / "legacy.pt"
    torch.save(weights, path, _use_new_zipfile_serialization=False)
    loaded = files.load_checkpoint(path)
    assert torch.equal(loaded["model"]["layer.weight"], weights["model"]["layer.weight"])
    assert files.unreadable(path) is None
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(files.CheckpointError, match="neither the zip archive .* nor its legacy"):
        files.load_checkpoint(tmp_path / "junk.pt")
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(files.CheckpointError, match="truncated or corrupt"):
        files.load_checkpoint(truncated)
