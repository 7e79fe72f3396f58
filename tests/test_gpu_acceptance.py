"""scripts/gpu_acceptance.py on a machine without CUDA: the rows that can run on a CPU run for
real, the CUDA-only rows say skipped, and the exit code is 0. (On a GPU it is run by hand.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kiln.cli.paths import REPO_ROOT

from .conftest import SUBPROCESS_ENV

CPU_ROWS = {"bf16", "channels_last"}
CUDA_ONLY = {
    "fp16 + GradScaler (provoked skip)",
    "pin_memory + non_blocking",
    "provoked OOM",
    "no host sync between log lines",
    "DDP over nccl (1 rank)",
}


def acceptance(tmp_path, *args):
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "gpu_acceptance.py"),
            "--quick",
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=1200,
    )
    return result, {row["name"]: row for row in json.loads(out.read_text())}


@pytest.mark.slow  # 26 s: each CPU row of the GPU machine's script
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine every row runs")
def test_cpu_rows_run_and_cuda_rows_are_skipped(tmp_path):
    result, rows = acceptance(tmp_path, "--only", *CPU_ROWS, *CUDA_ONLY)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in CPU_ROWS:
        assert rows[name]["status"] == "ok" and "samples/s on cpu" in rows[name]["figure"]
    for name in CUDA_ONLY:
        assert rows[name] == {
            "name": name,
            "status": "skipped",
            "figure": "",
            "detail": "no CUDA device",
        }
    assert "| bf16" in result.stdout  # the table


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_row_the_machine_can_run(tmp_path):
    result, rows = acceptance(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert rows["torch.compile"]["status"] == "ok"
