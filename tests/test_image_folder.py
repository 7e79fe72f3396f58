"""data=image_folder: every file of a damaged folder accounted for with exact counts, decoding of
each odd format to the configured channels, natural class order, the stratified split,
normalisation (and its cache), augmentation and MixUp/CutMix soft targets reaching the loss,
bitwise exact resume after SIGKILL with augmentation + MixUp at 0 and 2 workers, inference on
image files equal to the evaluation's outputs, and train.py end to end on examples/photos."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader

from kiln.cli.infer import main as infer_main
from kiln.cli.paths import REPO_ROOT
from kiln.config.data import FORCED_CUTMIX_ALPHA, FORCED_MIXUP_ALPHA
from kiln.data import build_data, example_batch
from kiln.data.image_folder import IMAGENET_MEAN, IMAGENET_STD, ImageFolderError
from kiln.data.loaders import build_dataloaders
from kiln.engine.loss import build_criterion
from kiln.engine.run import load_data
from kiln.guards.branches import check_loss_branches
from kiln.inference import InputError, Predictor
from kiln.inference.record import read_checkpoint, rebuild_model
from kiln.models import build_model, logits_of
from kiln.preprocessing import recipe_from_dict
from kiln.preprocessing.image_files import ImageDecodeError, decode
from kiln.preprocessing.pretrained import PretrainedInput

from .conftest import (
    SUBPROCESS_ENV,
    compose_config,
    read_metrics,
    read_summary,
    run_train,
    train_in_process,
    train_main_here,
    train_main_output,
)
from .image_folder_helpers import EXAMPLES, add_class, make_damaged_folder
from .test_resume import final_weights, start_train, wait_for

SMALL = ("data.image_size=16", "model=mlp")


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    return make_damaged_folder(tmp_path_factory.mktemp("photos"))


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def image_cfg(train_dir, cache_dir, *overrides):
    return compose_config(
        "data=image_folder",
        f"data.train_dir={train_dir}",
        f"data.cache_dir={cache_dir}",
        *SMALL,
        *overrides,
    )


def bundle_of(train_dir, cache_dir, *overrides):
    return build_data(image_cfg(train_dir, cache_dir, *overrides).data)


# ---------------------------------------------------------------------------------------------
# Every file accounted for


def test_damaged_folder_report_counts_every_file(damaged, cache, caplog):
    bundle = bundle_of(damaged.train_dir, cache, f"data.test_dir={damaged.test_dir}")
    train = bundle.report["train_dir"]
    assert train["files"] == damaged.files == 92
    assert train["skipped"] == {"hidden": damaged.hidden, "not_image": damaged.not_image}
    assert train["images_read"] == damaged.images_read
    assert train["images_kept"] == damaged.images_kept
    assert train["images_dropped"] == damaged.images_dropped == 2
    assert train["images_unused"] == damaged.images_unused
    records = {r["reason"]: r["path"] for r in train["dropped_records"]}
    assert records == {"truncated": damaged.truncated[0], "empty_file": damaged.empty_files[0]}
    assert train["dropped"] == {"truncated": 1, "empty_file": 1}
    assert train["classes_dropped"] == {
        damaged.empty_class: {"reason": "empty", "images": 0},
        damaged.single_image_class: {"reason": "single_image", "images": 1},
    }
    assert bundle.report["classes"] == list(damaged.classes)
    assert bundle.spec.class_names == bundle.recipe.class_names == damaged.classes
    images = bundle.report["images"]
    assert images["train"] + images["val"] == damaged.images_kept
    assert images["test"] == damaged.test_images == len(bundle.test)
    assert len(bundle.sources["test"]) == damaged.test_images
    kept = set(bundle.sources["train"]) | set(bundle.sources["val"])
    assert not kept & {*damaged.truncated, *damaged.empty_files}
    assert {str(p) for p in damaged.odd.values()} <= kept  # nothing good is lost
    # Said on the console too, naming the classes that are not classes.
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("2 dropped (empty_file 1, truncated 1)" in w for w in warnings)
    assert any(f"'{damaged.empty_class}'" in w and "no good image" in w for w in warnings)
    assert any(f"'{damaged.single_image_class}'" in w and "single" in w for w in warnings)


def test_bad_rows_error_stops_at_the_first_bad_file_naming_it(damaged, cache):
    with pytest.raises(ImageFolderError) as info:
        bundle_of(damaged.train_dir, cache, "data.bad_rows=error")
    assert str(info.value) == (
        f"truncated image: Image is incomplete or truncated ({damaged.truncated[0]}): fix or "
        "remove the file, or set data.bad_rows=drop to skip such files (listed in "
        "data_report.json)"
    )


def test_no_train_dir_is_one_error_line_naming_the_key(tmp_path, capfd):
    code, stderr = train_main_here(capfd, f"hydra.run.dir={tmp_path / 'run'}", "data=image_folder")
    assert code == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "data.train_dir" in lines[0]


def test_a_missing_folder_and_a_folder_without_classes_are_named(tmp_path, cache):
    with pytest.raises(ImageFolderError, match=r"no such folder: .*nowhere \(data.train_dir\)"):
        bundle_of(tmp_path / "nowhere", cache)
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (8, 8)).save(flat / "a.png")
    with pytest.raises(ImageFolderError, match=r"has no class subfolders \(data.train_dir\)"):
        bundle_of(flat, cache)
    one = tmp_path / "one"
    add_class(one, "cat", 3)
    with pytest.raises(ImageFolderError, match="only class 'cat' has two or more good images"):
        bundle_of(one, cache)


def test_a_test_class_the_training_data_lacks_is_reported_and_unused(damaged, tmp_path, cache):
    test_dir = tmp_path / "test"
    for name in damaged.classes:
        add_class(test_dir, name, 2)
    add_class(test_dir, "zebra", 3)
    bundle = bundle_of(damaged.train_dir, cache, f"data.test_dir={test_dir}")
    report = bundle.report["test_dir"]
    assert report["unknown_classes"] == {"zebra": 3} and report["images_unused"] == 3
    assert len(bundle.test) == 2 * len(damaged.classes)
    assert not any("zebra" in p for p in bundle.sources["test"])


def test_verdicts_are_cached_and_a_changed_file_is_checked_again(tmp_path, cache):
    train = tmp_path / "train"
    for name in ("a", "b"):
        add_class(train, name, 4)
    first = bundle_of(train, cache).report["cache"]["train_dir"]
    assert (first["hits"], first["checked"]) == (0, 8)
    second = bundle_of(train, cache).report["cache"]["train_dir"]
    assert (second["hits"], second["checked"]) == (8, 0)
    victim = train / "b" / "b_2.jpg"
    victim.write_bytes(victim.read_bytes()[:300])  # truncated after it was checked
    third = bundle_of(train, cache).report
    assert (third["cache"]["train_dir"]["hits"], third["cache"]["train_dir"]["checked"]) == (7, 1)
    records = third["train_dir"]["dropped_records"]
    assert [r["path"] for r in records if r["reason"] == "truncated"][0] == str(victim)


# ---------------------------------------------------------------------------------------------
# Decoding


def _pil(path: Path, mode: str) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert(mode))


@pytest.mark.parametrize(
    "kind", ["grayscale", "rgba", "palette", "png16", "upper_case", "bmp", "tiff"]
)
def test_each_odd_file_decodes_to_the_configured_channels(damaged, kind):
    path = damaged.odd[kind]
    rgb = decode(path.read_bytes(), 3).permute(1, 2, 0).numpy()
    grey = decode(path.read_bytes(), 1)
    assert rgb.dtype == np.uint8 and grey.dtype == torch.uint8
    assert rgb.shape[2] == 3 and grey.shape == (1, *rgb.shape[:2])
    source = _pil(damaged.train_dir / "dahlia" / "dahlia_01.jpg", "RGB")
    expected = {
        "grayscale": np.repeat(_pil(path, "L")[..., None], 3, axis=2),
        "rgba": source,  # alpha dropped, not composited: the colour channels as they are
        "palette": _pil(path, "RGB"),
        "png16": np.repeat(_pil(damaged.odd["grayscale"], "L")[..., None], 3, axis=2),
        "bmp": source,
        "tiff": source,
    }
    if kind == "upper_case":  # a JPEG: libjpeg's and Pillow's IDCTs may differ by a level
        assert np.abs(rgb.astype(int) - source.astype(int)).max() <= 2
    else:
        assert np.array_equal(rgb, expected[kind])
    luma = _pil(path if kind != "png16" else damaged.odd["grayscale"], "L")
    error = np.abs(grey[0].numpy().astype(int) - luma.astype(int))
    # A JPEG's grey is its own luma plane, not the luma of its upsampled colours: close on
    # average, a few levels apart at colour edges.
    assert error.mean() < 1 if kind == "upper_case" else error.max() <= 2


@pytest.mark.parametrize(
    ("data", "reason"),
    [(b"", "empty_file"), (b"not an image at all", "unreadable"), ("half", "truncated")],
)
def test_undecodable_bytes_say_why(data, reason):
    if data == "half":
        jpeg = (EXAMPLES / "train" / "dahlia" / "dahlia_01.jpg").read_bytes()
        data = jpeg[: len(jpeg) // 2]
    with pytest.raises(ImageDecodeError) as info:
        decode(data, 3)
    assert info.value.reason == reason


# ---------------------------------------------------------------------------------------------
# Classes and the split


def test_classes_are_the_folder_names_in_natural_order(tmp_path, cache):
    for name in ("img10", "img2", "img1"):
        add_class(tmp_path / "train", name, 3)
    bundle = bundle_of(tmp_path / "train", cache)
    assert bundle.spec.class_names == ("img1", "img2", "img10")
    label_of = dict(zip(bundle.sources["train"], bundle.train.labels, strict=True))
    assert all(bundle.spec.class_names[y] in Path(p).parent.name for p, y in label_of.items())


def test_split_is_stratified_seeded_and_disjoint(cache):
    train = EXAMPLES / "train"

    def split(seed):
        b = bundle_of(train, cache, "data.val_fraction=0.25", f"data.split_seed={seed}")
        return b.sources["train"], b.sources["val"], b.report["class_counts"]["val"]

    train_a, val_a, counts = split(0)
    assert counts == {"dahlia": 5, "flag": 5, "pagoda": 5, "portrait": 5}
    assert not set(train_a) & set(val_a) and len(train_a) + len(val_a) == 80
    assert split(0)[1] == val_a and split(1)[1] != val_a


def test_val_dir_replaces_the_split(cache):
    bundle = bundle_of(EXAMPLES / "train", cache, f"data.val_dir={EXAMPLES / 'test'}")
    assert bundle.report["images"] == {"train": 80, "val": 24}
    assert bundle.report["split"] == "data.val_dir"


# ---------------------------------------------------------------------------------------------
# Normalisation


def _eval_pixels(bundle) -> torch.Tensor:
    """The training split through the eval transform, in [0, 1], as a (N, C, S, S) tensor."""
    from kiln.preprocessing.image_files import EncodedImageLoader

    load = EncodedImageLoader.for_recipe(bundle.recipe)
    return torch.stack([load(Path(p).read_bytes()) for p in bundle.sources["train"]])


def test_normalize_dataset_is_the_training_splits_statistics_and_is_cached(cache):
    bundle = bundle_of(EXAMPLES / "train", cache, "data.normalize=dataset")
    pixels = _eval_pixels(bundle).double()
    assert np.allclose(bundle.recipe.mean, pixels.mean(dim=(0, 2, 3)), atol=1e-6)
    assert np.allclose(bundle.recipe.std, pixels.std(dim=(0, 2, 3), correction=0), atol=1e-6)
    assert bundle.report["normalize"]["source"].endswith("(computed)")
    (stats,) = cache.glob("stats-*.json")
    stored = json.loads(stats.read_text())
    stats.write_text(json.dumps({**stored, "mean": [0.25, 0.5, 0.75]}))  # a marker
    again = bundle_of(EXAMPLES / "train", cache, "data.normalize=dataset")
    assert again.recipe.mean == (0.25, 0.5, 0.75)  # read from the cache, not recomputed
    assert again.report["normalize"]["source"].endswith("(cached)")
    other = bundle_of(EXAMPLES / "train", cache, "data.normalize=dataset", "data.image_size=20")
    assert other.recipe.mean != (0.25, 0.5, 0.75)  # other settings: another entry


def test_normalize_modes(cache):
    train = EXAMPLES / "train"
    assert bundle_of(train, cache, "data.normalize=none").recipe.std == (1.0, 1.0, 1.0)
    imagenet = bundle_of(train, cache, "data.normalize=imagenet").recipe
    assert (imagenet.mean, imagenet.std) == (IMAGENET_MEAN, IMAGENET_STD)
    auto = bundle_of(train, cache).recipe
    assert auto.mean == bundle_of(train, cache, "data.normalize=dataset").recipe.mean
    weights = PretrainedInput(
        "test weights",
        (0.1, 0.2, 0.3),
        (0.4, 0.5, 0.6),
        image_size=24,
        crop_pct=0.8,
        interpolation="bicubic",
    )
    cfg = compose_config("data=image_folder", f"data.train_dir={train}", f"data.cache_dir={cache}")
    pretrained = build_data(cfg.data, pretrained=weights)
    recipe = pretrained.recipe
    assert (recipe.mean, recipe.std) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert (recipe.image_size, recipe.resize_size) == ((24, 24), 30)
    assert recipe.interpolation == "bicubic"
    assert recipe.pretrained == weights.to_dict()
    assert PretrainedInput.from_dict(recipe.pretrained) == weights
    assert recipe_from_dict(recipe.to_dict()) == recipe  # survives the checkpoint
    grey = build_data(dataclasses.replace(cfg.data, channels=1), pretrained=weights).recipe
    assert np.allclose(grey.mean, [0.2]) and np.allclose(grey.std, [0.5])
    assert pretrained.train[0][0].shape == (3, 24, 24)


# ---------------------------------------------------------------------------------------------
# Augmentation and MixUp / CutMix


@pytest.mark.parametrize("augment", ["none", "flip_crop", "trivialaugment", "randaugment"])
@pytest.mark.parametrize("channels", [3, 1])
def test_augment_modes_are_seeded_by_seed_epoch_and_index(augment, channels, cache):
    bundle = bundle_of(
        EXAMPLES / "train", cache, f"data.augment={augment}", f"data.channels={channels}"
    )
    image, label, seed = bundle.train[(3, 42, 1)]
    assert image.shape == (channels, 16, 16) and image.dtype == torch.float32
    again, _, seed_again = bundle.train[(3, 42, 1)]
    assert torch.equal(image, again) and seed == seed_again
    other_epoch, _, _ = bundle.train[(3, 42, 2)]
    if augment == "none":
        assert torch.equal(image, other_epoch)
        val_image, _ = bundle.val[0]
        assert val_image.shape == image.shape
    else:
        assert not torch.equal(image, other_epoch)


def test_mixup_and_cutmix_soft_targets_reach_the_loss(cache):
    cfg = image_cfg(
        EXAMPLES / "train",
        cache,
        "data.mixup_alpha=0.4",
        "data.cutmix_alpha=1.0",
        "loss.force_all_branches=true",
    )
    bundle = build_data(cfg.data)
    images, targets = example_batch(bundle, 8, seed=0)
    assert targets.shape == (8, 4) and targets.dtype == torch.float32
    assert torch.allclose(targets.sum(dim=1), torch.ones(8))
    assert (targets.max(dim=1).values < 1).any()  # mixed, not one-hot
    # Seeded: about one initialisation in 150 gives logits whose soft and hard losses agree.
    torch.manual_seed(0)
    model = build_model(bundle.spec, cfg.model, aux_head=True)
    criterion = build_criterion(model, cfg.loss)
    model.eval()  # no dropout: the two forwards below agree
    loss, terms = criterion(model, (images, targets))
    logits = logits_of(model(images)).float()
    assert torch.allclose(terms["main"], F.cross_entropy(logits, targets))
    assert not torch.allclose(terms["main"], F.cross_entropy(logits, targets.argmax(dim=1)))
    assert set(check_loss_branches(model, criterion, (images, targets))) >= {"main", "aux_head"}
    train_loader, val_loader = build_dataloaders(
        bundle, cfg.data, seed=0, rank=0, world_size=1, cuda=False
    )
    _, val_targets = next(iter(val_loader))
    assert val_targets.dtype == torch.int64 and val_targets.dim() == 1  # validation: never mixed
    _, train_targets = next(iter(train_loader))
    assert train_targets.shape[1] == 4


def test_force_all_branches_switches_mixup_and_cutmix_on(cache):
    forced = load_data(image_cfg(EXAMPLES / "train", cache, "loss.force_all_branches=true"))
    mix = forced.collate_fn
    assert (mix.mixup_alpha, mix.cutmix_alpha) == (FORCED_MIXUP_ALPHA, FORCED_CUTMIX_ALPHA)
    assert forced.report["input"]["mixup_alpha"] == 0.2
    kept = load_data(
        image_cfg(EXAMPLES / "train", cache, "loss.force_all_branches=true", "data.mixup_alpha=0.7")
    )
    assert (kept.collate_fn.mixup_alpha, kept.collate_fn.cutmix_alpha) == (0.7, 1.0)
    plain = load_data(image_cfg(EXAMPLES / "train", cache))
    assert plain.collate_fn.mix is None


def test_training_with_every_branch_forced_on_soft_targets_logs_finite_terms(tmp_path, cache):
    summary = train_in_process(
        tmp_path / "run",
        "data=image_folder",
        f"data.train_dir={EXAMPLES / 'train'}",
        f"data.cache_dir={cache}",
        *SMALL,
        "data.augment=trivialaugment",
        "loss.force_all_branches=true",  # MixUp, CutMix and every loss branch: rule 2's run
        "trainer.max_steps=3",
        "data.batch_size=16",
        "env.progress_bar=false",
    )
    assert summary["status"] == "ok" and summary["steps"] == 3
    assert np.isfinite(summary["val_loss"])
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert (report["input"]["mixup_alpha"], report["input"]["cutmix_alpha"]) == (0.2, 1.0)
    (logged,) = [m for m in read_metrics(tmp_path / "run") if m.get("step") == 1 and "loss" in m]
    assert {"loss/main", "loss/label_smoothing", "loss/aux_head"} <= set(logged)
    assert all(np.isfinite(v) for k, v in logged.items() if k.startswith("loss"))


# ---------------------------------------------------------------------------------------------
# Exact resume


def resumable(cache_dir: Path, workers: int) -> tuple[str, ...]:
    # 64 training images in batches of 8: 8 steps an epoch, a checkpoint every 3, so the kill
    # lands mid-epoch; augmentation, MixUp/CutMix and dropout all draw random numbers.
    return (
        "data=image_folder",
        f"data.train_dir={EXAMPLES / 'train'}",
        f"data.cache_dir={cache_dir}",
        *SMALL,
        "data.augment=trivialaugment",
        "data.mixup_alpha=0.4",
        "data.cutmix_alpha=1.0",
        f"data.num_workers={workers}",
        "data.batch_size=8",
        "model.dropout=0.2",
        "trainer.deterministic=true",
        "trainer.max_epochs=2",
        "trainer.checkpoint_every_n_steps=3",
        "trainer.log_every_n_steps=1",
        "env.progress_bar=false",
    )


@pytest.fixture(scope="module")
def reference_weights(tmp_path_factory):
    """An uninterrupted run (no workers): every interrupted run must end with these weights."""
    root = tmp_path_factory.mktemp("reference")
    train_in_process(root / "run", *resumable(root / "cache", 0))  # the processes: the others
    return final_weights(root / "run"), read_summary(root / "run")


@pytest.mark.parametrize(
    "workers",
    [2, pytest.param(0, marks=pytest.mark.slow)],  # 2 workers against a reference run with none
)
def test_sigkill_mid_epoch_then_resume_is_bitwise_equal_with_augmentation_and_mixup(
    workers, reference_weights, tmp_path
):
    expected, reference_summary = reference_weights
    run_dir = tmp_path / "run"
    settings = resumable(tmp_path / "cache", workers)
    proc = start_train(run_dir, *settings)
    wait_for(run_dir / "checkpoints" / "last.pt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["state"]
    assert saved["epoch"] == 0 and 0 < saved["batch_in_epoch"] < 8  # killed mid-epoch
    resumed = run_train(run_dir, *settings, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    actual = final_weights(run_dir)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs after resume"
    assert read_summary(run_dir)["steps"] == reference_summary["steps"] == 16


# ---------------------------------------------------------------------------------------------
# Inference on image files = the evaluation


@pytest.fixture(scope="module")
def photo_run(damaged, tmp_path_factory):
    root = tmp_path_factory.mktemp("photo_run")
    overrides = (
        "data=image_folder",
        f"data.train_dir={damaged.train_dir}",
        f"data.test_dir={damaged.test_dir}",
        f"data.cache_dir={root / 'cache'}",
        *SMALL,
        "trainer.max_steps=4",
        "data.batch_size=16",
        "env.progress_bar=false",
        "logger=none",
    )
    summary = train_in_process(root / "run", *overrides)
    assert summary["status"] == "ok"
    return root / "run" / "checkpoints" / "best.pt", compose_config(*overrides)


def _loader_probs(ckpt: Path, cfg) -> tuple[list[str], np.ndarray]:
    """The test split's probabilities as the evaluation computes them: the DataLoader's
    batches through the checkpoint's model."""
    bundle = build_data(cfg.data)
    record, state_dict = read_checkpoint(ckpt)
    model = rebuild_model(record, state_dict).eval()
    loader = DataLoader(bundle.test, batch_size=8, collate_fn=bundle.collate_fn)
    with torch.no_grad():
        probs = [F.softmax(logits_of(model(x)), dim=-1) for x, _ in loader]
    return list(bundle.sources["test"]), torch.cat(probs).numpy()


