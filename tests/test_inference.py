"""Inference on real (tiny) checkpoints: the Predictor repeats the training preprocessing, the
ONNX export agrees with torch, and the CLI turns user mistakes into one clear line."""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from kiln.cli.infer import main as infer_main
from kiln.cli.paths import REPO_ROOT
from kiln.data import build_data
from kiln.data.csv_text import _split, demo_corpus
from kiln.inference import (
    CheckpointPolicyError,
    InputError,
    Predictor,
    UnsupportedCheckpointError,
    export,
)
from kiln.inference.export import INT8_MIN_AGREEMENT, PROBS_TOLERANCE
from kiln.inference.record import read_checkpoint, rebuild_model

from .conftest import compose_config, run_python
from .inference_helpers import digits_run, raw_digits_val, trained_run


@pytest.fixture(scope="session")
def digits_ckpt(tmp_path_factory):
    run_dir, summary = digits_run(tmp_path_factory)
    return run_dir / "checkpoints" / "best.pt", summary


@pytest.fixture(scope="session")
def digits_export(digits_ckpt):
    return export(digits_ckpt[0], int8=True)


@pytest.fixture(scope="session")
def text_ckpt(tmp_path_factory):
    run_dir, summary = trained_run(
        tmp_path_factory, "infer_text", "data=csv_text", "model=text_bow"
    )
    return run_dir / "checkpoints" / "best.pt", summary


# ---------------------------------------------------------------------------------------------
# Torch backend: exactly the training preprocessing


def test_torch_predict_on_raw_pixels_equals_trainer_eval(digits_ckpt):
    ckpt, summary = digits_ckpt
    predictor = Predictor.from_checkpoint(ckpt)
    raw_val, labels = raw_digits_val()
    probs = predictor.predict_probs(raw_val)
    # Same accuracy as the trainer's own evaluation of this checkpoint on the val split.
    assert (probs.argmax(1) == labels).mean() == pytest.approx(summary["val_acc"], abs=1e-9)
    # And the same numbers as the model applied to the dataset's own normalised tensors.
    record, state = read_checkpoint(ckpt)
    val = build_data(compose_config("data=digits").data).val
    with torch.no_grad():
        expected = rebuild_model(record, state)(val.tensors[0]).softmax(-1).numpy()
    np.testing.assert_allclose(probs, expected, atol=1e-6)


def test_predict_returns_labels_and_probs(digits_ckpt):
    predictor = Predictor.from_checkpoint(digits_ckpt[0])
    raw_val, _ = raw_digits_val()
    # (H, W) for one-channel data, (C, H, W), numpy or nested lists: all the same image.
    out = predictor.predict([raw_val[0], raw_val[0][None], raw_val[0].tolist()])
    assert len(out) == 3 and out[0] == out[1] == out[2]
    assert out[0]["label"] in predictor.class_names
    assert len(out[0]["probs"]) == 10 and sum(out[0]["probs"]) == pytest.approx(1, abs=1e-5)


@pytest.mark.parametrize(
    ("bad_item", "expected"),
    [
        (np.zeros((3, 8, 8)), "item 1: expected an image of shape (C, H, W) = (1, 8, 8)"),
        (np.zeros((8, 7)), "got (8, 7)"),
        (np.full((8, 8), 255.0), "outside the training data's raw range [0, 16]"),
        (np.full((8, 8), np.nan), "item 1: contains NaN or Inf"),
        (
            "a picture",
            "item 1: expected an image of shape (C, H, W) = (1, 8, 8) or (8, 8), made of",
        ),
    ],
)
def test_bad_image_inputs_name_item_and_expected_shape(digits_ckpt, bad_item, expected):
    predictor = Predictor.from_checkpoint(digits_ckpt[0])
    with pytest.raises(InputError) as err:
        predictor.predict([np.zeros((8, 8)), bad_item])
    assert expected in str(err.value)
    assert err.value.index == 1


# ---------------------------------------------------------------------------------------------
# ONNX export


def test_export_parity_onnx_backend_and_int8(digits_ckpt, digits_export):
    ckpt, _ = digits_ckpt
    report = digits_export
    assert report.onnx_path == ckpt.with_name("model.onnx") and report.onnx_path.is_file()
    assert report.onnx_path.with_name("model.onnx.json").is_file()
    assert {c.name for c in report.parity} == {"batch=1", "batch=64"}
    assert all(c.max_abs_diff <= PROBS_TOLERANCE for c in report.parity)
    assert report.int8_agreement >= INT8_MIN_AGREEMENT

    raw_val, _ = raw_digits_val()
    torch_probs = Predictor.from_checkpoint(ckpt).predict_probs(raw_val)
    onnx_probs = Predictor.from_checkpoint(ckpt, backend="onnx").predict_probs(raw_val)
    np.testing.assert_array_equal(onnx_probs.argmax(1), torch_probs.argmax(1))
    assert np.abs(onnx_probs - torch_probs).max() <= PROBS_TOLERANCE
    int8 = Predictor.from_checkpoint(ckpt, backend="onnx", int8=True).predict_probs(raw_val)
    assert (int8.argmax(1) == torch_probs.argmax(1)).mean() >= INT8_MIN_AGREEMENT
    # The .onnx alone carries its preprocessing (the sidecar JSON): no .pt needed.
    alone = Predictor.from_checkpoint(report.onnx_path, backend="onnx")
    np.testing.assert_array_equal(alone.predict_probs(raw_val), onnx_probs)


