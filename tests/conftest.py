"""Shared helpers: the real config, composed and shrunk; training in-process through the same
`train(cfg, run_dir)` the CLI calls; the real train.py in a subprocess where the process itself
(exit codes, signals, stderr, torchrun) is what a test checks."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli.paths import REPO_ROOT
from kiln.config import load_config
from kiln.registry import load_plugins

# Your own modules join the registry-wide tests: KILN_PLUGINS=my_parts make test
load_plugins([m for m in os.environ.get("KILN_PLUGINS", "").split(",") if m])

# Tests moved from `make test` to `make test-all` by their measured time (pytest --durations
# on the 2-core CI machine, 2026-12-03), so the default suite stays near ten minutes. Each is
# 8 s or more, and `make test` keeps a quicker test of the same concern: the value names it.
LONG_TESTS = dict(  # test -> the quicker test of the same concern that `make test` keeps
    [
        (
            "test_finetune.py::test_sigkill_mid_epoch_resume_is_exact_with_init_from_freeze_head_lr_and_ema",
            "test_resume.py::test_sigkill_mid_epoch_then_resume_matches_an_uninterrupted_run",
        ),
        (
            "test_failures.py::test_a_users_models_join_the_registry_wide_tests_without_any_test_edit",
            "test_registry.py::test_a_users_model_and_dataset_train_through_train_py_and_predict",
        ),
        (
            "test_registry.py::test_a_checkpoint_records_its_plugin_package_and_names_it_when_it_is_gone",
            "test_registry.py::test_an_installed_plugin_that_fails_to_import_is_named_and_skipped",
        ),
        (
            "test_printed_commands.py::test_a_plugin_run_carries_its_plugins_into_the_commands_it_prints",
            "test_printed_commands.py::test_a_failed_runs_printed_commands_run_as_printed",
        ),
        (
            "test_printed_commands.py::test_an_entry_point_plugin_declares_its_config_folder",
            "test_registry.py::test_plugins_can_also_come_from_an_entry_point",
        ),
        (
            "test_matrix.py::test_a_broken_cell_fails_the_matrix_with_its_fail_line",
            "test_failures.py: each broken model's one [FAIL] line",
        ),
        (
            "test_image_folder.py::test_train_py_on_the_example_photos_with_resnet18",
            "test_readme.py::test_every_command_in_the_readme_runs_as_typed",  # its image folder
        ),
        (
            "test_torchvision_detection_export.py::test_fasterrcnn_exports_to_onnx_with_box_parity_and_serves_from_it",
            "test_torchvision_detection_export.py::test_the_traced_resize_sizes_every_image_as_eager_torch_does",
        ),
        (
            "test_ddp.py::test_the_other_ranks_wait_for_the_main_ranks_fail_line_before_they_exit",
            "test_ddp.py::test_nonfinite_loss_under_ddp_stops_every_rank_with_one_fail_line",
        ),
        (
            "test_ddp.py::test_parameters_used_in_some_steps_stop_a_ddp_run_before_step_1",
            "test_ddp.py::test_two_cpu_processes_match_one_process_with_the_same_global_batch",
        ),
        (
            "test_ddp.py::test_ranks_share_one_run_directory_without_hydra_run_dir",
            "test_ddp.py::test_two_cpu_processes_match_one_process_with_the_same_global_batch",
        ),
        (
            "test_fsdp.py::test_fsdp_on_two_ranks_trains_as_one_process_and_writes_sharded_checkpoints",
            "test_fsdp.py::test_a_checkpoint_naming_incomplete_shards_is_skipped_and_stray_folders_removed",
        ),
        (
            "test_zoo_photos.py::test_torchvision_resnet18_fine_tuned_from_a_state_dict_end_to_end",
            "test_zoo.py::test_resnet18_trains_then_exports_and_predicts_without_its_weights_file",
        ),
        (
            "test_antibodies.py::test_behaviour_checks_and_the_learn_probe_pass[resnet18-on-image_folder]",
            "test_antibodies.py: resnet18-on-synthetic_images",
        ),
        (
            "test_antibodies.py::test_behaviour_checks_and_the_learn_probe_pass[torchvision[swin_t]-on-synthetic_images]",
            "test_antibodies.py: torchvision[efficientnet_b0]-on-synthetic_images",
        ),
        (
            "test_search_storage.py::test_the_same_search_again_continues_its_study",
            "test_search_configs.py::test_optuna_search_runs_in_memory",
        ),
        (
            "test_triage.py::test_a_flat_loss",
            "test_triage.py::test_the_command_prints_the_ranked_causes",
        ),
        (
            "test_resume_as_typed.py::test_resume_auto_after_a_finished_run",
            "test_resume_as_typed.py::test_resume_auto_after_a_preempted_run",
        ),
        (
            "test_train_smoke.py::test_two_step_run_of_each_model[resnet50]",
            "test_train_smoke.py::test_resnet50_with_amp_runs_on_cpu_as_bf16",
        ),
        (
            "test_hostile_models.py::test_refusals_take_little_memory_in_a_fresh_process",
            "test_hostile_models.py::test_a_config_past_the_machine_is_refused_naming_the_key_and_the_size",
        ),
        (
            "test_preemption.py::test_a_signal_during_an_evaluation_ends_it_and_checkpoints_that_step",
            "test_resume.py::test_sigterm_checkpoints_at_a_step_boundary_and_exits_75",
        ),
        (
            "test_preemption.py::test_a_signal_during_a_checkpoint_write_leaves_whole_files",
            "test_resume.py::test_sigterm_checkpoints_at_a_step_boundary_and_exits_75",
        ),
        (
            "test_preemption.py::test_a_signal_during_the_export_leaves_no_model_onnx",
            "test_bad_checkpoints.py::test_bad_weights_are_one_error_line_and_exit_2",  # no onnx
        ),
        (
            "test_preemption.py::test_a_signal_before_step_1_stops_the_run_at_once_saying_nothing_was_trained[tokenizing]",
            # a native call ended by the watch
            "test_preemption.py::test_a_signal_before_step_1_stops_the_run_at_once_saying_nothing_was_trained[native]",
        ),
    ]
)


@pytest.hookimpl(tryfirst=True)  # before -m picks by marker
def pytest_collection_modifyitems(config, items):
    """Mark LONG_TESTS slow; a name there that its collected file no longer has is an error (a
    renamed test would otherwise come back to `make test` unnoticed)."""
    found, files = set(), set()
    for item in items:
        name = item.nodeid.removeprefix("tests/")
        files.add(name.split("::")[0])
        if name in LONG_TESTS:
            item.add_marker(pytest.mark.slow)
            found.add(name)
    if any("::" in arg for arg in config.args):
        return  # tests picked by name: not every test of a file was collected
    stale = [n for n in LONG_TESTS if n.split("::")[0] in files and n not in found]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py LONG_TESTS names missing tests: {stale}")


# Keep CPU work predictable on the 2-core machines tests run on.
SUBPROCESS_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "PYTHONUNBUFFERED": "1",
}


# Every check before step 1 off (rule 2's loss terms stay: a forward without backward).
PROBES_OFF = (
    "trainer.probe_sizes=false",
    "trainer.shape_check=false",
    "trainer.learn_probe=false",
    "trainer.skip_checks=[batch_dependence,determinism,purity,numerics,dead_gradients,device]",
)


def compose_config(*overrides: str):
    """The typed config `python train.py <overrides>` would run (kiln.config.load_config)."""
    return load_config(list(overrides))


def train_in_process(run_dir: Path, *overrides: str) -> dict:
    """Train as train.py does, in this process; returns the summary."""
    from kiln.engine.run import train

    return train(compose_config(*overrides), run_dir)


@pytest.fixture(autouse=True)
def _own_probe_cache(tmp_path_factory, monkeypatch):
    """Each test its own probe cache (kiln.guards.probe_cache), in this process and in the
    subprocesses it starts: a model another test probed is probed again."""
    directory = str(tmp_path_factory.mktemp("probe-cache"))
    monkeypatch.setenv("KILN_PROBE_CACHE", directory)
    monkeypatch.setitem(SUBPROCESS_ENV, "KILN_PROBE_CACHE", directory)


@pytest.fixture(autouse=True)
def _quiet_threads():
    """One intra-op thread per test, as the subprocess runs have (OMP_NUM_THREADS=1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _own_log_handlers():
    """A CLI main() called in this process (Hydra's job logging, infer's basicConfig) leaves a
    handler on the stream pytest captured for that test, closed when the test ends: a later
    test's log line would hit it ('--- Logging error ---' in that test's output). As separate
    processes the CLIs never share handlers, so each test's new handlers leave with it
    (pytest's own capture handlers come and go with each phase; they are its business)."""
    import logging

    loggers = [logging.getLogger(), logging.getLogger("kiln")]
    before = {logger.name: (set(logger.handlers), logger.level) for logger in loggers}
    yield
    for logger in loggers:
        handlers, level = before[logger.name]
        for handler in list(logger.handlers):
            if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
                handler.close()
        logger.setLevel(level)


def run_train(
    run_dir: Path,
    *overrides: str,
    cwd: Path | None = None,
    timeout: int = 300,
    launcher=None,
    explicit_run_dir: bool = True,
    env_overrides: dict | None = None,
):
    """Run the real `python train.py` with hydra.run.dir=run_dir; returns CompletedProcess."""
    cmd = [*(launcher or [sys.executable]), str(REPO_ROOT / "train.py")]
    cmd += [f"hydra.run.dir={run_dir}"] if explicit_run_dir else []
    cmd += overrides
    return subprocess.run(
        cmd,
        cwd=cwd or run_dir.parent,
        env={**SUBPROCESS_ENV, **(env_overrides or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_wandb_records(run_dir: Path) -> tuple[Path, list[dict]]:
    """The offline W&B run under run_dir, read by wandb's own reader (`wandb leet inspect`)."""
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return run_file, [json.loads(line) for line in out.splitlines() if line.strip()]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# A learning rate that drives the digits MLP to a non-finite loss within a few steps. The learn
# probe would stop such a run before step 1 (cannot learn): these runs are made to reach the
# loop's own non-finite handling, so it is off for them.
DIVERGING = ("optimizer=sgd", "optimizer.lr=1e12", "scheduler=none", "trainer.learn_probe=false")

# Settings that make a real training run take seconds: tiny data, few steps, no progress bar.
FAST = (
    "trainer.max_epochs=1",
    "trainer.log_every_n_steps=1",
    "env.progress_bar=false",
)


@pytest.fixture
def temporary_model():
    """Register a model builder for one test: `temporary_model("name", Builder)`; returns the
    config of the default run with model.name switched to it (schema: the mlp's)."""

    from kiln.config.model import MlpConfig
    from kiln.registry import MODELS

    added = []

    def register(name, builder, *overrides):
        MODELS.register(name, config=MlpConfig)(builder)
        added.append(name)
        cfg = compose_config(*overrides)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=name))

    yield register
    for name in added:
        del MODELS._entries[name]


def start_process(cmd: list[str], cwd: Path) -> subprocess.Popen:
    """A real process the test will signal or kill, its output captured."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=SUBPROCESS_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
