"""The messages of issue 32's point 9, each said plainly where it used to be wrong or missing."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kiln.data import build_data

from .conftest import compose_config, train_in_process
from .hostile_inputs import damaged_pngs, png_chunk


def test_a_channel_of_one_value_is_divided_by_one_and_said(tmp_path, caplog):
    for name in ("a", "b"):
        (tmp_path / "train" / name).mkdir(parents=True)
        for i in range(3):
            pixels = np.zeros((12, 12, 3), np.uint8)
            pixels[..., 0] = np.random.default_rng(i).integers(0, 256, (12, 12))  # red varies
            pixels[..., 1] = 90  # green: one value everywhere
            Image.fromarray(pixels).save(tmp_path / "train" / name / f"{i}.png")
    cfg = compose_config(
        "data=image_folder",
        f"data.train_dir={tmp_path / 'train'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.image_size=8",
        "data.normalize=dataset",
        "data.val_fraction=0.34",
        "model=mlp",
    )
    with caplog.at_level(logging.WARNING):
        bundle = build_data(cfg.data)
    std = bundle.recipe.std
    assert std[0] > 0.1 and std[1] == std[2] == 1.0  # green and blue hold one value each
    normalize = json.loads(json.dumps(bundle.report["normalize"]))
    assert normalize["flat_channels"] == [1, 2] and normalize["measured_std"][1] < 1e-6
    assert "channel(s) 1, 2 of the training images hold one value" in caplog.text


def png_with_a_bogus_profile(pixels: np.ndarray) -> bytes:
    """A good PNG plus an iCCP chunk libpng warns about ("iCCP: too short") on every decode."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    png = buffer.getvalue()
    profile = png_chunk(b"iCCP", b"bogus\x00\x00" + zlib.compress(b"\x00\x00\x01\x00" + bytes(252)))
    return png[:33] + profile + png[33:]  # after IHDR


def test_a_png_libpng_rejects_is_a_bad_file_not_a_crash_or_a_hang(tmp_path):
    """Every damaged PNG decoded in one process of its own: with PNG through torchvision 0.29
    (main before issue 32), the first killed that process (SIGSEGV) and the last never returned."""
    damaged = damaged_pngs()
    for i, (data, _) in enumerate(damaged.values()):
        (tmp_path / f"{i}.png").write_bytes(data)
    code = (
        "import sys; from kiln.preprocessing.image_files import read_image_file, "
        "ImageDecodeError\nfor path in sys.argv[1:]:\n    try:\n"
        "        read_image_file(path, 3)\n        print('decoded')\n"
        "    except ImageDecodeError as err:\n        print(err.reason)"
    )
    paths = [str(tmp_path / f"{i}.png") for i in range(len(damaged))]
    done = subprocess.run(
        [sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-500:]}"
    assert done.stdout.split() == [reason for _, reason in damaged.values()]
    assert "libpng" not in done.stderr


def test_no_libpng_warning_is_printed_at_any_epoch_and_a_rejected_png_is_dropped(tmp_path, capfd):
    for name in ("a", "b"):
        (tmp_path / "train" / name).mkdir(parents=True)
        for i in range(4):
            pixels = np.random.default_rng(10 * len(name) + i).integers(0, 256, (12, 12, 3))
            (tmp_path / "train" / name / f"{i}.png").write_bytes(
                png_with_a_bogus_profile(pixels.astype(np.uint8))
            )
    (tmp_path / "train" / "a" / "bad.png").write_bytes(damaged_pngs()["bad row filter"][0])
    run = tmp_path / "run"
    summary = train_in_process(
        run,
        "data=image_folder",
        f"data.train_dir={tmp_path / 'train'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.image_size=8",
        "model=mlp",
        "trainer.max_epochs=2",
        "data.batch_size=2",
        "data.val_fraction=0.25",
        "env.progress_bar=false",
        "logger=none",
    )
    assert summary["status"] in ("ok", "at_chance")  # random pixels: nothing to learn
    printed = capfd.readouterr()
    assert "libpng" not in printed.err + printed.out  # neither at the scan nor at any epoch
    report = json.loads((run / "data_report.json").read_text())["train_dir"]
    (dropped,) = report["dropped_records"]
    assert dropped["reason"] == "unreadable" and report["dropped"] == {"unreadable": 1}
    assert Path(dropped["path"]).name == "bad.png" and report["images_kept"] == 8