def test_onnx_backend_refuses_export_of_another_checkpoint(digits_ckpt, digits_export, tmp_path):
    ckpt, _ = digits_ckpt
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["model"] = {k: v + 1 for k, v in checkpoint["model"].items()}
    torch.save(checkpoint, tmp_path / "best.pt")
    for name in ("model.onnx", "model.onnx.json"):
        shutil.copy(ckpt.with_name(name), tmp_path / name)
    with pytest.raises(ValueError, match="exported from a different checkpoint"):
        Predictor.from_checkpoint(tmp_path / "best.pt", backend="onnx")
    with pytest.raises(FileNotFoundError, match="mode=export"):
        Predictor.from_checkpoint(tmp_path / "best.pt", backend="onnx", int8=True)


def test_text_model_predict_and_export_two_lengths(text_ckpt):
    ckpt, summary = text_ckpt
    cfg = compose_config("data=csv_text", "model=text_bow").data
    texts, labels = demo_corpus()
    _, _, val_texts, val_labels = _split(texts, labels, cfg.val_fraction, cfg.split_seed)
    predictor = Predictor.from_checkpoint(ckpt)
    predicted = [p["label"] for p in predictor.predict(val_texts)]
    accuracy = np.mean([p == y for p, y in zip(predicted, val_labels, strict=True)])
    assert accuracy == pytest.approx(summary["val_acc"], abs=1e-9)

    report = export(ckpt)
    lengths = {c.name.split("length=")[1] for c in report.parity}
    assert len(report.parity) == 3 and len(lengths) == 2
    assert all(c.max_abs_diff <= PROBS_TOLERANCE for c in report.parity)
    onnx = Predictor.from_checkpoint(ckpt, backend="onnx")
    # One text alone (its own length) and the whole set (padded to the longest).
    assert onnx.predict(val_texts[:1])[0]["label"] == predicted[0]
    assert [p["label"] for p in onnx.predict(val_texts)] == predicted
    with pytest.raises(InputError, match="item 1: expected a text"):
        predictor.predict(["fine", 3])


