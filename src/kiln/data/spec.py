"""What a dataset tells the rest of kiln: the shapes models are built from (DataSpec) and the
preprocessing recipe that inference must repeat exactly (kiln.preprocessing)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, overload

from torch.utils.data import Dataset

from kiln.preprocessing import Recipe

MULTILABEL = "multilabel"  # DataSpec.task of data with a set of labels per item


@dataclass(frozen=True)
class DataSpec:
    """Shapes and labels a model is built from. Nothing in a model hard-codes these."""

    task: str  # "classification" | "multilabel" | "detection" (picks the evaluator)
    input_kind: str  # "image" | "tokens" | "image_list" (which models fit)
    num_classes: int
    class_names: tuple[str, ...]
    channels: int | None = None  # images
    image_size: tuple[int, int] | None = None  # images: (H, W) the data was made at
    vocab_size: int | None = None  # tokens
    max_length: int | None = None  # tokens
    pad_id: int = 0  # tokens
    # tokens: the vocabulary's strings by id, for models that look inside words (text_bow's
    # character n-grams); None where the data has no vocabulary
    tokens: tuple[str, ...] | None = None
    # multi-label (task "multilabel"): how a row's labels are joined in files (data.
    # label_separator) and the probability from which a class is predicted (data.threshold)
    label_separator: str | None = None
    threshold: float = 0.5

    def __post_init__(self) -> None:
        # Plain str, whatever the dataset gave (numpy strings from a pandas column, say): a
        # checkpoint holds the names, and torch.load(weights_only=True) refuses numpy objects.
        object.__setattr__(self, "class_names", tuple(str(name) for name in self.class_names))

    @property
    def multi_label(self) -> bool:
        return self.task == MULTILABEL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataSpec:
        d = dict(d)
        d["class_names"] = tuple(d["class_names"])
        if d.get("image_size") is not None:
            d["image_size"] = tuple(d["image_size"])
        if d.get("tokens") is not None:
            d["tokens"] = tuple(d["tokens"])
        return cls(**d)


@dataclass
class TextSample:
    """A bounded, seeded sample of a text dataset's cleaned training and validation texts with
    their class indices: what the TF-IDF + linear baseline (kiln.inference.baseline) is fitted
    and scored on. `val_positions`: each validation text's index in the val split."""

    train_texts: list[str]
    train_labels: list[int]
    val_texts: list[str]
    val_labels: list[int]
    val_positions: list[int]
    train_total: int  # rows in the training split (the sample is at most data.baseline_rows)
    val_total: int

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> TextSample:
        return cls(**{f.name: stored[f.name] for f in fields(cls)})


@dataclass
class DataBundle:
    """A built dataset: spec, splits, how to batch them, and the preprocessing recipe."""

    spec: DataSpec
    train: Dataset
    val: Dataset
    recipe: Recipe
    collate_fn: Callable | None = None
    # Per-batch quantities the training log reports as interval means, computed on the device
    # from a collated batch: e.g. {"padding_frac": tensor, "tokens": tensor} for text.
    batch_metrics: Callable[[Any], dict[str, Any]] | None = None
    # What building the data found (rows read, kept, dropped per reason...): written to
    # <run>/data_report.json.
    report: dict[str, Any] | None = None
    # Tokens (or any size) per item of `train`: when set, training batches group items of
    # similar length (kiln.data.loaders.BucketedSampler), so little of a batch is padding.
    bucket_lengths: Sequence[int] | None = None
    # The same of `val`: evaluation reads it shortest first (kiln.data.loaders.LengthOrderedSampler)
    val_lengths: Sequence[int] | None = None
    # A held-out test split, evaluated once at the end of training (<run>/eval/).
    test: Dataset | None = None
    # What each item of a split is, for reports (errors.csv): {"val": ["photos/cat/1.jpg", ...]}
    # or row numbers ("row 17"); a split without an entry is named by its index.
    sources: dict[str, Sequence[str]] | None = None
    # What the data checks said without stopping the run (kiln.findings.Finding: a split
    # overlap below data.max_split_overlap, ...): written to findings.json with the probes'.
    findings: list = field(default_factory=list)
    # Text classification: the sample the end of training fits its linear baseline on (or None)
    baseline: TextSample | None = None


class SourceNames(Sequence[str]):
    """A split's sources made on demand, `template.format(value)` per item -- e.g.
    SourceNames("reviews.csv row {}", rows) -- so a large split keeps one array, not a string per
    item."""

    def __init__(self, template: str, values: Sequence[Any]):
        self.template, self.values = template, values

    def __len__(self) -> int:
        return len(self.values)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.template.format(v) for v in self.values[index]]
        return self.template.format(self.values[index])
