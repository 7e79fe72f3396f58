"""The resume contract: a changed command line on an old checkpoint is refused, applied for real
when resume_override says so, or accepted when harmless; never silently wrong."""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

from kiln import checkpoint as files
from kiln.cli.paths import REPO_ROOT
from kiln.engine.checkpointer import ResumeError

from .conftest import (
    SUBPROCESS_ENV,
    read_metrics,
    read_summary,
    run_python,
    run_train,
    train_in_process,
    train_main_here,
)

BASE = ("env.progress_bar=false", "logger=none", "trainer.log_every_n_steps=1")


def first_run(run_dir, *overrides):
    return train_in_process(run_dir, *BASE, *overrides)


def resume(run_dir, *overrides):
    return train_in_process(run_dir, *BASE, *overrides, "resume=auto")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("optimizer=sgd",), "optimizer.name: 'adamw' -> 'sgd'"),
        (("scheduler=cosine",), "scheduler.name: 'onecycle' -> 'cosine'"),
        (("model.hidden_dims=[64]",), "model.hidden_dims: [256, 128] -> [64]"),
        (("data.val_fraction=0.3",), "<data fingerprint>"),
        (("seed=1",), "seed: 42 -> 1"),
    ],
)
def test_incompatible_changes_are_refused_naming_key_and_values(tmp_path, change, expected):
    run_dir = tmp_path / "run"
    first_run(run_dir, "trainer.max_epochs=1")
    with pytest.raises(ResumeError) as info:
        resume(run_dir, "trainer.max_epochs=1", *change)
    message = str(info.value)
    assert expected in message and "for a new run" in message
    summary = read_summary(run_dir)  # the refused run as it was built, not a blank one
    assert summary["status"] == "failed" and summary["monitor"] is not None


def lrs(run_dir):
    return [m["lr"] for m in read_metrics(run_dir) if "loss" in m]


def test_a_new_learning_rate_is_refused_unless_overridden_and_then_applied(tmp_path):
    run_dir = tmp_path / "run"
    settings = ("scheduler=none", "trainer.max_epochs=1")
    first_run(run_dir, *settings)
    with pytest.raises(ResumeError, match=r"resume_override=\[optimizer.lr\]"):
        resume(run_dir, "scheduler=none", "trainer.max_epochs=2", "optimizer.lr=0.01")
    before = len(lrs(run_dir))
    resume(
        run_dir,
        "scheduler=none",
        "trainer.max_epochs=2",
        "optimizer.lr=0.01",
        "resume_override=[optimizer.lr]",
    )
    trace = lrs(run_dir)
    assert set(trace[:before]) == {0.003} and set(trace[before:]) == {0.01}  # applied for real


def test_an_overridden_learning_rate_reshapes_the_schedule_from_where_it_stands(tmp_path):
    """With onecycle the new peak applies from the current step on, as if the run had used it."""
    reference, first, resumed = tmp_path / "reference", tmp_path / "first", tmp_path / "resumed"
    first_run(reference, "trainer.max_epochs=2", "optimizer.lr=0.01")
    first_run(first, "trainer.max_epochs=2")  # lr 0.003; epoch-1.pt after 23 steps
    train_in_process(
        resumed,
        *BASE,
        "trainer.max_epochs=2",
        "optimizer.lr=0.01",
        "resume_override=[optimizer.lr]",
        f"resume={first}/checkpoints/epoch-1.pt",
    )
    assert lrs(resumed) == pytest.approx(lrs(reference)[23:], rel=1e-9)
    assert lrs(resumed) != pytest.approx(lrs(first)[23:], rel=1e-3)


@pytest.mark.parametrize(("batch", "mapped"), [(16, True), (128, False)])
def test_mid_epoch_resume_with_another_batch_size_maps_samples_exactly_or_is_refused(
    tmp_path, batch, mapped
):
    run_dir = tmp_path / "run"
    settings = ("scheduler=none", "trainer.max_epochs=1", "trainer.checkpoint_every_n_steps=5")
    first_run(run_dir, *settings, "trainer.max_steps=5")  # 5 batches of 64 = 320 samples
    assert (
        files.load_checkpoint(run_dir / "checkpoints" / "last.pt")["state"]["batch_in_epoch"] == 5
    )
    with pytest.raises(ResumeError, match="would change the run"):
        resume(run_dir, *settings, f"data.batch_size={batch}")
    override = (f"data.batch_size={batch}", "resume_override=[data.batch_size]")
    if not mapped:  # 320 samples are not a whole number of batches of 128
        with pytest.raises(ResumeError, match="is 320 samples into the epoch"):
            resume(run_dir, *settings, *override)
        return
    summary = resume(run_dir, *settings, *override)
    assert summary["epochs"] == 1
    state = files.load_checkpoint(run_dir / "checkpoints" / "last.pt")["state"]
    assert (
        state["samples_seen"] == 1437
    )  # every training digit exactly once: none skipped or repeated


