"""Issue 19's whole route, as a user types it: `python train.py data=image_folder ... model=timm
model.arch=resnet18 model.weights=<file>` (and the torchvision architecture, fine-tuned with
init_from= a saved state dict) on a damaged copy of examples/photos -- photos cropped from the
sample images scikit-learn and matplotlib ship (scripts/make_example_photos.py) -- with a
truncated JPEG, a zero-byte file, a .DS_Store, a text file, an empty class, a one-image class and
grayscale, RGBA, palette and 16-bit files among them. The broken files are reported, nothing
good is lost, the test split's report is written, and infer.py on the test folder and the
server on the files' bytes (PNG among them) predict what the evaluation predicted."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest
import torch

from kiln.cli.infer import main as infer_main
from kiln.inference import Predictor
from kiln.serving import create_app

from .conftest import read_summary, run_train
from .image_folder_helpers import make_damaged_folder
from .inference_helpers import live_server

IMAGE_SIZE = 32


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    return make_damaged_folder(tmp_path_factory.mktemp("photos"))


def imagenet_weights(library: str, path: Path) -> Path:
    """A 1000-class resnet18 state dict, as a downloaded weights file would hold (random
    numbers: nothing can be downloaded here; the loading code is the same)."""
    torch.manual_seed(0)
    if library == "timm":
        import timm
        from safetensors.torch import save_file

        save_file(timm.create_model("resnet18").state_dict(), str(path))
    else:
        import torchvision

        torch.save(torchvision.models.resnet18().state_dict(), path)
    return path


def train_on_photos(run_dir: Path, damaged, *overrides: str):
    result = run_train(
        run_dir,
        "data=image_folder",
        f"data.train_dir={damaged.train_dir}",
        f"data.test_dir={damaged.test_dir}",
        f"data.cache_dir={run_dir.parent / 'cache'}",
        f"data.image_size={IMAGE_SIZE}",
        "data.batch_size=16",
        "trainer.max_steps=3",
        "env.progress_bar=false",
        "logger=none",
        *overrides,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def check_data_report(run_dir: Path, damaged) -> None:
    report = json.loads((run_dir / "data_report.json").read_text())
    train = report["train_dir"]
    records = train["dropped_records"]
    assert [f["path"] for f in records if f["reason"] == "truncated"] == list(damaged.truncated)
    assert [f["path"] for f in records if f["reason"] == "empty_file"] == list(damaged.empty_files)
    assert all(f["detail"] for f in records)  # the reason
    assert train["images_kept"] == damaged.images_kept  # nothing good is lost
    assert train["skipped"] == {"hidden": damaged.hidden, "not_image": damaged.not_image}
    assert set(train["classes_dropped"]) == {damaged.empty_class, damaged.single_image_class}
    assert report["classes"] == list(damaged.classes)
    assert report["images"]["test"] == damaged.test_images


def check_predictions_agree(run_dir: Path, damaged, tmp_path: Path) -> None:
    """infer.py on the test folder, and the server on each file's bytes, give the evaluation's
    probabilities (eval/predictions.csv, written at the end of training)."""
    ckpt = run_dir / "checkpoints" / "best.pt"
    evaluation = pd.read_csv(run_dir / "eval" / "predictions.csv").set_index("source")
    assert len(evaluation) == damaged.test_images
    classes = list(damaged.classes)
    expected = evaluation[[f"prob_{c}" for c in classes]]

    out = tmp_path / "preds.csv"
    infer_main([f"ckpt={ckpt}", f"input={damaged.test_dir}", f"output={out}"])
    predicted = pd.read_csv(out).set_index("source").loc[expected.index]
    np.testing.assert_allclose(
        predicted[expected.columns].to_numpy(), expected.to_numpy(), atol=1e-4
    )
    assert (predicted["label"] == evaluation["label"]).all()

    sources = list(expected.index)
    assert any(s.endswith(".png") for s in sources)
    encoded = [base64.b64encode(Path(s).read_bytes()).decode() for s in sources]
    with live_server(create_app(Predictor.from_checkpoint(ckpt), max_delay_ms=2)) as server:
        v1 = httpx.post(f"{server.url}/v1/predict", json={"inputs": encoded}, timeout=120)
        assert v1.status_code == 200, v1.text
        served = np.array([p["probs"] for p in v1.json()["predictions"]])
    np.testing.assert_allclose(served, expected.to_numpy(), atol=1e-4)


@pytest.mark.slow  # 23 s; the photos: the torchvision twin below; timm weights: test_zoo.py
def test_timm_resnet18_with_a_weights_file_end_to_end(damaged, tmp_path):
    weights = imagenet_weights("timm", tmp_path / "resnet18.safetensors")
    run_dir = tmp_path / "run"
    result = train_on_photos(
        run_dir, damaged, "model=timm", "model.arch=resnet18", f"model.weights={weights}"
    )
    log = result.stdout + result.stderr
    assert "re-initialised (1000 classes in the file" in log, log[-3000:]
    check_data_report(run_dir, damaged)
    summary = read_summary(run_dir)
    assert summary["status"] in ("ok", "at_chance") and "test_acc" in summary
    metrics = json.loads((run_dir / "eval" / "metrics.json").read_text())
    assert set(metrics["per_class"]) == set(damaged.classes)
    assert (run_dir / "eval" / "confusion_matrix.png").stat().st_size > 0
    checkpoint = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert checkpoint["pretrained"]["mean"] == pytest.approx([0.485, 0.456, 0.406])
    check_predictions_agree(run_dir, damaged, tmp_path)


def test_torchvision_resnet18_fine_tuned_from_a_state_dict_end_to_end(damaged, tmp_path):
    state_dict = imagenet_weights("torchvision", tmp_path / "resnet18.pth")
    run_dir = tmp_path / "run"
    result = train_on_photos(
        run_dir,
        damaged,
        "model=torchvision",
        "model.arch=resnet18",
        f"init_from={state_dict}",
        "model.freeze=backbone",
        "optimizer.head_lr_mult=10",
    )
    log = result.stdout + result.stderr
    # The key matching block: every backbone tensor loaded, the 1000-class head not.
    assert f"init_from {state_dict}: 120 tensors loaded" in log, log[-3000:]
    assert "head.weight (1000, 512) in the file vs (4, 512)" in log, log[-3000:]
    assert "missing from the file" not in log and "unexpected in the file" not in log
    check_data_report(run_dir, damaged)
    check_predictions_agree(run_dir, damaged, tmp_path)
