"""The evaluation report: a checkpoint's predictions over labelled data, measured and written to
an `eval/` folder. Shared by `python infer.py mode=evaluate` and the end of training (a data
test split), so both say the same thing about a model.

    eval/metrics.json          the numbers (below), the checkpoint and the data they came from
    eval/confusion_matrix.png  classification: counts, coloured by share of the true class
    eval/errors.csv            the most confidently wrong inputs (detection: the worst images)
    eval/predictions.csv       every input: source, true, label (predicted), prob_<class> ...
                               (detection: every box, with the true box it matched and the IoU)

Classification metrics come from the confusion matrix (kiln.inference.scores, equal to
scikit-learn's: accuracy, top-5 accuracy when there are more than 5 classes, macro-F1 over the
classes present in the labels or the predictions, per-class precision / recall / F1 / support,
the confusion matrix). Detection is torchmetrics'
MeanAveragePrecision (COCO's evaluation through pycocotools), the same computation as the
training log's val_map50, so the report and the log agree: mAP@[.5:.95], mAP@.5 and per class.

Predictions go through the `Predictor` that `infer.py` predict and the server use: raw inputs
(files, texts) through `convert` + `run`, exactly as predict; a dataset split that is already
prepared (the end of training, or no data= given) through `run_prepared`."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.atomic import atomic_file, write_json
from kiln.data.multilabel import join_labels
from kiln.errors import UserError
from kiln.inference.labelled import (
    LabelledDataError,
    LabelledInputs,
    read_labelled_csv,
    read_labelled_folder,
    read_labelled_records,
)
from kiln.inference.predictor import Predictor
from kiln.inference.tables import write_predictions
from kiln.preprocessing import InputError
from kiln.preprocessing.image_files import DEFAULT_MAX_PIXELS

log = logging.getLogger(__name__)

EVAL_DIR = "eval"
METRICS_FILE, CONFUSION_FILE = "metrics.json", "confusion_matrix.png"
PER_CLASS_FILE = "per_class.png"  # multi-label: precision, recall, F1 per class
ERRORS_FILE, PREDICTIONS_FILE = "errors.csv", "predictions.csv"
DEFAULT_NUM_ERRORS = 100
TOP_K = 5


class EvaluateError(UserError, ValueError):
    """Evaluate was asked for something it cannot do; the message says what instead."""


@dataclass
class Report:
    """What was written, and where."""

    directory: Path
    metrics: dict[str, Any]

    def headline(self, prefix: str = "test_") -> dict[str, Any]:
        """The numbers a summary carries: test_acc, test_top5_acc, test_macro_f1, test_count (or
        test_map, test_map50 for detection), with the report's folder."""
        m = self.metrics
        keys = {
            "accuracy": "acc",
            "top5_accuracy": "top5_acc",
            "macro_f1": "macro_f1",
            "f1_micro": "f1_micro",
            "f1_macro": "f1_macro",
            "exact_match": "exact_match",
            "map": "map",
            "map_50": "map50",
            "count": "count",
        }
        out = {f"{prefix}{short}": m[key] for key, short in keys.items() if key in m}
        return {**out, f"{prefix}eval_dir": str(self.directory)}

    def lines(self) -> list[str]:
        m = self.metrics
        if m["task"] == "detection":
            numbers = f"mAP {_number(m['map'])}, mAP@0.5 {_number(m['map_50'])}"
        elif m["task"] == "multilabel":
            numbers = (
                f"micro-F1 {m['f1_micro']:.4f}, macro-F1 {m['f1_macro']:.4f}, exact match "
                f"{m['exact_match']:.4f} (threshold {m['threshold']})"
            )
        else:
            top5 = f", top-5 {m['top5_accuracy']:.4f}" if "top5_accuracy" in m else ""
            numbers = f"accuracy {m['accuracy']:.4f}{top5}, macro-F1 {m['macro_f1']:.4f}"
        data = m["data"]
        what = data.get("path") or f"the {data['split']} split of data={data.get('dataset')}"
        lines = [f"evaluated {m['count']} inputs ({what}): {numbers}"]
        if data.get("dropped"):
            first = {}
            for record in data["dropped_records"]:
                first.setdefault(record["reason"], _where(record, data["path"]))
            skipped = "; ".join(
                f"{count} {reason} (first: {first[reason]})"
                for reason, count in data["dropped"].items()
            )
            lines.append(f"skipped, not evaluated: {skipped}; listed in metrics.json")
        if m.get("baseline"):
            from kiln.inference.baseline import lines as baseline_lines

            found = m["baseline"]
            lines += baseline_lines(found, found["what"], found["override"])
        lines.append(f"wrote {self.directory}/: {', '.join(m['files'])}")
        return lines


