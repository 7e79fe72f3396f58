"""scripts/bench_image_folder.py runs end to end on a tiny setting. Speed is reported, never
asserted; the test checks that the table and the JSON are complete and self-consistent."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from .bench_tables import markdown_tables, number
from .conftest import SUBPROCESS_ENV

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_image_folder.py"


@pytest.mark.slow  # 8 s: the whole script
def test_bench_image_folder_reports_both_pipelines_and_their_ratio(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--images", "16", "--rounds", "2", "--batch-size", "8"]
        + ["--workers", "0", "--image-size", "32", "--workdir", str(tmp_path), "--out", str(out)]
        + ["--markdown"],
        cwd=REPO,
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["images"] == 16 and result["rounds"] == 2
    kiln, base = result["kiln_images_per_s"], result["torchvision_images_per_s"]
    assert len(kiln) == len(base) == len(result["ratios"]) == 2
    for ratio, k, b in zip(result["ratios"], kiln, base, strict=True):
        assert k > 0 and b > 0 and math.isclose(ratio, k / b, rel_tol=1e-9)
    assert math.isclose(result["median_ratio"], statistics.median(result["ratios"]))
    assert result["spread"] == [min(result["ratios"]), max(result["ratios"])]
    assert result["meets_floor"] == (result["median_ratio"] >= result["floor"] == 0.95)
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("floor 0.95: ")
    # --markdown: the table as docs/benchmarks.md holds it, its numbers the JSON's
    ((header, rows),) = markdown_tables(done.stdout)
    assert header == ["pipeline", "images/s (median)", "min", "max"]
    by = {row["pipeline"]: [number(row[c]) for c in header[1:]] for row in rows}
    assert list(by) == ["kiln image_folder", "torchvision ImageFolder", "ratio kiln / torchvision"]
    for name, rates in (("kiln image_folder", kiln), ("torchvision ImageFolder", base)):
        expected = [statistics.median(rates), min(rates), max(rates)]
        assert by[name] == pytest.approx(expected, abs=0.5)
    ratio = [result["median_ratio"], *result["spread"]]
    assert by["ratio kiln / torchvision"] == pytest.approx(ratio, abs=0.005)
    assert "[bench_image_folder] round 2:" in done.stderr  # progress while it runs
