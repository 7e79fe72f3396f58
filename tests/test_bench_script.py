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
    proc, result = run_bench(tmp_path, "optimizer=sgd")  # an extra Hydra override passes through
    engine, baseline = result["engine_samples_per_s"], result["baseline_samples_per_s"]
    assert engine > 0 and baseline > 0
    assert math.isclose(result["ratio"], engine / baseline, rel_tol=1e-12)
    assert result["threshold"] == 0.97
    assert result["within_budget"] == (result["ratio"] >= 0.97)
    # both orders: each side timed twice per repeat
    assert len(result["engine_runs"]) == len(result["baseline_runs"]) == 2
    assert (result["model"], result["image_size"], result["steps"]) == ("mlp", 8, 3)
    assert (result["batch_size"], result["optimizer"], result["torch_threads"]) == (16, "sgd", 1)
    assert "engine samples/s" in proc.stdout and "ratio engine/baseline" in proc.stdout
