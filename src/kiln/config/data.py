"""data=<option>: one schema per dataset. The registry entry of each names its builder."""

from __future__ import annotations

import codecs
import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from omegaconf import MISSING

from kiln.config.base import ConfigError, at_least, auto_or_count, in_range, invalid
from kiln.registry import DATASETS, EVALUATORS


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Options every dataset has."""

    name: str = MISSING  # the dataset (set by data=<option>)
    batch_size: int = 64  # per process (per rank under DDP)
    # DataLoader worker processes (0: load in the training process; auto: none for in-memory
    # data, else a quarter of the usable physical cores, at most half: kiln.threads)
    num_workers: Any = "auto"
    pin_memory: bool = True  # page-locked batches for faster copies; applied only on CUDA
    persistent_workers: bool = True  # keep workers between epochs; only when num_workers > 0
    prefetch_factor: int = 2  # batches each worker loads ahead; only when num_workers > 0
    split_seed: int = 0  # the train/val split and generated data; never the run's seed
    drop_last: bool = False  # leave out each epoch's partial last training batch (BatchNorm: 1)
    # the share of a validation or test split's examples also in an earlier split (training)
    # that stops the run, counted beyond the share the training split repeats of itself (data
    # that repeats itself shares that much with any random split; one shared item never
    # stops it); 1: never stop
    max_split_overlap: float = 0.05

    def check(self, key: str) -> None:
        at_least(self.batch_size, 1, f"{key}.batch_size")
        in_range(self.max_split_overlap, 0, 1, f"{key}.max_split_overlap")
        auto_or_count(self.num_workers, 0, f"{key}.num_workers")
        at_least(self.prefetch_factor, 1, f"{key}.prefetch_factor")


@dataclass(frozen=True, kw_only=True)
class DigitsConfig(DataConfig):
    """scikit-learn's bundled 8x8 handwritten digits: 1,797 images, 10 classes, offline."""

    val_fraction: float = 0.2  # share of the images held out for validation

    def check(self, key: str) -> None:
        super().check(key)
        in_range(self.val_fraction, 0, 1, f"{key}.val_fraction", open_low=True, open_high=True)


@dataclass(frozen=True, kw_only=True)
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


def check_multi_label(separator: str | None, threshold: float, key: str) -> None:
    """data.label_separator and data.threshold, for every dataset that has them."""
    if separator is not None and (not separator.strip() or any(c in separator for c in '"\r\n')):
        raise invalid(
            f"{key}.label_separator",
            f"must be a visible separator such as '|' or ',', got {separator!r} (null: one "
            "label per row)",
        )
    if not 0 < threshold < 1:
        raise invalid(f"{key}.threshold", f"must be in (0, 1) (a probability), got {threshold}")
    if separator is None and threshold != 0.5:
        raise ConfigError(
            f"threshold={threshold} applies to multi-label data only, and label_separator is null",
            f"{key}.threshold",
            f"set {key}.label_separator (e.g. '|') for several labels per row, or leave threshold",
        )


class BadRows(StrEnum):
    drop = "drop"  # count and skip bad rows (listed in <run>/data_report.json)
    error = "error"  # stop at the first bad row, naming the file, row, line and column


class Tokenizer(StrEnum):
    words = "words"  # each word and punctuation mark a token: counted in one pass, fast
    bpe = "bpe"  # byte-pair encoding: rare words in pieces (for sequence models)


class TextFormat(StrEnum):
    auto = "auto"  # by the path: a datasets folder, .parquet, .jsonl/.ndjson/.json, else CSV
    csv = "csv"  # a CSV with a header row
    parquet = "parquet"  # a .parquet file, a folder of them, or a glob of one split's shards
    jsonl = "jsonl"  # JSON Lines: one object per line
    datasets = "datasets"  # a Hugging Face datasets save_to_disk folder (Arrow IPC files)


class UnicodeForm(StrEnum):
    NFC = "NFC"
    NFKC = "NFKC"  # also folds compatibility forms: ligatures, full-width letters
    none = "none"


