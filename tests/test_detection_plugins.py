"""The docs' detection plugins (examples/detection_plugin: a dataset of boxes in a CSV file and a
small detector declaring the detection contract) train through train.py with every check before
step 1, and the detector exports to ONNX, checked box by box against torch. Run in a copy of the
example folder, as a user's own project, so the repo's tree gets no run folders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kiln.cli.paths import REPO_ROOT

from .conftest import SUBPROCESS_ENV

EXAMPLE = REPO_ROOT / "examples" / "detection_plugin"
IMAGES = REPO_ROOT / "examples" / "detection" / "coco" / "images" / "train"


@pytest.mark.slow  # two subprocesses (train.py with its checks, infer.py export): about 60 s
def test_the_docs_dataset_and_detector_plugins_train_check_and_export(tmp_path):
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("outputs", "__pycache__"))
    train = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        "plugins=[box_csv,tiny_detector]",
        "data=box_csv",
        "model=tiny_detector",
        f"data.images={IMAGES}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_steps=3",
        "env.progress_bar=false",
        "hydra.run.dir=run",
    ]
    done = subprocess.run(
        train, cwd=project, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "[FAIL]" not in done.stdout + done.stderr  # the checks before step 1 passed
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and "val_map" in summary
    report = json.loads((project / "run" / "data_report.json").read_text())
    assert report["classes"] == ["flower", "portrait"]
    assert report["train_files"]["annotations"]["annotations_read"] == 22
    export = [
        sys.executable,
        str(REPO_ROOT / "infer.py"),
        "mode=export",
        f"ckpt={project / 'run' / 'checkpoints' / 'best.pt'}",
        "plugins=[box_csv,tiny_detector]",
    ]
    done = subprocess.run(
        export, cwd=project, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "parity, all images: " in done.stdout + done.stderr
    assert "min IoU 1.0000" in done.stdout + done.stderr
