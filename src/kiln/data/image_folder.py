"""Your images in class folders (torchvision's ImageFolder layout), `data=image_folder`:

    train_dir/<class>/<image files>     (val_dir, test_dir: the same layout, optional)

1. every file is accounted for (kiln.data.image_scan): kept, skipped (hidden, not an image) or
   dropped for a named reason (empty, truncated, unreadable) after a full decode, with the
   verdicts cached; classes are the training folder's subfolders with at least two good images,
   in natural order; without val_dir a stratified data.val_fraction of train_dir is held out;
2. items are decoded by the shared kiln.preprocessing.image_files (torchvision's decode_image,
   Pillow for the other formats) and transformed with torchvision transforms v2: the eval
   transform (resize + center crop) for validation and test, data.augment for training; then
   scaled to [0, 1] and normalised (data.normalize);
3. MixUp / CutMix run in the collate function on training batches: soft targets (N, classes).

Exact resume: a training item's randomness is seeded from (run seed, epoch, index), which the
training sampler sends as the item's key (kiln.data.loaders.SeededItemSampler), and a batch's
MixUp from its items' seeds, so an item is augmented the same whichever worker loads it, and a
run resumed mid-epoch sees the very batches an uninterrupted one did.

The recipe saved with every checkpoint is the eval transform (resize_size, image_size,
interpolation, mean, std), so `infer.py` and the server prepare image files exactly so."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from kiln.atomic import write_json
from kiln.config.data import Augment, ImageFolderConfig, Normalize
from kiln.data.bad_inputs import changed_file
from kiln.data.image_labels import ListedImages, missing_labels_csv, read_labels_csv
from kiln.data.image_scan import (
    FolderImages,
    ImageFolderError,
    default_cache_dir,
    folder_line,
    read_folder,
)
from kiln.data.multilabel import multi_hot
from kiln.data.spec import MULTILABEL, DataBundle, DataSpec
from kiln.data.split import stratified_split, val_count
from kiln.preprocessing import ImageRecipe
from kiln.preprocessing.image_files import (
    DEFAULT_CROP_PCT,
    DEFAULT_IMAGE_SIZE,
    DEFAULT_MAX_PIXELS,
    eval_transform,
    interpolation_mode,
    read_image_file,
    resize_size_for,
    to_unit,
)
from kiln.preprocessing.pretrained import PretrainedInput
from kiln.rng import forked
from kiln.sorting import natural_key

log = logging.getLogger(__name__)

__all__ = ["ImageCollate", "ImageFiles", "ImageFolderError", "build_image_folder"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
STATS_VERSION = 1  # bump when the statistics' meaning changes
# A channel's std below this (a quarter of one 8-bit level) is a channel of one value: dividing
# by it would multiply any difference at inference a million-fold, so it is divided by 1.
MIN_STD = 1 / 1020


# ---------------------------------------------------------------------------------------------
# Input size and transforms


@dataclass(frozen=True)
class InputSize:
    """The eval geometry: resize the shorter side to resize_size, center crop image_size."""

    image_size: int
    crop_pct: float
    resize_size: int
    interpolation: str

    @classmethod
    def resolve(cls, cfg: ImageFolderConfig, pretrained: PretrainedInput | None) -> InputSize:
        """data.* where set, else the pretrained weights' own, else 224 / 0.875 / bilinear."""
        weights = pretrained or PretrainedInput(source="none", mean=(), std=())
        size = cfg.image_size or weights.image_size or DEFAULT_IMAGE_SIZE
        crop_pct = cfg.crop_pct or weights.crop_pct or DEFAULT_CROP_PCT
        interpolation = weights.interpolation if pretrained is not None else "bilinear"
        return cls(size, crop_pct, resize_size_for(size, crop_pct), interpolation)