def _where(record: dict, path: str) -> str:
    """A left-out input as a source reads: `<file>: <detail>`, or `<csv name> row N`."""
    if "path" not in record:
        return f"{Path(path).name} row {record['row']}"
    return f"{record['path']}: {record['detail']}" if "detail" in record else record["path"]


# ---------------------------------------------------------------------------------------------
# Classification


def classification_metrics(
    probs: np.ndarray, targets: np.ndarray, class_names: Sequence[str]
) -> dict[str, Any]:
    """The numbers of metrics.json from probabilities (N, K) and true class indices (N,)."""
    from kiln.inference.scores import ClassScores, top_k_accuracy

    probs, targets = np.asarray(probs, np.float32), np.asarray(targets, np.int64)
    scores = ClassScores.of(probs.argmax(axis=1), targets, len(class_names))
    out: dict[str, Any] = {"accuracy": scores.accuracy}
    if len(class_names) > TOP_K:
        out["top5_accuracy"] = top_k_accuracy(probs, targets, TOP_K)
    return out | {
        "macro_f1": scores.macro(scores.f1),
        "macro_precision": scores.macro(scores.precision),
        "macro_recall": scores.macro(scores.recall),
        "count": int(len(targets)),
        "errors": int(len(targets) - np.trace(scores.counts)),
        "num_classes": len(class_names),
        "per_class": scores.per_class(class_names),
        "confusion_matrix": scores.counts.tolist(),  # rows: true class, columns: predicted
    }


def most_confident_errors(probs, targets, sources, class_names, limit: int):
    """The wrong predictions, highest probability of the (wrong) prediction first; ties keep
    the inputs' order. Columns: source, true, predicted, prob_predicted, prob_true."""
    import pandas as pd

    predicted = probs.argmax(axis=1)
    wrong = np.flatnonzero(predicted != targets)
    confidence = probs[wrong, predicted[wrong]]
    order = wrong[np.argsort(-confidence, kind="stable")][:limit]
    names = list(class_names)
    return pd.DataFrame(
        {
            "source": [sources[i] for i in order],
            "true": [names[targets[i]] for i in order],
            "predicted": [names[predicted[i]] for i in order],
            "prob_predicted": probs[order, predicted[order]],
            "prob_true": probs[order, targets[order]],
        }
    )


def write_classification_report(
    directory: Path,
    probs: np.ndarray,
    targets: np.ndarray,
    sources: Sequence[str],
    class_names: Sequence[str],
    about: dict[str, Any],
    num_errors: int = DEFAULT_NUM_ERRORS,
) -> Report:
    """metrics.json, confusion_matrix.png, errors.csv and predictions.csv into `directory`."""
    from kiln.inference.confusion import write_confusion_matrix

    _check_lengths(len(probs), targets, sources)
    metrics = {
        "task": "classification",
        **about,
        **classification_metrics(probs, targets, class_names),
    }
    directory.mkdir(parents=True, exist_ok=True)
    title = (
        f"{metrics['count']} inputs, accuracy {metrics['accuracy']:.4f}, macro-F1 "
        f"{metrics['macro_f1']:.4f}"
    )
    counts = np.asarray(metrics["confusion_matrix"])
    write_confusion_matrix(counts, list(class_names), directory / CONFUSION_FILE, title)
    errors = most_confident_errors(probs, targets, sources, class_names, num_errors)
    _write_csv(errors, directory / ERRORS_FILE)
    names = list(class_names)
    write_predictions(
        probs, names, directory / PREDICTIONS_FILE, list(sources), truth=[names[i] for i in targets]
    )
    metrics["files"] = [METRICS_FILE, CONFUSION_FILE, ERRORS_FILE, PREDICTIONS_FILE]
    write_json(directory / METRICS_FILE, metrics, indent=2)
    return Report(directory, metrics)


