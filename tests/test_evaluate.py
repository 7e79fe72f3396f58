"""The evaluation report (kiln.inference.evaluate): its numbers against scikit-learn's on the same
predictions, the confusion matrix's readability at 50 classes, errors.csv's order, `infer.py
mode=evaluate` on real (tiny) checkpoints of each task, equality with `infer.py` predict, the
end-of-training report on a test split, and its `error:` lines."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import TensorDataset

from kiln.cli.infer import main as infer_main
from kiln.engine.evaluators import macro_f1
from kiln.inference.confusion import DPI, confusion_figure, font_sizes
from kiln.inference.detection_report import detection_metrics, match_image
from kiln.inference.evaluate import classification_metrics, write_classification_report

from .conftest import compose_config, read_summary
from .inference_helpers import detector_run, digits_run, raw_digits_val, text_run

ABOUT = {"checkpoint": "ckpt.pt", "data": {"split": "val"}}


def random_predictions(num: int, k: int, seed: int = 0, absent: tuple[int, ...] = ()):
    """Probabilities (num, k) that are right about 60% of the time; classes in `absent` never
    appear, neither as labels nor as predictions."""
    rng = np.random.default_rng(seed)
    present = np.array([c for c in range(k) if c not in absent])
    targets = rng.choice(present, size=num)
    logits = rng.normal(size=(num, k))
    logits[np.arange(num), targets] += 1.5
    logits[:, list(absent)] = -50.0
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return probs.astype(np.float32), targets.astype(np.int64)


def run_infer(capsys, *argv: str) -> tuple[int, str, str]:
    """`python infer.py <argv>` in this process: (exit status, stdout, stderr)."""
    try:
        infer_main(list(argv))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------------------------------------
# The numbers, against an independent computation


@pytest.mark.parametrize("k, absent", [(12, (3, 7)), (3, ())])
def test_metrics_equal_scikit_learns_on_the_same_predictions(k, absent):
    # scikit-learn is imported where it is the reference, not at the top: every xdist worker
    # collecting the suite paid its import (2 CPU-s).
    from sklearn.metrics import classification_report, confusion_matrix, top_k_accuracy_score

    probs, targets = random_predictions(500, k, absent=absent)
    names = [f"c{i}" for i in range(k)]
    ours = classification_metrics(probs, targets, names)
    predicted = probs.argmax(1)
    theirs = classification_report(targets, predicted, output_dict=True, zero_division=0)
    assert ours["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-6)
    # Macro averages over the classes in the labels or predictions, as scikit-learn's default.
    assert ours["macro_f1"] == pytest.approx(theirs["macro avg"]["f1-score"], abs=1e-6)
    assert ours["macro_precision"] == pytest.approx(theirs["macro avg"]["precision"], abs=1e-6)
    assert ours["macro_recall"] == pytest.approx(theirs["macro avg"]["recall"], abs=1e-6)
    # Validation's val_macro_f1, from the flat counts the evaluator sums over ranks: the same.
    flat = torch.bincount(torch.from_numpy(targets * k + predicted), minlength=k * k)
    assert macro_f1(flat.double()) == pytest.approx(theirs["macro avg"]["f1-score"], abs=1e-6)
    for i, name in enumerate(names):
        row = ours["per_class"][name]
        if i in absent:
            assert row == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}
            continue
        for key, their_key in (
            ("precision", "precision"),
            ("recall", "recall"),
            ("f1", "f1-score"),
        ):
            assert row[key] == pytest.approx(theirs[str(i)][their_key], abs=1e-6), (name, key)
        assert row["support"] == theirs[str(i)]["support"]
    expected = confusion_matrix(targets, predicted, labels=range(k))
    assert ours["confusion_matrix"] == expected.tolist()
    assert ours["count"] == 500 and ours["errors"] == int((predicted != targets).sum())
    if k > 5:
        top5 = top_k_accuracy_score(targets, probs, k=5, labels=range(k))
        assert ours["top5_accuracy"] == pytest.approx(top5, abs=1e-6)


def test_top5_accuracy_only_with_more_than_five_classes():
    five, six = random_predictions(50, 5), random_predictions(50, 6)
    assert "top5_accuracy" not in classification_metrics(*five, list("abcde"))
    assert "top5_accuracy" in classification_metrics(*six, list("abcdef"))


def test_errors_csv_lists_the_most_confident_mistakes_first(tmp_path):
    probs = np.array(
        [
            [0.9, 0.05, 0.05],  # right
            [0.2, 0.7, 0.1],  # wrong (true 0): 0.7
            [0.1, 0.1, 0.8],  # wrong (true 1): 0.8
            [0.6, 0.3, 0.1],  # wrong (true 2): 0.6
            [0.2, 0.7, 0.1],  # wrong (true 0): 0.7, a tie with row 1: kept in input order
        ],
        dtype=np.float32,
    )
    targets = np.array([0, 0, 1, 2, 0])
    sources = [f"photos/{i}.png" for i in range(5)]
    report = write_classification_report(
        tmp_path, probs, targets, sources, ["cat", "dog", "owl"], ABOUT, num_errors=3
    )
    errors = pd.read_csv(tmp_path / "errors.csv")
    assert list(errors.columns) == ["source", "true", "predicted", "prob_predicted", "prob_true"]
    assert errors["source"].tolist() == ["photos/2.png", "photos/1.png", "photos/4.png"]
    assert errors["true"].tolist() == ["dog", "cat", "cat"]
    assert errors["predicted"].tolist() == ["owl", "dog", "dog"]
    np.testing.assert_allclose(errors["prob_predicted"], [0.8, 0.7, 0.7], atol=1e-6)
    np.testing.assert_allclose(errors["prob_true"], [0.1, 0.2, 0.2], atol=1e-6)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics == json.loads(json.dumps(report.metrics))
    assert metrics["errors"] == 4 and metrics["checkpoint"] == "ckpt.pt"
    predictions = pd.read_csv(tmp_path / "predictions.csv")
    assert predictions["label"].tolist() == ["cat", "dog", "owl", "cat", "dog"]
    assert predictions["source"].tolist() == sources


# ---------------------------------------------------------------------------------------------
# The confusion matrix


def _label_boxes(figure, labels):
    renderer = figure.canvas.get_renderer()
    return [label.get_window_extent(renderer) for label in labels]


def _overlapping(boxes) -> list[int]:
    return [i for i in range(len(boxes) - 1) if boxes[i].overlaps(boxes[i + 1])]


@pytest.mark.parametrize("k", [10, 50])
def test_confusion_matrix_is_readable_and_scales_with_the_classes(tmp_path, k):
    names = [f"{'golden_retriever' if i % 3 else 'owl'}_{i}" for i in range(k)]
    rng = np.random.default_rng(k)
    counts = rng.integers(0, 4, size=(k, k))
    np.fill_diagonal(counts, rng.integers(100, 2000, size=k))
    figure = confusion_figure(counts, names, "t")
    axis = figure.axes[0]
    figure.canvas.draw()
    xs, ys = axis.get_xticklabels(), axis.get_yticklabels()
    assert [t.get_text() for t in xs] == names == [t.get_text() for t in ys]
    assert min(t.get_fontsize() for t in [*xs, *ys]) >= 8
    # No two neighbouring names overlap, and every name is inside the picture.
    xboxes, yboxes = _label_boxes(figure, xs), _label_boxes(figure, ys)
    assert _overlapping(xboxes) == [] and _overlapping(yboxes) == []
    width, height = figure.canvas.get_width_height()
    for box in [*xboxes, *yboxes]:
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height
    # Every non-zero count is written in its cell, at a size that fits the cell.
    texts = {t.get_text() for t in axis.texts}
    assert {str(c) for c in counts[counts > 0]} <= texts
    assert min(t.get_fontsize() for t in axis.texts) >= font_sizes(k)[1] >= 7
    path = tmp_path / "cm.png"
    figure.savefig(path, dpi=DPI)  # as write_confusion_matrix saves it
    from PIL import Image

    with Image.open(path) as image:
        side = image.size
    # Cells keep their size as classes are added: the picture grows instead.
    assert min(side) >= (k * 30 if k == 50 else 500)


# ---------------------------------------------------------------------------------------------
# infer.py mode=evaluate on real checkpoints


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    run_dir, summary = digits_run(tmp_path_factory)
    return run_dir, summary


def test_evaluate_digits_without_data_reports_the_val_split(digits, capsys):
    from sklearn.datasets import load_digits

    run_dir, summary = digits
    code, out, err = run_infer(capsys, "mode=evaluate", f"ckpt={run_dir}/checkpoints/best.pt")
    assert code == 0, err
    metrics = json.loads((run_dir / "eval" / "metrics.json").read_text())
    assert f"wrote {run_dir / 'eval'}/" in out and "accuracy" in out
    assert metrics["data"]["split"] == "val" and metrics["data"]["dataset"] == "digits"
    assert metrics["count"] == 360 and metrics["num_classes"] == 10
    # The same number the trainer measured on that split for this (only) checkpoint.
    assert metrics["accuracy"] == pytest.approx(summary["val_acc"], abs=1e-6)
    assert "top5_accuracy" in metrics and sorted(metrics["per_class"]) == list("0123456789")
    # Each source names the image in scikit-learn's load_digits(), with its true label.
    errors = pd.read_csv(run_dir / "eval" / "errors.csv")
    assert len(errors) == min(100, metrics["errors"])
    target = load_digits().target
    for source, true in zip(errors["source"], errors["true"], strict=True):
        assert source.startswith("load_digits()[")
        assert target[int(source[len("load_digits()[") : -1])] == true
    for name in ("confusion_matrix.png", "predictions.csv"):
        assert (run_dir / "eval" / name).stat().st_size > 0


def test_evaluate_on_a_folder_equals_predict_on_the_same_images(digits, tmp_path, capsys):
    """A folder of class subfolders (raw pixel arrays, what a digits model reads from files)
    gives, input by input, infer.py predict's predictions on the same images."""
    run_dir, _ = digits
    ckpt = f"ckpt={run_dir}/checkpoints/best.pt"
    images, labels = raw_digits_val()
    folder = tmp_path / "labelled"
    order = []
    for i in np.argsort(labels, kind="stable")[:120]:
        (folder / str(labels[i])).mkdir(parents=True, exist_ok=True)
        np.save(folder / str(labels[i]) / f"img{i}.npy", images[i][None])
        order.append(i)
    (folder / "3" / ".DS_Store").write_bytes(b"\0")
    (folder / "3" / "notes.txt").write_text("not an image")
    # Natural order inside each class folder, as evaluate reads them.
    order = sorted(order, key=lambda i: (labels[i], i))
    np.save(tmp_path / "same.npy", images[order][:, None])
    out_dir = tmp_path / "report"
    code, out, err = run_infer(capsys, "mode=evaluate", ckpt, f"data={folder}", f"output={out_dir}")
    assert code == 0, err
    assert "1 hidden" in out and "1 not_an_image (first: " in out
    code, _, err = run_infer(
        capsys, ckpt, f"input={tmp_path / 'same.npy'}", f"output={tmp_path / 'preds.csv'}"
    )
    assert code == 0, err
    ours, predict = pd.read_csv(out_dir / "predictions.csv"), pd.read_csv(tmp_path / "preds.csv")
    assert ours["label"].astype(str).tolist() == predict["label"].astype(str).tolist()
    prob_columns = [c for c in predict.columns if c.startswith("prob_")]
    np.testing.assert_array_equal(ours[prob_columns].to_numpy(), predict[prob_columns].to_numpy())
    assert ours["true"].tolist() == [labels[i] for i in order]
    assert ours["source"].tolist()[0].endswith(f"img{order[0]}.npy")
    metrics = json.loads((out_dir / "metrics.json").read_text())
    # a data_report.json entry's layout (kiln.data.bad_inputs.BadInputLog)
    assert metrics["data"]["dropped"] == {"hidden": 1, "not_an_image": 1}
    assert metrics["data"]["dropped_records"] == [
        {"reason": "hidden", "path": str(folder / "3" / ".DS_Store")},
        {"reason": "not_an_image", "path": str(folder / "3" / "notes.txt")},
    ]
    assert [metrics["data"][f"images_{n}"] for n in ("read", "kept", "dropped")] == [122, 120, 2]
    assert metrics["accuracy"] == pytest.approx((ours["label"] == ours["true"]).mean(), abs=1e-6)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return text_run(tmp_path_factory)