@dataclass(frozen=True, kw_only=True)
class CsvTextConfig(DataConfig):
    """Text classification from a text and a label column of a CSV, Parquet, JSON Lines or a
    datasets folder: read in chunks, cleaned, tokenized into a token cache on disk. A first run
    on tens of thousands of rows is good with these defaults."""

    PATH_KEYS: ClassVar[tuple[str, ...]] = ("train_path", "val_path", "cache_dir")

    batch_size: int = 256
    # the training data: a CSV, Parquet (a file, a folder or a glob of shards), JSON Lines or a
    # datasets save_to_disk folder (data.format); null: the bundled demo corpus
    train_path: str | None = None
    val_path: str | None = None  # validation data, as train_path; null: val_fraction of it
    format: TextFormat = TextFormat.auto  # csv | parquet | jsonl | datasets; auto: by the path
    val_fraction: float = 0.2  # share held out for validation when val_path is null
    text_column: str = "text"  # the column holding the texts (a CSV header's, a Parquet field...)
    label_column: str = "label"  # the column holding the labels (a ClassLabel: read as names)
    # a second text column: each row is the pair (text, pair) -- NLI, question/answer,
    # duplicates -- fed to a pretrained tokenizer as tokenizer(a, b) (kiln's own: joined)
    text_pair_column: str | None = None
    # with text_pair_column: join the two columns into one text (a space between them; model=hf:
    # the tokenizer's separator token, e.g. [SEP]) instead of feeding them as a pair
    join_columns: bool = False
    # several labels per row in label_column, separated by this ('|' or ','): multi-label (a
    # sigmoid per class, BCE); null: one label per row
    label_separator: str | None = None
    threshold: float = 0.5  # multi-label: a class is predicted when its probability is >= this
    encoding: str = "utf-8"  # the files' text encoding (a Python codec: utf-8, latin-1, cp1252)
    na_values: list[str] = field(default_factory=list)  # spellings meaning missing (NA is text)
    bad_rows: BadRows = BadRows.drop  # drop: count and skip bad rows; error: stop at the first
    labels: list[str] | None = None  # the classes; null: the labels of the clean training rows
    min_rows_per_class: int = 2  # a label in fewer training rows is a suspect, not a class
    max_suspect_labels: int = 0  # more suspect labels stop the run; up to this many are dropped
    max_field_lines: int = 1000  # a quoted field spanning more lines is an unbalanced quote
    max_field_bytes: int = 1_048_576  # a longer record is a bad row, passed over unread
    # a Parquet row group or Arrow record batch whose text and label columns hold more
    # (uncompressed, by the file's metadata) is not read: its rows are block_too_large
    max_block_bytes: int = 256 * 2**20
    chunk_rows: int = 100_000  # records read at a time: bounds memory
    cache_dir: str | None = None  # token cache; null: $XDG_CACHE_HOME or ~/.cache, /kiln/text
    tokenizer: Tokenizer = Tokenizer.words  # words | bpe (both split on spaces and punctuation)
    vocab_size: int = 16000  # tokenizer vocabulary, at most
    # a word (words) or a merge (bpe) seen fewer times in the tokenizer's training texts is not
    # learned (TF-IDF's min_df): one text's typo or identifier is noise a model can memorise.
    # text_bow still reads such a word through its character n-grams (it comes spelled)
    min_token_count: int = 2
    tokenizer_rows: int = 200_000  # training rows the tokenizer learns from (a seeded sample)
    max_length: int = 256  # tokens per text after truncation
    # the linear baseline: TF-IDF + LinearSVC fitted on at most this many training texts (a
    # seeded sample; as many validation texts scored) at the end of training and by
    # `infer.py mode=evaluate`, reported beside the model's scores; 0: no baseline
    baseline_rows: int = 5_000
    bucket_by_length: bool = True  # batch texts of similar length (shuffled buckets): less padding
    strip_html: bool = True  # cleaning: drop HTML tags (keeping their text), scripts and comments
    unescape_entities: bool = True  # cleaning: &amp; -> &, &lt; -> <
    unicode_form: UnicodeForm = UnicodeForm.NFKC  # cleaning: Unicode normalisation
    lowercase: bool = True  # cleaning: lower-case every text
    normalize_whitespace: bool = True  # cleaning: collapse whitespace, drop control characters

    def check(self, key: str) -> None:
        super().check(key)
        in_range(self.val_fraction, 0, 1, f"{key}.val_fraction", open_low=True, open_high=True)
        at_least(self.vocab_size, 16, f"{key}.vocab_size", "room for special tokens and letters")
        at_least(self.max_length, 1, f"{key}.max_length")
        at_least(self.baseline_rows, 0, f"{key}.baseline_rows")
        at_least(self.min_token_count, 1, f"{key}.min_token_count")
        at_least(self.chunk_rows, 1, f"{key}.chunk_rows")
        at_least(self.tokenizer_rows, 1, f"{key}.tokenizer_rows")
        at_least(self.min_rows_per_class, 1, f"{key}.min_rows_per_class")
        at_least(self.max_suspect_labels, 0, f"{key}.max_suspect_labels")
        at_least(self.max_field_lines, 1, f"{key}.max_field_lines")
        at_least(self.max_field_bytes, 1024, f"{key}.max_field_bytes")
        at_least(self.max_block_bytes, 2**20, f"{key}.max_block_bytes")
        if self.labels is not None:
            names = [str(label).strip() for label in self.labels]
            if len(set(names)) < 2 or len(set(names)) != len(names) or not all(names):
                raise invalid(
                    f"{key}.labels",
                    f"needs two or more distinct, non-empty labels, got {list(self.labels)}",
                )
        if self.train_path is None and self.text_pair_column is not None:
            raise ConfigError(
                "text_pair_column is set but train_path is null (the demo corpus has single texts)",
                f"{key}.text_pair_column",
                "set data.train_path to a CSV with both columns",
            )
        if self.train_path is None and self.val_path is not None:
            raise ConfigError(
                "val_path is set but train_path is null",
                f"{key}.val_path",
                "set data.train_path too",
            )
        if self.join_columns and self.text_pair_column is None:
            raise ConfigError(
                "join_columns=true joins text_column with text_pair_column, which is null",
                f"{key}.join_columns",
                "set data.text_pair_column=<the second column>",
            )
        check_multi_label(self.label_separator, self.threshold, key)
        if self.label_separator is not None and self.train_path is None:
            raise ConfigError(
                "label_separator is set but train_path is null (the demo corpus has one label "
                "per text)",
                f"{key}.label_separator",
                "set data.train_path to a CSV with several labels per row",
            )
        try:
            codecs.lookup(self.encoding)
        except LookupError:
            raise invalid(
                f"{key}.encoding",
                f"unknown encoding {self.encoding!r}; use a Python codec such as utf-8, "
                "latin-1 or cp1252",
            ) from None


