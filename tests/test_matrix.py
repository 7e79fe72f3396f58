"""scripts/matrix.py through real train.py runs: a broken model's cell failing with its [FAIL]
line in the default suite; the reduced matrix (each model once through train.py, plus a DDP and
an AMP cell: two and a half minutes on two cores) and the whole one in make test-all. Every
model's training steps stay in the default suite (tests/test_train_smoke.py), and so do DDP
(tests/test_ddp.py) and bf16 autocast."""

from __future__ import annotations

import os
import sys

import pytest

from kiln.cli.paths import REPO_ROOT
from kiln.registry import MODELS, compatible_pairs

from .conftest import SUBPROCESS_ENV, run_python
from .test_failures import REGISTER_BROKEN

SCRIPT = REPO_ROOT / "scripts" / "matrix.py"


def matrix(tmp_path, *args, env=None, timeout=1500):
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "m"), *args]
    return run_python(cmd, tmp_path, env or SUBPROCESS_ENV, timeout)


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


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_whole_matrix(tmp_path):
    result = matrix(tmp_path, timeout=3500)  # within the test's own 3600 s
    assert result.returncode == 0, result.stdout[-5000:]
    cells = 4 * len(compatible_pairs())
    assert f"{cells}/{cells} cells ok" in result.stdout