# ---------------------------------------------------------------------------------------------
# Multi-label


def multilabel_metrics(
    probs: np.ndarray, targets: np.ndarray, class_names: Sequence[str], threshold: float
) -> dict[str, Any]:
    """The numbers of a multi-label metrics.json, torchmetrics' multilabel classes at the
    model's threshold: micro and macro F1 (precision, recall), exact-match (subset) accuracy,
    per class precision / recall / F1 / support."""
    import torch
    from torchmetrics.classification import (
        MultilabelExactMatch,
        MultilabelF1Score,
        MultilabelPrecision,
        MultilabelRecall,
    )

    k = len(class_names)
    preds = torch.from_numpy(np.asarray(probs, np.float32))
    target = torch.from_numpy(np.asarray(targets)).round().long()

    def value(metric_class, **kwargs) -> Any:
        return metric_class(num_labels=k, threshold=threshold, **kwargs)(preds, target).tolist()

    precision = value(MultilabelPrecision, average=None)
    recall = value(MultilabelRecall, average=None)
    f1 = value(MultilabelF1Score, average=None)
    support = target.sum(dim=0).tolist()
    predicted = preds >= threshold
    return {
        "threshold": threshold,
        "f1_micro": value(MultilabelF1Score, average="micro"),
        "f1_macro": value(MultilabelF1Score, average="macro"),
        "precision_micro": value(MultilabelPrecision, average="micro"),
        "recall_micro": value(MultilabelRecall, average="micro"),
        "exact_match": value(MultilabelExactMatch),
        "count": int(len(target)),
        "errors": int((predicted != target.bool()).any(dim=1).sum()),  # samples not exact
        "num_classes": k,
        "per_class": {
            name: {
                "precision": precision[i],
                "recall": recall[i],
                "f1": f1[i],
                "support": int(support[i]),
            }
            for i, name in enumerate(class_names)
        },
    }


def multilabel_errors(probs, targets, sources, class_names, threshold, separator, limit: int):
    """The samples whose predicted set is not the true one, the most confidently wrong first
    (the largest gap between a wrong class's probability and its truth). Columns: source, true,
    predicted, missed, extra, worst_prob_gap."""
    import pandas as pd

    truth = np.asarray(targets) > 0.5
    predicted = probs >= threshold
    wrong = np.flatnonzero((predicted != truth).any(axis=1))
    gap = np.abs(probs - truth)[wrong].max(axis=1) if len(wrong) else np.zeros(0)
    order = wrong[np.argsort(-gap, kind="stable")][:limit]
    names = np.asarray(list(class_names), dtype=object)

    def joined(mask) -> str:
        return join_labels(list(names[mask]), separator)

    return pd.DataFrame(
        {
            "source": [sources[i] for i in order],
            "true": [joined(truth[i]) for i in order],
            "predicted": [joined(predicted[i]) for i in order],
            "missed": [joined(truth[i] & ~predicted[i]) for i in order],
            "extra": [joined(predicted[i] & ~truth[i]) for i in order],
            "worst_prob_gap": np.abs(probs - truth)[order].max(axis=1) if len(order) else [],
        }
    )


