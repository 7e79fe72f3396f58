"""ONNX export of torchvision's detectors: fasterrcnn_mobilenet_v3_large_320_fpn at 96 px,
trained one step on the COCO folder made from real photos, exported by `infer.py`'s export
(`kiln.inference.export.export`), its ONNX Runtime boxes checked against torch's (IoU >= 0.99,
same labels, scores within 1e-4) on images of several sizes, then served from the ONNX model
(v1 and v2) with the boxes torch gives. The sweep over every box detector is slow."""

from __future__ import annotations

import dataclasses
import json

import httpx
import numpy as np
import pytest
import torch

from kiln.data import build_data
from kiln.data.photo_boxes import make_photo_boxes
from kiln.inference import Predictor
from kiln.inference.export import MIN_BOX_IOU, NothingComparedError, export
from kiln.models import build_model
from kiln.models.zoo.detection import detection_archs
from kiln.serving import create_app

from .conftest import compose_config, train_in_process
from .inference_helpers import assert_boxes_agree, live_server
from .test_torchvision_detection import NO_PROBES, overrides


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_photo_boxes(tmp_path_factory.mktemp("tv_export_boxes"))


@pytest.fixture(scope="module")
def ckpt(folder, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tv_export_run")
    summary = train_in_process(
        run_dir,
        *overrides(folder),
        "trainer.max_steps=1",
        "trainer.shape_check=false",
        "logger=none",
        "device=cpu",
        "env.progress_bar=false",
        *NO_PROBES,
    )
    assert summary["steps"] == 1, summary
    return run_dir / "checkpoints" / "last.pt"


def val_images(folder) -> list[np.ndarray]:
    bundle = build_data(compose_config(*overrides(folder)).data)
    return [bundle.val[i][0].numpy() for i in range(len(bundle.val))]


def test_fasterrcnn_exports_to_onnx_with_box_parity_and_serves_from_it(ckpt, folder):
    report = export(ckpt, ckpt.with_name("model.onnx"))
    assert report.exporter == "legacy"
    assert len(report.parity) >= 3 and all(c.unit == "iou" for c in report.parity)
    assert all(1 - c.max_abs_diff >= MIN_BOX_IOU for c in report.parity)
    assert len({c.name for c in report.parity}) >= 2  # several image sizes, one graph
    assert report.boxes.matched > 0 and "parity, all images: " in "\n".join(report.lines())
    sidecar = json.loads(ckpt.with_name("model.onnx.json").read_text())
    assert sidecar["graph_input"]["shape"] == [1, 3, "height", "width"]

    torch_predictor = Predictor.from_checkpoint(ckpt)
    onnx_predictor = Predictor.from_checkpoint(ckpt, backend="onnx")
    images = val_images(folder)
    expected = torch_predictor.detect(images)
    assert sum(len(d["boxes"]) for d in expected) > 0  # there are boxes to compare
    assert len({image.shape for image in images}) >= 2  # of mixed sizes
    assert_boxes_agree(onnx_predictor.detect(images), expected)

    names = onnx_predictor.class_names
    with live_server(create_app(onnx_predictor, max_batch_size=4, max_delay_ms=5)) as server:
        v1 = httpx.post(
            f"{server.url}/v1/predict",
            json={"inputs": [x.tolist() for x in images[:2]]},
            timeout=120,
        )
        image = images[0]
        tensor = {"name": "input", "shape": [1, *image.shape], "datatype": "FP32"}
        body = {"inputs": [{**tensor, "data": image.ravel().tolist()}]}
        v2 = httpx.post(f"{server.url}/v2/models/kiln/infer", json=body, timeout=120)
    assert v1.status_code == 200, v1.text
    served = [
        {
            "boxes": np.asarray(p["boxes"], dtype=np.float32).reshape(-1, 4),
            "scores": np.asarray(p["scores"], dtype=np.float32),
            "labels": np.asarray([names.index(n) + 1 for n in p["labels"]]),
        }
        for p in v1.json()["predictions"]
    ]
    assert_boxes_agree(served, expected[:2])
    assert v2.status_code == 200, v2.text
    outputs = {o["name"]: o for o in v2.json()["outputs"]}
    assert outputs["num_detections"]["data"] == [len(expected[0]["boxes"])]
    from_v2 = {
        "boxes": np.asarray(outputs["boxes"]["data"], dtype=np.float32).reshape(-1, 4),
        "scores": np.asarray(outputs["scores"]["data"], dtype=np.float32),
        "labels": np.asarray([names.index(n) + 1 for n in outputs["labels"]["data"]]),
    }
    assert_boxes_agree([from_v2], expected[:1])


@pytest.mark.slow  # every box detector, resnet50 ones included: minutes on two CPU cores
@pytest.mark.parametrize("arch", detection_archs())
def test_every_box_detector_exports_with_parity_or_is_refused_by_name(arch, folder, tmp_path):
    """Random weights at 96 px: each architecture either exports and agrees with torch box by
    box, or is refused in one line naming it (NOT_ONNX_EXPORTABLE)."""
    from kiln.inference.errors import InferenceError
    from kiln.inference.export import export_checked, graph_for, parity_batches

    torch.manual_seed(0)
    cfg = compose_config(*overrides(folder))
    bundle = build_data(cfg.data)
    model = build_model(bundle.spec, dataclasses.replace(cfg.model, arch=arch)).eval()
    record = type("Record", (), {"spec": bundle.spec})()
    if model.onnx_refusal:
        with pytest.raises(InferenceError, match=f"ONNX export of {arch} is not supported"):
            graph_for(record, model)
        return
    for holder in (model.net, getattr(model.net, "roi_heads", None)):
        if hasattr(holder, "score_thresh"):  # random weights score low: keep boxes to compare
            holder.score_thresh = 0.001
    graph = graph_for(record, model)
    images = [bundle.val[i][0] for i in range(len(bundle.val))]
    batches = parity_batches(images, "image_list", graph.fixed_batch)
    with torch.no_grad():
        assert all(len(graph.net(batch)[0][0]) for batch in batches.values())
    _, checks = export_checked(graph, batches, tmp_path / "model.onnx", "cpu")
    assert all(1 - c.max_abs_diff >= MIN_BOX_IOU for c in checks)


def test_parity_counts_the_boxes_it_compares_and_refuses_to_compare_none(folder, tmp_path):
    """Random weights at 96 px: the parity lines say how many torch boxes found their ONNX twin
    on how many images; the same graph with a score threshold no box passes is refused (a
    check over zero boxes passed before, 'min box IoU 1.0000')."""
    from kiln.inference.export import boxes_first, export_checked, graph_for, parity_batches

    torch.manual_seed(0)
    bundle = build_data(compose_config(*overrides(folder)).data)
    model = build_model(bundle.spec, compose_config(*overrides(folder)).model).eval()
    record = type("Record", (), {"spec": bundle.spec})()
    images = [bundle.val[i][0] for i in range(len(bundle.val))]
    graph = graph_for(record, model)
    ordered, source = boxes_first(graph, images, "validation")
    assert source.endswith(f"torch finds boxes on {len(images)} (checked first)")
    _, checks = export_checked(
        graph, parity_batches(ordered, "image_list", 1), tmp_path / "model.onnx", "cpu"
    )
    assert all(c.boxes.problem() is None and c.boxes.matched == c.boxes.boxes > 0 for c in checks)
    assert " torch boxes matched on 1 of 1 images (min IoU 1.0000" in checks[0].line()
    model.net.roi_heads.score_thresh = 1.0  # nothing scores above it
    with pytest.raises(NothingComparedError, match="parity compared no box: neither torch nor"):
        export_checked(
            graph_for(record, model),
            parity_batches(images, "image_list", 1),
            tmp_path / "none.onnx",
            "cpu",
        )
    assert not (tmp_path / "none.onnx").exists()


def test_the_traced_resize_sizes_every_image_as_eager_torch_does(tmp_path):
    """torchvision's own traced resize floors 122 x 96/122 to 95 px in float32 where eager torch
    gets 96; kiln's (kiln.models.zoo.traced_resize) agrees with eager on every size tried."""
    import warnings

    import onnxruntime as ort
    import torchvision

    from kiln.models.zoo.traced_resize import traced_resize_as_eager

    net = torchvision.models.get_model(
        "fasterrcnn_mobilenet_v3_large_320_fpn",
        weights=None,
        weights_backbone=None,
        min_size=96,
        max_size=96,
    )
    traced_resize_as_eager(net.transform)

    class Resize(torch.nn.Module):
        def forward(self, x):
            return net.transform.resize(x[0])[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Resize(),
            (torch.rand(1, 3, 124, 110),),
            str(tmp_path / "resize.onnx"),
            input_names=["input"],
            dynamic_axes={"input": {2: "h", 3: "w"}},
            opset_version=17,
            dynamo=False,
        )
    session = ort.InferenceSession(str(tmp_path / "resize.onnx"))
    sizes = [(122, 121), (124, 110), (119, 127), (99, 96), (33, 250), (250, 33), (96, 96)]
    sizes += [(int(h), int(w)) for h, w in torch.randint(20, 300, (20, 2)).tolist()]
    for height, width in sizes:
        image = torch.rand(1, 3, height, width)
        eager = net.transform.resize(image[0])[0]
        (onnx,) = session.run(None, {"input": image.numpy()})
        assert onnx.shape == tuple(eager.shape), (height, width)
        np.testing.assert_allclose(onnx, eager.numpy(), atol=1e-4)