@dataclass(frozen=True, kw_only=True)
class ShapesDetectionConfig(DataConfig):
    """Generated detection data: images of mixed sizes with coloured shapes and their boxes."""

    batch_size: int = 4
    image_size: int = 128  # the largest image side in pixels
    min_image_size: int = 96  # the smallest side (0: same as image_size)
    num_classes: int = 2  # shape kinds to draw, 1..4 (rectangle, ellipse, triangle, diamond)
    num_train: int = 256  # training images
    num_val: int = 64  # validation images
    max_objects: int = 3  # shapes per image, at most
    num_background: int = 0  # images per split with no shape at all (background only)

    def check(self, key: str) -> None:
        super().check(key)
        in_range(self.num_classes, 1, 4, f"{key}.num_classes")
        for name in ("max_objects", "num_train", "num_val"):
            at_least(getattr(self, name), 1, f"{key}.{name}")
        at_least(self.num_background, 0, f"{key}.num_background")
        low = self.min_image_size or self.image_size
        if not 16 <= low <= self.image_size:
            raise ConfigError(
                f"needs 16 <= min_image_size <= image_size, got {low} and {self.image_size}",
                f"{key}.min_image_size",
                "0 means image_size",
            )


class DetectionAugment(StrEnum):
    none = "none"  # images as they are
    hflip = "hflip"  # horizontal flip (half the images), boxes flipped with them
    hflip_scale = "hflip_scale"  # hflip + scale jitter (0.5x..1.5x of data.image_size)
    # torchvision's reference SSD policy: photometric distortion, zoom out, random IoU crop,
    # hflip; boxes that leave the picture are cut to it or dropped
    ssd = "ssd"