def train_transform(augment: Augment, size: InputSize):
    """uint8 (C, H, W) -> uint8 (C, S, S), per data.augment; the randomness is torch's global
    RNG, which ImageFiles seeds per item."""
    from torchvision.transforms import v2

    if augment == Augment.none:
        return eval_transform(size.image_size, size.resize_size, size.interpolation)
    mode = interpolation_mode(size.interpolation)
    steps = [
        v2.RandomResizedCrop(size.image_size, interpolation=mode, antialias=True),
        v2.RandomHorizontalFlip(),
    ]
    if augment == Augment.trivialaugment:
        steps.append(v2.TrivialAugmentWide(interpolation=mode))
    elif augment == Augment.randaugment:
        steps.append(v2.RandAugment(interpolation=mode))
    return v2.Compose(steps)


def finish_transform(mean: Sequence[float], std: Sequence[float]):
    """uint8 -> float32 in [0, 1] -> normalised."""
    from torchvision.transforms import v2

    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])


def item_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one item's augmentation, from the run's seed, the epoch and its index
    only (never from which worker or process loads it)."""
    words = np.random.SeedSequence([seed % 2**64, epoch, index]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def batch_seed(item_seeds: Sequence[int]) -> int:
    words = np.random.SeedSequence(list(item_seeds)).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


# ---------------------------------------------------------------------------------------------
# Dataset and batches


class ImageFiles(Dataset):
    """Image files with class indices. Eval items: (image (C, S, S) float32, label). Training
    items (train=True) also carry their augmentation seed: (image, label, seed); the key is an
    index or, from the training sampler, (index, run seed, epoch)."""

    def __init__(
        self,
        paths: Sequence[str],
        labels: Sequence[int],
        *,
        channels: int,
        transform,
        finish,
        train: bool,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
    ):
        self.paths = list(paths)
        # class indices, or (multi-label, labels_csv) multi-hot rows (N, C) float32
        multi_hot = np.ndim(labels) == 2
        self.labels = np.asarray(labels, np.float32) if multi_hot else [int(y) for y in labels]
        self.channels, self.transform, self.finish = channels, transform, finish
        self.max_pixels = max_pixels
        self.train = train
        self.seeded_keys = train  # kiln.data.loaders: send (index, seed, epoch) keys

    def __len__(self) -> int:
        return len(self.paths)

    def content_keys(self) -> list[bytes]:
        """Each file's bytes, digested (kiln.data.split_hygiene, cached by path and mtime)."""
        from kiln.data.split_hygiene import file_digests

        return file_digests(self.paths)

    def load(self, index: int) -> torch.Tensor:
        """The decoded uint8 image (C, H, W) of item `index`."""
        path = self.paths[index]
        try:
            return read_image_file(path, self.channels, self.max_pixels)
        except (OSError, ValueError) as err:  # changed or removed since the scan
            raise changed_file(path, err) from None

    def __getitem__(self, key: int | tuple[int, int, int]):
        index, seed, epoch = key if isinstance(key, tuple) else (key, 0, 0)
        image, label = self.load(index), self.labels[index]
        if not self.train:
            return self.finish(self.transform(image)), label
        sample_seed = item_seed(seed, epoch, index)
        with forked(sample_seed, cuda=False):
            pixels = self.transform(image)
        return self.finish(pixels), label, sample_seed


