"""model=torchvision_detection: torchvision's detectors sized from the data, trained on data=coco
(a folder made from real photos, with its bad annotations) from a COCO weights file the test
writes into TORCH_HOME (nothing is downloaded), their checkpoints read back by the Predictor;
model=torchvision refusing a detector by naming the option that takes it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kiln.config import ConfigError
from kiln.data import build_data
from kiln.data.photo_boxes import make_photo_boxes
from kiln.models import build_model
from kiln.models.zoo.detection import detection_archs, freeze_batchnorm

from .conftest import compose_config, train_in_process

ARCH = "fasterrcnn_mobilenet_v3_large_320_fpn"
NO_PROBES = (
    "trainer.probe_sizes=false",
    "trainer.learn_probe=false",
    "trainer.skip_checks=[batch dependence,determinism,purity,numerics,dead gradients,device]",
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_photo_boxes(tmp_path_factory.mktemp("tv_boxes"), damaged=True)


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    """A COCO weights file (91 classes) as torchvision publishes it, made from a fresh build,
    under the file name of the weights' URL in $TORCH_HOME/hub/checkpoints."""
    import torchvision.models

    from kiln.models.zoo.cache import url_file_name

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    weights = torchvision.models.get_model_weights(ARCH).DEFAULT
    net = torchvision.models.get_model(ARCH, weights=None, weights_backbone=None, num_classes=91)
    freeze_batchnorm(net)  # torchvision's COCO files hold FrozenBatchNorm2d's tensors
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(net.state_dict(), folder / url_file_name(weights.url))
    return net.state_dict()


def overrides(folder, *extra):
    return (
        "data=coco",
        "model=torchvision_detection",
        f"data.train_json={folder.train_json}",
        f"data.train_images={folder.train_images}",
        f"data.val_json={folder.val_json}",
        f"data.val_images={folder.val_images}",
        f"data.cache_dir={folder.root / 'cache'}",
        "data.image_size=96",
        *extra,
    )


def test_coco_weights_load_with_the_class_head_sized_from_the_data(folder, torch_home, caplog):
    cfg = compose_config(*overrides(folder, "model.weights=DEFAULT"))
    spec = build_data(cfg.data).spec
    with caplog.at_level("INFO"):
        model = build_model(spec, cfg.model)
    predictor = model.net.roi_heads.box_predictor
    assert predictor.cls_score.out_features == spec.num_classes + 1 == 3  # + background
    assert "re-initialised (91 classes in the file, 3 in the data)" in caplog.text
    backbone = "backbone.body.0.0.weight"
    assert torch.equal(model.net.state_dict()[backbone], torch_home[backbone])
    assert model.net.transform.min_size == (96,) and model.net.transform.max_size == 96


def test_ssdlite_weights_reinitialise_only_the_class_layers(folder, tmp_path, caplog):
    """SSDlite's classification head also holds depthwise convolutions and BatchNorm that the
    classes do not size: those load from the file; only the class layers start fresh, and the
    log counts the classes (the head's outputs are anchors x classes), not its channels."""
    import torchvision.models

    arch = "ssdlite320_mobilenet_v3_large"
    net = torchvision.models.get_model(arch, weights=None, weights_backbone=None, num_classes=91)
    freeze_batchnorm(net)
    torch.save(net.state_dict(), tmp_path / "ssdlite_coco.pth")
    cfg = compose_config(
        *overrides(folder, f"model.arch={arch}", f"model.weights={tmp_path / 'ssdlite_coco.pth'}")
    )
    with caplog.at_level("INFO"):
        model = build_model(build_data(cfg.data).spec, cfg.model)
    assert "re-initialised (91 classes in the file, 3 in the data)" in caplog.text, caplog.text
    head = "head.classification_head.module_list.0"
    ours, theirs = model.net.state_dict(), net.state_dict()
    assert torch.equal(ours[f"{head}.0.0.weight"], theirs[f"{head}.0.0.weight"])  # loaded
    assert ours[f"{head}.1.weight"].shape[0] == 6 * 3  # 6 anchors x (2 classes + background)
    regression = "head.regression_head.module_list.0.1.weight"  # boxes: not sized by classes
    assert torch.equal(ours[regression], theirs[regression])


