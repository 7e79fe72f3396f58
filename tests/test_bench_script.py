"""scripts/bench_engine.py runs end to end on a tiny config. Speed is reported, never asserted."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from .bench_tables import markdown_tables, number
from .conftest import run_python

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_engine.py"
TINY = ["--model", "mlp", "--image-size", "8", "--batch-size", "16", "--steps", "7"]


def run_bench(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    proc = run_python(
        [sys.executable, str(SCRIPT), *TINY, "--warmup", "1", "--threads", "1"]
        + ["--out", str(out), *extra],
        REPO,
    )
    return proc, json.loads(out.read_text()) if out.is_file() else {}


def test_bench_reports_paired_ratios_their_median_and_interval(tmp_path):
    # --check with a free budget passes; an extra Hydra override passes through to the config.
    proc, result = run_bench(tmp_path, "--check", "--threshold", "0", "--markdown", "optimizer=sgd")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (r,) = result["comparisons"]
    ratios = r["paired_ratios"]
    assert len(ratios) == 7 and all(x > 0 for x in ratios)
    assert r["ratio_median"] == pytest.approx(statistics.median(ratios))
    low, high = r["ratio_ci95"]
    assert min(ratios) <= low <= r["ratio_median"] <= high <= max(ratios)
    assert r["verdict"] == "within budget" and r["within_budget"]
    assert (r["model"], r["image_size"], r["steps"]) == ("mlp", 8, 7)
    assert (r["batch_size"], r["optimizer"], r["torch_threads"]) == (16, "sgd", 1)
    assert "eager: 7/7 step pairs" in proc.stdout  # progress while it runs
    # --markdown: the table as docs/benchmarks.md holds it, its numbers the JSON's
    ((header, rows),) = markdown_tables(proc.stdout)
    assert header == [
        "mode",
        "engine samples/s",
        "baseline samples/s",
        "ratio (median)",
        "95% CI low",
        "95% CI high",
        "verdict",
    ]
    (row,) = rows
    assert row["mode"] == "eager" and row["verdict"] == "within budget"
    assert number(row["ratio (median)"]) == pytest.approx(r["ratio_median"], abs=5e-4)
    assert [number(row["95% CI low"]), number(row["95% CI high"])] == pytest.approx(
        [low, high], abs=5e-4
    )
    assert number(row["engine samples/s"]) == pytest.approx(r["engine_samples_per_s"], abs=0.05)
    assert number(row["baseline samples/s"]) > 0


def test_check_fails_an_impossible_budget_and_a_straddling_interval_is_inconclusive(tmp_path):
    proc, result = run_bench(tmp_path, "--check", "--threshold", "1e9")
    assert proc.returncode == 1, proc.stderr
    assert result["comparisons"][0]["verdict"] == "over budget" and "over budget" in proc.stdout
    sys.path.insert(0, str(SCRIPT.parent))
    from bench_engine import median_ci, verdict

    median, low, high = median_ci([0.9, 0.95, 1.0, 1.05, 1.1, 0.92, 1.08, 0.99])
    assert low < 0.97 < high and verdict(low, high, 0.97).startswith("inconclusive")
