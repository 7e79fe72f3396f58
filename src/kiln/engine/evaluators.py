"""One evaluator per task, chosen by the dataset's DataSpec.task through the EVALUATORS registry.
An evaluator runs the model (already in eval mode, under no_grad) over validation batches and
returns metrics; `monitor` names the one that picks best.pt when trainer.monitor=auto."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kiln.engine.chance import (
    Chance,
    classification_chance,
    detection_chance,
    multilabel_chance,
)
from kiln.engine.distributed import DistInfo, all_reduce_sum
from kiln.engine.precision import Precision
from kiln.models import logits_of
from kiln.registry import EVALUATORS


def build_evaluator(
    task: str, *, precision: Precision, device: torch.device, dist: DistInfo, **settings
):
    """The task's evaluator; `settings`: what the data says about its metrics (multi-label:
    threshold)."""
    return EVALUATORS.get(task)(precision=precision, device=device, dist=dist, **settings)


class ClassificationEvaluator:
    """val_loss (cross-entropy), val_acc and val_macro_f1 (the mean over classes of each one's
    F1, as scikit-learn's f1_score(average="macro") over the classes seen or predicted: a rare
    class counts as much as a common one) over every validation sample, all ranks summed; and
    what they would be for a model that knows nothing (`chance`, from the labels' counts)."""

    monitor, monitor_mode = "val_acc", "max"

    def __init__(self, *, precision: Precision, device: torch.device, dist: DistInfo):
        self.precision, self.device, self.dist = precision, device, dist
        self.chance: dict[str, Chance] = {}

    def __call__(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        totals = torch.zeros(3, device=self.device, dtype=torch.float64)  # loss sum, correct, n
        confusion = None  # (C * C,) counts of label * C + prediction
        for inputs, targets in batches:
            with self.precision.autocast():
                logits = logits_of(model(inputs)).float()
            loss = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
            # Soft targets (N, C) too: MixUp batches, validated under trainer.overfit_batches.
            labels = targets.argmax(dim=-1) if targets.dim() == 2 else targets
            predicted = logits.argmax(dim=-1)
            correct = (predicted == labels).sum()
            count = torch.tensor(len(targets), device=self.device)
            totals += torch.stack([loss.double(), correct.double(), count.double()])
            classes = logits.shape[-1]
            pairs = torch.bincount(labels * classes + predicted, minlength=classes * classes)
            confusion = pairs if confusion is None else confusion + pairs
        loss_sum, correct, count = all_reduce_sum(totals).tolist()
        count = max(count, 1.0)
        metrics = {"val_loss": loss_sum / count, "val_acc": correct / count}
        self.chance = {}
        if confusion is not None:
            confusion = all_reduce_sum(confusion.double())
            per_label = confusion.reshape(classes, classes).sum(dim=1)
            self.chance = classification_chance(per_label.tolist())
            metrics["val_macro_f1"] = macro_f1(confusion)
        return metrics


def macro_f1(confusion: torch.Tensor) -> float:
    """Macro-F1 from flat (C * C,) counts of label * C + prediction: 2TP / (2TP + FP + FN) per
    class, averaged over the classes that occur as a label or a prediction (the evaluation
    report's, kiln.inference.scores)."""
    from kiln.inference.scores import ClassScores

    classes = int(round(confusion.numel() ** 0.5))
    scores = ClassScores.from_counts(confusion.reshape(classes, classes).cpu().numpy())
    return scores.macro(scores.f1)


class MultiLabelEvaluator:
    """Multi-label (DataSpec.task "multilabel"): val_loss (binary cross-entropy, mean over
    samples and classes, as training's), and from the classes predicted at the data's threshold
    (a sigmoid per class) val_f1_micro, val_f1_macro (every class's F1 averaged, a class with no
    true and no predicted sample counting 0: torchmetrics' MultilabelF1Score(average="macro"))
    and val_exact_match (the share of samples whose predicted set is exactly the true one). All
    ranks summed; best.pt is picked by val_f1_micro."""

    monitor, monitor_mode = "val_f1_micro", "max"

    def __init__(
        self, *, precision: Precision, device: torch.device, dist: DistInfo, threshold=0.5
    ):
        self.precision, self.device, self.dist = precision, device, dist
        self.threshold = threshold
        self.chance: dict[str, Chance] = {}

    def __call__(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        totals = torch.zeros(3, device=self.device, dtype=torch.float64)  # loss sum, exact, n
        counts = None  # (3, C): true positives, predicted, true per class
        for inputs, targets in batches:
            with self.precision.autocast():
                logits = logits_of(model(inputs)).float()
            targets = targets.float()
            loss = (
                torch.nn.functional.binary_cross_entropy_with_logits(
                    logits, targets, reduction="sum"
                )
                / logits.shape[-1]
            )  # the per-sample mean over classes, summed over samples
            predicted = torch.sigmoid(logits) >= self.threshold
            truth = targets > 0.5
            exact = (predicted == truth).all(dim=-1).sum()
            count = torch.tensor(len(targets), device=self.device)
            totals += torch.stack([loss.double(), exact.double(), count.double()])
            batch_counts = torch.stack(
                [(predicted & truth).sum(0), predicted.sum(0), truth.sum(0)]
            ).double()
            counts = batch_counts if counts is None else counts + batch_counts
        loss_sum, exact, count = all_reduce_sum(totals).tolist()
        count = max(count, 1.0)
        metrics = {"val_loss": loss_sum / count, "val_exact_match": exact / count}
        self.chance = {}
        if counts is not None:
            hits, predicted, true = all_reduce_sum(counts)
            both = (predicted.sum() + true.sum()).clamp(min=1)
            metrics["val_f1_micro"] = float(2 * hits.sum() / both)
            metrics["val_f1_macro"] = float((2 * hits / (predicted + true).clamp(min=1)).mean())
            self.chance = multilabel_chance(true.tolist(), count)
        return metrics


class DetectionEvaluator:
    """mAP@0.5 over every validation image, predictions gathered from all ranks; beside it
    COCO's mAP@[.5:.95] (val_map), mAP@.75, per object size and recall (kiln.engine.
    detection_eval.COCO_LOG_KEYS), all by torchmetrics' pycocotools evaluation. best.pt is
    picked by val_map, COCO's headline number (trainer.monitor=val_map50 for mAP@.5)."""

    monitor, monitor_mode = "val_map", "max"

    def __init__(self, *, precision: Precision, device: torch.device, dist: DistInfo):
        self.precision, self.device, self.dist = precision, device, dist
        self.chance: dict[str, Chance] = {}

    def __call__(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        from kiln.engine.detection_eval import coco_metrics, mean_average_precision

        predictions, targets = [], []
        for images, batch_targets in batches:
            with self.precision.autocast():
                outputs = model(images)
            # fp32 boxes and scores also under autocast; labels stay integers
            predictions += [
                {k: (v.float() if v.is_floating_point() else v).cpu() for k, v in p.items()}
                for p in outputs
            ]
            targets += [{k: v.cpu() for k, v in t.items()} for t in batch_targets]
        if self.dist.enabled:
            gathered = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, (predictions, targets))
            predictions = [p for part in gathered for p in part[0]]
            targets = [t for part in gathered for t in part[1]]
        self.chance = detection_chance(len(targets))
        return {
            "val_map50": mean_average_precision(predictions, targets, iou_threshold=0.5),
            **coco_metrics(predictions, targets),
        }


__all__ = [
    "ClassificationEvaluator",
    "DetectionEvaluator",
    "EVALUATORS",
    "MultiLabelEvaluator",
    "build_evaluator",
]