@pytest.mark.slow  # about 40 s on two CPU cores (fasterrcnn's evaluation, the checkpoints)
def test_fasterrcnn_trains_on_coco_from_a_weights_file_and_its_checkpoint_predicts(
    folder, torch_home, tmp_path
):
    from kiln.inference import Predictor

    run_dir = tmp_path / "run"
    # The probes before step 1 are tests/test_antibodies.py's (torchvision_detection on
    # shapes_detection): minutes at this size on two CPU cores, so they are left out here.
    summary = train_in_process(
        run_dir,
        *overrides(folder, "model.weights=DEFAULT"),
        "trainer.max_steps=2",
        "logger=none",
        "device=cpu",
        "env.progress_bar=false",
        *NO_PROBES,
    )
    assert summary["status"] in ("ok", "at_chance"), summary
    assert summary["steps"] == 2
    report = json.loads((run_dir / "data_report.json").read_text())
    assert sum(report["train_files"]["annotations"]["dropped"].values()) == 4
    predictor = Predictor.from_checkpoint(run_dir / "checkpoints" / "best.pt")
    image = build_data(compose_config(*overrides(folder)).data).val[0][0]
    (found,) = predictor.predict([image.numpy()])
    assert {"boxes", "labels", "scores"} <= set(found)
    # the server answers with the same boxes (v1, raw pixels)
    import httpx
    import numpy as np

    from kiln.serving import create_app

    from .inference_helpers import live_server

    expected = predictor.detect([image.numpy()])
    with live_server(create_app(predictor, max_batch_size=4, max_delay_ms=5)) as server:
        answer = httpx.post(
            f"{server.url}/v1/predict", json={"inputs": [image.numpy().tolist()]}, timeout=120
        )
    assert answer.status_code == 200, answer.text
    (served,) = answer.json()["predictions"]
    served_boxes = np.asarray(served["boxes"]).reshape(-1, 4)
    expected_boxes = np.asarray(expected[0]["boxes"]).reshape(-1, 4)
    np.testing.assert_allclose(served_boxes, expected_boxes, atol=1e-3)


def test_onnx_export_refuses_an_architecture_that_does_not_export_naming_it(folder):
    from types import SimpleNamespace

    from kiln.inference.errors import InferenceError
    from kiln.inference.export import graph_for

    cfg = compose_config(*overrides(folder, "model.arch=ssdlite320_mobilenet_v3_large"))
    spec = build_data(cfg.data).spec
    with pytest.raises(InferenceError) as err:
        graph_for(SimpleNamespace(spec=spec), build_model(spec, cfg.model))
    message = str(err.value)
    assert "\n" not in message
    assert "ONNX export of ssdlite320_mobilenet_v3_large is not supported" in message
    assert "backend=torch" in message


def test_model_torchvision_names_the_option_for_a_detector(folder):
    with pytest.raises(
        ConfigError, match="model=torchvision takes classifiers.*torchvision_detection"
    ):
        cfg = compose_config("data=digits", "model=torchvision", f"model.arch={ARCH}")
        build_model(build_data(cfg.data).spec, cfg.model)


