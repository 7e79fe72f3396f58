"""scripts/bench_detection.py runs end to end on a tiny setting: kiln and torchvision's reference
loop agree on every loss term at step 1 (same weights, batch and seed), and the table and the JSON
are complete. Speed is reported, never asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import SUBPROCESS_ENV

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_detection.py"


@pytest.mark.slow  # about 45 s on two busy CPU cores: a Faster R-CNN trained a few steps twice
def test_bench_detection_matches_step1_losses_and_reports_the_ratio(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--image-size", "64", "--images", "4", "--batch-size", "2"]
        + ["--val-images", "3"]
        + ["--rounds", "1", "--steps", "1", "--workdir", str(tmp_path), "--out", str(out)]
        + ["--markdown"],
        cwd=REPO,
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["step1_losses_agree"]
    assert set(result["step1_losses"]) == {
        "loss_classifier",
        "loss_box_reg",
        "loss_objectness",
        "loss_rpn_box_reg",
    }
    (ratio,) = result["ratios"]
    (kiln,), (reference,) = result["kiln_images_per_s"], result["reference_images_per_s"]
    assert math.isclose(ratio, kiln / reference, rel_tol=1e-9)
    assert result["meets_floor"] == (ratio >= result["floor"] == 1.0)
    assert "| ratio kiln / reference |" in done.stdout
    # both networks evaluated after the round, the same way (torchmetrics' mAP)
    assert result["steps_after_round"] == [3] and result["val_images"] == 3
    for side in ("kiln_map", "reference_map"):
        ((scores,),) = [result[side]]
        assert set(scores) == {"map", "map_50"} and all(0 <= v <= 1 for v in scores.values())
    assert "| after step | kiln mAP@.5 | reference mAP@.5 | kiln mAP | reference mAP |" in (
        done.stdout
    )
    assert "*Recorded " in done.stdout and ", commit " in done.stdout  # --markdown's stamp
    assert "[bench_detection] round 1:" in done.stderr