def test_the_same_global_batch_split_differently_is_harmless(tmp_path, caplog):
    run_dir = tmp_path / "run"
    first_run(run_dir, "trainer.max_epochs=1", "data.batch_size=32")
    with caplog.at_level(logging.INFO):
        resume(
            run_dir,
            "trainer.max_epochs=1",
            "data.batch_size=16",
            "trainer.accumulate_grad_batches=2",
        )
    assert "accepted harmless changes" in caplog.text and "data.batch_size: 32 -> 16" in caplog.text


def test_harmless_changes_are_accepted_and_listed(tmp_path, caplog):
    run_dir = tmp_path / "run"
    first_run(run_dir, "trainer.max_epochs=1")
    with caplog.at_level(logging.INFO):
        summary = resume(
            run_dir, "trainer.max_epochs=1", "data.num_workers=1", "trainer.keep_last_k=5"
        )
    assert summary["status"] == "ok"
    assert "data.num_workers: 'auto' -> 1" in caplog.text
    assert "trainer.keep_last_k: 2 -> 5" in caplog.text


def test_an_unknown_override_key_is_a_config_error():
    from kiln.config import ConfigError

    from .conftest import compose_config

    with pytest.raises(ConfigError, match="unknown key 'optimiser.lr' \\(resume_override\\)"):
        compose_config("resume_override=[optimiser.lr]")


def test_a_refused_resume_is_one_line_with_exit_2_through_train_py(tmp_path, capfd):
    """train.py's main, in this process (its one-line refusals from a real process:
    test_train_smoke.py)."""
    run_dir = tmp_path / "run"
    train_in_process(run_dir, *BASE, "trainer.max_epochs=1")
    code, stderr = train_main_here(
        capfd,
        f"hydra.run.dir={run_dir}",
        *BASE,
        "trainer.max_epochs=1",
        "optimizer=sgd",
        "resume=auto",
    )
    assert code == 2, stderr[-2000:]
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: cannot resume") and "optimizer.name" in line
    assert read_summary(run_dir)["status"] == "failed"


