"""Detection through the same paths as classification: the Predictor on images of mixed sizes,
`infer.py` on a folder / .npz, the live server (v1 and v2), and ONNX export with a parity check
on boxes. The checkpoint is a detector trained for two steps: its boxes mean nothing, but there
are boxes, which is what these paths must carry. Whether detection learns is
test_detection_learns (slow)."""

from __future__ import annotations

import functools
import json
import sys

import httpx
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from kiln.cli.paths import REPO_ROOT
from kiln.inference import Predictor
from kiln.inference.export import BOX_TOLERANCE_PX, export
from kiln.serving import create_app

from .conftest import read_summary, run_python, run_train
from .inference_helpers import assert_boxes_agree, detector_run, live_server, mixed_size_images


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    run_dir, _ = detector_run(tmp_path_factory)
    return run_dir / "checkpoints" / "best.pt"


@pytest.fixture(scope="module")
def predictor(ckpt):
    return Predictor.from_checkpoint(ckpt)


def assert_same_detections(got: list[dict], expected: list[dict], atol: float = 1e-4) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert len(a["boxes"]) == len(b["boxes"])
        np.testing.assert_allclose(np.asarray(a["boxes"]), np.asarray(b["boxes"]), atol=atol)
        np.testing.assert_allclose(np.asarray(a["scores"]), np.asarray(b["scores"]), atol=1e-5)
        assert list(a["labels"]) == list(b["labels"])


def test_detector_predicts_boxes_on_images_of_mixed_sizes(predictor):
    images = mixed_size_images(4)
    found = predictor.detect(images)
    assert len(found) == 4 and sum(len(d["boxes"]) for d in found) > 0
    for image, d in zip(images, found, strict=True):
        height, width = image.shape[1:]
        assert d["boxes"].shape[1] == 4 and len(d["boxes"]) == len(d["scores"]) == len(d["labels"])
        assert (d["boxes"][:, [0, 2]] <= width).all() and (d["boxes"][:, [1, 3]] <= height).all()
        assert (d["scores"] >= 0.05).all() and set(d["labels"].tolist()) <= {1, 2}
    # Each image alone gets the same boxes as in a batch of mixed sizes.
    assert_same_detections([predictor.detect([image])[0] for image in images], found)
    answers = predictor.predict(images[:1])
    assert set(answers[0]) == {"boxes", "labels", "scores"}
    assert set(answers[0]["labels"]) <= {"rectangle", "ellipse"}


def test_bad_detection_inputs_name_the_item(predictor):
    from kiln.inference import InputError

    good = mixed_size_images(1)[0]
    for bad, message in [
        (np.zeros((1, 40, 40)), "item 1: expected an image of shape (C, H, W) = (3, H, W)"),
        (np.zeros((3, 8, 40)), "got (3, 8, 40)"),
        (np.full((3, 40, 40), 2.0), "outside the training data's raw range [0, 1]"),
    ]:
        with pytest.raises(InputError) as err:
            predictor.detect([good, bad])
        assert message in str(err.value)


def test_detector_onnx_export_has_box_parity(ckpt, predictor, tmp_path):
    report = export(ckpt, tmp_path / "model.onnx")
    assert report.parity and all(c.unit == "box" for c in report.parity)
    assert all(c.max_abs_diff <= BOX_TOLERANCE_PX for c in report.parity)
    assert any("x" in c.name for c in report.parity)  # several image sizes were checked
    onnx = Predictor.from_checkpoint(tmp_path / "model.onnx", backend="onnx")
    images = mixed_size_images(3, seed=4)
    assert_boxes_agree(
        onnx.detect(images),
        predictor.detect(images),
        ("torch", "ONNX Runtime"),
        max_corner_px=BOX_TOLERANCE_PX,
    )