def write_multilabel_report(
    directory: Path,
    probs: np.ndarray,
    targets: np.ndarray,
    sources: Sequence[str],
    class_names: Sequence[str],
    about: dict[str, Any],
    multi_label: tuple[str, float],
    num_errors: int = DEFAULT_NUM_ERRORS,
) -> Report:
    """metrics.json, per_class.png (precision / recall / F1 per class), errors.csv and
    predictions.csv (labels joined by the separator) into `directory`."""
    from kiln.inference.confusion import write_per_class_bars

    separator, threshold = multi_label
    _check_lengths(len(probs), targets, sources)
    metrics = {
        "task": "multilabel",
        **about,
        **multilabel_metrics(probs, targets, class_names, threshold),
    }
    directory.mkdir(parents=True, exist_ok=True)
    title = (
        f"{metrics['count']} inputs, micro-F1 {metrics['f1_micro']:.4f}, macro-F1 "
        f"{metrics['f1_macro']:.4f}, exact match {metrics['exact_match']:.4f}"
    )
    write_per_class_bars(metrics["per_class"], directory / PER_CLASS_FILE, title)
    errors = multilabel_errors(
        probs, targets, sources, class_names, threshold, separator, num_errors
    )
    _write_csv(errors, directory / ERRORS_FILE)
    names = np.asarray(list(class_names), dtype=object)
    truth = [join_labels(list(names[row > 0.5]), separator) for row in np.asarray(targets)]
    write_predictions(
        probs,
        list(class_names),
        directory / PREDICTIONS_FILE,
        list(sources),
        truth=truth,
        multi_label=multi_label,
    )
    metrics["files"] = [METRICS_FILE, PER_CLASS_FILE, ERRORS_FILE, PREDICTIONS_FILE]
    write_json(directory / METRICS_FILE, metrics, indent=2)
    return Report(directory, metrics)


# ---------------------------------------------------------------------------------------------
# Detection (the numbers: kiln.inference.detection_report)


def write_detection_report(
    directory,
    detections,
    targets,
    sources,
    class_names,
    about,
    num_errors: int = DEFAULT_NUM_ERRORS,
    images=None,
) -> Report:
    """metrics.json, errors.csv and the pictures (kiln.inference.detection_pictures): the AP per
    class, and the boxes over the first `images` ((3, H, W) arrays in [0, 1]) when given."""
    from kiln.inference.detection_pictures import (
        AP_FILE,
        BOXES_FILE,
        write_ap_bars,
        write_boxes_grid,
    )
    from kiln.inference.detection_report import (
        DETECTION_MATCH_IOU,
        DETECTION_SCORE_THRESHOLD,
        box_predictions,
        detection_errors,
        detection_metrics,
    )

    _check_lengths(len(detections), targets, sources)
    metrics = {"task": "detection", **about, **detection_metrics(detections, targets, class_names)}
    metrics["errors_listing"] = {
        "score_threshold": DETECTION_SCORE_THRESHOLD,
        "match_iou": DETECTION_MATCH_IOU,
    }
    directory.mkdir(parents=True, exist_ok=True)
    errors = detection_errors(detections, targets, sources, class_names, num_errors)
    _write_csv(errors, directory / ERRORS_FILE)
    _write_csv(
        box_predictions(detections, targets, sources, class_names), directory / PREDICTIONS_FILE
    )
    metrics["files"] = [METRICS_FILE, ERRORS_FILE, PREDICTIONS_FILE, AP_FILE]
    title = f"{metrics['count']} images: mAP {_number(metrics['map'])}, mAP@.5 " + _number(
        metrics["map_50"]
    )
    write_ap_bars(metrics["per_class"], directory / AP_FILE, title)
    if images:
        write_boxes_grid(
            images,
            detections,
            targets,
            sources,
            class_names,
            directory / BOXES_FILE,
            DETECTION_SCORE_THRESHOLD,
        )
        metrics["files"].append(BOXES_FILE)
    write_json(directory / METRICS_FILE, metrics, indent=2)
    return Report(directory, metrics)


# ---------------------------------------------------------------------------------------------
# Predictions


def predict_split(
    predictor: Predictor, dataset, *, collate_fn=None, batch_size: int = 256, num_workers: int = 0
) -> tuple[Any, Any]:
    """(outputs, targets) over a prepared dataset split, in its order: probabilities (N, K) and
    class indices (N,), or per-image Detections and target dicts."""
    from torch.utils.data import DataLoader

    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        collate_fn=collate_fn,
        num_workers=num_workers,
    )
    outputs, targets = [], []
    for inputs, batch_targets in loader:
        outputs.append(predictor.run_prepared(inputs))
        targets.append(batch_targets)
    if predictor.task == "detection":
        flat = [{k: np.asarray(v) for k, v in t.items()} for part in targets for t in part]
        return [d for part in outputs for d in part], flat
    if not outputs:
        return predictor.empty_outputs(), np.zeros(0, dtype=np.int64)
    return np.concatenate(outputs), np.concatenate([np.asarray(t) for t in targets])


