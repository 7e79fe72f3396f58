"""Checkpoints that cannot be served as they are: weights that do not fit the model their config
records (a key missing, a tensor of another size) and weights holding NaN or Inf. Each is one
`error:` line and exit 2 in every mode that loads weights (predict, export, serve) -- never a
traceback, never a server that says it is ready and then answers garbage."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from kiln.cli.infer import main as infer_main
from kiln.cli.paths import REPO_ROOT

from .conftest import run_python
from .inference_helpers import digits_run, free_port


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    run_dir, _ = digits_run(tmp_path_factory)
    return run_dir / "checkpoints" / "best.pt"


def altered(good_ckpt, path, change) -> str:
    checkpoint = torch.load(good_ckpt, weights_only=True)
    change(checkpoint["model"])
    torch.save(checkpoint, path)
    return str(path)


def first_key(weights: dict, suffix: str = "weight") -> str:
    return next(k for k in weights if k.endswith(suffix))


def drop_a_key(weights):
    del weights[first_key(weights, "bias")]


def widen_a_tensor(weights):
    key = first_key(weights)
    weights[key] = torch.zeros(weights[key].shape[0] + 3, *weights[key].shape[1:])


def poison(weights):
    key = first_key(weights)
    weights[key] = weights[key].clone()
    weights[key].view(-1)[:5] = float("nan")


CASES = {
    "missing key": (drop_a_key, "its weights do not fit the model its config records: missing"),
    "size mismatch": (widen_a_tensor, "size mismatch"),
    "NaN weights": (poison, "hold NaN or Inf, first"),
}


def mode_args(mode: str, ckpt: str, tmp_path) -> list[str]:
    if mode == "predict":
        np.save(tmp_path / "x.npy", np.zeros((2, 8, 8), dtype=np.float32))
        return [f"ckpt={ckpt}", f"input={tmp_path / 'x.npy'}", f"output={tmp_path / 'p.csv'}"]
    return [f"mode={mode}", f"ckpt={ckpt}", f"server.port={free_port()}"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["predict", "export", "serve"])
def test_bad_weights_are_one_error_line_and_exit_2(good_ckpt, tmp_path, capsys, mode, case):
    """Today: exit 1 and a 17-20-line traceback (mismatch); NaN weights were served (v1
    answered bare NaN, v2 answered 500)."""
    change, message = CASES[case]
    ckpt = altered(good_ckpt, tmp_path / "best.pt", change)
    with pytest.raises(SystemExit) as stopped:
        infer_main(mode_args(mode, ckpt, tmp_path))
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert message in err[0]
    if case != "NaN weights":
        weights = torch.load(good_ckpt, weights_only=True)["model"]
        key = first_key(weights, "bias" if case == "missing key" else "weight")
        assert key in err[0]  # the first mismatched key is named
    assert not (tmp_path / "model.onnx").exists()  # export wrote nothing


def test_serve_process_refuses_nan_weights(good_ckpt, tmp_path):
    """The real `python infer.py mode=serve`, as an orchestrator starts it."""
    ckpt = altered(good_ckpt, tmp_path / "best.pt", poison)
    cmd = [sys.executable, str(REPO_ROOT / "infer.py"), "mode=serve", f"ckpt={ckpt}"]
    cmd.append(f"server.port={free_port()}")
    done = run_python(cmd, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {ckpt}: "), lines
    assert "serving" not in done.stdout  # it never started listening
