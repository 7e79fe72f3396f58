"""A run that learned nothing is not ok. Each evaluator says what its metrics are when the model
knows nothing (`Chance`): the majority class's share of the validation labels for val_acc, the
loss of always predicting the labels' frequencies for val_loss (ln C when they are uniform), 0 for
the mAP of a detector that finds nothing. At every evaluation the monitored metric is compared
with it, with a margin for the sample (two binomial standard deviations of the share for an
accuracy): an evaluation there is said in the log, and a run whose best stays there ends with
status `at_chance` and one line saying so."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Chance:
    """What a metric is for a model that knows nothing, with the margin a sample this size
    leaves around it."""

    metric: str
    value: float
    margin: float
    what: str  # how the value comes about, for the message

    def reached(self, value: float | None, mode: str) -> bool:
        """Whether `value` (of a metric `mode` "max" or "min") is at chance."""
        if value is None or not math.isfinite(value):
            return False
        if mode == "max":
            return value <= self.value + self.margin
        return value >= self.value - self.margin

    def describe(self, value: float) -> str:
        return (
            f"{self.metric} {value:.4g} is at chance: {self.what} is {self.value:.4g} "
            f"(within {self.margin:.2g})"
        )


def classification_chance(counts: list[float]) -> dict[str, Chance]:
    """From the validation labels' counts per class."""
    total = sum(counts)
    if total <= 0:
        return {}
    share = max(counts) / total
    prior = [c / total for c in counts if c > 0]
    entropy = -sum(p * math.log(p) for p in prior)
    classes = len(counts)
    return {
        "val_acc": Chance(
            "val_acc",
            share,
            2 * math.sqrt(share * (1 - share) / total) + 1 / total,
            f"the majority class's share of the {int(total)} validation samples",
        ),
        "val_loss": Chance(
            "val_loss",
            entropy,
            0.02 * entropy,
            "the loss of always predicting the labels' frequencies "
            f"(ln {classes} = {math.log(classes):.3g} when uniform)",
        ),
    }


def multilabel_chance(positives: list[float], samples: float) -> dict[str, Chance]:
    """From the validation samples holding each class: the BCE of always predicting each
    class's frequency (the mean over classes of its binary entropy), and the micro-F1 of
    predicting every class for every sample (what a model that knows nothing reaches by saying
    yes to all)."""
    if samples <= 0 or not positives:
        return {}
    shares = [min(max(p / samples, 0.0), 1.0) for p in positives]
    entropy = sum(-s * math.log(s) - (1 - s) * math.log(1 - s) for s in shares if 0 < s < 1)
    entropy /= len(shares)
    positive = sum(positives)
    all_yes = 2 * positive / (samples * len(positives) + positive)
    return {
        "val_loss": Chance(
            "val_loss",
            entropy,
            0.02 * entropy,
            "the loss of always predicting each class's frequency",
        ),
        "val_f1_micro": Chance(
            "val_f1_micro",
            all_yes,
            2 * math.sqrt(all_yes * (1 - all_yes) / samples) + 1 / samples,
            f"the micro-F1 of predicting every class for each of the {int(samples)} samples",
        ),
    }


def detection_chance(images: int) -> dict[str, Chance]:
    nothing = f"the mAP of a detector that finds nothing on {images} images"
    return {name: Chance(name, 0.0, 0.01, nothing) for name in ("val_map", "val_map50")}