class ImageCollate:
    """Items -> (images (N, C, S, S), labels (N,)). Training items (with their seed) go through
    MixUp / CutMix when either alpha is > 0 (one of the two per batch when both are), seeded
    from the items' seeds: labels become soft targets (N, num_classes). Module-level and plain,
    so DataLoader workers can pickle it."""

    def __init__(self, num_classes: int, mixup_alpha: float, cutmix_alpha: float):
        self.num_classes = num_classes
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.mix = self._mixer()

    def _mixer(self):
        from torchvision.transforms import v2

        mixers = []
        if self.mixup_alpha > 0:
            mixers.append(v2.MixUp(alpha=self.mixup_alpha, num_classes=self.num_classes))
        if self.cutmix_alpha > 0:
            mixers.append(v2.CutMix(alpha=self.cutmix_alpha, num_classes=self.num_classes))
        if len(mixers) == 2:
            return v2.RandomChoice(mixers)
        return mixers[0] if mixers else None

    def __call__(self, items: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.stack([item[0] for item in items])
        if isinstance(items[0][1], np.ndarray):  # multi-hot (labels_csv): never mixed
            return images, torch.from_numpy(np.stack([item[1] for item in items]))
        labels = torch.tensor([item[1] for item in items], dtype=torch.int64)
        if self.mix is None or len(items[0]) < 3:  # validation and test: never mixed
            return images, labels
        with forked(batch_seed([item[2] for item in items]), cuda=False):
            mixed, soft = self.mix(images, labels)
        return mixed, soft


# ---------------------------------------------------------------------------------------------
# Normalisation


def _channel_stats(values: Sequence[float], channels: int) -> tuple[float, ...]:
    """RGB statistics for one-channel data: their mean (the grey a weights' model expects)."""
    values = tuple(float(v) for v in values)
    return values if len(values) == channels else (sum(values) / len(values),) * channels


def dataset_stats(
    paths: Sequence[str],
    channels: int,
    size: InputSize,
    cache_dir: Path,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
) -> tuple[tuple[float, ...], tuple[float, ...], bool]:
    """(mean, std, cache hit) of the pixels in [0, 1] of these files through the eval
    transform; cached by the files (path, size, mtime) and the settings. A std may be 0 (a
    channel of one value): `normalisation` decides what to divide by."""
    stamps = [(os.path.abspath(p), *_stamp(p)) for p in paths]
    key_inputs = {
        "version": STATS_VERSION,
        "files": stamps,
        "channels": channels,
        "size": [size.image_size, size.resize_size, size.interpolation],
    }
    key = hashlib.sha256(json.dumps(key_inputs).encode()).hexdigest()[:24]
    cached = cache_dir / f"stats-{key}.json"
    try:
        stored = json.loads(cached.read_text())
        return tuple(stored["mean"]), tuple(stored["std"]), True
    except (OSError, ValueError, KeyError):
        pass
    transform = eval_transform(size.image_size, size.resize_size, size.interpolation)

    def sums(path: str) -> torch.Tensor:
        pixels = to_unit(transform(read_image_file(path, channels, max_pixels))).double()
        flat = pixels.reshape(channels, -1)
        return torch.stack([flat.sum(1), flat.square().sum(1)])

    with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 8))) as pool:
        total = sum(pool.map(sums, paths))
    count = len(paths) * size.image_size**2
    mean = total[0] / count
    std = (total[1] / count - mean.square()).clamp_min(0).sqrt()
    mean_t, std_t = tuple(mean.tolist()), tuple(std.tolist())
    write_json(cached, {"mean": mean_t, "std": std_t, "images": len(paths)}, unique=True)
    return mean_t, std_t, False


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def normalisation(
    cfg: ImageFolderConfig,
    pretrained: PretrainedInput | None,
    train_paths: Sequence[str],
    size: InputSize,
    cache_dir: Path,
) -> tuple[tuple[float, ...], tuple[float, ...], dict]:
    """(mean, std, what the report says about them) per data.normalize."""
    mode, channels = cfg.normalize, cfg.channels
    if mode == Normalize.auto:
        mode = Normalize.dataset if pretrained is None else None
    if mode is None:
        mean = _channel_stats(pretrained.mean, channels)
        std = _channel_stats(pretrained.std, channels)
        source = f"pretrained weights ({pretrained.source})"
    elif mode == Normalize.imagenet:
        mean, std = _channel_stats(IMAGENET_MEAN, channels), _channel_stats(IMAGENET_STD, channels)
        source = "imagenet"
    elif mode == Normalize.none:
        mean, std, source = (0.0,) * channels, (1.0,) * channels, "none (pixels in [0, 1])"
    else:
        mean, std, hit = dataset_stats(train_paths, channels, size, cache_dir, cfg.max_image_pixels)
        source = f"the training split's pixels ({'cached' if hit else 'computed'})"
    report = {"mode": str(cfg.normalize), "source": source, "mean": mean, "std": std}
    flat = [c for c, value in enumerate(std) if value < MIN_STD]
    if flat:
        measured = ", ".join(f"{std[c]:.2g}" for c in flat)
        std = tuple(1.0 if c in flat else value for c, value in enumerate(std))
        report |= {"std": std, "measured_std": report["std"], "flat_channels": flat}
        log.warning(
            "data: channel(s) %s of the training images hold one value (std %s, below %.5f: "
            "less than a quarter of an 8-bit level), so they are divided by 1, not by their "
            "std (which would multiply any difference at inference a million-fold); such a "
            "channel tells the model nothing (see data_report.json, normalize)",
            ", ".join(map(str, flat)),
            measured,
            MIN_STD,
        )
    return mean, std, report