def test_a_file_of_texts_runs_in_calls_of_like_length_and_answers_in_order(text_ckpt):
    """infer.py's texts are run shortest first (a call pads its texts to the longest among
    them) and answered in the file's order, each as that text alone would be."""
    texts, _ = demo_corpus()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(texts, size=rng.integers(1, 8))) for _ in range(48)]
    predictor = Predictor.from_checkpoint(text_ckpt[0])
    tokens = [predictor.preprocess.recipe.encode([t]).shape[1] for t in texts]
    calls = []
    probs = predictor.backend.probs  # the real backend, its calls' shapes recorded
    predictor.backend.probs = lambda batch: calls.append(tuple(batch.shape)) or probs(batch)
    together = predictor.predict_probs(texts, batch_size=8)
    assert len(calls) == 6
    assert sum(n * length for n, length in calls) < 1.25 * sum(tokens)  # file order: 1.6x
    alone = np.concatenate([predictor.predict_probs([t]) for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-6)
    with pytest.raises(InputError, match="item 41: expected a text"):
        predictor.predict_probs([*texts[:41], 3], batch_size=8)


def test_text_bow_with_character_ngrams_exports_with_parity(tmp_path_factory, tmp_path):
    """The character n-grams are a table inside the model: the ONNX graph holds it, and takes
    the same ids (two lengths, batch 1 and more)."""
    overrides = ("data=csv_text", "model=text_bow", "model.char_ngrams=[2,5]")
    run_dir, _ = trained_run(tmp_path_factory, "infer_chars", *overrides)
    ckpt = run_dir / "checkpoints" / "best.pt"
    report = export(ckpt, tmp_path / "model.onnx")
    assert len(report.parity) == 3 and all(c.max_abs_diff <= PROBS_TOLERANCE for c in report.parity)
    texts, _ = demo_corpus()
    torch_labels = [p["label"] for p in Predictor.from_checkpoint(ckpt).predict(texts[:50])]
    onnx = Predictor.from_checkpoint(tmp_path / "model.onnx", backend="onnx")
    assert [p["label"] for p in onnx.predict(texts[:50])] == torch_labels


def test_text_transformer_export_keeps_batch_and_length_dynamic(tmp_path_factory):
    """nn.MultiheadAttention: the legacy exporter bakes the batch size in (parity fails), and
    the dynamo exporter must be traced on a batch of two, or it specialises the batch to 1.
    The exported graph (the nested-tensor fast path in eval) predicts raw texts as torch does."""
    run_dir, _ = trained_run(
        tmp_path_factory, "infer_transformer", "data=csv_text", "model=text_transformer"
    )
    ckpt = run_dir / "checkpoints" / "best.pt"
    report = export(ckpt)  # model.onnx beside it, where backend="onnx" reads it
    assert report.exporter == "dynamo"
    assert len(report.parity) == 3 and all(c.max_abs_diff <= PROBS_TOLERANCE for c in report.parity)
    texts = ["the striker scored in extra time", "<b>bake the bread</b> until golden"]
    onnx = Predictor.from_checkpoint(ckpt, backend="onnx").predict_probs(texts)
    torch_probs = Predictor.from_checkpoint(ckpt).predict_probs(texts)
    assert abs(onnx - torch_probs).max() <= PROBS_TOLERANCE


# ---------------------------------------------------------------------------------------------
# Checkpoint policy and unsupported checkpoints


def _altered_copy(ckpt, path, change):
    checkpoint = torch.load(ckpt, weights_only=True)
    change(checkpoint)
    torch.save(checkpoint, path)
    return path


def test_production_profile_refuses_anything_but_best(digits_ckpt, tmp_path):
    def production(c):
        c["config"]["env"] = {**c["config"]["env"], "name": "production"}
        c["config"]["env"]["require_best_checkpoint"] = True

    last = _altered_copy(digits_ckpt[0], tmp_path / "last.pt", production)
    with pytest.raises(CheckpointPolicyError, match="only best.pt may be used"):
        Predictor.from_checkpoint(last)
    best = _altered_copy(digits_ckpt[0], tmp_path / "best.pt", production)
    assert Predictor.from_checkpoint(best).predict([np.zeros((8, 8))])


def test_a_task_inference_does_not_know_says_not_supported(digits_ckpt, tmp_path):
    def segmentation(c):
        c["data_spec"]["task"] = "segmentation"

    ckpt = _altered_copy(digits_ckpt[0], tmp_path / "best.pt", segmentation)
    supported = "supports classification, multilabel, detection only"
    with pytest.raises(UnsupportedCheckpointError, match=supported):
        Predictor.from_checkpoint(ckpt)


# ---------------------------------------------------------------------------------------------
# The CLI


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ckpt=/nonexistent/best.pt", "input=x.npy"], "checkpoint /nonexistent/best.pt does"),
        (["mode=train", "ckpt=x.pt"], "unknown mode='train'; valid modes: predict, export, serve"),
        (["ckpt=x.pt", "inptu=x.npy"], "; did you mean input?"),
        (["ckpt=x.pt"], "mode=predict needs input="),
    ],
)
def test_cli_user_errors_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        infer_main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_cli_wrong_input_shape_names_file(digits_ckpt, tmp_path, capsys):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((4, 3, 8, 8), dtype=np.float32))
    with pytest.raises(SystemExit):
        infer_main([f"ckpt={digits_ckpt[0]}", f"input={bad}"])
    err = capsys.readouterr().err
    assert f"{bad}: expected an array of shape (N, 1, 8, 8) or (N, 8, 8), got (4, 3, 8, 8)" in err


def test_cli_predict_subprocess_writes_csv(digits_ckpt, digits_export, tmp_path):
    ckpt, _ = digits_ckpt
    raw_val, _ = raw_digits_val()
    np.save(tmp_path / "x.npy", raw_val[:50])
    out = tmp_path / "preds.csv"
    cmd = [sys.executable, str(REPO_ROOT / "infer.py"), f"ckpt={ckpt}"]
    cmd += [f"input={tmp_path / 'x.npy'}", f"output={out}", "backend=onnx"]
    done = run_python(cmd, timeout=120)
    assert done.returncode == 0, done.stderr
    frame = pd.read_csv(out, dtype={"label": str})
    assert list(frame.columns) == ["index", "label", *[f"prob_{i}" for i in range(10)]]
    expected = Predictor.from_checkpoint(ckpt).predict(raw_val[:50])
    assert frame["label"].tolist() == [p["label"] for p in expected]


def test_cli_export_subprocess_prints_parity(digits_ckpt, tmp_path):
    ckpt = tmp_path / "best.pt"
    shutil.copy(digits_ckpt[0], ckpt)
    cmd = [sys.executable, str(REPO_ROOT / "infer.py"), "mode=export", f"ckpt={ckpt}"]
    done = run_python(cmd, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "parity batch=64: max |dprob| = " in done.stdout
    assert (tmp_path / "model.onnx").is_file() and (tmp_path / "model.onnx.json").is_file()