def test_evaluate_text_on_a_csv_equals_predict_and_names_rows(text, tmp_path, capsys):
    from sklearn.metrics import classification_report

    from kiln.data.csv_text import demo_corpus

    run_dir, _ = text
    texts, labels = demo_corpus()
    rng = np.random.default_rng(0)
    chosen = rng.choice(len(texts), size=200, replace=False)
    # Some wrong labels, so there are errors to list and the numbers are not all 1.0.
    names = sorted(set(labels))
    given = [
        labels[i] if j % 7 else names[(names.index(labels[i]) + 1) % len(names)]
        for j, i in enumerate(chosen)
    ]
    csv = tmp_path / "held_out.csv"
    pd.DataFrame({"label": given, "text": [texts[i] for i in chosen]}).to_csv(csv, index=False)
    ckpt = f"ckpt={run_dir}/checkpoints/best.pt"
    out_dir = tmp_path / "report"
    code, out, err = run_infer(capsys, "mode=evaluate", ckpt, f"data={csv}", f"output={out_dir}")
    assert code == 0, err
    code, _, err = run_infer(capsys, ckpt, f"input={csv}", f"output={tmp_path / 'preds.csv'}")
    assert code == 0, err
    ours, predict = pd.read_csv(out_dir / "predictions.csv"), pd.read_csv(tmp_path / "preds.csv")
    assert ours["label"].tolist() == predict["label"].tolist()
    prob_columns = [c for c in predict.columns if c.startswith("prob_")]
    np.testing.assert_array_equal(ours[prob_columns].to_numpy(), predict[prob_columns].to_numpy())
    assert ours["source"].tolist() == [f"held_out.csv row {r}" for r in range(1, 201)]
    metrics = json.loads((out_dir / "metrics.json").read_text())
    theirs = classification_report(given, ours["label"], output_dict=True, zero_division=0)
    assert metrics["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-6)
    assert metrics["macro_f1"] == pytest.approx(theirs["macro avg"]["f1-score"], abs=1e-6)
    errors = pd.read_csv(out_dir / "errors.csv")
    assert len(errors) == metrics["errors"] > 0
    for source, true in zip(errors["source"], errors["true"], strict=True):
        assert given[int(source.rsplit(" ", 1)[1]) - 1] == true


def test_rows_without_a_label_are_skipped_and_named(text, tmp_path, capsys):
    run_dir, _ = text
    csv = _write_csv(
        tmp_path / "some.csv",
        {
            "text": ["the match", "rain today", "a new phone"],
            "label": ["sports", " ", "technology"],
        },
    )
    code, out, err = run_infer(
        capsys,
        "mode=evaluate",
        f"ckpt={run_dir}/checkpoints/best.pt",
        f"data={csv}",
        f"output={tmp_path / 'report'}",
    )
    assert code == 0, err
    assert "1 missing_label (first: some.csv row 2)" in out
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert metrics["count"] == 2
    assert {k: v for k, v in metrics["data"].items() if k not in ("path", "layout")} == {
        "rows_read": 3,
        "rows_kept": 2,
        "rows_dropped": 1,
        "dropped": {"missing_label": 1},
        "dropped_records": [{"reason": "missing_label", "row": 2, "column": "label"}],
    }
    predictions = pd.read_csv(tmp_path / "report" / "predictions.csv")
    assert predictions["source"].tolist() == ["some.csv row 1", "some.csv row 3"]
    assert predictions["true"].tolist() == ["sports", "technology"]


def test_evaluate_text_without_data_names_the_csv_rows(text, tmp_path, capsys):
    run_dir, summary = text
    out_dir = tmp_path / "report"
    code, _, err = run_infer(
        capsys, "mode=evaluate", f"ckpt={run_dir}/checkpoints/best.pt", f"output={out_dir}"
    )
    assert code == 0, err
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["accuracy"] == pytest.approx(summary["val_acc"], abs=1e-6)
    predictions = pd.read_csv(out_dir / "predictions.csv")
    assert predictions["source"].str.fullmatch(r"demo corpus row \d+").all()


def test_csv_text_sources_are_the_csv_rows_of_the_kept_rows(tmp_path):
    """With bad rows dropped, each validation item is still named by its own row of the file."""
    from kiln.data import build_data

    # Every third row has no text: dropped, so kept rows and file rows part ways.
    texts = [f"good text {i}" if i % 3 != 1 else "" for i in range(60)]
    frame = pd.DataFrame({"text": texts, "label": ["a", "b", "b"] * 20})
    train = tmp_path / "train.csv"
    frame.to_csv(train, index=False)
    cfg = compose_config(
        "data=csv_text",
        "model=text_bow",
        f"data.train_path={train}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.vocab_size=64",
    ).data
    bundle = build_data(cfg)
    assert bundle.report["train_file"]["rows_dropped"] == 20
    sources = bundle.sources["val"]
    assert len(sources) == len(bundle.val) == 8
    for index, source in enumerate(sources):
        name, _, row = source.rpartition(" row ")
        line = frame.iloc[int(row) - 1]  # row 1: the first after the header
        assert name == "train.csv" and line["text"]
        assert line["label"] == bundle.spec.class_names[int(bundle.val[index][1])]


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    return detector_run(tmp_path_factory)


def test_evaluate_detection_reports_per_class_ap(detector, tmp_path, capsys):
    run_dir, summary = detector
    out_dir = tmp_path / "report"
    code, out, err = run_infer(
        capsys, "mode=evaluate", f"ckpt={run_dir}/checkpoints/best.pt", f"output={out_dir}"
    )
    assert code == 0, err
    assert "mAP@0.5" in out
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["task"] == "detection" and metrics["count"] == 4
    # The same torchmetrics computation as the training log's val_map50.
    assert metrics["map_50"] == pytest.approx(summary["val_map50"], abs=1e-6)
    assert sorted(metrics["per_class"]) == ["ellipse", "rectangle"]
    for row in metrics["per_class"].values():
        assert set(row) == {"ap", "ap50", "true_boxes", "predicted_boxes"}
    assert sum(r["true_boxes"] for r in metrics["per_class"].values()) > 0
    errors = pd.read_csv(out_dir / "errors.csv")
    mistakes = (errors["missed"] + errors["false_positives"]).tolist()
    assert mistakes == sorted(mistakes, reverse=True) and all(m > 0 for m in mistakes)
    assert errors["source"].str.fullmatch(r"val\[\d\]").all()
    assert (errors["matched"] + errors["missed"] == errors["true_boxes"]).all()


def shapes_as_coco_and_yolo(root, count: int = 5, seed: int = 7):
    """Images drawn like shapes_detection's (classes ellipse, rectangle) written as PNG files
    with their boxes as a COCO file (category ids 5 and 9, listed rectangle first) and as a
    YOLO tree (classes in the training's order): (coco json, yolo images folder)."""
    from PIL import Image

    from kiln.data.shapes_detection import make_image

    rng = np.random.default_rng(seed)
    categories = [{"id": 9, "name": "rectangle"}, {"id": 5, "name": "ellipse"}]
    coco = {"images": [], "annotations": [], "categories": categories}
    for folder in ("coco/images/val", "yolo/images/val", "yolo/labels/val"):
        (root / folder).mkdir(parents=True)
    (root / "yolo" / "data.yaml").write_text("names: [ellipse, rectangle]\n")
    for i in range(count):
        height, width = 48 + 4 * i, 64 - 3 * i
        image, target = make_image(rng, height, width, max_objects=3, num_classes=2)
        pixels = (image.numpy().transpose(1, 2, 0) * 255).round().astype(np.uint8)
        name = f"img_{i}.png"
        for folder in ("coco/images/val", "yolo/images/val"):
            Image.fromarray(pixels).save(root / folder / name)
        coco["images"].append({"id": 100 + i, "file_name": name, "width": width, "height": height})
        lines = []
        for box, label in zip(target["boxes"].tolist(), target["labels"].tolist(), strict=True):
            x1, y1, x2, y2 = box
            coco["annotations"].append(
                {
                    "id": len(coco["annotations"]),
                    "image_id": 100 + i,
                    "category_id": {1: 5, 2: 9}[label],
                    "iscrowd": 0,
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                }
            )
            lines.append(
                f"{label - 1} {(x1 + x2) / 2 / width} {(y1 + y2) / 2 / height} "
                f"{(x2 - x1) / width} {(y2 - y1) / height}"
            )
        (root / "yolo" / "labels" / "val" / f"img_{i}.txt").write_text("\n".join(lines))
    (root / "coco" / "val.json").write_text(json.dumps(coco))
    return root / "coco" / "val.json", root / "yolo" / "images" / "val"


BOX_COLUMNS = [
    "image",
    "x1",
    "y1",
    "x2",
    "y2",
    "score",
    "label",
    "status",
    "truth",
    "truth_x1",
    "truth_y1",
    "truth_x2",
    "truth_y2",
    "iou",
]


def test_evaluate_a_detector_on_a_coco_file_and_a_yolo_folder(detector, tmp_path, capsys):
    """data= a COCO file and the same set as a YOLO folder: the same numbers (classes matched
    by name, whatever the file's ids or order), and predictions.csv beside the report: every
    box with the true box it matched and their IoU, then the true boxes nothing found."""
    run_dir, _ = detector
    coco, yolo = shapes_as_coco_and_yolo(tmp_path / "sets")
    reports = {}
    for layout, data in (("coco", coco), ("yolo", yolo)):
        out_dir = tmp_path / layout
        code, _, err = run_infer(
            capsys,
            "mode=evaluate",
            f"ckpt={run_dir}/checkpoints/best.pt",
            f"data={data}",
            f"output={out_dir}",
        )
        assert code == 0, err
        reports[layout] = json.loads((out_dir / "metrics.json").read_text())
        assert reports[layout]["data"]["layout"] == layout
        assert reports[layout]["data"]["images"]["images_kept"] == 5
    assert reports["coco"]["count"] == reports["yolo"]["count"] == 5
    for key in ("map", "map_50"):
        assert reports["coco"][key] == pytest.approx(reports["yolo"][key], abs=1e-4), key
    for name, row in reports["coco"]["per_class"].items():
        assert row == pytest.approx(reports["yolo"]["per_class"][name], abs=1e-4), name
    boxes = pd.read_csv(tmp_path / "coco" / "predictions.csv")
    assert list(boxes.columns) == BOX_COLUMNS
    assert set(boxes["image"]) <= {f"img_{i}.png" for i in range(5)}
    assert set(boxes["status"]) <= {"matched", "false_positive", "missed"}
    matched = boxes[boxes["status"] == "matched"]
    assert (matched["iou"] >= 0.5).all()
    true_boxes = sum(r["true_boxes"] for r in reports["coco"]["per_class"].values())
    assert len(matched) + (boxes["status"] == "missed").sum() == true_boxes
    assert "predictions.csv" in reports["coco"]["files"]
    labelled = json.loads(coco.read_text())
    labelled["categories"][0]["name"] = "triangle"  # a class the checkpoint does not know
    coco.write_text(json.dumps(labelled))
    code, _, err = run_infer(
        capsys,
        "mode=evaluate",
        f"ckpt={run_dir}/checkpoints/best.pt",
        f"data={coco.parent}",
        f"output={tmp_path / 'x'}",
    )
    assert code == 2 and "boxes of class(es) 'triangle', which the checkpoint does not know" in err


def test_box_predictions_match_every_box_to_a_true_one_or_say_why():
    from kiln.inference.detection_report import box_predictions

    truth = {
        "boxes": np.array([[0, 0, 10, 10], [20, 20, 40, 40], [50, 50, 60, 60]], np.float32),
        "labels": np.array([1, 2, 2]),
    }
    found = {
        "boxes": np.array([[21, 21, 40, 40], [0, 0, 10, 12], [0, 0, 10, 10]], np.float32),
        "labels": np.array([2, 1, 1]),
        "scores": np.array([0.3, 0.9, 0.6], np.float32),
    }
    rows = box_predictions([found], [truth], ["a.jpg"], ["square", "ring"])
    assert rows["status"].tolist() == ["matched", "false_positive", "matched", "missed"]
    assert rows["truth"].tolist()[:1] == [0] and rows["score"].tolist()[:1] == [pytest.approx(0.9)]
    # the false positive duplicates a box already found: its IoU is its best with its class
    assert rows["iou"].tolist()[:3] == [0.8333, 1.0, 0.9025]
    assert rows.iloc[3][["x1", "label", "truth"]].tolist() == [50.0, "ring", 2]


def test_detection_metrics_per_class_on_known_answers():
    boxes = np.array([[0, 0, 10, 10], [20, 20, 40, 40], [50, 5, 60, 30]], dtype=np.float32)
    truth = [{"boxes": boxes, "labels": np.array([1, 2, 1])}]
    perfect = [{"boxes": boxes, "labels": np.array([1, 2, 1]), "scores": np.ones(3, np.float32)}]
    result = detection_metrics(perfect, truth, ["square", "ring", "star"])
    assert result["map"] == pytest.approx(1.0) and result["map_50"] == pytest.approx(1.0)
    assert result["per_class"]["square"] == {
        "ap": 1.0,
        "ap50": 1.0,
        "true_boxes": 2,
        "predicted_boxes": 2,
    }
    assert result["per_class"]["star"]["ap"] is None  # no true box: undefined, not 0
    # The ring found nowhere: AP 0 for it, the squares still perfect.
    only_squares = [
        {"boxes": boxes[[0, 2]], "labels": np.array([1, 1]), "scores": np.ones(2, np.float32)}
    ]
    result = detection_metrics(only_squares, truth, ["square", "ring", "star"])
    assert result["per_class"]["square"]["ap50"] == pytest.approx(1.0)
    assert result["per_class"]["ring"]["ap50"] == 0.0
    assert result["map_50"] == pytest.approx(0.5)


def test_detection_errors_match_boxes_by_class_and_iou():
    truth = {
        "boxes": np.array([[0, 0, 10, 10], [20, 20, 40, 40]], np.float32),
        "labels": np.array([1, 2]),
    }
    found = {
        "boxes": np.array(
            [[0, 0, 10, 11], [0, 0, 10, 10], [21, 21, 40, 40], [60, 60, 70, 70]], np.float32
        ),
        "labels": np.array([1, 1, 1, 2]),
        "scores": np.array([0.9, 0.8, 0.95, 0.3], np.float32),
    }
    labels, matched, found_true = match_image(found, truth)
    # Highest score first; the 0.3 box is below the threshold; the second box on the square
    # is a duplicate (false); the class-1 box on the class-2 object matches nothing.
    assert labels.tolist() == [1, 1, 1] and matched.tolist() == [False, True, False]
    assert found_true.tolist() == [True, False]


# ---------------------------------------------------------------------------------------------
# The end of training: a test split gets its report


def _digits_with_test(cfg, broken: bool = False):
    """digits with half of its validation split held out as a test split."""
    from kiln.data.digits import build_digits

    bundle = build_digits(dataclasses.replace(cfg, name="digits"))
    x, y = bundle.val.tensors
    half = len(y) // 2
    names = bundle.sources["val"]
    bundle.val = TensorDataset(x[:half], y[:half])
    test_x = x[half:, :, :, :4] if broken else x[half:]  # broken: images of another shape
    bundle.test = TensorDataset(test_x, y[half:])
    bundle.sources = {"val": names[:half], "test": names[half:]}
    return bundle


@pytest.fixture
def dataset_with_test():
    from kiln.config.data import DigitsConfig
    from kiln.registry import DATASETS

    added = []

    def register(name: str, broken: bool = False):
        def build(cfg):
            return _digits_with_test(cfg, broken)

        DATASETS.register(name, config=DigitsConfig, provides="image")(build)
        added.append(name)
        cfg = compose_config("trainer.max_epochs=1", "env.progress_bar=false", "logger=none")
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, name=name))

    yield register
    for name in added:
        del DATASETS._entries[name]