# ---------------------------------------------------------------------------------------------
# The split


def split_files(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, ...]:
    """(train, val) positions in file order: round(n * val_fraction) for validation, stratified
    by class where every class can be in both splits, seeded by data.split_seed."""
    num_val = val_count(len(labels), val_fraction, "images", "data.val_dir", ImageFolderError)
    train, val = stratified_split(labels, num_val, seed)
    return np.sort(train), np.sort(val)


# ---------------------------------------------------------------------------------------------
# The bundle


def _read(cfg: ImageFolderConfig, key: str, cache_dir: Path, classes=None) -> FolderImages:
    return read_folder(
        getattr(cfg, key),
        key,
        channels=cfg.channels,
        bad_rows=str(cfg.bad_rows),
        cache_dir=cache_dir,
        classes=classes,
        max_pixels=cfg.max_image_pixels,
        follow_symlinks=cfg.follow_symlinks,
    )


def _class_names(train: FolderImages) -> list[str]:
    names = sorted(set(train.labels), key=natural_key)
    if len(names) < 2:
        found = f"only class {names[0]!r} has" if names else "no class has"
        raise ImageFolderError(
            f"{train.log.path}: {found} two or more good images (data.train_dir): "
            "classification needs at least two classes (see data_report.json)"
        )
    return names


def log_report(report: dict) -> None:
    for key in ("train_dir", "val_dir", "test_dir", *LISTED_SPLITS):
        folder = report.get(key)
        if folder is None:
            continue
        bad = folder["images_dropped"] or folder["skipped"]
        (log.warning if bad else log.info)(
            "data: %s%s", folder_line(folder), " (see data_report.json)" if bad else ""
        )
        for name, why in folder.get("classes_dropped", {}).items():
            holds = "no good image" if why["reason"] == "empty" else "a single good image"
            log.warning(
                "data: class folder %r of %s holds %s, so it is not a class (a class needs two "
                "or more images)",
                name,
                folder["path"],
                holds,
            )
        for name, count in folder.get("unknown_classes", {}).items():
            log.warning(
                "data: class folder %r of %s is not a class of data.train_dir; its %d image(s) "
                "are not used",
                name,
                folder["path"],
                count,
            )
    images, size = report["images"], report["input"]
    log.info(
        "data: %d classes, %s images at %dx%d (resize %d, %s), normalised by %s; prepared in "
        "%.1f s",
        len(report["classes"]),
        " / ".join(f"{n} {split}" for split, n in images.items()),
        size["image_size"],
        size["image_size"],
        size["resize_size"],
        size["interpolation"],
        report["normalize"]["source"],
        report["prepare_s"],
    )