def test_predictor_on_image_files_equals_the_models_outputs_on_the_test_loader(photo_run):
    ckpt, cfg = photo_run
    sources, expected = _loader_probs(ckpt, cfg)
    predictor = Predictor.from_checkpoint(ckpt)
    assert predictor.preprocess.takes_files
    files = [Path(p).read_bytes() for p in sources]
    assert any(p.endswith(".png") for p in sources)  # grayscale, RGBA and palette PNGs too
    np.testing.assert_allclose(predictor.predict_probs(files, batch_size=5), expected, atol=1e-5)
    pixels = predictor.convert(files[:2])  # float32 (C, S, S) in [0, 1]: still accepted
    assert pixels.shape == (2, 3, 16, 16) and pixels.min() >= 0 and pixels.max() <= 1
    np.testing.assert_allclose(predictor.predict_probs(pixels), expected[:2], atol=1e-5)


def test_undecodable_bytes_are_refused_naming_the_item(photo_run):
    predictor = Predictor.from_checkpoint(photo_run[0])
    good = (EXAMPLES / "test" / "flag" / "flag_01.jpg").read_bytes()
    with pytest.raises(InputError, match=r"^item 3: not a readable image \(unreadable"):
        predictor.validate([good, good, good, b"GIF89a but not really"])
    with pytest.raises(InputError, match=r"^item 6: not a readable image \(truncated"):
        predictor.predict_probs([good] * 6 + [good[:500]], batch_size=4)  # in the second chunk


