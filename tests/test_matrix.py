"""scripts/matrix.py through real train.py runs: a broken model's cell failing with its [FAIL]
line in the default suite; the reduced matrix (each model once through train.py, plus a DDP and
an AMP cell: two and a half minutes on two cores) and the whole one in make test-all. Every
model's training steps stay in the default suite (tests/test_train_smoke.py), and so do DDP
(tests/test_ddp.py) and bf16 autocast."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kiln.cli.paths import REPO_ROOT
from kiln.registry import MODELS, compatible_pairs

from .conftest import SUBPROCESS_ENV, run_python, shell_env
from .test_failures import REGISTER_BROKEN

SCRIPT = REPO_ROOT / "scripts" / "matrix.py"


def matrix(tmp_path, *args, env=None, timeout=1500):
    """scripts/matrix.py, its cells' `python train.py` (torchrun and its ranks too) children of
    the worker's preloaded Python (tests/preloaded_python.py) as the docs' commands are: the
    whole matrix started 384 interpreters, each paying torch's import before its few steps (a
    DDP cell of the MLP on digits: 5.3 s wall and about 8 CPU-s, 2.5 s and 4 with its ranks
    forked too)."""
    env = shell_env(env or SUBPROCESS_ENV)
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "m"), "--python", "python", *args]
    return run_python(cmd, tmp_path, env, timeout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_reduced_matrix_runs_each_model_once_plus_a_ddp_and_an_amp_cell(tmp_path):
    result = matrix(tmp_path, "--reduced")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    oks = [line for line in result.stdout.splitlines() if line.startswith("[OK]")]
    assert len(oks) == len(MODELS.names()) + 2
    assert {line.split("-", 1)[1].split(" |")[0] for line in oks} >= set(MODELS.names())
    assert any("| DDP |" in line for line in oks) and any("amp=True" in line for line in oks)
    table = (tmp_path / "m" / "matrix.md").read_text()
    assert f"{len(oks)} cells, 0 failed" in table


def test_a_broken_cell_fails_the_matrix_with_its_fail_line(tmp_path):
    (tmp_path / "broken_parts.py").write_text(REGISTER_BROKEN)
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "eval_structure.yaml").write_text("dropout: 0.0\n")
    env = {**SUBPROCESS_ENV, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(tmp_path)])}
    searchpath = f"hydra.searchpath=[file://{tmp_path}/conf]"
    args = ("--plugins", "broken_parts", "--models", "eval_structure", "--data", "digits")
    args = (*args, "--single", searchpath)
    result = matrix(tmp_path, *args, env=env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.startswith("1 cells, "), result.stdout  # digits only: --data
    assert "[FAIL] digits-eval_structure | single | amp=False | shapes @ step 0" in (result.stdout)
    failures = (tmp_path / "m" / "failures.log").read_text()
    assert "rule 3 (train and eval must agree)" in failures


# model=torchvision (resnet18's ImageNet stem) on digits' 8x8 images gives layer4's first
# convolution (3x3, stride 2, padding 1) a 1x1 input; under precision=amp on a CPU whose oneDNN
# has the bug below, its weight gradient holds whatever memory the allocator handed back, and
# the cell ends NaN about one time in three (measured 2026-12-07: 2 of 6 runs of the single cell).
ONE_PIXEL_CELLS = ("digits-torchvision | single | amp=True", "digits-torchvision | DDP | amp=True")


def onednn_leaves_bf16_taps_unwritten() -> bool:
    """Whether this machine's oneDNN (as torch 2.14.1 ships it) has the bug: a bf16 convolution
    with stride 2 and padding 1 over a 1x1 input leaves the weight-gradient taps that saw only
    padding unwritten (they must be 0; here NaN, from memory filled with NaN and freed). fp32,
    torch.backends.mkldnn.enabled=False and an AVX2 CPU (bf16 emulated) write zeros."""
    conv = torch.nn.Conv2d(16, 16, 3, stride=2, padding=1, bias=False)
    x = torch.randn(2, 16, 1, 1)
    for _ in range(20):
        torch.full((1 << 16,), float("nan"))  # freed at once: the next allocations reuse it
        conv.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            conv(x).float().sum().backward()
        padding_only = conv.weight.grad.clone()
        padding_only[..., 1, 1] = 0  # the one tap that saw the pixel
        if padding_only.count_nonzero():
            return True
    return False


def test_the_one_pixel_check_sees_the_bug_only_where_onednn_runs_bf16():
    """With oneDNN off, the check finds every tap written: it can say no."""
    with torch.backends.mkldnn.flags(enabled=False):
        assert not onednn_leaves_bf16_taps_unwritten()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_whole_matrix(tmp_path):
    """Every cell ok, but the ONE_PIXEL_CELLS, which may end NaN where oneDNN has the bug."""
    result = matrix(tmp_path, timeout=3500)  # within the test's own 3600 s
    cells = 4 * len(compatible_pairs())
    failed = [line for line in result.stdout.splitlines() if line.startswith("[FAIL]")]
    known = ONE_PIXEL_CELLS if onednn_leaves_bf16_taps_unwritten() else ()
    unexplained = [
        line for line in failed if not any(line.startswith(f"[FAIL] {c} | ") for c in known)
    ]
    assert unexplained == [] and all("NaN @ step" in line for line in failed), result.stdout
    assert f"{cells - len(failed)}/{cells} cells ok" in result.stdout, result.stdout[-5000:]