def test_missing_weights_name_the_file_and_the_folder(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    cfg = compose_config(*overrides(folder, "model.weights=COCO_V1"))
    with pytest.raises(ConfigError, match=r"907ea3f9\.pth.*hub/checkpoints"):
        build_model(build_data(cfg.data).spec, cfg.model)


@pytest.mark.slow
@pytest.mark.parametrize("arch", detection_archs())
def test_every_box_detector_builds_small_and_keeps_the_contract(arch, folder):
    cfg = compose_config(*overrides(folder))
    bundle = build_data(cfg.data)
    model = build_model(bundle.spec, dataclasses.replace(cfg.model, arch=arch))
    images, targets = bundle.collate_fn([bundle.train[i] for i in (0, len(bundle.train) - 1)])
    model.train()
    losses = model(images, targets)
    assert model.check_output("train", losses) == []
    assert all(bool(torch.isfinite(v)) for v in losses.values())
    model.eval()
    with torch.no_grad():
        assert model.check_output("eval", model(images), len(images)) == []


def test_imagenet_backbone_weights_and_trainable_layers(folder, tmp_path, monkeypatch, caplog):
    """model.weights_backbone: mobilenet_v3_large's ImageNet file (written here) into the
    detector's backbone body; model.trainable_layers: only the top stages learn."""
    import torchvision.models

    from kiln.models.zoo.cache import url_file_name

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    weights = torchvision.models.get_model_weights("mobilenet_v3_large").DEFAULT
    classifier = torchvision.models.mobilenet_v3_large(weights=None)
    folder_ = tmp_path / "torch" / "hub" / "checkpoints"
    folder_.mkdir(parents=True)
    torch.save(classifier.state_dict(), folder_ / url_file_name(weights.url))
    cfg = compose_config(
        *overrides(folder, "model.weights_backbone=DEFAULT", "model.trainable_layers=2")
    )
    spec = build_data(cfg.data).spec
    with caplog.at_level("INFO"):
        model = build_model(spec, cfg.model)
    assert "model.weights_backbone:" in caplog.text and "mobilenet_v3_large" in caplog.text
    body = model.net.backbone.body.state_dict()
    assert torch.equal(body["0.0.weight"], classifier.state_dict()["features.0.0.weight"])
    blocks = list(model.net.backbone.body.children())
    assert not any(p.requires_grad for p in blocks[0].parameters())  # the stem: frozen
    assert all(p.requires_grad for p in blocks[-1].parameters())  # the top stage learns
    assert all(p.requires_grad for p in model.net.roi_heads.parameters())
    from kiln.models import without_weights

    assert without_weights(cfg.model).weights_backbone is None  # a checkpoint holds them
    with pytest.raises(ConfigError, match="weights and weights_backbone"):
        compose_config(
            *overrides(folder, "model.weights=DEFAULT", "model.weights_backbone=DEFAULT")
        )


def test_ssdlite_levels_that_match_no_object_are_said_not_judged_dead(folder, caplog):
    """SSDlite320 on the photos (objects of 30-60 px in images of about 120 px, resized to its
    320): the anchors of its coarse levels match no object, so no loss term reaches their heads
    and the extra layers feeding them (gradients exactly zero). The dead-gradients check says
    why instead of refusing torchvision's own model; a parameter of a level that did match an
    object stays judged."""
    from kiln.engine.loss import OwnLossCriterion
    from kiln.guards.live_gradients import check_live_gradients, judged
    from kiln.guards.step_probe import observe_step

    cfg = compose_config(*overrides(folder, "model.arch=ssdlite320_mobilenet_v3_large"))
    bundle = build_data(cfg.data)
    torch.manual_seed(0)
    model = build_model(bundle.spec, cfg.model)
    batch = bundle.collate_fn([bundle.train[i] for i in range(4)])
    seen = observe_step(model, OwnLossCriterion(), batch)
    coarse = "net.head.regression_head.module_list.5.1.weight"  # the 1x1 level
    assert coarse in seen.zero and "net.backbone.extra.3.0.0.weight" in seen.zero
    with caplog.at_level("WARNING"):
        check_live_gradients(seen)
    assert "not judged on the probe batch" in caplog.text
    assert "matched no object in the batch" in caplog.text and "1x1" in caplog.text
    matched, _, side = model.matched_levels(batch)
    assert 0 < len(matched) < 6 and side == 320
    level = min(matched)
    at_a_matched_level = f"net.head.regression_head.module_list.{level}.1.weight"
    assert judged(model, [coarse, at_a_matched_level], batch) == [at_a_matched_level]


# Refused by the learn probe at the defaults (AdamW, lr 3e-3, from random weights with frozen
# BatchNorm, which normalises nothing): one step at 3e-3 takes the probe batch's loss up 1e3 to
# 1e9 times, while at 3e-4 it falls (measured 2026-12-04). A run at the defaults without the
# probe is unstable too (fasterrcnn_resnet50_fpn: 6.8 -> 0.71 at step 2, then 35 and 58 when
# the one-cycle schedule reaches 3e-3, 18 at step 20). Strict: a default that fits them, or a
# probe that judges otherwise, makes these pass, and the mark must go.
# From random weights under AdamW at 3e-3 these diverge on one batch even after the warm-up's
# first steps (the learn probe's fix: optimizer.lr=0.0003); fasterrcnn_resnet50_fpn_v2 and
# ssd300_vgg16 rise from cold too but fall after the warm-up, and train (measured 2026-12-05;
# the same verdicts at the test's batch of 2, 2026-12-07).
LEARN_PROBE_REFUSES = {"fasterrcnn_resnet50_fpn", "retinanet_resnet50_fpn"}


def every_arch():
    from kiln.guards.learn_probe import CannotLearnError

    why = "the learn probe: lr 3e-3 diverges from random weights, after a warm-up too"
    refused = pytest.mark.xfail(raises=CannotLearnError, strict=True, reason=why)
    return [
        pytest.param(a, marks=refused) if a in LEARN_PROBE_REFUSES else a for a in detection_archs()
    ]


@pytest.mark.slow  # every box detector, with every check before step 1: minutes on two CPU cores
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("arch", every_arch())
def test_every_box_detector_trains_with_every_check_on(arch, folder, tmp_path):
    """torchvision's detectors at their defaults on the photo set, every check before step 1
    run (no budget): none refuses torchvision's own model (but LEARN_PROBE_REFUSES). 10 steps:
    onecycle's warm-up starts at a 25th of the lr (2 steps have none to speak of). Batches of 2:
    the probes take the batch size too, and fasterrcnn_resnet50_fpn_v2's box head (4 convs
    over 512 sampled regions an image) made its test 20 minutes of make test-all at 4, 15 at 2."""
    summary = train_in_process(
        tmp_path / "run",
        *overrides(folder, f"model.arch={arch}"),
        "trainer.max_steps=10",
        "data.batch_size=2",
        "trainer.probe_budget.enforce=false",
        "logger=none",
        "device=cpu",
        "env.progress_bar=false",
    )
    assert summary["status"] in ("ok", "at_chance"), summary
    assert summary["steps"] == 10