def test_infer_cli_on_a_test_folder_writes_the_evaluations_predictions(
    photo_run, damaged, tmp_path
):
    ckpt, cfg = photo_run
    sources, expected = _loader_probs(ckpt, cfg)
    folder = tmp_path / "test"
    shutil.copytree(damaged.test_dir, folder)
    (folder / ".DS_Store").write_bytes(b"\x00Bud1")  # hidden and non-image files are skipped
    (folder / "flag" / "README.md").write_text("skipped\n")
    out = tmp_path / "preds.csv"
    infer_main([f"ckpt={ckpt}", f"input={folder}", f"output={out}"])
    frame = pd.read_csv(out)
    assert list(frame.columns[:3]) == ["index", "source", "label"]
    relative = [str(Path(p).relative_to(damaged.test_dir)) for p in sources]
    assert sorted(frame["source"]) == sorted(str(folder / r) for r in relative)
    by_source = frame.set_index("source").loc[[str(folder / r) for r in relative]]
    probs = by_source[[f"prob_{c}" for c in cfg_classes(ckpt)]].to_numpy()
    np.testing.assert_allclose(probs, expected, atol=1e-5)
    glob_out = tmp_path / "glob.csv"
    infer_main([f"ckpt={ckpt}", f"input={folder}/*/*.png", f"output={glob_out}"])
    pngs = [str(folder / p.relative_to(damaged.test_dir)) for p in damaged.test_odd.values()]
    assert sorted(pd.read_csv(glob_out)["source"]) == sorted(pngs)