@dataclass(frozen=True, kw_only=True)
class DetectionFilesConfig(DataConfig):
    """Options of the detection datasets read from files (data=coco, data=yolo)."""

    batch_size: int = 4
    # the side detectors work at: kiln's detector resizes every image to it (or to the largest
    # side in the data, when smaller), torchvision_detection's min_size and max_size
    image_size: int = 512
    val_fraction: float = 0.2  # share of the training images held out when no val set is given
    # an image file or an annotation that cannot be used (missing or unreadable image, box
    # outside its image or of zero area, unknown category, a label line that does not parse,
    # a repeated image id): drop (listed in data_report.json) | error (stop at the first)
    bad_rows: BadRows = BadRows.drop
    cache_dir: str | None = None  # image file checks; null: ~/.cache/kiln/images
    max_image_pixels: int | None = 89_478_485  # header pixels above: too_large (null: no limit)
    # an image's boxes past this many (in file order) are left out and counted as
    # too_many_boxes in data_report.json; COCO 2017's most crowded image has 93
    max_boxes_per_image: int = 1000
    # training images only, boxes kept in sync (transforms v2, tv_tensors.BoundingBoxes):
    # none | hflip | hflip_scale | ssd; seeded per item, so a resumed run sees the same batches
    augment: DetectionAugment = DetectionAugment.none
    # training batches of images of one aspect-ratio group (wider than tall or not), as
    # torchvision's reference GroupedBatchSampler: detectors pad a batch to its largest image
    group_by_aspect_ratio: bool = False

    def check(self, key: str) -> None:
        super().check(key)
        at_least(self.image_size, 32, f"{key}.image_size")
        in_range(self.val_fraction, 0, 1, f"{key}.val_fraction", open_low=True, open_high=True)
        if self.max_image_pixels is not None:
            at_least(self.max_image_pixels, 1, f"{key}.max_image_pixels")
        at_least(self.max_boxes_per_image, 1, f"{key}.max_boxes_per_image")


@dataclass(frozen=True, kw_only=True)
class CocoConfig(DetectionFilesConfig):
    """Object detection from COCO `instances` JSON files (Label Studio, CVAT, Roboflow export
    them): bbox [x, y, w, h] in pixels, category ids mapped to labels 1..C in id order."""

    PATH_KEYS: ClassVar[tuple[str, ...]] = (
        "train_json",
        "train_images",
        "val_json",
        "val_images",
        "test_json",
        "test_images",
        "cache_dir",
    )

    train_json: str | None = None  # the training annotations (required)
    train_images: str | None = None  # the folder its file_names are relative to (required)
    val_json: str | None = None  # null: a val_fraction of the training images is held out
    val_images: str | None = None  # null: train_images
    test_json: str | None = None  # evaluated once at the end (<run>/eval/)
    test_images: str | None = None  # null: train_images
    # an annotation file larger than this is refused before it is parsed (it is read element
    # by element, never held whole); 2 GiB fits COCO 2017 train's 448 MiB and LVIS v1's 1.1 GB
    max_json_bytes: int = 2 * 2**30

    def check(self, key: str) -> None:
        super().check(key)
        at_least(self.max_json_bytes, 1024, f"{key}.max_json_bytes")
        if self.train_json is None or self.train_images is None:
            raise ConfigError(
                "no training annotations given",
                f"{key}.train_json",
                "set data.train_json=<instances.json> and data.train_images=<its image folder>",
            )


@dataclass(frozen=True, kw_only=True)
class YoloConfig(DetectionFilesConfig):
    """Object detection from a YOLO tree: <root>/images/<split>/x.jpg with its boxes in
    <root>/labels/<split>/x.txt, one `class cx cy w h` line per box (normalised to 0..1), the
    class names in a data.yaml (names:) or a data.names file (one per line)."""

    PATH_KEYS: ClassVar[tuple[str, ...]] = (
        "train_dir",
        "val_dir",
        "test_dir",
        "names_file",
        "cache_dir",
    )

    train_dir: str | None = None  # the training images folder (.../images/train; required)
    val_dir: str | None = None  # null: a val_fraction of the training images is held out
    test_dir: str | None = None  # evaluated once at the end (<run>/eval/)
    # data.yaml or data.names; null: the first found in train_dir's parent folders
    names_file: str | None = None
    # a label file (or the names file) larger than this is refused unread: its boxes are
    # left out as label_file; 1 MiB holds ~25,000 boxes, far past max_boxes_per_image
    max_label_file_bytes: int = 2**20

    def check(self, key: str) -> None:
        super().check(key)
        at_least(self.max_label_file_bytes, 1024, f"{key}.max_label_file_bytes")
        if self.train_dir is None:
            raise ConfigError(
                "no training images given",
                f"{key}.train_dir",
                "set data.train_dir=<root>/images/train (labels in <root>/labels/train)",
            )