def test_training_with_a_test_split_writes_its_report(tmp_path, dataset_with_test, capsys):
    from kiln.engine.run import train

    cfg = dataset_with_test("digits_with_test")
    summary = train(cfg, tmp_path)
    eval_dir = tmp_path / "eval"
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    assert metrics["data"]["split"] == "test" and metrics["count"] == 180
    assert metrics["checkpoint"] == str((tmp_path / "checkpoints" / "best.pt").resolve())
    written = read_summary(tmp_path)
    for key in ("test_acc", "test_top5_acc", "test_macro_f1", "test_count", "test_eval_dir"):
        assert written[key] == summary[key], key
    assert written["test_acc"] == pytest.approx(metrics["accuracy"])
    assert written["status"] == "ok" and "test_eval_error" not in written
    # The numbers are those of best.pt's predictions on the test images.
    predictions = pd.read_csv(eval_dir / "predictions.csv")
    assert written["test_acc"] == pytest.approx(
        (predictions["label"] == predictions["true"]).mean(), abs=1e-6
    )
    assert predictions["source"].str.startswith("load_digits()[").all()
    # infer.py mode=evaluate without data= picks the same test split, the same numbers.
    code, _, err = run_infer(
        capsys,
        "mode=evaluate",
        f"ckpt={tmp_path}/checkpoints/best.pt",
        f"output={tmp_path / 'again'}",
    )
    assert code == 0, err
    again = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert again["accuracy"] == metrics["accuracy"] and again["data"]["split"] == "test"


