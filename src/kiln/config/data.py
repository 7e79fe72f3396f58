"""data=<option>: one schema per dataset. The registry entry of each names its builder."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from kiln.config.base import ConfigError, at_least, in_range
from kiln.registry import DATASETS, EVALUATORS


@dataclass
class DataConfig:
    """Options every dataset has."""

    name: str = MISSING  # the dataset (set by data=<option>)
    batch_size: int = 64  # per process (per rank under DDP)
    num_workers: int = 0  # DataLoader worker processes (0: load in the training process)
    pin_memory: bool = True  # page-locked batches for faster copies; applied only on CUDA
    persistent_workers: bool = True  # keep workers between epochs; only when num_workers > 0
    prefetch_factor: int = 2  # batches each worker loads ahead; only when num_workers > 0
    split_seed: int = 0  # the train/val split and generated data; never the run's seed

    def check(self, key: str) -> None:
        at_least(self.batch_size, 1, f"{key}.batch_size")
        at_least(self.num_workers, 0, f"{key}.num_workers")
        at_least(self.prefetch_factor, 1, f"{key}.prefetch_factor")


@dataclass
class DigitsConfig(DataConfig):
    """scikit-learn's bundled 8x8 handwritten digits: 1,797 images, 10 classes, offline."""

    val_fraction: float = 0.2  # share of the images held out for validation

    def check(self, key: str) -> None:
        super().check(key)
        in_range(self.val_fraction, 0, 1, f"{key}.val_fraction", open_low=True, open_high=True)


@dataclass
class SyntheticImagesConfig(DataConfig):
    """Random images of any size; the class shifts the mean of one band, so it is learnable."""

    image_size: int = 32  # side in pixels
    channels: int = 3  # colour channels
    num_classes: int = 10  # classes to generate
    num_train: int = 2048  # training images
    num_val: int = 512  # validation images

    def check(self, key: str) -> None:
        super().check(key)
        for name in ("image_size", "channels", "num_train", "num_val"):
            at_least(getattr(self, name), 1, f"{key}.{name}")
        at_least(self.num_classes, 2, f"{key}.num_classes")


@dataclass
class CsvTextConfig(DataConfig):
    """Text classification from a CSV with a text and a label column (WordPiece tokenizer)."""

    batch_size: int = 32
    train_path: str | None = None  # the training CSV; null: the bundled demo corpus
    val_path: str | None = None  # a validation CSV; null: split val_fraction off train_path
    val_fraction: float = 0.2  # share held out for validation when val_path is null
    text_column: str = "text"  # CSV column holding the texts
    label_column: str = "label"  # CSV column holding the labels
    vocab_size: int = 2000  # tokenizer vocabulary, at most
    max_length: int = 64  # tokens per text after truncation

    def check(self, key: str) -> None:
        super().check(key)
        in_range(self.val_fraction, 0, 1, f"{key}.val_fraction", open_low=True, open_high=True)
        at_least(self.vocab_size, 16, f"{key}.vocab_size", "room for special tokens and letters")
        at_least(self.max_length, 1, f"{key}.max_length")
        if self.train_path is None and self.val_path is not None:
            raise ConfigError("val_path is set but train_path is null", f"{key}.val_path",
                              "set data.train_path too")  # fmt: skip


@dataclass
class ShapesDetectionConfig(DataConfig):
    """Generated detection data: images of mixed sizes with coloured shapes and their boxes."""

    batch_size: int = 4
    image_size: int = 128  # the largest image side in pixels
    min_image_size: int = 96  # the smallest side (0: same as image_size)
    num_classes: int = 2  # shape kinds to draw, 1..4 (rectangle, ellipse, triangle, diamond)
    num_train: int = 256  # training images
    num_val: int = 64  # validation images
    max_objects: int = 3  # shapes per image, at most

    def check(self, key: str) -> None:
        super().check(key)
        in_range(self.num_classes, 1, 4, f"{key}.num_classes")
        for name in ("max_objects", "num_train", "num_val"):
            at_least(getattr(self, name), 1, f"{key}.{name}")
        low = self.min_image_size or self.image_size
        if not 16 <= low <= self.image_size:
            raise ConfigError(
                f"needs 16 <= min_image_size <= image_size, got {low} and {self.image_size}",
                f"{key}.min_image_size",
                "0 means image_size",
            )


# provides: the DataSpec.input_kind the dataset's batches have.
DATASETS.declare("digits", "kiln.data.digits:build_digits", config=DigitsConfig, provides="image")
DATASETS.declare(
    "synthetic_images",
    "kiln.data.synthetic:build_synthetic_images",
    config=SyntheticImagesConfig,
    provides="image",
)
DATASETS.declare(
    "csv_text", "kiln.data.csv_text:build_csv_text", config=CsvTextConfig, provides="tokens"
)
DATASETS.declare(
    "shapes_detection",
    "kiln.data.shapes_detection:build_shapes_detection",
    config=ShapesDetectionConfig,
    provides="image_list",
)
# How a dataset's task is evaluated (DataSpec.task picks the entry).
EVALUATORS.declare("classification", "kiln.engine.evaluators:ClassificationEvaluator")
EVALUATORS.declare("detection", "kiln.engine.evaluators:DetectionEvaluator")