class Augment(StrEnum):
    none = "none"  # the eval transform (resize + center crop) for training too
    flip_crop = "flip_crop"  # RandomResizedCrop + horizontal flip
    trivialaugment = "trivialaugment"  # flip_crop + TrivialAugmentWide
    randaugment = "randaugment"  # flip_crop + RandAugment


class Normalize(StrEnum):
    auto = "auto"  # the pretrained weights' mean and std, else the dataset's
    imagenet = "imagenet"  # ImageNet's mean and std
    dataset = "dataset"  # mean and std of the training split (computed once, cached)
    none = "none"  # pixels in [0, 1]


@dataclass(frozen=True, kw_only=True)
class ImageFolderConfig(DataConfig):
    """Your images in class subfolders (torchvision ImageFolder layout): train_dir/<class>/*.jpg,
    decoded and augmented with torchvision (decode_image, transforms v2)."""

    PATH_KEYS: ClassVar[tuple[str, ...]] = (
        "train_dir",
        "val_dir",
        "test_dir",
        "cache_dir",
        "labels_csv",
        "val_labels_csv",
        "test_labels_csv",
        "root",
    )

    batch_size: int = 32
    train_dir: str | None = None  # folder of class subfolders (required unless labels_csv)
    # multi-label images: a CSV of path,labels rows (the labels joined by label_separator) instead
    # of class folders; a stratified val_fraction of its rows is held out unless val_labels_csv
    labels_csv: str | None = None
    # labels_csv's own validation images, the same path,labels layout (as val_dir is to
    # train_dir): its rows are the val split; a label training lacks is unseen_label (dropped).
    # null: a stratified val_fraction of labels_csv's rows
    val_labels_csv: str | None = None
    # labels_csv's test images, the same layout; evaluated at the end of training (<run>/eval/)
    test_labels_csv: str | None = None
    root: str | None = None  # the folder the *labels_csv paths are relative to (null: each CSV's)
    label_separator: str = "|"  # labels_csv: between a row's labels
    threshold: float = 0.5  # labels_csv: a class is predicted when its probability is >= this
    val_dir: str | None = None  # same layout; null: a stratified val_fraction of train_dir
    test_dir: str | None = None  # same layout; evaluated at the end (<run>/eval/)
    val_fraction: float = 0.2  # share of each class held out when val_dir is null
    channels: int = 3  # every image is converted to this many channels (1 or 3)
    image_size: int | None = None  # side of the square model input (null: the weights', else 224)
    crop_pct: float | None = None  # eval: resize to image_size / crop_pct, center crop (0.875)
    augment: Augment = Augment.flip_crop  # none | flip_crop | trivialaugment | randaugment
    mixup_alpha: float = 0.0  # MixUp's Beta(alpha, alpha) (0: off); soft targets
    cutmix_alpha: float = 0.0  # CutMix's Beta(alpha, alpha) (0: off); with mixup, one per batch
    normalize: Normalize = Normalize.auto  # auto | imagenet | dataset | none
    bad_rows: BadRows = BadRows.drop  # unreadable, empty, truncated, too large files: drop | error
    cache_dir: str | None = None  # file checks and dataset statistics; null: ~/.cache/kiln/images
    # An image whose header asks for more pixels (every frame of an animated one) is dropped as
    # too_large before it is decoded (Pillow's MAX_IMAGE_PIXELS). Symlinked files are read once
    # (by resolved path), symlinked folders walked unless they lead back into the folder.
    max_image_pixels: int | None = 89_478_485  # header pixels above: too_large (null: no limit)
    follow_symlinks: bool = True  # false: no link is followed (each one is reported)

    def check(self, key: str) -> None:
        super().check(key)
        if self.labels_csv is not None:
            self.check_labels_csv(key)
        elif self.val_labels_csv is not None or self.test_labels_csv is not None:
            name = "val_labels_csv" if self.val_labels_csv is not None else "test_labels_csv"
            folder = "val_dir" if name == "val_labels_csv" else "test_dir"
            raise ConfigError(
                f"{name} is set but labels_csv is null",
                f"{key}.{name}",
                f"set data.labels_csv=<the training CSV of path,labels> too (class folders take "
                f"data.{folder})",
            )
        elif self.train_dir is None:
            raise ConfigError(
                "no training images given",
                f"{key}.train_dir",
                "set data.train_dir=<folder with one subfolder per class>, or "
                "data.labels_csv=<csv of path,labels> for multi-label images",
            )
        in_range(self.val_fraction, 0, 1, f"{key}.val_fraction", open_low=True, open_high=True)
        if self.channels not in (1, 3):
            raise invalid(f"{key}.channels", f"must be 1 or 3, got {self.channels}")
        if self.image_size is not None:
            at_least(self.image_size, 8, f"{key}.image_size")
        if self.crop_pct is not None:
            in_range(self.crop_pct, 0, 1, f"{key}.crop_pct", open_low=True)
        at_least(self.mixup_alpha, 0, f"{key}.mixup_alpha")
        at_least(self.cutmix_alpha, 0, f"{key}.cutmix_alpha")
        if self.max_image_pixels is not None:
            at_least(self.max_image_pixels, 1, f"{key}.max_image_pixels")

    def check_labels_csv(self, key: str) -> None:
        for name in ("train_dir", "val_dir", "test_dir"):
            if getattr(self, name) is not None:
                raise ConfigError(
                    f"labels_csv and {name} are both set",
                    f"{key}.{name}",
                    f"with data.labels_csv the CSV lists the images (relative to data.root); "
                    f"set data.{name}=null",
                )
        if self.mixup_alpha or self.cutmix_alpha:
            raise ConfigError(
                "MixUp/CutMix mix one class per image; labels_csv is multi-label",
                f"{key}.mixup_alpha",
                "set data.mixup_alpha=0 data.cutmix_alpha=0",
            )
        check_multi_label(self.label_separator, self.threshold, key)

    def with_all_branches(self) -> ImageFolderConfig:
        """loss.force_all_branches (rule 2's forced run): MixUp and CutMix on as well, at
        timm's usual alphas where they are off, so soft targets are part of the forced run
        (multi-label data, labels_csv, has no single class to mix: it stays as it is)."""
        if self.labels_csv is not None:
            return self
        return dataclasses.replace(
            self,
            mixup_alpha=self.mixup_alpha or FORCED_MIXUP_ALPHA,
            cutmix_alpha=self.cutmix_alpha or FORCED_CUTMIX_ALPHA,
        )


