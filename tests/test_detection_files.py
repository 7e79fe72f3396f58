"""data=coco and data=yolo on a folder made from real photos (kiln.data.photo_boxes: objects cut
from the packages' sample photos, pasted at known boxes): every bad annotation reported where it
is, the same images as COCO and as YOLO giving the same dataset to the pixel, and kiln's
detector training on it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.data import build_data
from kiln.data.detection_files import DetectionDataError
from kiln.data.photo_boxes import CATEGORIES, make_photo_boxes

from .conftest import compose_config, train_in_process


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return make_photo_boxes(tmp_path_factory.mktemp("photo_boxes"))


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    return make_photo_boxes(tmp_path_factory.mktemp("damaged_boxes"), damaged=True)


def coco_overrides(folder, *extra, val=True):
    val_keys = (f"data.val_json={folder.val_json}", f"data.val_images={folder.val_images}")
    return (
        "data=coco",
        "model=detector",
        f"data.train_json={folder.train_json}",
        f"data.train_images={folder.train_images}",
        *(val_keys if val else ()),
        f"data.cache_dir={folder.root / 'cache'}",
        *extra,
    )


def yolo_overrides(folder, *extra):
    return (
        "data=yolo",
        "model=detector",
        f"data.train_dir={folder.yolo_train}",
        f"data.val_dir={folder.yolo_val}",
        f"data.cache_dir={folder.root / 'cache'}",
        *extra,
    )


def coco(folder, *extra, val=True):
    return build_data(compose_config(*coco_overrides(folder, *extra, val=val)).data)


def expected_boxes(sample) -> tuple[np.ndarray, np.ndarray]:
    label = {c["id"]: k for k, c in enumerate(CATEGORIES, start=1)}
    boxes = np.array([(x, y, x + w, y + h) for x, y, w, h in sample.boxes], np.float32)
    return boxes.reshape(-1, 4), np.array([label[c] for c in sample.categories], np.int64)


def test_coco_boxes_are_xyxy_with_contiguous_labels_and_names(clean):
    bundle = coco(clean)
    assert bundle.spec.task == "detection" and bundle.spec.input_kind == "image_list"
    assert bundle.spec.class_names == ("portrait", "flower")  # category ids 3 and 7 -> 1, 2
    assert bundle.recipe.class_names == ("portrait", "flower")  # what the checkpoint keeps
    assert len(bundle.train) == len(clean.train_samples) and len(bundle.val) == len(
        clean.val_samples
    )
    for dataset, samples in ((bundle.train, clean.train_samples), (bundle.val, clean.val_samples)):
        for i, sample in enumerate(samples):
            image, target = dataset[i]
            assert image.shape == (3, sample.height, sample.width) and image.dtype == torch.float32
            assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0
            boxes, labels = expected_boxes(sample)
            np.testing.assert_array_equal(target["boxes"].numpy(), boxes)
            np.testing.assert_array_equal(target["labels"].numpy(), labels)
    assert len(bundle.train[len(bundle.train) - 1][1]["boxes"]) == 0  # a negative, kept
    assert bundle.report["images_without_boxes"]["train"] == 1


def test_the_probes_pick_a_detection_sets_extremes_from_its_headers_without_decoding(
    clean, tmp_path
):
    """The sizes and box counts a COCO set lists (from the files' headers, at the scan) equal
    its decoded items'; the probes pick the data's extremes from that list, opening no image:
    with every image moved away the list is still there."""
    import shutil
    from pathlib import Path

    from kiln.data.extremes import image_list_sizes

    bundle = coco(clean)
    decoded = [
        (image.shape[-2], image.shape[-1], len(target["boxes"]))
        for image, target in (bundle.train[i] for i in range(len(bundle.train)))
    ]
    paths = [Path(p) for p in bundle.train.paths]
    kept = tmp_path / "kept"
    kept.mkdir()
    for path in paths:
        shutil.move(path, kept / path.name)
    try:
        assert image_list_sizes(bundle) == decoded
    finally:
        for path in paths:
            shutil.move(kept / path.name, path)


def test_the_same_images_as_yolo_give_the_same_dataset(clean):
    from_coco = coco(clean)
    from_yolo = build_data(compose_config(*yolo_overrides(clean)).data)
    assert from_yolo.spec == from_coco.spec
    for split in ("train", "val"):
        a, b = getattr(from_coco, split), getattr(from_yolo, split)
        assert len(a) == len(b)
        for i in range(len(a)):
            (image_a, target_a), (image_b, target_b) = a[i], b[i]
            assert torch.equal(image_a, image_b)
            # the same boxes to the pixel (YOLO's normalised text: within float32 rounding)
            torch.testing.assert_close(target_a["boxes"], target_b["boxes"], atol=1e-3, rtol=0)
            assert torch.equal(target_a["labels"], target_b["labels"])


def test_coco_reports_each_bad_annotation_with_its_file_and_id(damaged):
    bundle = coco(damaged)
    files = bundle.report["train_files"]
    annotations, images = files["annotations"], files["images"]
    assert images["dropped"] == {"missing_image": 1, "duplicate_image_id": 1}
    assert annotations["dropped"] == {
        "missing_image": 1,
        "box_outside_image": 1,
        "zero_area_box": 1,
        "unknown_category": 1,
    }
    by_reason = {r["reason"]: r for r in annotations["dropped_records"]}
    assert by_reason["missing_image"]["file"].endswith("gone.jpg")
    assert by_reason["unknown_category"]["category_id"] == 99
    assert all("annotation_id" in r and "file" in r for r in annotations["dropped_records"])
    assert files["annotations_clipped"] == damaged.clipped == 1
    clipped = files["clipped_records"][0]
    first = damaged.train_samples[0]
    assert clipped["clipped_to"][2:] == [first.width, first.height]
    # the good images are all there, the clipped box on the first one
    assert len(bundle.train) == len(damaged.train_samples)
    assert len(bundle.train[0][1]["boxes"]) == len(first.boxes) + 1


def test_bad_rows_error_stops_at_the_first_bad_input(damaged):
    with pytest.raises(DetectionDataError, match=r"duplicate image id .*train.json.*image_id 1"):
        coco(damaged, "data.bad_rows=error")


def test_without_a_val_set_a_share_of_train_is_held_out(clean):
    bundle = coco(clean, "data.val_fraction=0.25", val=False)
    assert len(bundle.train) + len(bundle.val) == len(clean.train_samples)
    assert len(bundle.val) == 4
    train, val = set(bundle.sources["train"]), set(bundle.sources["val"])
    assert not train & val
    assert bundle.report["split"] == {"val_fraction": 0.25, "split_seed": 0}


def test_a_yolo_line_that_does_not_parse_is_reported(clean, tmp_path):
    import shutil

    root = tmp_path / "yolo"
    shutil.copytree(clean.yolo_train.parent.parent, root)
    label = root / "labels" / "train" / "img_001.txt"
    label.write_text(label.read_text() + "flower 0.5 0.5 0.1\n7 0.5 0.5 0.2 0.2\n")
    (root / "labels" / "train" / "orphan.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    cfg = compose_config(
        "data=yolo",
        "model=detector",
        f"data.train_dir={root / 'images/train'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ).data
    report = build_data(cfg).report["train_files"]["annotations"]
    assert report["dropped"] == {"missing_image": 1, "unknown_category": 1, "bad_label_line": 1}
    bad_line = next(r for r in report["dropped_records"] if r["reason"] == "bad_label_line")
    lines = label.read_text().splitlines()
    assert bad_line["line"] == len(lines) - 1 and bad_line["label_file"] == str(label)


def yolo_copy(clean, tmp_path, names_yaml: str):
    import shutil

    root = tmp_path / "yolo"
    shutil.copytree(clean.yolo_train.parent.parent, root)
    (root / "data.yaml").write_text(names_yaml)
    return root


def yolo_bundle(root, tmp_path):
    cfg = compose_config(
        "data=yolo",
        "model=detector",
        f"data.train_dir={root / 'images/train'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ).data
    return build_data(cfg)


def test_yolo_nc_and_names_are_checked_against_each_other_and_the_labels(clean, tmp_path, caplog):
    """nc that is not the number of names is an error; a name no label uses (an empty class)
    is a warning naming it, and listed in data_report.json."""
    root = yolo_copy(clean, tmp_path, "nc: 3\nnames: [portrait, flower]\n")
    with pytest.raises(
        DetectionDataError,
        match=r"nc: 3 but names lists 2 class\(es\) "
        r"\(portrait, flower\)",
    ):
        yolo_bundle(root, tmp_path)
    (root / "data.yaml").write_text("nc: 4\nnames: [portrait, flower, dog, cat]\n")
    with caplog.at_level("WARNING"):
        bundle = yolo_bundle(root, tmp_path)
    assert bundle.report["names_without_boxes"] == ["dog", "cat"]
    assert "names 2 class(es) no label uses: dog, cat" in caplog.text


def test_pixel_unit_yolo_labels_are_named_as_such(clean, tmp_path):
    root = yolo_copy(clean, tmp_path, "names: [portrait, flower]\n")
    label = root / "labels" / "train" / "img_001.txt"
    label.write_text(label.read_text() + "1 60 50 30 20\n")  # pixels of a ~120 px image
    report = yolo_bundle(root, tmp_path).report["train_files"]["annotations"]
    assert report["dropped"] == {"pixel_units": 1}
    (record,) = report["dropped_records"]
    assert record["label_file"] == str(label) and record["text"] == "1 60 50 30 20"
    assert "values > 1: these look like pixels, YOLO wants 0..1" in record["detail"]


def test_boxes_clipped_to_their_image_are_counted_in_the_log(damaged, caplog):
    with caplog.at_level("WARNING"):
        bundle = coco(damaged)
    line = "train.json: 1 box(es) partly outside their image clipped to it and kept"
    assert line in caplog.text
    assert any(line in summary for summary in bundle.report["summary"])


def test_missing_keys_and_files_are_one_line_errors(tmp_path):
    from kiln.config import ConfigError

    with pytest.raises(ConfigError, match="data.train_json"):
        compose_config("data=coco", "model=detector")
    (tmp_path / "bad.json").write_text('{"images": []}')
    cfg = compose_config(
        "data=coco",
        "model=detector",
        f"data.train_json={tmp_path / 'bad.json'}",
        f"data.train_images={tmp_path}",
    ).data
    with pytest.raises(DetectionDataError, match="not COCO instances JSON.*annotations"):
        build_data(cfg)


def test_kilns_detector_trains_on_coco_and_reports_the_bad_annotations(damaged, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # with the SSD augmentation: its items are keyed (index, seed, epoch) by the training sampler
    summary = train_in_process(
        run_dir,
        *coco_overrides(damaged),
        "model.width=8",
        "data.augment=ssd",
        "trainer.max_steps=2",
        "logger=none",
        "device=cpu",
        "env.progress_bar=false",
    )
    assert summary["status"] in ("ok", "at_chance"), summary
    report = json.loads((run_dir / "data_report.json").read_text())
    assert report["train_files"]["annotations"]["annotations_dropped"] == 4
    assert "val_map50" in summary and "val_map" in summary and "val_map_75" in summary
    assert summary["monitor"] == "val_map"  # COCO's mAP@[.5:.95] picks best.pt
    # infer.py on the validation images, each also drawn with its boxes (draw=true)
    from kiln.cli.infer import main as infer_main

    output = tmp_path / "preds.csv"
    infer_main(
        [
            f"ckpt={run_dir / 'checkpoints' / 'best.pt'}",
            f"input={damaged.val_images}",
            f"output={output}",
            "draw=true",
        ]
    )
    assert "drew the boxes on 6 images" in capsys.readouterr().out
    drawn = sorted(p.name for p in (tmp_path / "preds_boxes").iterdir())
    assert drawn == [f"{i}_img_{i:03d}.png" for i in range(6)]


# --- rule 3 for detectors: each mode held to the declared contract, eval with and without grad


class _GradDependentDetector(torch.nn.Module):
    """A detector whose eval-mode output has one box more when autograd is on."""

    def __init__(self):
        from kiln.models.detection_contract import DetectionContract

        super().__init__()
        self.contract = DetectionContract()
        self.contract.loss_keys, self.contract.num_classes = ("loss",), 2
        self.weight = torch.nn.Parameter(torch.ones(()))

    computes_own_loss = True

    def check_output(self, mode, output, batch_size=None):
        return self.contract.check_output(mode, output, batch_size)

    def forward(self, images, targets=None):
        if self.training:
            return {"loss": self.weight * 1.0}
        k = 2 if torch.is_grad_enabled() else 1
        return [
            {
                "boxes": torch.zeros(k, 4),
                "labels": torch.ones(k, dtype=torch.long),
                "scores": torch.ones(k) * self.weight,
            }
            for _ in images
        ]


def test_rule3_compares_a_detectors_eval_outputs_with_and_without_grad():
    from kiln.engine.loss import OwnLossCriterion
    from kiln.guards.shape_check import ShapeContractError, check_train_eval_agreement

    batch = (
        [torch.zeros(3, 16, 16)],
        [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}],
    )
    model = _GradDependentDetector()
    with pytest.raises(ShapeContractError, match="eval mode with grad vs without") as info:
        check_train_eval_agreement(model, batch, OwnLossCriterion().forward)
    assert "differ by design" in str(info.value) and "instead of comparing" in str(info.value)


# --- data.augment: boxes kept in sync with the pixels


@pytest.mark.parametrize("augment", ["hflip", "hflip_scale", "ssd"])
def test_augmented_boxes_stay_in_their_image_and_an_item_repeats_from_its_key(clean, augment):
    bundle = coco(clean, f"data.augment={augment}")
    assert bundle.train.seeded_keys and bundle.report["input"]["augment"] == augment
    for index in range(len(bundle.train)):
        for epoch in (0, 1):
            image, target = bundle.train[(index, 7, epoch)]
            again, target_again = bundle.train[(index, 7, epoch)]
            assert torch.equal(image, again) and torch.equal(target["boxes"], target_again["boxes"])
            height, width = image.shape[1:]
            boxes = target["boxes"]
            assert len(boxes) == len(target["labels"]) and image.dtype == torch.float32
            assert bool((boxes[:, :2] >= 0).all() and (boxes[:, 2:] > boxes[:, :2]).all())
            assert bool((boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all())
    assert not bundle.val.seeded_keys  # validation is never augmented


def test_hflip_mirrors_the_boxes_with_the_pixels(clean):
    plain = coco(clean)
    flipped = coco(clean, "data.augment=hflip")
    seen_flip = False
    for index in range(len(plain.train)):
        image, target = plain.train[index]
        for epoch in range(4):
            got, got_target = flipped.train[(index, 0, epoch)]
            if torch.equal(got, image):
                assert torch.equal(got_target["boxes"], target["boxes"])
                continue
            seen_flip = True
            assert torch.equal(got, image.flip(-1))
            width = image.shape[-1]
            mirrored = target["boxes"][:, [2, 1, 0, 3]] * torch.tensor(
                [-1, 1, -1, 1]
            ) + torch.tensor([width, 0, width, 0])
            torch.testing.assert_close(got_target["boxes"], mirrored)
    assert seen_flip


def test_group_by_aspect_ratio_batches_images_of_one_shape_with_seeded_keys(clean):
    from kiln.data.loaders import train_sampler_for

    bundle = coco(clean, "data.group_by_aspect_ratio=true", "data.augment=hflip")
    wide = bundle.bucket_lengths
    assert wide is not None and 0 < sum(wide) < len(wide)  # both shapes are in the data
    sampler = train_sampler_for(bundle, 2, rank=0, world_size=1, seed=3)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        keys = list(sampler)
        assert all(key[1:] == (3, epoch) for key in keys)  # augmentation keys, as unbatched
        batches = [keys[i : i + 2] for i in range(0, len(keys), 2)]
        mixed = [b for b in batches if len({wide[index] for index, _, _ in b}) > 1]
        assert len(mixed) <= 1  # one pool of batches: at most its boundary batch mixes
        assert sorted(index for index, _, _ in keys) == list(range(len(bundle.train)))


def test_coco_metrics_leave_undefined_sizes_out_and_always_give_val_map():
    from kiln.engine.detection_eval import coco_metrics

    truth = [{"boxes": torch.tensor([[10.0, 10.0, 50.0, 50.0]]), "labels": torch.tensor([1])}]
    found = [
        {
            "boxes": torch.tensor([[10.0, 10.0, 50.0, 50.0]]),
            "labels": torch.tensor([1]),
            "scores": torch.tensor([0.9]),
        }
    ]
    metrics = coco_metrics(found, truth)
    assert metrics["val_map"] == pytest.approx(1.0) and metrics["val_map_75"] == pytest.approx(1.0)
    assert metrics["val_map_medium"] == pytest.approx(1.0)  # 40 x 40: COCO's medium
    assert "val_map_small" not in metrics and "val_map_large" not in metrics  # undefined: -1
    empty = [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}]
    assert coco_metrics(found, empty) == {"val_map": 0.0}


def test_the_detection_report_draws_the_boxes_and_the_ap_per_class(clean, tmp_path):
    from PIL import Image

    from kiln.inference.evaluate import write_detection_report

    bundle = coco(clean)
    items = [bundle.val[i] for i in range(len(bundle.val))]
    targets = [{k: v.numpy() for k, v in t.items()} for _, t in items]
    found = [{**t, "scores": np.full(len(t["labels"]), 0.9, np.float32)} for t in targets]
    report = write_detection_report(
        tmp_path,
        found,
        targets,
        bundle.sources["val"],
        bundle.spec.class_names,
        {},
        images=[image.numpy() for image, _ in items],
    )
    assert report.metrics["map"] == pytest.approx(1.0)
    assert {"boxes.png", "ap_per_class.png"} <= set(report.metrics["files"])
    for name in ("boxes.png", "ap_per_class.png"):
        with Image.open(tmp_path / name) as picture:
            assert picture.format == "PNG" and min(picture.size) > 200


def with_crowd(json_path, out_path, crowds: list[tuple[int, int, list[float]]]) -> None:
    """A copy of a COCO file with iscrowd regions added: (image id, category id, bbox)."""
    data = json.loads(json_path.read_text())
    next_id = max(a["id"] for a in data["annotations"]) + 1
    for offset, (image_id, category, bbox) in enumerate(crowds):
        data["annotations"].append(
            {
                "id": next_id + offset,
                "image_id": image_id,
                "category_id": category,
                "bbox": bbox,
                "iscrowd": 1,
                "area": bbox[2] * bbox[3],
            }
        )
    out_path.write_text(json.dumps(data))


def test_iscrowd_regions_are_not_trained_on_and_are_scored_as_coco_scores_them(clean, tmp_path):
    from kiln.engine.detection_eval import coco_metrics
    from kiln.inference.detection_report import detection_errors, detection_metrics

    train_data = json.loads(clean.train_json.read_text())
    val_data = json.loads(clean.val_json.read_text())
    first_train, (first_val, second_val) = train_data["images"][0], val_data["images"][:2]
    category = CATEGORIES[0]["id"]
    region = [2.0, 3.0, 30.0, 25.0]  # x, y, w, h
    with_crowd(clean.train_json, tmp_path / "train.json", [(first_train["id"], category, region)])
    val_crowds = [(first_val["id"], category, region), (second_val["id"], category, region)]
    with_crowd(clean.val_json, tmp_path / "val.json", val_crowds)
    cfg = compose_config(
        "data=coco",
        "model=detector",
        f"data.train_json={tmp_path / 'train.json'}",
        f"data.train_images={clean.train_images}",
        f"data.val_json={tmp_path / 'val.json'}",
        f"data.val_images={clean.val_images}",
        f"data.cache_dir={clean.root / 'cache'}",
    )
    bundle = build_data(cfg.data)
    plain = coco(clean)
    assert bundle.report["iscrowd"] == {"train": 1, "val": 2}
    # training: the crowd region is no box to learn, and nothing else changed
    _, train_target = bundle.train[0]
    assert set(train_target) == {"boxes", "labels"}
    assert torch.equal(train_target["boxes"], plain.train[0][1]["boxes"])
    assert sum(bundle.report["train_files"]["annotations"]["dropped"].values()) == 0
    # evaluation: the val items carry their crowd regions beside their boxes
    _, val_target = bundle.val[0]
    assert torch.equal(val_target["boxes"], plain.val[0][1]["boxes"])
    assert val_target["crowd_boxes"].tolist() == [[2.0, 3.0, 32.0, 28.0]]
    assert val_target["crowd_labels"].tolist() == [1]
    targets = [bundle.val[i][1] for i in range(len(bundle.val))]
    sources = [f"val/{i}" for i in range(len(targets))]
    perfect = [
        {"boxes": t["boxes"], "labels": t["labels"], "scores": torch.full((len(t["labels"]),), 0.9)}
        for t in targets
    ]
    # a confident detection on the first crowd region; none on the second (no miss either)
    on_crowd = [dict(p) for p in perfect]
    on_crowd[0] = {
        "boxes": torch.cat([perfect[0]["boxes"], targets[0]["crowd_boxes"]]),
        "labels": torch.cat([perfect[0]["labels"], targets[0]["crowd_labels"]]),
        "scores": torch.cat([perfect[0]["scores"], torch.tensor([0.95])]),
    }
    assert coco_metrics(on_crowd, targets)["val_map"] == pytest.approx(1.0)
    assert detection_metrics(on_crowd, targets, bundle.spec.class_names)["map"] == pytest.approx(
        1.0
    )
    # without the crowd regions the same detection is a false positive, ranked first
    no_crowd = [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets]
    assert coco_metrics(on_crowd, no_crowd)["val_map"] < 0.99
    # errors.csv agrees: no mistake with the crowd regions, one invented box without them
    names = bundle.spec.class_names
    assert detection_errors(on_crowd, targets, sources, names, limit=10).empty
    invented = detection_errors(on_crowd, no_crowd, sources, names, limit=10)
    assert invented[["source", "false_positives", "missed"]].values.tolist() == [[sources[0], 1, 0]]
    # a detection of another class on the crowd region is still invented
    other = dict(on_crowd[0], labels=on_crowd[0]["labels"].clone())
    other["labels"][-1] = 2 if int(other["labels"][-1]) == 1 else 1
    wrong_class = detection_errors([other, *on_crowd[1:]], targets, sources, names, limit=10)
    assert wrong_class["false_positives"].tolist() == [1]


def test_boxes_are_checked_against_the_picture_the_exif_orientation_stands_up(tmp_path):
    """A JPEG stored 120 wide and 80 high with EXIF orientation 6 (turn 90 degrees) decodes 80
    wide and 120 high, for training as for the box checks: a box low in the standing picture is
    kept as it is (not clipped to the stored height), one right of its width is outside it; a
    YOLO label is normalised to the standing picture too."""
    from PIL import Image

    images = tmp_path / "images" / "train"
    images.mkdir(parents=True)
    stored = Image.new("RGB", (120, 80), (200, 30, 30))
    stored.paste((20, 200, 20), (0, 0, 60, 80))  # the left half green: the turn is visible
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(images / "phone.jpg", quality=95, exif=exif.tobytes())
    categories = [{"id": 1, "name": "thing"}]
    data = {
        "images": [{"id": 1, "file_name": "phone.jpg", "width": 80, "height": 120}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 90, 50, 25]},
            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [90, 10, 20, 20]},
        ],
        "categories": categories,
    }
    (tmp_path / "train.json").write_text(json.dumps(data))
    bundle = build_data(
        compose_config(
            "data=coco",
            "model=detector",
            f"data.train_json={tmp_path / 'train.json'}",
            f"data.train_images={images}",
            f"data.val_json={tmp_path / 'train.json'}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ).data
    )
    image, target = bundle.train[0]
    assert tuple(image.shape) == (3, 120, 80)  # decoded standing up
    assert target["boxes"].tolist() == [[10.0, 90.0, 60.0, 115.0]]  # kept, not clipped
    files = bundle.report["train_files"]
    assert files["annotations_clipped"] == 0
    (dropped,) = files["annotations"]["dropped_records"]
    assert dropped["reason"] == "box_outside_image" and dropped["annotation_id"] == 2
    assert dropped["image_size"] == [80, 120]  # width, height of the standing picture
    # YOLO: cx cy w h normalised to the standing picture's 80 x 120
    labels = tmp_path / "labels" / "train"
    labels.mkdir(parents=True)
    (labels / "phone.txt").write_text(f"0 {35 / 80} {102.5 / 120} {50 / 80} {25 / 120}\n")
    (tmp_path / "data.yaml").write_text("names: [thing]\n")
    yolo = build_data(
        compose_config(
            "data=yolo",
            "model=detector",
            f"data.train_dir={images}",
            f"data.val_dir={images}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ).data
    )
    np.testing.assert_allclose(yolo.train[0][1]["boxes"].numpy(), [[10, 90, 60, 115]], atol=1e-4)