def predict_labelled(
    predictor: Predictor,
    labelled: LabelledInputs,
    batch_size: int,
    max_image_pixels: int | None = DEFAULT_MAX_PIXELS,
) -> tuple[Any, LabelledInputs]:
    """(outputs, the inputs they are of). Texts: through `convert` + `run` in chunks as
    `infer.py` predict runs them, a bad one named by its source. Files: read, decoded and
    predicted one batch at a time (kiln.inference.stream); one that cannot be opened, is too
    large or cannot be decoded is left out and reported under `skipped` with its reason."""
    if labelled.inputs and isinstance(labelled.inputs[0], Path):
        return _predict_files(predictor, labelled, batch_size, max_image_pixels)
    chunks = []
    for start in range(0, len(labelled.inputs), batch_size):
        try:
            chunks.append(
                predictor.run(predictor.convert(labelled.inputs[start : start + batch_size]))
            )
        except InputError as err:
            where = labelled.sources[start + err.index] if err.index is not None else "an input"
            raise InputError(f"{where}: {err}", None) from None
    return np.concatenate(chunks), labelled


def _predict_files(predictor, labelled: LabelledInputs, batch_size: int, max_image_pixels):
    from functools import partial

    from kiln.inference.files import NamedFile, load_file_input
    from kiln.inference.stream import predict_batches

    files = [
        NamedFile(path, source)
        for path, source in zip(labelled.inputs, labelled.sources, strict=True)
    ]
    load = partial(load_file_input, predictor.preprocess, max_image_pixels=max_image_pixels)
    outputs, kept, failed = [], [], {}
    report = labelled.report  # the reader's, plus the files that could not be decoded
    for batch in predict_batches(predictor, files, load, batch_size):
        outputs.append(batch.outputs)
        kept += batch.good
        for i, error in batch.errors.items():
            reason, _, detail = error.partition(": ")
            failed.setdefault(reason, []).append(f"{labelled.sources[i]}: {detail}")
            report.add({"reason": reason, "path": labelled.sources[i], "detail": detail})
    if not kept:
        raise LabelledDataError(
            f"none of the {len(files)} inputs could be read: "
            + "; ".join(f"{len(v)} {k} (e.g. {v[0]})" for k, v in failed.items())
        )
    report.kept = len(kept)
    survivors = LabelledInputs(
        [labelled.inputs[i] for i in kept],
        labelled.targets[kept],
        [labelled.sources[i] for i in kept],
        report=report,
    )
    return np.concatenate(outputs), survivors


def write_report(
    predictor: Predictor,
    outputs,
    targets,
    sources,
    directory: Path,
    about,
    num_errors: int = DEFAULT_NUM_ERRORS,
    images=None,
) -> Report:
    if predictor.task == "detection":
        return write_detection_report(
            directory,
            outputs,
            targets,
            sources,
            predictor.class_names,
            about,
            num_errors,
            images=images,
        )
    if predictor.multi_label is not None:
        return write_multilabel_report(
            directory,
            outputs,
            targets,
            sources,
            predictor.class_names,
            about,
            predictor.multi_label,
            num_errors,
        )
    return write_classification_report(
        directory, outputs, targets, sources, predictor.class_names, about, num_errors
    )


# ---------------------------------------------------------------------------------------------
# Entry points


def evaluate_split(
    ckpt: str | Path,
    dataset,
    *,
    split: str,
    directory: Path,
    data: dict[str, Any],
    sources: Sequence[str] | None = None,
    collate_fn=None,
    device: str = "cpu",
    batch_size: int = 256,
    num_workers: int = 0,
    num_errors: int = DEFAULT_NUM_ERRORS,
) -> Report:
    """The report of checkpoint `ckpt` on a prepared split (`dataset`: a DataBundle's val or
    test), e.g. at the end of training. `data`: what the split is, for metrics.json."""
    predictor = Predictor.from_checkpoint(ckpt, "torch", device)
    outputs, targets = predict_split(
        predictor, dataset, collate_fn=collate_fn, batch_size=batch_size, num_workers=num_workers
    )
    about = _about(predictor, {"split": split, **data})
    return write_report(
        predictor,
        outputs,
        targets,
        split_sources(sources, split, len(targets)),
        directory,
        about,
        num_errors,
        images=first_images(predictor, dataset),
    )