def cfg_classes(ckpt: Path) -> list[str]:
    record, _ = read_checkpoint(ckpt)
    return list(record.spec.class_names)


def test_a_single_png_file_is_predicted(photo_run, tmp_path):
    image = Image.open(EXAMPLES / "test" / "pagoda" / "pagoda_01.jpg")
    path = tmp_path / "one.PNG"
    image.save(path, format="PNG")
    out = tmp_path / "one.csv"
    infer_main([f"ckpt={photo_run[0]}", f"input={path}", f"output={out}"])
    frame = pd.read_csv(out)
    assert frame["source"].tolist() == [str(path)]
    predictor = Predictor.from_checkpoint(photo_run[0])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    np.testing.assert_allclose(
        frame.filter(like="prob_").to_numpy(),
        predictor.predict_probs([buffer.getvalue()]),
        atol=1e-6,
    )


# ---------------------------------------------------------------------------------------------
# train.py, end to end


def test_train_py_on_the_example_photos_with_resnet18(tmp_path, capfd):
    run_dir = tmp_path / "run"
    code, stdout, stderr = train_main_output(
        capfd,
        f"hydra.run.dir={run_dir}",
        "data=image_folder",
        f"data.train_dir={EXAMPLES / 'train'}",
        f"data.test_dir={EXAMPLES / 'test'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model=resnet18",
        "data.image_size=32",
        "trainer.max_steps=2",
        "data.batch_size=8",
        "trainer.limit_val_batches=1",
        "env.progress_bar=false",
    )
    assert code == 0, stderr[-3000:]
    assert read_summary(run_dir)["steps"] == 2
    report = json.loads((run_dir / "data_report.json").read_text())
    assert report["images"] == {"train": 64, "val": 16, "test": 24}
    checkpoint = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    recipe = recipe_from_dict(checkpoint["preprocessing"])
    assert (recipe.image_size, recipe.resize_size) == ((32, 32), 37)
    assert list(checkpoint["data_spec"]["class_names"]) == ["dahlia", "flag", "pagoda", "portrait"]
    assert "data: 4 classes, 64 train / 16 val / 24 test images at 32x32" in stdout


