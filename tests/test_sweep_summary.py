"""scripts/summarize_sweep.py and kiln.logging.sweep_summary on a hand-made Hydra multirun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import yaml

from kiln.logging.sweep_summary import METRIC_COLUMNS, collect_runs, write_summary

REPO = Path(__file__).resolve().parents[1]


def _make_run(sweep: Path, name: str, overrides: list[str], summary: dict | None) -> None:
    hydra_dir = sweep / name / ".hydra"
    hydra_dir.mkdir(parents=True)
    (hydra_dir / "config.yaml").write_text("seed: 42\n")
    (hydra_dir / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if summary is not None:
        (sweep / name / "summary.json").write_text(json.dumps(summary))


def _ok(val_acc: float, samples_per_s: float, data_time_frac: float) -> dict:
    return {
        "status": "ok",
        "val_acc": val_acc,
        "val_loss": 0.3,
        "steps": 120,
        "samples_per_s": samples_per_s,
        "data_time_frac": data_time_frac,
        "error": None,
    }


@pytest.fixture
def sweep(tmp_path) -> Path:
    """Four runs as Hydra lays them out; trainer.max_epochs=1 was passed to all (not swept)."""
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")  # the sweep's own file: not a run
    common = ["trainer.max_epochs=1"]
    _make_run(tmp_path, "0", ["data.num_workers=0", "precision=fp32", *common], _ok(0.9, 1500, 0.4))
    _make_run(
        tmp_path, "1", ["data.num_workers=2", "precision=fp32", *common], _ok(0.91, 2500, 0.1)
    )
    failed = {"status": "failed", "steps": 5, "error": "loss NaN @ step 5"}
    _make_run(tmp_path, "2", ["data.num_workers=0", "precision=amp", *common], failed)
    _make_run(tmp_path, "10", ["data.num_workers=2", "precision=amp", *common], None)  # crashed
    return tmp_path


def test_collect_runs_one_row_per_run_with_swept_columns(sweep):
    runs = collect_runs(sweep)
    assert list(runs.columns) == ["run", "data.num_workers", "precision", *METRIC_COLUMNS]
    assert runs["run"].tolist() == ["0", "1", "2", "10"]  # natural order
    assert runs["data.num_workers"].tolist() == ["0", "2", "0", "2"]
    assert runs["precision"].tolist() == ["fp32", "fp32", "amp", "amp"]
    assert runs["status"].tolist() == ["ok", "ok", "failed", "failed"]
    assert runs["error"].tolist()[2:] == ["loss NaN @ step 5", "no summary.json"]
    assert runs["samples_per_s"].tolist()[:2] == [1500, 2500]
    assert runs["val_acc"].iloc[:2].tolist() == [0.9, 0.91]
    assert runs["val_acc"].iloc[2:].isna().all()


def test_write_summary_markdown_and_png(sweep):
    markdown_path, png_path = write_summary(collect_runs(sweep), sweep)
    lines = markdown_path.read_text().splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == (
        "| run | data.num_workers | precision | status | val_acc | val_loss | steps "
        "| samples_per_s | data_time_frac | error |"
    )
    assert table[2] == "| 0 | 0 | fp32 | ok | 0.9 | 0.3 | 120 | 1500 | 0.4 |  |"
    assert table[4] == "| 2 | 0 | amp | failed |  |  | 5 |  |  | loss NaN @ step 5 |"
    assert table[5].endswith("| failed |  |  |  |  |  | no summary.json |")
    assert any(line.startswith("4 runs, 2 failed. Best val_acc") for line in lines)

    image = matplotlib.image.imread(png_path)  # raises unless it is a readable PNG
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300


def test_script_prints_the_table(sweep):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "MPLBACKEND": "Agg"}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "summarize_sweep.py"), str(sweep)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert "| 1 | 2 | fp32 | ok | 0.91 |" in result.stdout
    assert "no summary.json" in result.stdout
    assert (sweep / "summary.md").is_file() and (sweep / "summary.png").is_file()


def test_empty_directory_is_reported(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "summarize_sweep.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        timeout=60,
    )
    assert result.returncode == 1 and "no runs under" in result.stdout