def first_images(predictor: Predictor, dataset) -> list | None:
    """A detector's first evaluated images ((3, H, W) arrays), for the report's boxes.png."""
    from kiln.inference.detection_pictures import MAX_GRID_IMAGES

    if predictor.task != "detection":
        return None
    return [np.asarray(dataset[i][0]) for i in range(min(len(dataset), MAX_GRID_IMAGES))]


def evaluate_checkpoint(
    ckpt: str | Path,
    *,
    data: str | Path | None = None,
    output: str | Path | None = None,
    split: str | None = None,
    backend: str = "torch",
    device: str = "cpu",
    batch_size: int = 256,
    num_errors: int = DEFAULT_NUM_ERRORS,
    max_image_pixels: int | None = DEFAULT_MAX_PIXELS,
    follow_symlinks: bool = True,
) -> Report:
    """`python infer.py mode=evaluate`: on a labelled folder or CSV (`data`), else on the
    checkpoint's own recorded data, rebuilt (its test split when it has one, else val)."""
    predictor = Predictor.from_checkpoint(
        ckpt, backend, device, threads="auto", batch_size=batch_size
    )
    directory = Path(output) if output is not None else default_directory(Path(ckpt))
    if data is None:
        dataset, collate_fn, sources, described, sample = rebuild_split(predictor, split)
        outputs, targets = predict_split(
            predictor, dataset, collate_fn=collate_fn, batch_size=batch_size
        )
        sources = split_sources(sources, described["split"], len(targets))
        images = first_images(predictor, dataset)
        beside = None
        if sample is not None and described["split"] == "val":
            beside = (sample, sample.val_texts, sample.val_positions, "validation texts")
    elif predictor.task == "detection":  # a COCO file or a YOLO folder, read as training reads
        from kiln.data.shapes_detection import collate_image_list
        from kiln.inference.labelled import read_labelled_boxes

        labelled = read_labelled_boxes(
            Path(data), predictor.class_names, max_image_pixels=max_image_pixels
        )
        outputs, targets = predict_split(
            predictor, labelled.dataset, collate_fn=collate_image_list, batch_size=batch_size
        )
        sources, images = labelled.sources, first_images(predictor, labelled.dataset)
        described = {
            "path": str(Path(data).resolve()),
            "layout": labelled.layout,
            **labelled.report,
        }
        beside = None
    else:
        images = None
        labelled, described = read_labelled(predictor, Path(data), follow_symlinks)
        outputs, labelled = predict_labelled(predictor, labelled, batch_size, max_image_pixels)
        targets, sources = labelled.targets, labelled.sources
        described |= left_out_entry(labelled)
        beside = labelled_beside(predictor, labelled)
    about = _about(predictor, described)
    if beside is not None:
        about["baseline"] = baseline_result(predictor, *beside, outputs, targets)
    return write_report(
        predictor, outputs, targets, sources, directory, about, num_errors, images=images
    )


def _baseline_sample(predictor: Predictor):
    """The training split's baseline sample (kiln.data.spec.TextSample) of a text classifier's
    recorded data, rebuilt (from the token cache when it is there), or None."""
    from kiln.config import option_from_dict
    from kiln.data import build_data

    if predictor.preprocess.input_kind != "tokens" or predictor.multi_label is not None:
        return None
    data_config = predictor.record.config.get("data", {})
    try:
        bundle = build_data(
            option_from_dict("data", data_config), pretrained=_pretrained(predictor)
        )
    except (UserError, FileNotFoundError) as err:
        log.warning("baseline: not fitted (the training data could not be read again: %s)", err)
        return None
    return bundle.baseline


