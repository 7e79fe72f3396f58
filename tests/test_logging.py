"""Logger backends, read back with each library's own reader (pandas, TensorBoard's
EventAccumulator, W&B's `wandb leet inspect`, json)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kiln.logging import JsonlWriter, MultiLogger, build_loggers, read_jsonl, redact
from kiln.logging.csv_backend import CsvLogger

from .conftest import read_wandb_records

FAKE_API_KEY = "kiln-test-secret-" + "0123456789abcdef" * 2
CONFIG = {
    "model": {"name": "mlp", "hidden_dims": [256, 128]},
    "optimizer": {"name": "adamw", "lr": 0.003},
    # A key that slipped into the config must never reach a backend.
    "extra": {"note": f"token is {FAKE_API_KEY}", "hf_token": "hf_abcdefghijklmnop"},
}
# (step, metrics): train steps, then an eval that brings new keys; "/" in names on purpose.
STEPS = [
    (10, {"loss": 2.0, "loss/z_loss": 0.01, "lr": 1e-3, "grad_norm": 1.5}),
    (20, {"loss": 1.5, "loss/z_loss": 0.02, "lr": 2e-3, "grad_norm": 1.25}),
    (30, {"loss": 1.0, "loss/z_loss": 0.03, "lr": 3e-3, "grad_norm": 1.0}),
    (30, {"val_loss": 0.75, "val_acc": 0.875}),
]


def _assert_logged(logged: list[tuple[int, float]], key: str) -> None:
    """`logged` (step, value) pairs match what STEPS logged for `key` (float32 tolerance)."""
    expected = [(step, metrics[key]) for step, metrics in STEPS if key in metrics]
    assert [step for step, _ in logged] == [step for step, _ in expected], key
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6), key


@pytest.fixture(scope="module")
def all_backends_run(tmp_path_factory) -> Path:
    """One run through every backend (W&B offline init costs seconds, so it is shared)."""
    root = tmp_path_factory.mktemp("logging")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.setenv("WANDB_DISABLE_GIT", "true")
        env.setenv("WANDB_API_KEY", FAKE_API_KEY)
        for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache")):
            env.setenv(var, str(root / sub))  # keep W&B out of the home directory
        env.setenv("WANDB_DATA_DIR", str(root / "data"))
        run_dir = root / "run"
        loggers = build_loggers(
            ["csv", "tensorboard", "wandb"], run_dir, run_name="test-run", resume_id="kilntest01"
        )
        loggers.log_config(CONFIG)
        for step, metrics in STEPS:
            loggers.log_metrics(metrics, step=step)
        loggers.close()
        loggers.close()  # a second close is a no-op
    return run_dir


def test_csv_is_a_flat_table_with_late_keys(all_backends_run):
    table = pd.read_csv(all_backends_run / "metrics.csv")
    assert list(table.columns) == [
        "step",
        "loss",
        "loss/z_loss",
        "lr",
        "grad_norm",
        "val_loss",
        "val_acc",
    ]
    assert table["step"].tolist() == [step for step, _ in STEPS]
    assert table["loss"].iloc[:3].tolist() == [2.0, 1.5, 1.0]
    assert table["loss/z_loss"].iloc[:3].tolist() == [0.01, 0.02, 0.03]
    assert math.isnan(table["loss"].iloc[3])  # the eval row logged no loss
    assert table["val_acc"].iloc[:3].isna().all()  # train rows padded when val_acc appeared
    assert table["val_acc"].iloc[3] == 0.875


def test_csv_appends_on_resume_and_keeps_non_finite(tmp_path):
    path = tmp_path / "metrics.csv"
    first = CsvLogger(tmp_path)
    first.log_metrics({"loss": 1.0}, step=1)
    first.close()
    resumed = CsvLogger(tmp_path)
    resumed.log_metrics({"loss": float("nan"), "lr": float("inf")}, step=2)
    resumed.close()
    resumed.close()
    table = pd.read_csv(path)
    assert table["step"].tolist() == [1, 2]
    assert table["loss"].iloc[0] == 1.0 and math.isnan(table["loss"].iloc[1])
    assert math.isnan(table["lr"].iloc[0]) and table["lr"].iloc[1] == math.inf


def test_tensorboard_event_files_hold_scalars_and_config(all_backends_run):
    events = EventAccumulator(str(all_backends_run / "tensorboard"))
    events.Reload()
    for key in ("loss", "loss/z_loss", "lr", "val_acc"):
        logged = [(event.step, event.value) for event in events.Scalars(key)]
        _assert_logged(logged, key)
    (text_event,) = events.Tensors("config/text_summary")
    text = text_event.tensor_proto.string_val[0].decode()
    assert "hidden_dims" in text and "0.003" in text
    assert FAKE_API_KEY not in text and "hf_abcdefghijklmnop" not in text


def _wandb_records(run_dir: Path) -> list[dict]:
    run_file, records = read_wandb_records(run_dir)
    assert run_file.name == "run-kilntest01.wandb"  # the resume id became the run id
    return records


def test_wandb_offline_run_holds_history_and_config(all_backends_run):
    records = _wandb_records(all_backends_run)
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["display_name"] == "test-run" and run["project"] == "kiln"
    history = [r["history"] for r in records if r["type"] == "history"]
    for key in ("loss", "loss/z_loss", "val_acc"):
        logged = [(h["step"]["num"], h["item"][key]) for h in history if key in h["item"]]
        _assert_logged(logged, key)
    config = {}
    for record in records:
        if record["type"] == "config":
            config.update(record["config"].get("update", {}))
    assert config["model"] == CONFIG["model"] and config["optimizer"] == CONFIG["optimizer"]
    assert config["extra"] == {"note": "token is [redacted]", "hf_token": "[redacted]"}
    assert records[-1]["type"] == "exit" and records[-1]["exit"]["exit_code"] == 0


def test_wandb_api_key_never_written(all_backends_run):
    files = [path for path in all_backends_run.parent.rglob("*") if path.is_file()]
    assert any(path.suffix == ".wandb" for path in files)
    leaked = [path for path in files if FAKE_API_KEY.encode() in path.read_bytes()]
    assert leaked == []


def test_wandb_online_without_key_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ValueError, match="WANDB_API_KEY"):
        build_loggers(["csv", "wandb"], tmp_path, run_name="x", wandb_mode="online")
    assert not (tmp_path / "metrics.csv").exists()  # refused before anything was written


def test_unknown_backend_and_mode_are_refused(tmp_path):
    with pytest.raises(ValueError, match="choose from: csv, tensorboard, wandb"):
        build_loggers(["csv", "mlflow"], tmp_path, run_name="x")
    with pytest.raises(ValueError, match="offline, online"):
        build_loggers(["wandb"], tmp_path, run_name="x", wandb_mode="sometimes")


class _BrokenBackend:
    """Stands in for a backend whose disk filled up: every call raises."""

    def __init__(self):
        self.close_calls = 0

    def log_config(self, config):
        raise OSError("disk full")

    def log_metrics(self, metrics, step):
        raise OSError("disk full")

    def close(self):
        self.close_calls += 1
        raise OSError("disk full")


def test_multilogger_drops_a_failing_backend_and_closes_safely(tmp_path, caplog):
    broken = _BrokenBackend()
    loggers = MultiLogger({"broken": broken, "csv": CsvLogger(tmp_path)})
    loggers.log_metrics({"loss": 1.0}, step=1)
    loggers.log_metrics({"loss": 0.5}, step=2)
    loggers.close()
    loggers.close()
    assert list(loggers.backends) == []
    assert broken.close_calls == 1  # closed once, when it was dropped
    assert "'broken' failed in log_metrics" in caplog.text
    assert pd.read_csv(tmp_path / "metrics.csv")["loss"].tolist() == [1.0, 0.5]


def test_no_backends_is_a_valid_logger(tmp_path):
    loggers = build_loggers([], tmp_path, run_name="x")
    loggers.log_config(CONFIG)
    loggers.log_metrics({"loss": 1.0}, step=1)
    loggers.close()
    assert list(tmp_path.iterdir()) == []


def test_jsonl_lines_are_strict_json_with_non_finite_as_strings(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonlWriter(path) as writer:
        writer.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf")})
        writer.write({"step": 2, "loss": np.float32(0.5), "lr": torch.tensor(1e-3).item()})
    with JsonlWriter(path) as writer:  # a resumed run appends
        writer.write({"step": 3, "loss": torch.tensor(0.25), "min": float("-inf")})

    def refuse_bare_constants(name):
        raise AssertionError(f"bare {name} in metrics.jsonl")

    lines = path.read_text().splitlines()
    parsed = [json.loads(line, parse_constant=refuse_bare_constants) for line in lines]
    assert parsed[0] == {"step": 1, "loss": "NaN", "grad_norm": "Infinity"}
    assert parsed[1] == {"step": 2, "loss": 0.5, "lr": pytest.approx(1e-3)}
    assert parsed[2] == {"step": 3, "loss": 0.25, "min": "-Infinity"}
    restored = read_jsonl(path)
    assert math.isnan(restored[0]["loss"]) and restored[2]["min"] == -math.inf


def test_redact_returns_plain_containers_from_omegaconf():
    from omegaconf import OmegaConf

    config = OmegaConf.create({"lr": 0.1, "dims": [1, 2], "extra": {"token": "x", "n": "${lr}"}})
    redacted = redact(config, secrets=[])
    assert redacted == {"lr": 0.1, "dims": [1, 2], "extra": {"token": "[redacted]", "n": 0.1}}
    assert type(redacted) is dict and type(redacted["dims"]) is list


def test_redact_keeps_ordinary_keys():
    config = {"data": {"tokenizer": "wordpiece", "max_tokens": 64}, "wandb_api_key": "abc"}
    assert redact(config, secrets=[]) == {
        "data": {"tokenizer": "wordpiece", "max_tokens": 64},
        "wandb_api_key": "[redacted]",
    }


def test_the_step_logs_rate_keeps_two_digits_below_ten_per_second():
    """A torchvision detector on a CPU trains at 0.4 images/s: the step log said '0 samples/s'."""
    from kiln.engine.metrics import rate_text

    assert [rate_text(r) for r in (0.4213, 0.0042, 3.71, 12.6, 18432.4)] == [
        "0.42",
        "0.0042",
        "3.7",
        "13",
        "18432",
    ]
