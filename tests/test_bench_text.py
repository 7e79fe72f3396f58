"""scripts/bench_text.py runs end to end on a small CSV of its user's own (other column names).
Speed is reported, never asserted; the test checks the report is complete and self-consistent."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.data.text_corpus import ticket_rows

from .conftest import SUBPROCESS_ENV

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_text.py"


@pytest.mark.slow  # 44 s: the whole script on a small CSV; make bench runs it for real
@pytest.mark.timeout(900)
def test_bench_text_reports_every_section_on_a_given_csv(tmp_path):
    path = tmp_path / "mine.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "body", "topic"])
        writer.writerows((i, text, label) for i, (text, label) in enumerate(ticket_rows(240)))
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--csv", str(path), "--epochs", "1", "--repeats", "1"]
        + ["--contention", "1", "--workdir", str(tmp_path / "work"), "--out", str(out)]
        + ["--no-hf-trainer"]  # its own test below
        + ["data.text_column=body", "data.label_column=topic", "data.batch_size=16"],
        cwd=REPO,
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    data = result["data_path"]
    assert data["rows"] == 240 and data["identical_ids"] is True
    assert math.isclose(
        data["rust_over_python"], data["rust_rows_per_s"] / data["python_rows_per_s"], rel_tol=1e-9
    )
    pad = result["padding"]
    assert 0 <= pad["bucketed"] <= pad["dynamic"] <= pad["pad_to_max"] < 1
    # The side-by-side table: the same split files, each tool a timed fresh process, quiet and
    # beside one busy process in each round, no tool's threads pinned.
    side = result["side_by_side"]
    assert side["val_rows"] == 48 and side["repeats"] == 1 and side["contention"] == 1
    assert side["threads"] == 0 and "corpora" not in result  # --csv: that file only
    expected = {"kiln text_bow", "TF-IDF + LinearSVC"}
    if importlib.util.find_spec("fasttext") is not None:
        expected.add("fastText")
    else:
        missing = "fastText is not installed (pip install fasttext-wheel, or --fasttext venv)"
        assert missing in done.stderr
    assert set(side["tools"]) == expected
    for row in side["tools"].values():
        for suffix in ("", "_loaded"):
            runs = [row[f"{key}_runs{suffix}"] for key in ("val_acc", "val_macro_f1", "wall_s")]
            assert [len(r) for r in runs] == [1, 1, 1]
            assert 0 <= row[f"val_acc{suffix}"] <= 1 and 0 <= row[f"val_macro_f1{suffix}"] <= 1
            assert row[f"wall_s{suffix}"] == row[f"wall_s_runs{suffix}"][0] > 0
            # CPU s of the command's processes: at least the interpreter's start-up, each run
            assert min(row[f"cpu_s_runs{suffix}"]) > 0.05
        # The slowdown: each round's loaded run over its quiet run.
        assert row["slowdown_rounds"] == [
            loaded / quiet
            for loaded, quiet in zip(row["wall_s_runs_loaded"], row["wall_s_runs"], strict=True)
        ]
    svc = side["tools"]["TF-IDF + LinearSVC"]
    assert math.isclose(svc["over_svc"], 1.0) and svc["over_svc_rounds"] == [1.0]
    kiln = side["tools"]["kiln text_bow"]
    assert math.isclose(kiln["over_svc"], kiln["wall_s"] / svc["wall_s"])
    assert kiln["over_svc_rounds"] == [
        k / b for k, b in zip(kiln["wall_s_runs"], svc["wall_s_runs"], strict=True)
    ]
    assert kiln["best_epoch"] == [1] and kiln["threads"] == [1]  # --epochs 1; a small step
    split = [tmp_path / "work" / name for name in ("split-train.csv", "split-val.csv")]
    assert [sum(1 for _ in csv.reader(p.open())) - 1 for p in split] == [192, 48]
    transformer = side["transformer"]
    assert 0 <= transformer["val_acc"] <= 1 and transformer["wall_s"] > 0
    floors = result["floors"]
    assert floors["bucketed padding < 10%"][1] == (pad["bucketed"] < 0.10)
    title = "mine.csv: text_bow"
    assert floors[f"{title} wall <= TF-IDF + LinearSVC, quiet"][1] == (
        kiln["wall_s"] <= svc["wall_s"]
    )
    assert floors[f"{title} accuracy >= TF-IDF + LinearSVC"][1] == (
        kiln["val_acc"] >= svc["val_acc"]
    )
    assert floors[f"{title} slowdown <= TF-IDF + LinearSVC's"][1] == (
        kiln["slowdown"] <= svc["slowdown"]
    )
    assert floors[f"{title} beside 1 busy process <= 1.5x its quiet wall"][1] == (
        kiln["slowdown"] <= 1.5
    )
    assert "| TF-IDF (word 1-2 + char 2-5 grams" in done.stdout and "beside 1 busy" in done.stdout
    assert "| bucketed by length |" in done.stdout
    assert "[bench_text] kiln text_bow: run 1 of 1" in done.stderr  # progress while it runs
    assert "run 1 of 1 beside 1 busy process(es)" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_text_sets_kiln_model_hf_beside_hugging_faces_trainer(tmp_path):
    """The Trainer section alone: both sides on the same split files with the same settings,
    one thread each; the table has both rows, both accuracies and the ratio, and the floors
    say what was measured."""
    path = tmp_path / "mine.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "body", "topic"])
        writer.writerows((i, text, label) for i, (text, label) in enumerate(ticket_rows(200)))
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--csv", str(path), "--skip-models", "--hf-trainer"]
        + ["--hf-steps", "6", "--hf-rounds", "1", "--hf-batch-size", "16", "--no-hf-warmup"]
        + ["--workdir", str(tmp_path / "work"), "--out", str(out)]
        + ["data.text_column=body", "data.label_column=topic"],
        cwd=REPO,
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert "side_by_side" not in result  # --skip-models: the Trainer section only
    hf = result["hf_trainer"]
    assert (hf["train_rows"], hf["val_rows"], hf["steps"], hf["batch_size"]) == (160, 40, 6, 16)
    kiln, trainer = hf["sides"]["kiln model=hf"], hf["sides"]["transformers Trainer"]
    for side in (kiln, trainer):
        assert side["steps_runs"] == [6] and side["threads_runs"] == [1]
        assert side["samples_per_s"] == side["samples_per_s_runs"][0] > 0
        assert 0 <= side["val_acc"] <= 1 and side["wall_s"] > side["train_time_s"] > 0
    assert trainer["samples_runs"] == [6 * 16] and trainer["val_rows_runs"] == [40]
    assert hf["ratio_rounds"] == [kiln["samples_per_s"] / trainer["samples_per_s"]]
    floors = result["floors"]
    assert floors["kiln model=hf training samples/s >= the Trainer's (1.0x)"][1] == (
        hf["ratio"] >= 1.0
    )
    assert floors["kiln model=hf val_acc = the Trainer's within noise"][1] == (
        abs(kiln["val_acc"] - trainer["val_acc"]) <= hf["accuracy_noise"]
    )
    assert "| kiln (`train.py ... model=hf`, trainer.threads=1) |" in done.stdout
    assert "| transformers `Trainer` (scripts/hf_trainer_side.py) |" in done.stdout
    assert "| kiln / Trainer, per round: median (min-max) |" in done.stdout
    assert "[bench_text] transformers Trainer: round 1 of 1, 6 steps" in done.stderr