def test_make_example_photos_reproduces_the_shipped_folder(tmp_path):
    out = tmp_path / "photos"
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "make_example_photos.py"), "--out", str(out)],
        check=True,
        env=SUBPROCESS_ENV,
        capture_output=True,
        timeout=120,
    )
    made = sorted(p.relative_to(out) for p in out.rglob("*.jpg"))
    shipped = sorted(p.relative_to(EXAMPLES) for p in EXAMPLES.rglob("*.jpg"))
    assert made == shipped and len(made) == 104
    size = sum((EXAMPLES / p).stat().st_size for p in shipped)
    assert size < 500_000
    for p in made[::10]:  # the same pixels (JPEG encoding is deterministic for one libjpeg)
        assert np.array_equal(_pil(out / p, "RGB"), _pil(EXAMPLES / p, "RGB"))


def test_server_takes_image_files_in_v1_base64_and_v2_bytes(photo_run):
    """The server on the bytes of the test photos (PNG among them) answers what the
    evaluation's DataLoader computes: v1 base64 strings and {"b64": ...}, v2 BYTES over JSON
    (base64) and the binary extension (raw bytes), and tritonclient's own BYTES input."""
    import base64
    import struct

    import httpx
    import tritonclient.http as triton

    from kiln.serving import create_app

    from .inference_helpers import live_server

    ckpt, cfg = photo_run
    sources, expected = _loader_probs(ckpt, cfg)
    files = [Path(p).read_bytes() for p in sources]
    encoded = [base64.b64encode(f).decode() for f in files]
    predictor = Predictor.from_checkpoint(ckpt)
    with live_server(create_app(predictor, max_batch_size=8, max_delay_ms=2)) as server:
        v1 = httpx.post(f"{server.url}/v1/predict", json={"inputs": encoded}, timeout=60)
        assert v1.status_code == 200, v1.text
        got = np.array([p["probs"] for p in v1.json()["predictions"]])
        np.testing.assert_allclose(got, expected, atol=1e-5)
        wrapped = [{"b64": e} for e in encoded[:2]]
        v1b = httpx.post(f"{server.url}/v1/predict", json={"inputs": wrapped}, timeout=60)
        np.testing.assert_allclose(
            [p["probs"] for p in v1b.json()["predictions"]], expected[:2], atol=1e-5
        )
        bad = httpx.post(f"{server.url}/v1/predict", json={"inputs": [encoded[0], "bm90IGFu"]})
        assert bad.status_code == 422 and "item 1: not a readable image" in bad.json()["detail"]

        body = {
            "inputs": [
                {"name": "input", "datatype": "BYTES", "shape": [len(encoded)], "data": encoded}
            ]
        }
        v2 = httpx.post(f"{server.url}/v2/models/kiln/infer", json=body, timeout=60)
        assert v2.status_code == 200, v2.text
        probs = next(o for o in v2.json()["outputs"] if o["name"] == "probs")
        np.testing.assert_allclose(
            np.array(probs["data"]).reshape(len(files), -1), expected, atol=1e-5
        )

        # The OpenAPI document says so, so a generated client knows it.
        doc = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
        item = doc["V1Request"]["properties"]["inputs"]["items"]["anyOf"]
        assert item[0]["contentEncoding"] == "base64" and item[1]["required"] == ["b64"]
        (forms,) = [doc["InferRequest"]["properties"]["inputs"]["items"]["anyOf"]]
        assert [f["properties"]["datatype"]["const"] for f in forms] == ["BYTES", "FP32"]
        assert forms[0]["properties"]["data"]["items"]["contentEncoding"] == "base64"

        client = triton.InferenceServerClient(server.url.removeprefix("http://"))
        tensor = triton.InferInput("input", [len(files)], "BYTES")
        tensor.set_data_from_numpy(np.array(files, dtype=object), binary_data=True)
        result = client.infer("kiln", [tensor], outputs=[triton.InferRequestedOutput("probs")])
        np.testing.assert_allclose(result.as_numpy("probs"), expected, atol=1e-5)
        client.close()

        raw = b"".join(struct.pack("<I", len(f)) + f for f in files[:1])
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "input",
                        "datatype": "BYTES",
                        "shape": [1],
                        "parameters": {"binary_data_size": len(raw)},
                    }
                ]
            }
        ).encode()
        v2b = httpx.post(
            f"{server.url}/v2/models/kiln/infer",
            content=header + raw,
            headers={"Inference-Header-Content-Length": str(len(header))},
            timeout=60,
        )
        assert v2b.status_code == 200, v2b.text