def _small_net(tmp_path):
    from kiln.checkpoint import atomic_save

    weights = {"0.weight": torch.ones(4, 3), "0.bias": torch.zeros(4)}
    path = tmp_path / "w.pt"
    atomic_save({"model": weights}, path)
    return torch.nn.Sequential(torch.nn.Linear(3, 4)), weights, path


def test_init_from_names_nan_weights_int8_weights_and_mismatched_shapes(tmp_path):
    from kiln.checkpoint import atomic_save
    from kiln.models.weights import WeightsError, init_from

    model, weights, path = _small_net(tmp_path)
    assert init_from(model, path).loaded == ["0.weight", "0.bias"]
    poisoned = {**weights, "0.weight": weights["0.weight"].clone()}
    poisoned["0.weight"][1, 2] = float("nan")
    atomic_save({"model": poisoned}, tmp_path / "nan.pt")
    with pytest.raises(WeightsError, match=r"nan.pt: tensor 0.weight holds 1 NaN or Inf value"):
        init_from(model, tmp_path / "nan.pt")
    quantised = {**weights, "0.weight": torch.ones(4, 3, dtype=torch.int8)}
    atomic_save({"model": quantised}, tmp_path / "int8.pt")
    with pytest.raises(
        WeightsError,
        match=r"1 tensor\(s\) are integers where the model's are "
        r"float32, e.g. 0.weight \(int8\)",
    ):
        init_from(model, tmp_path / "int8.pt")
    wider = {"0.weight": torch.ones(5, 3), "0.bias": torch.zeros(5)}
    atomic_save({"model": wider}, tmp_path / "wide.pt")
    shapes = r"0.weight: \[5, 3\] in the file, \[4, 3\] in the model; 0.bias: \[5\] in the"
    with pytest.raises(WeightsError, match=shapes):
        init_from(model, tmp_path / "wide.pt")


def test_the_export_sidecar_says_the_graph_takes_standardised_pixels(tmp_path):
    import onnxruntime

    from kiln.inference import Predictor, export

    run = tmp_path / "run"
    summary = train_in_process(run, "trainer.max_steps=3", "env.progress_bar=false", "logger=none")
    assert summary["status"] == "ok"
    report = export(run / "checkpoints" / "best.pt")
    sidecar = json.loads(report.onnx_path.with_suffix(".onnx.json").read_text())
    graph = sidecar["graph_input"]
    assert "standardised" in graph["holds"] and "NOT raw pixels" in graph["holds"]
    recipe = sidecar["preprocessing"]
    low, high = recipe["value_range"]
    mean, std = recipe["mean"], recipe["std"]
    ranges = graph["value_range_per_channel"]
    assert ranges == [[(low - m) / s, (high - m) / s] for m, s in zip(mean, std, strict=True)]
    predictor = Predictor.from_checkpoint(run / "checkpoints" / "best.pt")
    raw = np.random.default_rng(0).uniform(low, high, (5, *predictor.preprocess.shape))
    raw = raw.astype(np.float32)
    standardised = (raw - np.array(mean, np.float32)[:, None, None]) / np.array(std, np.float32)[
        :, None, None
    ]  # as graph_input says
    session = onnxruntime.InferenceSession(str(report.onnx_path))
    (probs,) = session.run(["probs"], {graph["name"]: standardised.astype(np.float32)})
    np.testing.assert_allclose(probs, predictor.predict_probs(raw), atol=1e-4)
    assert all(
        lo - 1e-4 <= standardised[:, c].min() and standardised[:, c].max() <= hi + 1e-4
        for c, (lo, hi) in enumerate(ranges)
    )
