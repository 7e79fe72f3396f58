"""Multi-label data (data.label_separator, image_folder's data.labels_csv) and joined text
columns (data.join_columns): several labels per row train a sigmoid/BCE head above the trivial
baseline, evaluate (torchmetrics' multilabel metrics), and infer.py, the ONNX export and the
server give the evaluation's probabilities; config mistakes are one-line errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest
import torch

from kiln.config.base import ConfigError
from kiln.inference import Predictor
from kiln.serving import create_app

from .conftest import compose_config, read_summary, train_in_process
from .hf_helpers import POSITIONS, csv_texts, write_bert
from .inference_helpers import live_server
from .test_evaluate import run_infer

TOPICS = {  # words that never overlap: each topic learnable from its words alone
    "arrays": ["numpy", "tensor", "vector", "matrix", "slice", "axis", "reshape", "dtype"],
    "http": ["request", "header", "cookie", "status", "proxy", "socket", "route", "json"],
    "files": ["folder", "path", "disk", "inode", "mount", "fsync", "chmod", "symlink"],
    "mail": ["inbox", "smtp", "sender", "subject", "spam", "reply", "mailbox", "imap"],
}
NAMES = sorted(TOPICS)
FILLER = ["the", "a", "we", "see", "when", "then", "it", "is", "of", "and"]
SEP = "|"


def multilabel_rows(count: int, seed: int) -> list[tuple[str, str]]:
    """(text, labels joined by SEP): each row one to three topics, its words from each."""
    rng = np.random.default_rng(seed)
    names = list(TOPICS)
    rows = []
    for _ in range(count):
        chosen = [n for n in names if rng.random() < 0.3] or [names[rng.integers(len(names))]]
        words = [str(rng.choice(TOPICS[n])) for n in chosen for _ in range(3)]
        words += [str(rng.choice(FILLER)) for _ in range(4)]
        rng.shuffle(words)
        rows.append((" ".join(words), SEP.join(chosen)))
    return rows


def write_multilabel_csv(path: Path, count: int, seed: int = 0, bad: bool = True) -> Path:
    rows = multilabel_rows(count, seed)
    if bad:  # a row whose field splits into no label: a bad row, counted
        rows.append(("numpy tensor folder", f" {SEP} "))
    pd.DataFrame(rows, columns=["text", "labels"]).to_csv(path, index=False)
    return path


ML = (
    "data=csv_text",
    "data.label_column=labels",
    f"data.label_separator={SEP}",
    "data.batch_size=16",
    "trainer.max_epochs=8",
    "trainer.early_stopping=null",
)


def trivial_f1(run_dir: Path) -> float:
    """The micro-F1 of predicting every class for every sample of the validation split."""
    report = json.loads((run_dir / "data_report.json").read_text())
    positives = sum(report["class_counts"]["val"].values())
    samples = (report.get("rows") or report["images"])["val"]
    return 2 * positives / (samples * len(report["classes"]) + positives)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multilabel")
    write_multilabel_csv(root / "train.csv", 200)
    write_multilabel_csv(root / "held_out.csv", 30, seed=7, bad=False)
    return root


@pytest.fixture(scope="module")
def bow_run(corpus) -> Path:
    run_dir = corpus / "bow_run"
    summary = train_in_process(
        run_dir,
        *ML,
        "model=text_bow",
        f"data.train_path={corpus / 'train.csv'}",
        f"data.cache_dir={corpus / 'cache'}",
        "optimizer.lr=0.05",
    )
    assert summary["status"] == "ok", summary
    return run_dir


def test_text_bow_multilabel_trains_above_the_trivial_baseline(bow_run):
    summary = read_summary(bow_run)
    assert summary["monitor"] == "val_f1_micro"
    assert summary["val_f1_micro"] > trivial_f1(bow_run) + 0.15, summary
    report = json.loads((bow_run / "data_report.json").read_text())
    assert report["classes"] == list(NAMES)
    assert report["train_file"]["dropped"] == {"missing_label": 1}, report["train_file"]
    ckpt = torch.load(bow_run / "checkpoints" / "best.pt", weights_only=True)
    spec = ckpt["data_spec"]
    assert (spec["task"], spec["label_separator"], spec["threshold"]) == ("multilabel", SEP, 0.5)


def check_predictions_agree(run_dir: Path, corpus: Path, tmp_path: Path, capsys) -> None:
    """evaluate, infer.py (torch and ONNX) and the server: the same probabilities (1e-4)."""
    csv_path = corpus / "held_out.csv"
    best = run_dir / "checkpoints" / "best.pt"
    code, out, err = run_infer(
        capsys, "mode=evaluate", f"ckpt={best}", f"data={csv_path}", f"output={tmp_path}/ev"
    )
    assert code == 0, err
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["task"] == "multilabel"
    for key in ("f1_micro", "f1_macro", "exact_match", "precision_micro", "recall_micro"):
        assert 0 <= metrics[key] <= 1
    assert set(metrics["per_class"]["http"]) == {"precision", "recall", "f1", "support"}
    assert {"per_class.png", "errors.csv", "predictions.csv"} <= set(metrics["files"])
    evaluated = pd.read_csv(tmp_path / "ev" / "predictions.csv", keep_default_na=False)
    probs = [c for c in evaluated.columns if c.startswith("prob_")]
    assert probs == [f"prob_{name}" for name in NAMES]
    code, _, err = run_infer(
        capsys, f"ckpt={best}", f"input={csv_path}", f"output={tmp_path}/preds.csv"
    )
    assert code == 0, err
    predicted = pd.read_csv(tmp_path / "preds.csv", keep_default_na=False)
    np.testing.assert_allclose(predicted[probs], evaluated[probs], atol=1e-4)
    # the labels column: the classes at or above 0.5, joined by the separator
    for _, row in predicted.iterrows():
        expected = [name for name in NAMES if row[f"prob_{name}"] >= 0.5]
        assert row["labels"] == SEP.join(expected)
    assert (predicted["labels"] == evaluated["labels"]).all()
    code, _, err = run_infer(capsys, "mode=export", f"ckpt={best}")
    assert code == 0, err
    onnx = best.with_name("model.onnx")
    code, _, err = run_infer(
        capsys, f"ckpt={onnx}", "backend=onnx", f"input={csv_path}", f"output={tmp_path}/onnx.csv"
    )
    assert code == 0, err
    np.testing.assert_allclose(
        pd.read_csv(tmp_path / "onnx.csv")[probs], evaluated[probs], atol=1e-4
    )
    texts = pd.read_csv(csv_path, keep_default_na=False)["text"].tolist()
    predictor = Predictor.from_checkpoint(best)
    with live_server(create_app(predictor, max_batch_size=8, max_delay_ms=5)) as server:
        v1 = httpx.post(f"{server.url}/v1/predict", json={"inputs": texts}, timeout=60)
        v2 = httpx.post(
            f"{server.url}/v2/models/kiln/infer",
            json={
                "inputs": [
                    {"name": "input", "datatype": "BYTES", "shape": [len(texts)], "data": texts}
                ]
            },
            timeout=60,
        )
    assert v1.status_code == 200, v1.text
    answers = v1.json()["predictions"]
    served = np.array([p["probs"] for p in answers])
    np.testing.assert_allclose(served, evaluated[probs].to_numpy(), atol=1e-4)
    assert [SEP.join(p["labels"]) for p in answers] == evaluated["labels"].tolist()
    for p in answers:
        assert p["scores"] == [p["probs"][NAMES.index(n)] for n in p["labels"]]
    assert v2.status_code == 200, v2.text
    outputs = {o["name"]: o for o in v2.json()["outputs"]}
    assert outputs["labels"]["data"] == evaluated["labels"].tolist()
    np.testing.assert_allclose(
        np.reshape(outputs["probs"]["data"], (len(texts), len(NAMES))), served, atol=1e-6
    )


def test_text_bow_multilabel_evaluate_infer_onnx_and_server_agree(
    bow_run, corpus, tmp_path, capsys
):
    check_predictions_agree(bow_run, corpus, tmp_path, capsys)


@pytest.fixture(scope="module")
def bert_run(corpus) -> Path:
    folder = write_bert(corpus / "bert", csv_texts(corpus / "train.csv"), num_labels=2)
    run_dir = corpus / "bert_run"
    summary = train_in_process(
        run_dir,
        *ML,
        "model=hf",
        f"model.arch={folder}",
        f"data.max_length={POSITIONS}",
        f"data.train_path={corpus / 'train.csv'}",
        f"data.cache_dir={corpus / 'cache'}",
        "optimizer.lr=0.003",
        "trainer.max_epochs=25",
        "data.batch_size=8",
    )
    assert summary["status"] == "ok", summary
    return run_dir


def test_hf_bert_multilabel_trains_evaluates_and_serves(bert_run, corpus, tmp_path, capsys):
    summary = read_summary(bert_run)
    assert summary["val_f1_micro"] > trivial_f1(bert_run) + 0.1, summary
    ckpt = torch.load(bert_run / "checkpoints" / "best.pt", weights_only=True)
    assert ckpt["data_spec"]["task"] == "multilabel"
    check_predictions_agree(bert_run, corpus, tmp_path, capsys)


def label_sets(probs: np.ndarray, threshold: float) -> np.ndarray:
    return probs >= threshold


def fresh_texts(count: int, seed: int) -> list[str]:
    return [text for text, _ in multilabel_rows(count, seed)]


@pytest.mark.parametrize("run", ["bow_run", "bert_run"])
def test_int8_multilabel_label_sets_agree_with_fp32(run, request, tmp_path):
    """int8=true on a multi-label model: the export's own check compares predicted label SETS
    (every class on the same side of data.threshold), not an argmax, and its line says so;
    measured again here on fresh rows, int8 ONNX against the fp32 torch model."""
    from kiln.inference import export
    from kiln.inference.export import INT8_MIN_AGREEMENT

    run_dir = request.getfixturevalue(run)
    best = run_dir / "checkpoints" / "best.pt"
    report = export(best, tmp_path / "model.onnx", int8=True)
    assert report.int8_path.is_file() and report.int8_num_examples > 0
    line = next(line for line in report.lines() if str(report.int8_path) in line)
    assert "predicted label sets (threshold 0.5) agree with torch's on" in line, line
    assert report.int8_agreement >= INT8_MIN_AGREEMENT, line
    texts = fresh_texts(400, seed=11)
    fp32 = Predictor.from_checkpoint(best)
    int8 = Predictor.from_checkpoint(report.int8_path, backend="onnx")
    threshold = fp32.spec.threshold
    ours, theirs = int8.predict_probs(texts), fp32.predict_probs(texts)
    same = (label_sets(ours, threshold) == label_sets(theirs, threshold)).all(axis=1)
    agreement = float(same.mean())
    message = (
        f"{run}: int8 label sets agree with fp32 on {agreement:.1%} of {len(texts)} rows "
        f"(the export's own check: {report.int8_agreement:.1%} of {report.int8_num_examples})"
    )
    print(message)
    assert agreement >= 0.95, message


@pytest.mark.parametrize("run", ["bow_run", "bert_run"])
def test_the_multilabel_triton_repository_gives_the_evaluations_sigmoid_probs(
    run, request, corpus, tmp_path, capsys
):
    """The Triton repository of a multi-label model: `probs` are sigmoids (its config.pbtxt
    says a class is predicted at >= data.threshold, the set may be empty or hold several);
    its model.onnx, run by onnxruntime on the ids a client makes with tokenizer.json, gives
    the evaluation's probabilities (1e-4)."""
    from tokenizers import Tokenizer

    from kiln.inference.backends import ort_session
    from kiln.inference.record import read_checkpoint
    from kiln.inference.triton import export_triton

    from .test_triton_export import assert_config_describes_the_graph, read_repository

    run_dir = request.getfixturevalue(run)
    best = run_dir / "checkpoints" / "best.pt"
    csv_path = corpus / "held_out.csv"
    code, _, err = run_infer(
        capsys, "mode=evaluate", f"ckpt={best}", f"data={csv_path}", f"output={tmp_path}/ev"
    )
    assert code == 0, err
    evaluated = pd.read_csv(tmp_path / "ev" / "predictions.csv", keep_default_na=False)
    probs = [f"prob_{name}" for name in NAMES]
    report = export_triton(best, tmp_path / "repo", max_batch_size=8)
    record, _ = read_checkpoint(best)
    config = (report.model_dir / "config.pbtxt").read_text()
    assert "probs (N, K) are independent sigmoids, one per class" in config, config
    assert f"a class is predicted when its prob >= {record.spec.threshold:g}" in config, config
    parsed, graph = read_repository(report.model_dir)  # Triton's own model-config protobuf
    assert_config_describes_the_graph(parsed, graph)
    outputs = {entry.name: entry for entry in parsed.output}
    assert list(outputs["probs"].dims) == [len(NAMES)]
    assert outputs["probs"].label_filename == "labels.txt"
    assert (report.model_dir / "labels.txt").read_text().split() == list(NAMES)
    tokenizer = Tokenizer.from_file(str(report.model_dir / "tokenizer.json"))
    tokenizer.enable_truncation(record.recipe.max_length)
    texts = pd.read_csv(csv_path, keep_default_na=False)["text"].tolist()
    encoded = [e.ids for e in tokenizer.encode_batch(texts)]
    ids = np.full((len(texts), max(map(len, encoded))), record.recipe.pad_id, dtype=np.int64)
    for row, sequence in enumerate(encoded):
        ids[row, : len(sequence)] = sequence
    session = ort_session(report.model_dir / "1" / "model.onnx")
    (sigmoids,) = session.run(["probs"], {session.get_inputs()[0].name: ids})
    np.testing.assert_allclose(sigmoids, evaluated[probs].to_numpy(), atol=1e-4)
    assert not np.allclose(sigmoids.sum(axis=1), 1.0)  # not a softmax
    predicted = [
        SEP.join(n for n, p in zip(NAMES, row, strict=True) if p >= 0.5) for row in sigmoids
    ]
    assert predicted == evaluated["labels"].tolist()