def labelled_beside(predictor: Predictor, labelled: LabelledInputs):
    """What the baseline is scored on for data=<file>: the evaluated texts, cleaned as training
    cleaned them (at most data.baseline_rows of them, a seeded sample)."""
    from kiln.preprocessing.cleaning import clean_text

    sample = _baseline_sample(predictor)
    if sample is None:
        return None
    data_config = predictor.record.config.get("data", {})
    count = len(labelled.inputs)
    most = int(data_config.get("baseline_rows") or count)
    positions = np.arange(count)
    if count > most:
        positions = np.sort(np.random.default_rng(0).choice(count, size=most, replace=False))
    cleaning = predictor.record.recipe.cleaning
    texts = []
    for i in positions.tolist():
        text = labelled.inputs[i]
        parts = text if isinstance(text, list | tuple) else [text]
        texts.append(" ".join(clean_text(str(part), cleaning) for part in parts))
    return sample, texts, positions.tolist(), "evaluated texts"


def baseline_result(predictor: Predictor, sample, texts, positions, what, outputs, targets):
    """TF-IDF + LinearSVC fitted on the training sample, scored on `texts` (the inputs at
    `positions`) beside the model's outputs there (kiln.inference.baseline)."""
    from kiln.inference import baseline

    chosen = np.asarray(positions, dtype=np.int64)
    scored = np.asarray(targets)[chosen], np.asarray(outputs)[chosen]
    result = baseline.compare(
        sample.train_texts, sample.train_labels, texts, *scored, predictor.class_names
    )
    config = predictor.record.config
    max_epochs = config.get("trainer", {}).get("max_epochs", 10)
    override, why = baseline.try_instead(config.get("model", {}).get("name", ""), max_epochs)
    return result | {"what": what, "override": override, "why": why}


def default_directory(ckpt: Path) -> Path:
    """<run>/eval for <run>/checkpoints/<file>; else eval/ beside the checkpoint."""
    parent = ckpt.resolve().parent
    return (parent.parent if parent.name == "checkpoints" else parent) / EVAL_DIR


def read_labelled(
    predictor: Predictor, path: Path, follow_symlinks: bool = True
) -> tuple[LabelledInputs, dict[str, Any]]:
    kind = predictor.preprocess.input_kind
    names = predictor.class_names
    if kind == "image" and predictor.spec.multi_label:
        raise EvaluateError(
            f"data={path}: a multi-label image model (data.labels_csv) is evaluated on its own "
            "data's split; leave out data= to evaluate the checkpoint's recorded data"
        )
    if kind == "image":
        if not path.is_dir():
            raise EvaluateError(
                f"data={path}: an image model is evaluated on a folder with one "
                "subfolder per class, not a file"
            )
        takes_encoded = getattr(predictor.preprocess.recipe, "resize_size", None) is not None
        labelled = read_labelled_folder(
            path, names, takes_encoded=takes_encoded, follow_symlinks=follow_symlinks
        )
        described = {"path": str(path.resolve()), "layout": "class subfolders"}
    else:
        from kiln.data.text_formats import resolve_format

        columns = predictor.record.config.get("data", {})
        fmt = resolve_format(path, "auto")
        if fmt != "csv":
            labelled = read_labelled_records(
                path,
                fmt,
                names,
                text_column=columns.get("text_column", "text"),
                label_column=columns.get("label_column", "label"),
                pair_column=columns.get("text_pair_column"),
                label_separator=predictor.spec.label_separator,
            )
            return labelled, {"path": str(path.resolve()), "layout": fmt}
        if path.is_dir() or path.suffix.lower() != ".csv":
            raise EvaluateError(
                f"data={path}: a text model is evaluated on a .csv, Parquet or JSON Lines file "
                "or a datasets folder, with a text and a label column"
            )
        labelled = read_labelled_csv(
            path,
            names,
            text_column=columns.get("text_column", "text"),
            label_column=columns.get("label_column", "label"),
            pair_column=columns.get("text_pair_column"),
            label_separator=predictor.spec.label_separator,
        )
        described = {"path": str(path.resolve()), "layout": "csv"}
    return labelled, described


def left_out_entry(labelled: LabelledInputs) -> dict[str, Any]:
    """metrics.json's `data` keys for what was read, kept and left out: a data_report.json
    entry's (`<unit>_read`, `<unit>_kept`, `<unit>_dropped`, `dropped`, `dropped_records`)."""
    entry = labelled.report.to_dict()
    del entry["path"]  # `data.path` is the one given, resolved
    return entry