def test_infer_py_writes_boxes_for_a_folder_and_an_npz_of_mixed_sizes(ckpt, predictor, tmp_path):
    images = mixed_size_images(3, seed=2)
    folder = tmp_path / "images"
    folder.mkdir()
    np.save(folder / "a.npy", images[0])
    pixels = np.round(images[1].transpose(1, 2, 0) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(folder / "b.png")
    np.savez(tmp_path / "images.npz", first=images[0], second=images[2])
    from_png = pixels.transpose(2, 0, 1).astype(np.float32) / 255.0

    for source, expected_images, names in [
        (folder, [images[0], from_png], ["a.npy", "b.png"]),
        (tmp_path / "images.npz", [images[0], images[2]], ["first", "second"]),
    ]:
        out = tmp_path / f"{source.stem}.csv"
        cmd = [sys.executable, str(REPO_ROOT / "infer.py"), f"ckpt={ckpt}"]
        cmd += [f"input={source}", f"output={out}"]
        done = run_python(cmd)
        assert done.returncode == 0, done.stderr
        frame = pd.read_csv(out)
        columns = ["index", "source", "x1", "y1", "x2", "y2", "label", "score"]
        files = ["error"] if source.is_dir() else []  # files each may fail alone: an error column
        assert list(frame.columns) == columns + files
        expected = predictor.detect(expected_images)
        for index, (name, found) in enumerate(zip(names, expected, strict=True)):
            rows = frame[frame["index"] == index]
            assert set(rows["source"]) == {name}
            assert len(rows) == max(len(found["boxes"]), 1)
            if len(found["boxes"]):
                boxes = rows[["x1", "y1", "x2", "y2"]].to_numpy()
                np.testing.assert_allclose(boxes, found["boxes"], atol=1e-3)
        assert f"boxes for {len(names)} images" in done.stdout


def test_the_server_returns_boxes_over_v1_and_v2(predictor):
    images = mixed_size_images(3, seed=3)
    expected = predictor.detect(images)
    with live_server(create_app(predictor, max_batch_size=4, max_delay_ms=5)) as server:
        v1 = httpx.post(
            f"{server.url}/v1/predict", json={"inputs": [x.tolist() for x in images]}, timeout=60
        )
        meta = httpx.get(f"{server.url}/v2/models/kiln").json()
        v2 = []
        for image in images:  # one size per v2 tensor
            tensor = {"name": "input", "shape": [1, *image.shape], "datatype": "FP32"}
            body = {"inputs": [{**tensor, "data": image.ravel().tolist()}]}
            v2.append(httpx.post(f"{server.url}/v2/models/kiln/infer", json=body, timeout=60))
    assert v1.status_code == 200, v1.text
    names = predictor.class_names
    got = [
        {
            "boxes": p["boxes"],
            "scores": p["scores"],
            "labels": [names.index(label) + 1 for label in p["labels"]],
        }
        for p in v1.json()["predictions"]
    ]
    assert_boxes_agree(got, expected, ("predict", "the server"), max_corner_px=1e-4)
    assert meta["inputs"] == [
        {"name": "input", "datatype": "FP32", "shape": [-1, 3, -1, -1]},
        {"name": "input", "datatype": "BYTES", "shape": [-1]},  # image files
    ]
    assert [o["name"] for o in meta["outputs"]] == ["boxes", "scores", "labels", "num_detections"]
    for response, found in zip(v2, expected, strict=True):
        assert response.status_code == 200, response.text
        outputs = {o["name"]: o for o in response.json()["outputs"]}
        assert outputs["num_detections"]["data"] == [len(found["boxes"])]
        boxes = np.asarray(outputs["boxes"]["data"]).reshape(outputs["boxes"]["shape"])
        np.testing.assert_allclose(boxes, found["boxes"], atol=1e-4)
        assert outputs["labels"]["data"] == [names[k - 1] for k in found["labels"]]


def png_files(images: list[np.ndarray]) -> tuple[list[bytes], list[np.ndarray]]:
    """The images as PNG files, and the pixels those files decode to (3, H, W) in [0, 1]."""
    import io

    files, pixels = [], []
    for image in images:
        rgb = (image.transpose(1, 2, 0) * 255).round().astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(rgb).save(buffer, format="PNG")
        files.append(buffer.getvalue())
        pixels.append(rgb.transpose(2, 0, 1).astype(np.float32) / 255)
    return files, pixels


def test_the_server_takes_image_files_for_a_detector(predictor):
    """v1 base64 (and TF Serving's {"b64": ...}), v2 BYTES in JSON and over the binary extension
    (tritonclient): the same boxes as predict on the pixels the files decode to; a file below
    the detector's smallest side or a decompression bomb is one 4xx naming the item."""
    import base64
    import io

    import tritonclient.http as triton

    files, pixels = png_files(mixed_size_images(3, seed=5))
    expected = predictor.detect(pixels)
    names = predictor.class_names
    encoded = [base64.b64encode(f).decode() for f in files]
    tiny = io.BytesIO()
    Image.new("RGB", (12, 40)).save(tiny, format="PNG")
    with live_server(create_app(predictor, max_batch_size=4, max_delay_ms=5)) as server:
        post = functools.partial(httpx.post, timeout=60)
        v1 = post(f"{server.url}/v1/predict", json={"inputs": encoded[:2] + [{"b64": encoded[2]}]})
        tensor = {"name": "input", "datatype": "BYTES", "shape": [len(files)], "data": encoded}
        v2 = post(f"{server.url}/v2/models/kiln/infer", json={"inputs": [tensor]})
        client = triton.InferenceServerClient(server.url.removeprefix("http://"))
        binary = triton.InferInput("input", [len(files)], "BYTES")
        binary.set_data_from_numpy(np.array(files, dtype=object), binary_data=True)
        found = client.infer("kiln", [binary])
        metadata = client.get_model_metadata("kiln")["inputs"]
        client.close()
        tiny_file = base64.b64encode(tiny.getvalue()).decode()
        small = post(f"{server.url}/v1/predict", json={"inputs": [encoded[0], tiny_file]})
    assert v1.status_code == 200, v1.text
    as_found = [
        {**p, "labels": [names.index(n) + 1 for n in p["labels"]]} for p in v1.json()["predictions"]
    ]
    assert_boxes_agree(as_found, expected, ("predict", "v1 files"), max_corner_px=1e-4)
    counts = [len(d["boxes"]) for d in expected]
    all_boxes = np.concatenate([d["boxes"] for d in expected])
    assert v2.status_code == 200, v2.text
    outputs = {o["name"]: o for o in v2.json()["outputs"]}
    assert outputs["num_detections"]["data"] == counts
    np.testing.assert_allclose(np.reshape(outputs["boxes"]["data"], (-1, 4)), all_boxes, atol=1e-4)
    assert found.as_numpy("num_detections").tolist() == counts
    np.testing.assert_allclose(found.as_numpy("boxes").reshape(-1, 4), all_boxes, atol=1e-4)
    assert {"name": "input", "datatype": "BYTES", "shape": [-1]} in metadata
    assert small.status_code == 422
    assert "item 1: the image is 12x40 px; this detector takes sides of 16 to " in small.text


@pytest.mark.slow  # the whole experiment: about 5 minutes of 2 idle CPU cores
@pytest.mark.timeout(3600)
def test_detection_learns(tmp_path):
    """experiment=shapes_detector reaches mAP@0.5 >= 0.7 on shapes_detection (the table of
    docs/benchmarks.md, "The detector on shapes")."""
    run_dir = tmp_path / "run"
    done = run_train(run_dir, "experiment=shapes_detector", "env.progress_bar=false", timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["val_map50"] >= 0.7, json.dumps(summary)