def test_a_failed_checkpoint_write_names_the_file_the_free_space_and_what_was_kept(tmp_path):
    """A real write failure (the process may not grow a file past 64 KiB, as on a full disk):
    the previous checkpoint survives and the message says so."""
    path = tmp_path / "last.pt"
    files.atomic_save({"model": {"w": torch.ones(2)}}, path)
    code = textwrap.dedent(
        f"""
        import resource, signal, torch
        from kiln import checkpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            checkpoint.atomic_save({{"model": {{"w": torch.zeros(1_000_000)}}}}, {str(path)!r})
        except checkpoint.CheckpointError as err:
            print(err)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=SUBPROCESS_ENV
    )
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    assert message.startswith(f"could not write checkpoint {path} (")
    assert "MiB free on its disk; the previous last.pt is kept)" in message
    assert torch.equal(files.load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert os.listdir(tmp_path) == ["last.pt"]  # no temp file left behind


def test_random_bytes_are_called_not_a_checkpoint(tmp_path):
    # some random files once failed inside the unpickler with an IndexError: try many
    path = tmp_path / "weights.pt"
    for _ in range(200):
        path.write_bytes(os.urandom(4096))
        with pytest.raises(files.CheckpointError, match="not a checkpoint at all"):
            files.load_checkpoint(path)
    # one in a million such files holds a zip end record's signature, which is all
    # zipfile.is_zipfile looks for (CI met one): an empty end record after random bytes
    path.write_bytes(os.urandom(4096) + b"PK\x05\x06" + bytes(18))
    assert zipfile.is_zipfile(path)
    with pytest.raises(files.CheckpointError, match="not a checkpoint at all"):
        files.load_checkpoint(path)


# ---------------------------------------------------------------------------------------------
# A refusal names the keys the user changed, old and new, and the command that would work


def test_a_longer_schedule_is_refused_naming_max_epochs_and_a_run_from_these_weights(tmp_path):
    run_dir = tmp_path / "run"
    first_run(run_dir, "trainer.max_epochs=2")  # onecycle over 2 x 23 optimizer steps
    with pytest.raises(ResumeError) as info:
        resume(run_dir, "trainer.max_epochs=3")
    message = str(info.value)
    assert "with this config: trainer.max_epochs: 2 -> 3 (<planned optimizer steps>: the " in (
        message
    )
    assert "onecycle schedule would span 69 optimizer steps, not 46)" in message
    assert "to resume it as it was: trainer.max_epochs=2;" in message
    last = run_dir / "checkpoints" / "last.pt"
    assert f"for a new run from these weights: init_from={last} (without resume=)" in message


def contract(**changes):
    from kiln.engine.resume import Contract

    config = {
        "trainer.name": "fsdp",
        "data.batch_size": 64,
        "scheduler.name": "onecycle",
        "resume_override": [],
    }
    fields = dict(
        config=config,
        planned_steps=12,
        batch_size=64,
        world_size=2,
        accumulate=1,
        data_fingerprint="same",
    )
    return Contract(**{**fields, **changes})


def test_another_number_of_ranks_names_nproc_per_node_and_the_per_rank_batch():
    """As a 2-rank FSDP run's checkpoint records it, resumed on one rank (the same planned
    steps: a schedule that does not depend on them)."""
    from kiln.engine.resume import check, judge

    with pytest.raises(ResumeError) as info:
        check(judge(contract(), contract(world_size=1), []), "run/checkpoints/last.pt")
    message = str(info.value)
    assert "with nproc_per_node 2 -> 1 (<global batch>: the global batch" in message
    assert "128 -> 64) would change the run" in message
    assert "to keep the global batch of 128 on 1 rank(s): data.batch_size=128" in message
    assert "to apply it: resume_override=[data.batch_size]" in message  # never []
    commands = info.value.with_commands(["trainer=fsdp", "resume=auto"], 1, "/runs/a")
    assert (
        "to keep the global batch of 128 on 1 rank(s): python train.py trainer=fsdp resume=auto "
        "data.batch_size=128 hydra.run.dir=/runs/a;" in commands
    )
    assert "to resume it as it was: torchrun --nproc_per_node=2 train.py trainer=fsdp" in commands
    check(judge(contract(), contract(world_size=1, batch_size=128), []), "last.pt")  # accepted


def test_the_printed_command_is_one_line_through_train_py_and_works_as_printed(tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(run_dir, *BASE, "trainer.max_epochs=2")
    assert first.returncode == 0, first.stderr[-2000:]
    result = run_train(run_dir, *BASE, "trainer.max_epochs=3", "resume=auto")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: cannot resume") and "trainer.max_epochs: 2 -> 3" in line
    as_it_was = line.split("to resume it as it was: ", 1)[1].split(";", 1)[0]
    assert as_it_was.startswith("python train.py ") and "trainer.max_epochs=2 resume=auto" in (
        as_it_was
    )
    assert f"hydra.run.dir={run_dir}" in as_it_was
    new_run = line.split("for a new run from these weights: ", 1)[1]
    assert "trainer.max_epochs=3" in new_run and f"init_from={run_dir}/checkpoints/" in new_run
    assert "resume=" not in new_run and "hydra.run.dir" not in new_run
    again = run_python([sys.executable, *shlex.split(as_it_was)[1:]], REPO_ROOT)
    assert again.returncode == 0, again.stderr[-2000:]
    assert read_summary(run_dir)["status"] == "ok"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_two_rank_fsdp_run_resumed_on_one_rank_names_the_ranks_and_the_batch(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run_dir = tmp_path / "run"
    same = (*BASE, "trainer=fsdp", "scheduler=none", "data.batch_size=64")
    first = run_train(run_dir, *same, "trainer.max_steps=3", launcher=torchrun)
    assert first.returncode == 0, first.stderr[-3000:]
    result = run_train(run_dir, *same, "trainer.max_steps=6", "resume=auto")
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "nproc_per_node 2 -> 1 (<global batch>: " in line and "128 -> 64" in line
    assert "resume_override=[data.batch_size]" in line and "resume_override=[]" not in line
    keep = line.split("to keep the global batch of 128 on 1 rank(s): ", 1)[1].split(";", 1)[0]
    assert "data.batch_size=128" in keep
    again = subprocess.run(
        [sys.executable, *shlex.split(keep)[1:]],
        cwd=REPO_ROOT,
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_summary(run_dir)["steps"] == 6


def test_a_checkpoint_saved_before_a_key_existed_resumes_as_its_run_did():
    """A key added later (kiln.engine.resume.ABSENT_MEANS) is judged as the value that
    reproduces the old run: the refusal names it, and setting it resumes."""
    from kiln.engine.resume import check, judge

    old = contract(config={**contract().config})  # saved before data.min_token_count
    now = contract(config={**contract().config, "data.min_token_count": 2})
    with pytest.raises(ResumeError) as info:
        check(judge(old, now, []), "run/checkpoints/last.pt")
    message = str(info.value)
    assert "data.min_token_count: 1 -> 2" in message
    assert "to resume it as it was: data.min_token_count=1" in message
    as_it_was = contract(config={**contract().config, "data.min_token_count": 1})
    check(judge(old, as_it_was, []), "last.pt")  # accepted: the same data


def test_a_key_added_since_a_checkpoint_is_read_as_its_schema_default():
    """An image_folder checkpoint saved before data.val_labels_csv existed resumes under a
    command that leaves it unset (the schema's None: what the run did), and is refused naming
    `None -> ...` when the command sets it. A key no schema knows stays '<absent>'."""
    from kiln.engine.resume import absent_means, check, judge

    saved = {**contract().config, "data.name": "image_folder"}
    now = {**saved, "data.val_labels_csv": None, "data.test_labels_csv": None}
    check(judge(contract(config=saved), contract(config=now), []), "last.pt")
    with pytest.raises(ResumeError, match=r"data.val_labels_csv: None -> 'val.csv'"):
        changed = contract(config={**now, "data.val_labels_csv": "val.csv"})
        check(judge(contract(config=saved), changed, []), "last.pt")
    assert absent_means("data.no_such_key", saved) == "<absent>"
    assert absent_means("data.val_labels_csv", {"data.name": "no_such_option"}) == "<absent>"
    assert absent_means("data.min_token_count", {"data.name": "csv_text"}) == 1  # ABSENT_MEANS