def build_image_folder(
    cfg: ImageFolderConfig, *, pretrained: PretrainedInput | None = None
) -> DataBundle:
    """The bundle for data=image_folder. `pretrained`: the model's weights' own preprocessing
    (mean/std for data.normalize=auto, the default image size, crop_pct and interpolation)."""
    start = time.perf_counter()
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    size = InputSize.resolve(cfg, pretrained)
    if cfg.labels_csv is not None:
        return _build_listed(cfg, pretrained, cache_dir, size, start)
    train = _read(cfg, "train_dir", cache_dir)
    class_names = _class_names(train)
    index = {name: i for i, name in enumerate(class_names)}
    folders = {"train_dir": train}
    labels = np.array([index[y] for y in train.labels], dtype=np.int64)
    paths = {"train": train.paths}
    targets = {"train": labels}
    if cfg.val_dir is not None:
        val = folders["val_dir"] = _read(cfg, "val_dir", cache_dir, class_names)
        if not val.paths:
            raise ImageFolderError(
                f"{cfg.val_dir}: no usable images (data.val_dir): {val.log.summary()}"
            )
        paths["val"], targets["val"] = val.paths, np.array([index[y] for y in val.labels])
    else:
        train_at, val_at = split_files(labels, cfg.val_fraction, cfg.split_seed)
        paths["val"], targets["val"] = [train.paths[i] for i in val_at], labels[val_at]
        paths["train"], targets["train"] = [train.paths[i] for i in train_at], labels[train_at]
    if cfg.test_dir is not None:
        test = folders["test_dir"] = _read(cfg, "test_dir", cache_dir, class_names)
        paths["test"], targets["test"] = test.paths, np.array([index[y] for y in test.labels])
    logs = {key: folder.log for key, folder in folders.items()}
    caches = {key: folder.cache for key, folder in folders.items()}
    return _bundle(
        cfg, pretrained, cache_dir, size, start, class_names, paths, targets, logs, caches
    )


LISTED_SPLITS = {"labels_csv": "train", "val_labels_csv": "val", "test_labels_csv": "test"}


def _build_listed(cfg: ImageFolderConfig, pretrained, cache_dir: Path, size, start) -> DataBundle:
    """data.labels_csv: multi-label images listed in a CSV (kiln.data.image_labels). The val
    split is data.val_labels_csv's rows when it is set, else a val_fraction of labels_csv's
    (stratified by label set where each set can be in both); data.test_labels_csv: the test
    split. Every CSV is looked for before the first image is checked."""
    for key in LISTED_SPLITS:
        path = getattr(cfg, key)
        if path is not None and not Path(path).is_file():
            raise missing_labels_csv(Path(path), f"data.{key}")

    def read(key: str, classes=None):
        return read_labels_csv(
            getattr(cfg, key),
            cfg.root,
            cfg.label_separator,
            channels=cfg.channels,
            bad_rows=str(cfg.bad_rows),
            cache_dir=cache_dir,
            max_pixels=cfg.max_image_pixels,
            key=f"data.{key}",
            classes=classes,
        )

    listed, class_names = read("labels_csv")
    index = {name: i for i, name in enumerate(class_names)}

    def label_sets(rows: ListedImages) -> list[tuple[int, ...]]:
        return [tuple(sorted(index[x] for x in labels)) for labels in rows.labels]

    sets = label_sets(listed)
    multi = multi_hot(sets, len(class_names))
    logs, caches = {"labels_csv": listed.log}, {"labels_csv": listed.cache}
    if cfg.val_labels_csv is None:
        set_codes = {key: i for i, key in enumerate(dict.fromkeys(sets))}
        codes = np.array([set_codes[key] for key in sets], dtype=np.int64)
        train_at, val_at = split_files(codes, cfg.val_fraction, cfg.split_seed)
        paths = {
            "train": [listed.paths[i] for i in train_at],
            "val": [listed.paths[i] for i in val_at],
        }
        targets = {"train": multi[train_at], "val": multi[val_at]}
    else:
        paths, targets = {"train": listed.paths}, {"train": multi}
    for key in ("val_labels_csv", "test_labels_csv"):
        if getattr(cfg, key) is None:
            continue
        rows, _ = read(key, class_names)
        split = LISTED_SPLITS[key]
        paths[split] = rows.paths
        targets[split] = multi_hot(label_sets(rows), len(class_names))
        logs[key], caches[key] = rows.log, rows.cache
    return _bundle(
        cfg, pretrained, cache_dir, size, start, class_names, paths, targets, logs, caches
    )


