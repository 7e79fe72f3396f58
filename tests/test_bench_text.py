"""scripts/bench_text.py runs end to end on a small CSV of its user's own (other column names).
Speed is reported, never asserted; the test checks the report is complete and self-consistent."""

from __future__ import annotations

import csv
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
        [sys.executable, str(SCRIPT), "--csv", str(path), "--epochs", "1", "--seeds", "2"]
        + ["--workdir", str(tmp_path / "work"), "--out", str(out)]
        + ["data.text_column=body", "data.label_column=topic", "data.batch_size=16"],
        cwd=REPO,
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=300,
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
    assert set(result["quality"]) == {"text_bow", "text_transformer", "tfidf_logreg"}
    for row in result["quality"].values():
        assert 0 <= row["val_acc"] <= 1 and row["wall_s"] > 0
    bow = result["quality"]["text_bow"]
    assert bow["samples_per_s"] > 0 and len(bow["val_acc_runs"]) == 2
    assert math.isclose(bow["val_acc"], sum(bow["val_acc_runs"]) / 2)
    floors = result["floors"]
    assert floors["bucketed padding < 10%"][1] == (pad["bucketed"] < 0.10)
    assert "| bucketed by length |" in done.stdout and "| tfidf_logreg |" in done.stdout
    assert "[bench_text] training text_bow" in done.stderr  # progress while it runs
