"""shapes_detection data, the detector model (train/eval conventions, output contract) and mAP."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from kiln.config import ConfigError
from kiln.data import build_data
from kiln.data.shapes_detection import collate_image_list
from kiln.data.spec import DataSpec
from kiln.engine.detection_eval import mean_average_precision
from kiln.models import build_model
from kiln.models.detector import LOSS_KEYS as DETECTOR_LOSS_KEYS

from .conftest import compose_config

LOSS_KEYS = set(DETECTOR_LOSS_KEYS)


def data_cfg(**overrides):
    # The real option, shrunk to a handful of small images so the tests stay quick on a CPU.
    shrunk = {"num_train": 8, "num_val": 4, "image_size": 64, "min_image_size": 40}
    cfg = compose_config("data=shapes_detection", "model=detector").data
    cfg = dataclasses.replace(cfg, **{**shrunk, **overrides})
    cfg.check("data")  # as the CLI would
    return cfg


def detector_cfg():
    return compose_config("data=shapes_detection", "model=detector").model


@pytest.fixture(scope="module")
def bundle():
    return build_data(data_cfg())


@pytest.fixture(scope="module")
def detector(bundle):
    torch.manual_seed(0)
    return build_model(bundle.spec, detector_cfg())


def _batch(bundle, batch_size: int):
    # The first images have different sizes (checked in test_images_have_mixed_sizes).
    return bundle.collate_fn([bundle.train[i] for i in range(batch_size)])


# --- the dataset ---------------------------------------------------------------------------


def test_spec_and_preprocessing(bundle):
    cfg, spec = data_cfg(), bundle.spec
    assert spec.task == "detection" and spec.input_kind == "image_list" and spec.channels == 3
    assert spec.image_size == (cfg.image_size, cfg.image_size)
    assert spec.num_classes == cfg.num_classes == len(spec.class_names)
    assert spec.class_names[:2] == ("rectangle", "ellipse")
    assert bundle.recipe.to_dict()["kind"] == "image_list"
    assert bundle.recipe.class_names == spec.class_names
    assert len(bundle.train) == cfg.num_train and len(bundle.val) == cfg.num_val


def test_items_have_valid_boxes_and_labels(bundle):
    cfg = data_cfg()
    for dataset in (bundle.train, bundle.val):
        for image, target in (dataset[i] for i in range(len(dataset))):
            channels, height, width = image.shape
            assert channels == 3 and image.dtype == torch.float32
            assert cfg.min_image_size <= min(height, width) <= max(height, width) <= cfg.image_size
            assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0
            boxes, labels = target["boxes"], target["labels"]
            assert boxes.dtype == torch.float32 and labels.dtype == torch.long
            assert 1 <= len(labels) == len(boxes) <= cfg.max_objects
            assert boxes.shape[1] == 4
            assert bool((boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all())
            assert float(boxes[:, [0, 1]].min()) >= 0
            assert bool((boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all())
            assert bool(((labels >= 1) & (labels <= cfg.num_classes)).all())


def test_images_have_mixed_sizes(bundle):
    sizes = {tuple(bundle.train[i][0].shape[1:]) for i in range(3)}
    assert len(sizes) == 3


def test_generation_is_seeded_and_train_differs_from_val(bundle):
    again = build_data(data_cfg())
    assert torch.equal(again.train[0][0], bundle.train[0][0])
    assert torch.equal(again.train[0][1]["boxes"], bundle.train[0][1]["boxes"])
    assert bundle.train[0][0].shape != bundle.val[0][0].shape or not torch.equal(
        bundle.train[0][0], bundle.val[0][0]
    )
    other = build_data(data_cfg(split_seed=5))
    assert not torch.equal(other.train[0][1]["boxes"], bundle.train[0][1]["boxes"])


def test_min_image_size_zero_means_fixed_size():
    fixed = build_data(data_cfg(min_image_size=0, image_size=48, num_train=3, num_val=1))
    assert {tuple(fixed.train[i][0].shape[1:]) for i in range(3)} == {(48, 48)}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"min_image_size": 200}, "min_image_size"),
        ({"num_classes": 99}, "num_classes"),
        ({"max_objects": 0}, "max_objects"),
    ],
)
def test_bad_config_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        data_cfg(**overrides)


def test_collate_keeps_lists_and_is_picklable(bundle):
    images, targets = _batch(bundle, 3)
    assert isinstance(images, list) and isinstance(targets, list)
    assert len(images) == len(targets) == 3
    assert torch.equal(images[1], bundle.train[1][0])
    assert pickle.loads(pickle.dumps(bundle.collate_fn)) is collate_image_list


# --- the detector ----------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 3])
def test_train_mode_returns_the_loss_dict(bundle, detector, batch_size):
    images, targets = _batch(bundle, batch_size)
    detector.train()
    losses = detector(images, targets)
    assert set(losses) == LOSS_KEYS
    assert detector.check_output("train", losses) == []
    assert all(torch.isfinite(loss) for loss in losses.values())


def test_train_mode_backward_gives_finite_grads(bundle, detector):
    # One backward only: the first backward through MobileNet's depthwise convolutions compiles
    # oneDNN kernels for the shape, which costs seconds on a small CPU.
    images, targets = _batch(bundle, 3)
    detector.train()
    detector.zero_grad()
    losses = detector(images, targets)
    sum(losses.values()).backward()
    grads = [p.grad for p in detector.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)


def test_train_mode_without_targets_is_a_clear_error(bundle, detector):
    images, _ = _batch(bundle, 1)
    detector.train()
    with pytest.raises(ValueError, match="needs targets"):
        detector(images)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_eval_mode_returns_one_detection_dict_per_image(bundle, detector, batch_size):
    images, _ = _batch(bundle, batch_size)
    detector.eval()
    with torch.no_grad():
        detections = detector(images)
    assert detector.check_output("eval", detections, batch_size=batch_size) == []
    assert len(detections) == batch_size
    for image, found in zip(images, detections, strict=True):
        height, width = image.shape[1:]
        assert set(found) == {"boxes", "labels", "scores"}
        if len(found["boxes"]):  # boxes are in the input image's own pixel coordinates
            assert float(found["boxes"][:, 2].max()) <= width
            assert float(found["boxes"][:, 3].max()) <= height


def _fake_detections(batch_size: int, num_boxes: int, num_classes: int):
    return [
        {
            "boxes": torch.rand(num_boxes, 4),
            "labels": torch.randint(1, num_classes + 1, (num_boxes,)),
            "scores": torch.rand(num_boxes),
        }
        for _ in range(batch_size)
    ]


def test_check_output_finds_wrong_eval_outputs(bundle, detector):
    num_classes = bundle.spec.num_classes
    good = _fake_detections(2, 3, num_classes)
    assert detector.check_output("eval", good, batch_size=2) == []

    wide = _fake_detections(2, 3, num_classes)
    wide[1]["boxes"] = torch.rand(3, 5)
    assert detector.check_output("eval", wide) == [
        "output[1]['boxes']: expected (K, 4), got (3, 5)"
    ]

    uneven = _fake_detections(2, 3, num_classes)
    uneven[0]["scores"] = uneven[0]["scores"][:2]  # K differs between boxes and scores
    assert detector.check_output("eval", uneven) == ["output[0]['scores']: expected (K,), got (2,)"]

    missing = _fake_detections(2, 3, num_classes)
    del missing[1]["labels"]
    assert "output[1]: missing key 'labels'" in detector.check_output("eval", missing)[0]

    background = _fake_detections(1, 3, num_classes)
    background[0]["labels"][0] = 0
    assert "expected values in 1.." in detector.check_output("eval", background)[0]

    problems = detector.check_output("eval", good, batch_size=3)
    assert problems and "expected 3 detection dicts" in problems[0]
    assert detector.check_output("eval", {"boxes": good[0]["boxes"]})  # not a list


def test_check_output_finds_wrong_train_outputs(detector):
    good = {key: torch.tensor(1.0) for key in LOSS_KEYS}
    assert detector.check_output("train", good) == []

    per_image = dict(good, loss_heatmap=torch.ones(2))
    assert detector.check_output("train", per_image) == [
        "output['loss_heatmap']: expected (), got (2,)"
    ]

    incomplete = {key: value for key, value in good.items() if key != "loss_size"}
    assert "missing keys ['loss_size']" in detector.check_output("train", incomplete)[0]
    assert detector.check_output("train", torch.tensor(1.0))  # a bare tensor is not the dict


def test_output_contract_describes_both_modes(detector):
    assert set(detector.output_contract("train")["keys"]) == LOSS_KEYS
    assert set(detector.output_contract("eval")["item"]) == {"boxes", "labels", "scores"}
    with pytest.raises(ValueError, match="'train' or 'eval'"):
        detector.output_contract("predict")


def test_detector_computes_its_own_loss(detector):
    assert detector.computes_own_loss is True


def test_detector_rejects_classification_data():
    spec = DataSpec(
        task="classification",
        input_kind="image",
        num_classes=10,
        class_names=tuple(str(i) for i in range(10)),
        channels=3,
        image_size=(32, 32),
    )
    with pytest.raises(ValueError, match="needs detection data"):
        build_model(spec, detector_cfg())


# --- mAP ---------------------------------------------------------------------------------------


def _target(boxes, labels):
    return {
        "boxes": torch.tensor(boxes, dtype=torch.float32),
        "labels": torch.tensor(labels, dtype=torch.long),
    }


def _prediction(boxes, labels, scores):
    return {**_target(boxes, labels), "scores": torch.tensor(scores, dtype=torch.float32)}


SQUARE, OTHER_SQUARE, FAR_AWAY = [0, 0, 10, 10], [20, 20, 30, 30], [50, 50, 60, 60]


def test_map_perfect_predictions_is_one():
    targets = [_target([SQUARE, OTHER_SQUARE], [1, 2]), _target([FAR_AWAY], [1])]
    predictions = [
        _prediction([SQUARE, OTHER_SQUARE], [1, 2], [0.9, 0.8]),
        _prediction([FAR_AWAY], [1], [0.7]),
    ]
    assert mean_average_precision(predictions, targets) == pytest.approx(1.0)


def test_map_all_wrong_is_zero():
    targets = [_target([SQUARE], [1]), _target([OTHER_SQUARE], [2])]
    misplaced = [_prediction([FAR_AWAY], [1], [0.9]), _prediction([SQUARE], [2], [0.9])]
    wrong_class = [_prediction([SQUARE], [2], [0.9]), _prediction([OTHER_SQUARE], [1], [0.9])]
    assert mean_average_precision(misplaced, targets) == pytest.approx(0.0)
    assert mean_average_precision(wrong_class, targets) == pytest.approx(0.0)


def test_map_one_class_right_one_wrong_is_half():
    targets = [_target([SQUARE, OTHER_SQUARE], [1, 2])]
    predictions = [
        _prediction([SQUARE, FAR_AWAY], [1, 2], [0.9, 0.9])
    ]  # class 1 AP 1, class 2 AP 0
    assert mean_average_precision(predictions, targets) == pytest.approx(0.5)


def test_map_ranking_false_positive_first():
    # Ranked: FP (P=0, R=0), TP (P=1/2, R=1/2), TP (P=2/3, R=1). The interpolated precision
    # (best precision at any recall >= r) is 2/3 at every recall level, so AP = 2/3.
    targets = [_target([SQUARE, OTHER_SQUARE], [1, 1])]
    predictions = [_prediction([FAR_AWAY, SQUARE, OTHER_SQUARE], [1, 1, 1], [0.9, 0.8, 0.7])]
    assert mean_average_precision(predictions, targets) == pytest.approx(2 / 3)


def test_map_half_recall_uses_101_point_interpolation():
    # One of two boxes found at precision 1: recall levels 0.00..0.50 (51 of COCO's 101) have
    # precision 1, the rest 0.
    targets = [_target([SQUARE, OTHER_SQUARE], [1, 1])]
    predictions = [_prediction([SQUARE], [1], [0.9])]
    assert mean_average_precision(predictions, targets) == pytest.approx(51 / 101)


def test_map_iou_threshold():
    targets = [_target([SQUARE], [1])]
    predictions = [_prediction([[0, 0, 10, 4]], [1], [0.9])]  # IoU = 40 / 100 = 0.4
    assert mean_average_precision(predictions, targets) == pytest.approx(0.0)
    assert mean_average_precision(predictions, targets, iou_threshold=0.3) == pytest.approx(1.0)


def test_map_edge_cases():
    empty_target = _target([], [])
    empty_target["boxes"] = empty_target["boxes"].reshape(0, 4)
    no_boxes = _prediction([], [], [])
    no_boxes["boxes"] = no_boxes["boxes"].reshape(0, 4)
    assert mean_average_precision([no_boxes], [empty_target]) == 0.0
    assert mean_average_precision([no_boxes], [_target([SQUARE], [1])]) == 0.0
    with pytest.raises(ValueError, match="one prediction per target"):
        mean_average_precision([no_boxes], [])
