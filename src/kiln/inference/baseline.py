"""The linear baseline of a text classifier, reported beside the model's numbers.

TF-IDF (word 1-2 grams and character 2-5 grams within words, sublinear tf, min_df 2, the same
features as scripts/bench_text.py's reference) + LinearSVC (C=1), fitted on a bounded, seeded
sample of the same training split the model trained on (kiln.data.spec.TextSample: at most
data.baseline_rows texts, each cut to 2,000 characters) and scored on the texts the model is
scored on: the validation split's sample at the end of training, the evaluated inputs in
`infer.py mode=evaluate`. A user learns from kiln when a linear model beats the trained one.

scikit-learn is imported only when a baseline is fitted: the server never imports it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

NAME = "TF-IDF + LinearSVC"
RECALL_GAP = 0.25  # a class the model recalls this much less often than the baseline is named


def fit_baseline(texts: Sequence[str], labels: Sequence[int]):
    """The fitted scikit-learn pipeline (texts -> class indices)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.pipeline import make_pipeline, make_union
    from sklearn.svm import LinearSVC

    min_df = 2 if len(texts) >= 50 else 1  # a handful of texts: every term counts
    features = make_union(
        TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=min_df),
        TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True, min_df=min_df),
    )
    return make_pipeline(features, LinearSVC()).fit(list(texts), np.asarray(labels))


def scores(predicted: np.ndarray, targets: np.ndarray, class_names: Sequence[str]) -> dict:
    """Accuracy, macro-F1 and per-class precision / recall / F1 / support of predicted class
    indices, as the evaluation report defines them (kiln.inference.scores)."""
    from kiln.inference.scores import ClassScores

    found = ClassScores.of(predicted, targets, len(class_names))
    return {
        "accuracy": found.accuracy,
        "macro_f1": found.macro(found.f1),
        "count": int(len(targets)),
        "per_class": found.per_class(class_names),
    }


def compare(
    train_texts: Sequence[str],
    train_labels: Sequence[int],
    eval_texts: Sequence[str],
    eval_targets: np.ndarray,
    model_probs: np.ndarray,
    class_names: Sequence[str],
) -> dict[str, Any]:
    """The baseline fitted on the training texts and scored on `eval_texts`, beside the model's
    scores on the same texts (`model_probs`, (N, K)): accuracy, macro-F1 and per class."""
    start = time.perf_counter()
    pipeline = fit_baseline(train_texts, train_labels)
    predicted = pipeline.predict(list(eval_texts))
    seconds = time.perf_counter() - start
    targets = np.asarray(eval_targets, dtype=np.int64)
    baseline = scores(np.asarray(predicted, dtype=np.int64), targets, class_names)
    model = scores(np.asarray(model_probs).argmax(axis=1), targets, class_names)
    weaker = {
        name: {
            "model_recall": model["per_class"][name]["recall"],
            "baseline_recall": base["recall"],
        }
        for name, base in baseline["per_class"].items()
        if base["support"] and base["recall"] - model["per_class"][name]["recall"] > RECALL_GAP
    }
    return {
        "name": NAME,
        "train_rows": len(train_texts),
        "eval_rows": len(eval_texts),
        "seconds": round(seconds, 2),
        "baseline": baseline,
        "model": model,
        "below": model["accuracy"] < baseline["accuracy"],
        "weaker_classes": weaker,
    }


def try_instead(model_name: str, max_epochs: int) -> tuple[str, str]:
    """(the override to try when the model is below the baseline, what it does)."""
    if model_name == "text_transformer":
        return "model=text_bow", "text_bow: a bag of words and n-grams, as the baseline reads"
    return (
        f"trainer.max_epochs={2 * max_epochs}",
        "train longer: small data needs more epochs than a few",
    )


def lines(result: dict[str, Any], what: str, override: str | None = None) -> list[str]:
    """The report's lines: the two side by side, then (below) the verdict with the override."""
    base, model = result["baseline"], result["model"]
    out = [
        f"baseline: {result['name']} fitted on {result['train_rows']:,} training texts, scored "
        f"on {result['eval_rows']:,} {what}: accuracy {base['accuracy']:.4f}, macro-F1 "
        f"{base['macro_f1']:.4f}; the model {model['accuracy']:.4f} / {model['macro_f1']:.4f}"
    ]
    for name, recall in list(result["weaker_classes"].items())[:3]:
        out.append(
            f"baseline: class {name!r} is recalled {recall['model_recall']:.0%} of the time by the "
            f"model, {recall['baseline_recall']:.0%} by the baseline"
        )
    if result["below"]:
        verdict = (
            f"the model is below the linear baseline (accuracy {model['accuracy']:.4f} < "
            f"{base['accuracy']:.4f})"
        )
        out.append(verdict + (f": train again with {override}" if override else ""))
    return out


def summary_keys(result: dict[str, Any]) -> dict[str, Any]:
    """What summary.json carries of a baseline comparison."""
    return {
        "baseline_acc": result["baseline"]["accuracy"],
        "baseline_macro_f1": result["baseline"]["macro_f1"],
        "baseline_model_acc": result["model"]["accuracy"],
        "baseline_model_macro_f1": result["model"]["macro_f1"],
        "baseline_below": result["below"],
    }
