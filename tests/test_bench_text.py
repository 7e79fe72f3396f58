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

from kiln.data.text_corpus import ticket_rows

from .conftest import SUBPROCESS_ENV

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_text.py"


def test_bench_text_reports_every_section_on_a_given_csv(tmp_path):
    path = tmp_path / "mine.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "body", "topic"])
        writer.writerows((i, text, label) for i, (text, label) in enumerate(ticket_rows(240)))
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--csv", str(path), "--epochs", "1", "--repeats", "2"]
        + ["--workdir", str(tmp_path / "work"), "--out", str(out)]
        + ["data.text_column=body", "data.label_column=topic", "data.batch_size=16"],
        cwd=REPO,
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=600,
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
    # The side-by-side table: the same split files, each tool a timed fresh process.
    side = result["side_by_side"]
    assert side["val_rows"] == 48 and side["repeats"] == 2
    expected = {"kiln text_bow", "TF-IDF + LinearSVC"}
    if importlib.util.find_spec("fasttext") is not None:
        expected.add("fastText")
    else:
        missing = "fastText is not installed (pip install fasttext-wheel, or --fasttext venv)"
        assert missing in done.stderr
    assert set(side["tools"]) == expected
    for row in side["tools"].values():
        assert len(row["val_acc_runs"]) == len(row["wall_s_runs"]) == len(row["cpu_s_runs"]) == 2
        assert 0 <= row["val_acc"] <= 1 and row["wall_s"] > 0
        # CPU s of the command's processes: at least the interpreter's start-up, each run
        assert min(row["cpu_s_runs"]) > 0.05 and row["cpu_s"] == sum(row["cpu_s_runs"]) / 2
        assert (
            row["wall_s"]
            == sorted(row["wall_s_runs"])[0]
            + (sorted(row["wall_s_runs"])[1] - sorted(row["wall_s_runs"])[0]) / 2
        )  # the median of two
    svc = side["tools"]["TF-IDF + LinearSVC"]
    assert math.isclose(svc["over_svc"], 1.0)
    kiln = side["tools"]["kiln text_bow"]
    assert math.isclose(kiln["over_svc"], kiln["wall_s"] / svc["wall_s"])
    assert svc["over_svc_rounds"] == [1.0, 1.0]
    assert kiln["over_svc_rounds"] == [
        k / b for k, b in zip(kiln["wall_s_runs"], svc["wall_s_runs"], strict=True)
    ]
    split = [tmp_path / "work" / name for name in ("split-train.csv", "split-val.csv")]
    assert [sum(1 for _ in csv.reader(p.open())) - 1 for p in split] == [192, 48]
    assert result["transformer"]["val_acc"] >= 0 and result["transformer"]["samples_per_s"] > 0
    floors = result["floors"]
    assert floors["bucketed padding < 10%"][1] == (pad["bucketed"] < 0.10)
    assert floors["text_bow wall < TF-IDF + LinearSVC"][1] == (kiln["wall_s"] < svc["wall_s"])
    assert "| bucketed by length |" in done.stdout and "| TF-IDF + LinearSVC |" in done.stdout
    assert "[bench_text] kiln text_bow: run 1 of 2" in done.stderr  # progress while it runs
