"""kiln.doctor: the CUDA and lock-drift reasoning on machines we describe, then the real command."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.doctor import (
    diagnose_cuda,
    find_drift,
    format_cudnn_version,
    min_driver_for_cuda,
    parse_lock,
    parse_nvidia_smi,
)

REPO = Path(__file__).resolve().parents[1]
H100_NEW_DRIVER = "NVIDIA H100 80GB HBM3, 580.82.07, 81559 MiB\n" * 2
A100_OLD_DRIVER = "NVIDIA A100-SXM4-40GB, 535.104.05, 40960 MiB\n"
SMI_NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)


def test_parse_nvidia_smi_rows_and_errors():
    gpus = parse_nvidia_smi(H100_NEW_DRIVER + "NVIDIA RTX A6000, Ada, 550.54.15, 49140 MiB\n")
    assert [gpu.driver_version for gpu in gpus] == ["580.82.07", "580.82.07", "550.54.15"]
    assert gpus[0].name == "NVIDIA H100 80GB HBM3" and gpus[0].memory_total == "81559 MiB"
    assert gpus[2].name == "NVIDIA RTX A6000, Ada"  # a comma in the name is kept
    assert parse_nvidia_smi(SMI_NO_DRIVER) == []


@pytest.mark.parametrize(
    ("cuda_version", "driver"),
    [("11.8", "450.80.02"), ("12.1", "525.60.13"), ("12.8", "525.60.13"), ("13.0", "580.65.06")],
)
def test_min_driver_per_cuda_major(cuda_version, driver):
    assert min_driver_for_cuda(cuda_version) == driver


@pytest.mark.parametrize(
    ("torch_cuda", "available", "smi", "visible", "consistent", "verdict", "words"),
    [
        ("13.0", True, H100_NEW_DRIVER, None, True, "CUDA usable", "CUDA 13.0"),
        (None, False, None, None, True, "CPU only", "CPU-only build"),
        ("13.0", False, None, None, True, "CPU only", "no NVIDIA driver"),
        (None, False, H100_NEW_DRIVER, None, False, "CPU-only torch on a GPU machine", "2 GPU"),
        ("13.0", False, A100_OLD_DRIVER, None, False, "driver too old", "535.104.05 is older"),
        ("12.4", False, A100_OLD_DRIVER, None, False, "CUDA unavailable", "cannot use them"),
        ("13.0", False, SMI_NO_DRIVER, None, False, "driver not working", "couldn't communicate"),
        ("13.0", False, H100_NEW_DRIVER, "", True, "CPU only (GPUs hidden)", "hides the 2"),
        ("13.0", False, H100_NEW_DRIVER, "0", False, "CUDA unavailable", "container runtime"),
    ],
)
def test_diagnose_cuda(torch_cuda, available, smi, visible, consistent, verdict, words):
    diagnosis = diagnose_cuda(torch_cuda, available, smi, visible)
    assert (diagnosis.consistent, diagnosis.verdict) == (consistent, verdict)
    assert words in diagnosis.reason


def test_driver_check_compares_numerically_not_as_text():
    # "1000.1" < "580.65.06" as text; numerically it is far newer.
    smi = "Future GPU, 1000.1, 1 MiB\n"
    assert diagnose_cuda("13.0", False, smi).verdict == "CUDA unavailable"
    assert diagnose_cuda("13.0", False, "Old GPU, 580.65.05, 1 MiB").verdict == "driver too old"


@pytest.mark.parametrize(
    ("encoded", "text"), [(92400, "9.24.0"), (90100, "9.1.0"), (8907, "8.9.7"), (None, "none")]
)
def test_format_cudnn_version(encoded, text):
    assert format_cudnn_version(encoded) == text


LOCK = """\
#    pip-compile --output-file=requirements.lock requirements.in
Torch==2.14.1
    # via -r requirements.in
ruamel.yaml==0.18.6 \\
    --hash=sha256:0123
pywin32==306 ; sys_platform == "win32"
typing_extensions==4.16.0  # via torch
-e file:.
"""


def test_parse_lock_normalises_names_and_skips_what_does_not_apply():
    assert parse_lock(LOCK) == {
        "torch": "2.14.1",
        "ruamel-yaml": "0.18.6",
        "typing-extensions": "4.16.0",
    }  # pywin32's marker is false on this Linux machine


def test_find_drift_reports_missing_and_mismatched():
    locked = parse_lock(LOCK)
    installed = {"torch": "2.14.1+cu130", "ruamel-yaml": "0.18.5", "pip": "25.0"}
    drift = find_drift(locked, installed)
    assert drift.missing == ["typing-extensions"]
    assert drift.mismatched == [("ruamel-yaml", "0.18.6", "0.18.5")]  # +cu130 is not drift
    assert not drift.clean
    assert find_drift({"torch": "2.14.1"}, installed).clean


def _run_doctor(lock: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "kiln.doctor", "--lock", str(lock)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_doctor_command_on_this_machine(tmp_path):
    """The real command: a lock this environment satisfies gives exit 0 (on a CPU machine the
    CUDA build without a driver counts as "CPU only"); a drifted pin gives exit 1 and names it."""
    numpy_version = importlib.metadata.version("numpy")
    good = tmp_path / "good.lock"
    good.write_text(f"numpy=={numpy_version}\n")
    bad = tmp_path / "bad.lock"
    bad.write_text(f"numpy=={numpy_version}\nrich==0.0.1\nnot-a-real-kiln-dep==1.0\n")

    result = _run_doctor(good)
    for component in ("torch CUDA build", "cuDNN", "NVIDIA driver", "ONNX Runtime", "numpy"):
        assert component in result.stdout
    cuda_line = next(line for line in result.stdout.splitlines() if "│ CUDA " in line)
    if "CUDA usable" in cuda_line or "CPU only" in cuda_line:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "all 1 locked packages installed" in result.stdout
    else:  # a GPU machine whose driver/torch disagree: the doctor must say so and fail
        assert result.returncode == 1

    result = _run_doctor(bad)
    assert result.returncode == 1
    assert "not-a-real-kiln-dep" in result.stdout and "missing" in result.stdout
    assert "0.0.1" in result.stdout and "inconsistent" in result.stdout