FORCED_MIXUP_ALPHA, FORCED_CUTMIX_ALPHA = 0.2, 1.0


# provides: the DataSpec.input_kind the dataset's batches have.
DATASETS.declare("digits", "kiln.data.digits:build_digits", config=DigitsConfig, provides="image")
DATASETS.declare(
    "synthetic_images",
    "kiln.data.synthetic:build_synthetic_images",
    config=SyntheticImagesConfig,
    provides="image",
)
# uses_pretrained (csv_text): a pretrained text model's own tokenizer (model=hf's PretrainedText)
DATASETS.declare(
    "csv_text",
    "kiln.data.csv_text:build_csv_text",
    config=CsvTextConfig,
    provides="tokens",
    uses_pretrained=True,
)
DATASETS.declare(
    "shapes_detection",
    "kiln.data.shapes_detection:build_shapes_detection",
    config=ShapesDetectionConfig,
    provides="image_list",
)
DATASETS.declare("coco", "kiln.data.coco:build_coco", config=CocoConfig, provides="image_list")
DATASETS.declare("yolo", "kiln.data.yolo:build_yolo", config=YoloConfig, provides="image_list")
# uses_pretrained: the builder takes `pretrained=` (a PretrainedInput or None): the model's
# weights' own preprocessing, for data.normalize=auto and the default input size.
DATASETS.declare(
    "image_folder",
    "kiln.data.image_folder:build_image_folder",
    config=ImageFolderConfig,
    provides="image",
    uses_pretrained=True,
)
# How a dataset's task is evaluated (DataSpec.task picks the entry).
EVALUATORS.declare("classification", "kiln.engine.evaluators:ClassificationEvaluator")
EVALUATORS.declare("detection", "kiln.engine.evaluators:DetectionEvaluator")
EVALUATORS.declare("multilabel", "kiln.engine.evaluators:MultiLabelEvaluator")
