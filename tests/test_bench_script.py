"""scripts/bench_engine.py runs end to end on a tiny config. Speed is reported, never asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_engine.py"
TINY = ["--model", "mlp", "--image-size", "8", "--batch-size", "16", "--steps", "3"]


def run_bench(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--warmup", "1", "--repeats", "1", "--threads", "1"]
        + ["--out", str(out), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_bench_reports_both_throughputs_and_their_ratio(tmp_path):
    # --check with a free budget passes; an extra Hydra override passes through to the config.
    proc, result = run_bench(tmp_path, "--check", "--threshold", "0", "optimizer=sgd")
    engine, baseline = result["engine_samples_per_s"], result["baseline_samples_per_s"]
    assert engine > 0 and baseline > 0
    assert math.isclose(result["ratio"], engine / baseline, rel_tol=1e-12)
    assert result["within_budget"] == (result["ratio"] >= result["threshold"])
    # both orders: each side timed twice per repeat
    assert len(result["engine_runs"]) == len(result["baseline_runs"]) == 2
    assert (result["model"], result["image_size"], result["steps"]) == ("mlp", 8, 3)
    assert (result["batch_size"], result["optimizer"], result["torch_threads"]) == (16, "sgd", 1)
    assert "engine samples/s" in proc.stdout and "ratio engine/baseline" in proc.stdout


def test_check_fails_an_impossible_budget(tmp_path):
    """--check is what a gate would use: it must fail when the ratio is below the threshold."""
    common = [sys.executable, str(SCRIPT), *TINY, "--warmup", "0", "--repeats", "1", "--check"]
    impossible = subprocess.run(
        [*common, "--threshold", "1e9"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert impossible.returncode == 1, impossible.stderr
    assert "NO" in impossible.stdout