def rebuild_split(predictor: Predictor, split: str | None):
    """The checkpoint's recorded data config, built again with kiln.data.build_data: (dataset,
    collate_fn, sources, what it is, the training split's baseline sample or None). Refused
    when the rebuilt preprocessing differs from the checkpoint's (the files changed since
    training): the model would be fed other inputs."""
    from kiln.config import option_from_dict
    from kiln.data import build_data

    config = predictor.record.config
    data_config = config.get("data", {})
    name = data_config.get("name")
    try:
        bundle = build_data(
            option_from_dict("data", data_config), pretrained=_pretrained(predictor)
        )
    except (UserError, FileNotFoundError) as err:
        raise EvaluateError(
            f"rebuilding this checkpoint's data (data={name}) failed: {err}; pass "
            "data=<a labelled folder or CSV> to evaluate on other data"
        ) from None
    differs = _recipe_differences(bundle.recipe.to_dict(), predictor.record.recipe.to_dict())
    if differs:
        raise EvaluateError(
            f"the checkpoint's data (data={name}) now builds a different preprocessing than it "
            f"was trained with ({', '.join(differs)} changed: the files changed since?); pass "
            "data=<a labelled folder or CSV> to evaluate on them as they are now"
        )
    chosen = split or ("test" if bundle.test is not None else "val")
    if chosen == "test" and bundle.test is None:
        raise EvaluateError(
            f"split=test: data={name} as this checkpoint recorded it has no test "
            "split; use split=val or data=<path>"
        )
    dataset = bundle.test if chosen == "test" else bundle.val
    sources = (bundle.sources or {}).get(chosen)
    return (
        dataset,
        bundle.collate_fn,
        sources,
        {"split": chosen, "dataset": name, "config": data_config},
        bundle.baseline if predictor.multi_label is None else None,
    )


def split_sources(sources: Sequence[str] | None, split: str, count: int) -> Sequence[str]:
    """A split's sources as the dataset named them, else `<split>[i]`."""
    if sources is None:
        return [f"{split}[{i}]" for i in range(count)]
    if len(sources) != count:
        raise ValueError(
            f"the dataset names {len(sources)} sources for its {split} split of "
            f"{count} items (DataBundle.sources[{split!r}])"
        )
    return sources


# ---------------------------------------------------------------------------------------------
# Helpers


def _number(value: float | None) -> str:
    return "undefined (no true box)" if value is None else f"{value:.4f}"


def _about(predictor: Predictor, data: dict[str, Any]) -> dict[str, Any]:
    return {
        "checkpoint": str(Path(predictor.source).resolve()),
        "checkpoint_sha256": predictor.record.checkpoint_sha256,
        "model": predictor.record.model_name,
        "backend": type(predictor.backend).__name__,
        "data": data,
    }


def _pretrained(predictor: Predictor):
    """What the checkpoint's recipe recorded of the model's weights (zoo models: their
    PretrainedInput; model=hf: its PretrainedText, tokenizer included; text_bow: its
    WordSpelling), or None."""
    from kiln.preprocessing.pretrained import pretrained_from_dict

    recipe = predictor.record.recipe
    spelling = getattr(recipe, "spelling", None)  # text_bow: its data spells unknown words
    return spelling or pretrained_from_dict(getattr(recipe, "pretrained", None))


def _recipe_differences(rebuilt: dict, recorded: dict) -> list[str]:
    plain = lambda d: json.loads(json.dumps(d, default=str))  # noqa: E731  tuples -> lists
    a, b = plain(rebuilt), plain(recorded)
    return [key for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]


def _check_lengths(count: int, targets, sources) -> None:
    if count == 0:
        raise EvaluateError("nothing to evaluate: the data has no inputs")
    if not len(targets) == len(sources) == count:
        raise ValueError(f"{count} predictions, {len(targets)} labels, {len(sources)} sources")


def _write_csv(frame, path: Path) -> None:
    with atomic_file(path, "w", newline="", encoding="utf-8") as f:
        frame.to_csv(f, index=False)