def split_source(cfg: ImageFolderConfig) -> str | dict:
    """Where the val split comes from: a key naming its own files, else the split's settings."""
    for key in ("val_dir", "val_labels_csv"):
        if getattr(cfg, key) is not None:
            return f"data.{key}"
    return {"val_fraction": cfg.val_fraction, "split_seed": cfg.split_seed}


def _bundle(cfg, pretrained, cache_dir, size, start, class_names, paths, targets, logs, caches):
    """The bundle from the files of each split and their targets (class indices, or multi-hot
    rows: labels_csv); `logs`: each source's bad-input report."""
    multi_label = cfg.labels_csv is not None
    mean, std, norm = normalisation(cfg, pretrained, paths["train"], size, cache_dir)
    finish = finish_transform(mean, std)
    evaluate = eval_transform(size.image_size, size.resize_size, size.interpolation)

    def dataset(split: str, transform, train_mode: bool) -> ImageFiles:
        return ImageFiles(
            paths[split],
            targets[split],
            channels=cfg.channels,
            transform=transform,
            finish=finish,
            train=train_mode,
            max_pixels=cfg.max_image_pixels,
        )

    train_set = dataset("train", train_transform(cfg.augment, size), True)
    side = size.image_size
    spec = DataSpec(
        MULTILABEL if multi_label else "classification",
        "image",
        len(class_names),
        tuple(class_names),
        channels=cfg.channels,
        image_size=(side, side),
        label_separator=cfg.label_separator if multi_label else None,
        threshold=cfg.threshold if multi_label else 0.5,
    )
    recipe = ImageRecipe(
        mean=tuple(mean),
        std=tuple(std),
        channels=cfg.channels,
        image_size=(side, side),
        class_names=tuple(class_names),
        value_range=(0.0, 1.0),
        resize_size=size.resize_size,
        interpolation=size.interpolation,
        pretrained=pretrained.to_dict() if pretrained is not None else None,
    )

    def counts(y) -> list[int]:  # images per class (multi-label: the images holding it)
        if multi_label:
            return y.sum(axis=0).astype(np.int64).tolist()
        return np.bincount(y, minlength=len(class_names)).tolist()

    report = {
        **{key: log_.to_dict() for key, log_ in logs.items()},
        "summary": [log_.summary() for log_ in logs.values()],  # as a CSV's report
        "classes": class_names,
        "images": {split: len(p) for split, p in paths.items()},
        "class_counts": {
            split: dict(zip(class_names, counts(y), strict=True)) for split, y in targets.items()
        },
        "split": split_source(cfg),
        "input": {
            "channels": cfg.channels,
            "image_size": side,
            "crop_pct": size.crop_pct,
            "resize_size": size.resize_size,
            "interpolation": size.interpolation,
            "augment": str(cfg.augment),
            "mixup_alpha": cfg.mixup_alpha,
            "cutmix_alpha": cfg.cutmix_alpha,
        },
        "normalize": norm,
        "cache": {"dir": str(cache_dir), **caches},
        "prepare_s": time.perf_counter() - start,
    }
    log_report(report)
    return DataBundle(
        spec=spec,
        train=train_set,
        val=dataset("val", evaluate, False),
        test=dataset("test", evaluate, False) if "test" in paths else None,
        recipe=recipe,
        collate_fn=ImageCollate(len(class_names), cfg.mixup_alpha, cfg.cutmix_alpha),
        report=report,
        sources={split: list(p) for split, p in paths.items()},
    )