def test_every_loss_branch_runs_on_multi_hot_targets(corpus):
    """Rule 2's forced run (every branch on) and the probes before step 1, multi-label."""
    summary = train_in_process(
        corpus / "forced",
        *ML,
        "model=text_transformer",
        "loss.force_all_branches=true",
        f"data.train_path={corpus / 'train.csv'}",
        f"data.cache_dir={corpus / 'cache'}",
        "trainer.max_steps=3",
    )
    assert summary["status"] in ("ok", "at_chance"), summary
    assert "val_f1_micro" in summary and "val_exact_match" in summary


def test_the_evaluators_f1_is_torchmetrics_multilabel_f1():
    from torchmetrics.classification import MultilabelExactMatch, MultilabelF1Score

    from kiln.engine.distributed import DistInfo
    from kiln.engine.evaluators import MultiLabelEvaluator
    from kiln.engine.precision import resolve_precision

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 5, generator=gen)
    targets = (torch.rand(40, 5, generator=gen) < 0.3).float()
    targets[:, 4] = 0  # a class with no sample
    cpu = torch.device("cpu")
    fp32 = resolve_precision("fp32", cpu)
    evaluator = MultiLabelEvaluator(precision=fp32, device=cpu, dist=DistInfo(), threshold=0.4)
    batches = [(logits[i : i + 16], targets[i : i + 16]) for i in range(0, 40, 16)]
    metrics = evaluator(torch.nn.Identity(), batches)
    probs, target = torch.sigmoid(logits), targets.long()
    for average in ("micro", "macro"):
        expected = MultilabelF1Score(5, threshold=0.4, average=average)(probs, target)
        assert metrics[f"val_f1_{average}"] == pytest.approx(float(expected), abs=1e-6)
    exact = MultilabelExactMatch(5, threshold=0.4)(probs, target)
    assert metrics["val_exact_match"] == pytest.approx(float(exact))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (("data.label_separator=''",), r"\(data.label_separator\): must be a visible separator"),
        (
            ("data.label_separator=|", "data.threshold=1.5"),
            r"\(data.threshold\): must be in \(0, 1\)",
        ),
        (
            ("data.label_separator=|", "data.threshold=0"),
            r"\(data.threshold\): must be in \(0, 1\)",
        ),
        (("data.threshold=0.3",), r"threshold=0.3 applies to multi-label data only"),
        (("data.join_columns=true",), r"join_columns=true joins text_column with"),
    ],
)
def test_config_mistakes_are_one_line_errors(tmp_path, overrides, match):
    train = write_multilabel_csv(tmp_path / "t.csv", 4)
    with pytest.raises(ConfigError, match=match) as caught:
        compose_config("data=csv_text", "model=text_bow", f"data.train_path={train}", *overrides)
    assert "\n" not in str(caught.value)