def test_a_failing_test_report_leaves_the_training_result_standing(tmp_path, dataset_with_test):
    from kiln.engine.run import train

    summary = train(dataset_with_test("digits_broken_test", broken=True), tmp_path)
    written = read_summary(tmp_path)
    assert written["status"] == "ok" and written["val_acc"] == summary["val_acc"] > 0
    assert "RuntimeError" in written["test_eval_error"]
    assert (tmp_path / "checkpoints" / "best.pt").is_file()
    assert not (tmp_path / "eval" / "metrics.json").exists()


# ---------------------------------------------------------------------------------------------
# Mistakes: one `error:` line each, exit 2


def _write_csv(path, columns: dict):
    pd.DataFrame(columns).to_csv(path, index=False)
    return path


def test_evaluate_argument_errors_are_one_line(digits, text, detector, tmp_path, capsys):
    digits_ckpt = f"ckpt={digits[0]}/checkpoints/best.pt"
    text_ckpt = f"ckpt={text[0]}/checkpoints/best.pt"
    detector_ckpt = f"ckpt={detector[0]}/checkpoints/best.pt"
    unknown_class = tmp_path / "unknown_class"
    (unknown_class / "3").mkdir(parents=True)
    (unknown_class / "cat").mkdir()
    np.save(unknown_class / "3" / "a.npy", np.zeros((1, 8, 8), np.float32))
    png_folder = tmp_path / "pngs"
    (png_folder / "3").mkdir(parents=True)
    (png_folder / "3" / "a.png").write_bytes(b"\x89PNG")
    bad_labels = _write_csv(
        tmp_path / "bad.csv", {"text": ["a", "b", "c", "d"], "label": ["nope", "", "nope", "nope"]}
    )
    no_label = _write_csv(tmp_path / "nolabel.csv", {"text": ["a"], "category": ["x"]})
    cases = [
        ([digits_ckpt, "split=train"], "split='train': choose one of val, test"),
        ([digits_ckpt, "split=val", f"data={unknown_class}"], "leave out one of them"),
        ([digits_ckpt, f"data={tmp_path / 'missing'}"], "does not exist (data=)"),
        ([digits_ckpt, "input=x.npy"], "not input=x.npy"),
        ([digits_ckpt, "num_errors=-1"], "num_errors=-1: must be >= 0"),
        ([digits_ckpt, "split=test"], "has no test split; use split=val"),
        ([digits_ckpt, f"data={unknown_class}"], "class folder(s) 'cat' are not among"),
        ([digits_ckpt, f"data={png_folder}"], "takes pixel arrays, not image files"),
        ([digits_ckpt, f"data={bad_labels}"], "not a file"),
        (
            [text_ckpt, f"data={unknown_class}"],
            "a .csv, Parquet or JSON Lines file or a datasets folder",
        ),
        (
            [text_ckpt, f"data={bad_labels}"],
            "3 row(s) have label 'nope' (3 rows: 1, 3, 4), not among",
        ),
        ([text_ckpt, f"data={no_label}"], "no 'label' column; columns present"),
        ([detector_ckpt, f"data={unknown_class}"], "a detector is evaluated on a COCO file"),
    ]
    for argv, expected in cases:
        code, _, err = run_infer(capsys, "mode=evaluate", *argv)
        lines = err.strip().splitlines()
        assert code == 2, (argv, err)
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
        assert expected in lines[0], (argv, lines[0])