def test_image_folder_labels_csv_mistakes_are_one_line_errors(tmp_path):
    base = ("data=image_folder", f"data.labels_csv={tmp_path / 'x.csv'}")
    with pytest.raises(ConfigError, match="labels_csv and train_dir are both set"):
        compose_config(*base, f"data.train_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"\(data.threshold\): must be in"):
        compose_config(*base, "data.threshold=1")
    with pytest.raises(ConfigError, match="MixUp/CutMix mix one class per image"):
        compose_config(*base, "data.mixup_alpha=0.2")


# ---------------------------------------------------------------------------------------------
# Images: data=image_folder data.labels_csv


COLOURS = ("blue", "green", "red")  # a label per channel: its channel bright when present


def write_listed_images(root: Path, count: int, seed: int = 0) -> Path:
    """`count` 12x12 PNGs whose labels are the bright channels, their CSV (path,labels), and
    three bad rows: a missing file, an empty label set, a label only one image has."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    rows = []
    for i in range(count):
        chosen = [c for c in COLOURS if rng.random() < 0.4] or [COLOURS[i % 3]]
        pixels = rng.integers(0, 60, (12, 12, 3), dtype=np.uint8)
        for colour in chosen:
            channel = ("red", "green", "blue").index(colour)
            pixels[..., channel] += 180
        name = f"images/{i:03d}.png"
        Image.fromarray(pixels).save(root / name)
        rows.append((name, SEP.join(chosen)))
    rows += [("images/absent.png", "red"), ("images/000.png", " "), ("images/001.png", "violet")]
    with open(root / "labels.csv", "w", newline="") as f:
        csv.writer(f).writerows([("path", "labels"), *rows])
    return root / "labels.csv"


def test_image_folder_labels_csv_trains_multilabel_and_predicts_the_same(tmp_path, capsys):
    labels_csv = write_listed_images(tmp_path / "photos", 90)
    run_dir = tmp_path / "run"
    summary = train_in_process(
        run_dir,
        "data=image_folder",
        f"data.labels_csv={labels_csv}",
        "data.image_size=12",
        "data.augment=none",
        "data.batch_size=16",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model=mlp",
        "trainer.max_epochs=12",
        "optimizer.lr=0.01",
    )
    assert summary["status"] == "ok", summary
    assert summary["val_f1_micro"] > trivial_f1(run_dir) + 0.15, summary
    report = json.loads((run_dir / "data_report.json").read_text())
    assert report["classes"] == list(COLOURS)
    dropped = report["labels_csv"]["dropped"]
    assert dropped.pop("missing_label") == 1 and dropped.pop("unknown_label") == 1, dropped
    assert sum(dropped.values()) == 1  # the missing file, as the folder scan names it
    assert (report["labels_csv"]["images_read"], report["labels_csv"]["images_kept"]) == (93, 90)
    best = run_dir / "checkpoints" / "best.pt"
    code, _, err = run_infer(capsys, "mode=evaluate", f"ckpt={best}", f"output={tmp_path}/ev")
    assert code == 0, err
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["task"] == "multilabel" and metrics["data"]["split"] == "val"
    evaluated = pd.read_csv(tmp_path / "ev" / "predictions.csv", keep_default_na=False)
    code, _, err = run_infer(
        capsys,
        f"ckpt={best}",
        f"input={tmp_path / 'photos' / 'images'}",
        f"output={tmp_path}/preds.csv",
    )
    assert code == 0, err
    predicted = pd.read_csv(tmp_path / "preds.csv", keep_default_na=False)
    predicted.index = [Path(s).name for s in predicted["source"]]
    mine = predicted.loc[[Path(s).name for s in evaluated["source"]]]
    probs = [f"prob_{c}" for c in COLOURS]
    np.testing.assert_allclose(mine[probs].to_numpy(), evaluated[probs].to_numpy(), atol=1e-4)
    assert mine["labels"].tolist() == evaluated["labels"].tolist()


def test_label_sets_are_judged_as_single_labels_are(tmp_path):
    """data.val_path: a row with a label training lacks is unseen_label; data.labels: a row
    holding a label it does not list is unlisted_label; targets are the rows' multi-hot sets."""
    from kiln.data.csv_text import build_csv_text

    train = write_multilabel_csv(tmp_path / "train.csv", 40)
    rows = [("numpy tensor inbox", f"arrays{SEP}mail"), ("proxy json", f"http{SEP}weather")]
    pd.DataFrame(rows, columns=["text", "labels"]).to_csv(tmp_path / "val.csv", index=False)
    common = (
        "data=csv_text",
        "model=text_bow",
        "data.label_column=labels",
        f"data.label_separator={SEP}",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    cfg = compose_config(
        *common, f"data.train_path={train}", f"data.val_path={tmp_path / 'val.csv'}"
    )
    bundle = build_csv_text(cfg.data)
    assert bundle.spec.class_names == tuple(NAMES) and bundle.spec.multi_label
    assert bundle.report["val_file"]["dropped"] == {"unseen_label": 1}
    assert bundle.report["unseen_labels"] == {"weather": 1}
    ((ids, target),) = [bundle.val[i] for i in range(len(bundle.val))]
    assert target.tolist() == [1.0, 0.0, 0.0, 1.0]  # arrays, mail
    listed = compose_config(*common, f"data.train_path={train}", "data.labels=[arrays,http,mail]")
    report = build_csv_text(listed.data).report
    assert set(report["train_file"]["dropped"]) == {"unlisted_label", "missing_label"}


def listed_rows(labels_csv: Path) -> list[tuple[str, str]]:
    with open(labels_csv, newline="") as f:
        return [(row["path"], row["labels"]) for row in csv.DictReader(f)]


def test_image_folder_val_and_test_labels_csv_are_the_splits_exactly(tmp_path):
    """data.val_labels_csv / data.test_labels_csv: the val and test splits are exactly those
    CSVs' good rows, in their order, with their label sets; no row of labels_csv is held out;
    a row with a label training lacks is unseen_label (a rare label is no class of the val)."""
    from kiln.data import build_data

    train = write_listed_images(tmp_path / "train", 40)
    val = write_listed_images(tmp_path / "val", 14, seed=1)
    test = write_listed_images(tmp_path / "test", 9, seed=2)
    cfg = compose_config(
        "data=image_folder",
        f"data.labels_csv={train}",
        f"data.val_labels_csv={val}",
        f"data.test_labels_csv={test}",
        "data.image_size=12",
        "data.augment=none",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model=mlp",
    )
    bundle = build_data(cfg.data)
    assert bundle.spec.class_names == COLOURS
    for split, labels_csv, count in (("val", val, 14), ("test", test, 9)):
        good = listed_rows(labels_csv)[:count]  # the three bad rows come last
        assert bundle.sources[split] == [str(labels_csv.parent / path) for path, _ in good]
        dataset = bundle.val if split == "val" else bundle.test
        assert len(dataset) == count
        for i, (_, labels) in enumerate(good):
            expected = [float(c in labels.split(SEP)) for c in COLOURS]
            assert dataset[i][1].tolist() == expected, (split, i)
    assert len(bundle.train) == len(bundle.sources["train"]) == 40  # none held out
    assert not set(bundle.sources["train"]) & set(bundle.sources["val"])
    report = bundle.report
    assert report["split"] == "data.val_labels_csv"
    assert report["images"] == {"train": 40, "val": 14, "test": 9}
    dropped = report["val_labels_csv"]["dropped"]
    assert dropped.pop("unseen_label") == 1 and dropped.pop("missing_label") == 1, dropped
    assert sum(dropped.values()) == 1  # the missing image file
    assert report["test_labels_csv"]["images_kept"] == 9


def test_a_run_with_val_and_test_labels_csv_validates_and_evaluates_on_them(tmp_path):
    train = write_listed_images(tmp_path / "train", 60)
    val = write_listed_images(tmp_path / "val", 20, seed=1)
    test = write_listed_images(tmp_path / "test", 12, seed=2)
    run_dir = tmp_path / "run"
    summary = train_in_process(
        run_dir,
        "data=image_folder",
        f"data.labels_csv={train}",
        f"data.val_labels_csv={val}",
        f"data.test_labels_csv={test}",
        "data.image_size=12",
        "data.augment=none",
        "data.batch_size=16",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model=mlp",
        "trainer.max_epochs=8",
        "optimizer.lr=0.01",
    )
    assert summary["status"] == "ok", summary
    assert summary["val_f1_micro"] > trivial_f1(run_dir) + 0.15, summary
    metrics = json.loads((run_dir / "eval" / "metrics.json").read_text())
    assert metrics["task"] == "multilabel" and metrics["count"] == 12, metrics
    assert metrics["data"]["split"] == "test", metrics["data"]


def test_val_and_test_labels_csv_mistakes_name_the_key(tmp_path):
    from kiln.data import build_data

    train = write_listed_images(tmp_path / "train", 12)
    base = ("data=image_folder", f"data.labels_csv={train}", f"data.cache_dir={tmp_path}/c")
    for key in ("val_labels_csv", "test_labels_csv"):
        cfg = compose_config(*base, f"data.{key}={tmp_path / 'absent.csv'}")
        with pytest.raises(ConfigError, match=rf"no such file: .*absent.csv \(data.{key}\)") as e:
            build_data(cfg.data)
        assert e.value.key == f"data.{key}" and "\n" not in str(e.value)
        with pytest.raises(ConfigError, match=rf"{key} is set but labels_csv is null") as e:
            compose_config("data=image_folder", f"data.{key}={train}")
        assert e.value.key == f"data.{key}"
    with pytest.raises(ConfigError, match=r"no such file: .*absent.csv \(data.labels_csv\)"):
        build_data(
            compose_config("data=image_folder", f"data.labels_csv={tmp_path / 'absent.csv'}").data
        )


def test_csv_text_multilabel_val_path_rows_are_the_val_split_exactly(tmp_path):
    """data.val_path with label sets: every good row of the val CSV is one val item with that
    row's multi-hot target, and nothing of the training CSV is held out."""
    from kiln.data.csv_text import build_csv_text

    train = write_multilabel_csv(tmp_path / "train.csv", 50)
    val = write_multilabel_csv(tmp_path / "val.csv", 17, seed=3)  # + a row with no label
    cfg = compose_config(
        "data=csv_text",
        "model=text_bow",
        "data.label_column=labels",
        f"data.label_separator={SEP}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"data.train_path={train}",
        f"data.val_path={val}",
    )
    bundle = build_csv_text(cfg.data)
    assert bundle.report["rows"] == {"train": 50, "val": 17}
    assert len(bundle.train) == 50 and len(bundle.val) == 17
    val_rows = multilabel_rows(17, 3)
    sources = list(bundle.sources["val"])
    assert sorted(sources) == sorted(f"val.csv row {n}" for n in range(1, 18))
    for i, source in enumerate(sources):
        _, labels = val_rows[int(source.removeprefix("val.csv row ")) - 1]
        expected = [float(name in labels.split(SEP)) for name in NAMES]
        assert bundle.val[i][1].tolist() == expected, source
