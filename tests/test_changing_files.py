"""Data that changes under a run, or that no model can learn from, is named as data:

- an image deleted (or damaged) after the scan is one `error:` line naming it, also when a
  DataLoader worker meets it (torch raised it again with the worker's traceback inside the
  message: many lines, where there was one without workers);
- a class folder whose name is not UTF-8 trains, predicts and evaluates (infer.py's table and
  evaluate's plot crashed on the name's lone surrogates);
- a training split of copies of one image stops before any model is built, as data (it ran on
  to `at_chance`, or a probe's "dead gradients")."""

from __future__ import annotations

import json
import os

import pytest
from torch.utils.data import DataLoader

from kiln.cli.infer import main as infer_main
from kiln.data import build_data
from kiln.data.bad_inputs import FileChangedError
from kiln.data.degenerate import DegenerateDataError

from .conftest import compose_config, train_in_process
from .hostile_inputs import encoded, photo

TINY = (
    "data.image_size=16",
    "model=mlp",
    "data.batch_size=4",
    "trainer.max_epochs=1",
    "env.progress_bar=false",
    "logger=none",
)


def class_folders(root, names: list[bytes], per_class: int = 8, same: bool = False):
    """root/<name>/img_<i>.png for each (bytes) name; `same`: every file one image."""
    for k, name in enumerate(names):
        folder = os.path.join(os.fsencode(root), name)
        os.makedirs(folder)
        for i in range(per_class):
            png = encoded(photo((20, 20), seed=0 if same else 10 * k + i), "PNG")
            with open(os.path.join(folder, b"img_%d.png" % i), "wb") as f:
                f.write(png)
    return root


def image_folder_cfg(tmp_path, train_dir, *extra):
    return compose_config(
        "data=image_folder",
        f"data.train_dir={train_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *TINY,
        *extra,
    )


def coco_bundle(tmp_path):
    images = class_folders(tmp_path / "images", [b"a"], per_class=6) / "a"
    entries = [{"id": i + 1, "file_name": f"img_{i}.png"} for i in range(6)]
    boxes = [
        {"id": i + 1, "image_id": i + 1, "category_id": 1, "bbox": [2, 2, 8, 8]} for i in range(6)
    ]
    path = tmp_path / "train.json"
    path.write_text(
        json.dumps(
            {"images": entries, "annotations": boxes, "categories": [{"id": 1, "name": "thing"}]}
        )
    )
    cfg = compose_config(
        "data=coco",
        "model=detector",
        f"data.train_json={path}",
        f"data.train_images={images}",
        f"data.cache_dir={tmp_path / 'c'}",
    )
    return build_data(cfg.data)


@pytest.mark.parametrize(
    ("kind", "workers"), [("image_folder", 0), ("image_folder", 2), ("coco", 0)]
)
def test_an_image_deleted_after_the_scan_is_one_error_line(tmp_path, kind, workers):
    if kind == "coco":
        bundle = coco_bundle(tmp_path)
    else:
        train = class_folders(tmp_path / "train", [b"cat", b"dog"])
        bundle = build_data(image_folder_cfg(tmp_path, train).data)
    for path in bundle.sources["train"]:
        os.unlink(path)
    loader = DataLoader(
        bundle.train, batch_size=2, num_workers=workers, collate_fn=bundle.collate_fn
    )
    batches = iter(loader)
    with pytest.raises(FileChangedError) as raised:
        next(batches)
    # its workers stop now: the traceback holds the iterator, and a later test's garbage
    # collection would wait out torch's 5 s join for each (kiln.data.loaders.stop_workers)
    getattr(batches, "_shutdown_workers", lambda: None)()
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith("a file changed since the data was checked: no such file (")
    assert bundle.sources["train"][0] in message or "img_" in message
    assert message.endswith("(the scan leaves out files that are gone or unreadable)")


def test_a_run_whose_images_vanish_after_the_scan_stops_on_one_line(tmp_path, temporary_model):
    train = class_folders(tmp_path / "train", [b"cat", b"dog"])
    from kiln.models.mlp import build_mlp

    def vanishing(spec, cfg, **options):  # built after the scan, before any batch is read
        for path in sorted(train.rglob("*.png")):
            path.unlink()
        return build_mlp(spec, cfg, **options)

    cfg = temporary_model(
        "vanishing_mlp",
        vanishing,
        "data=image_folder",
        f"data.train_dir={train}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *TINY[:1],
        *TINY[2:],
    )
    from kiln.engine.run import train as run_training

    with pytest.raises(FileChangedError, match=r"^a file changed since the data was checked"):
        run_training(cfg, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "\n" not in summary["error"]


def test_a_class_folder_whose_name_is_not_utf8_trains_predicts_and_evaluates(tmp_path):
    train = class_folders(tmp_path / "train", [b"caf\xe9", b"dog"])
    summary = train_in_process(tmp_path / "run", *image_folder_cfg_overrides(tmp_path, train))
    assert summary["status"] in ("ok", "at_chance"), summary
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["classes"] == ["caf\\xe9", "dog"]
    ckpt = tmp_path / "run" / "checkpoints" / "best.pt"
    infer_main([f"ckpt={ckpt}", f"input={train}", f"output={tmp_path / 'preds.csv'}"])
    header = (tmp_path / "preds.csv").read_text(encoding="utf-8").splitlines()[0]
    assert header == "index,source,label,prob_caf\\xe9,prob_dog,error"
    infer_main(["mode=evaluate", f"ckpt={ckpt}", f"data={train}", f"output={tmp_path / 'eval'}"])
    assert (tmp_path / "eval" / "confusion_matrix.png").stat().st_size > 0


def image_folder_cfg_overrides(tmp_path, train_dir) -> tuple[str, ...]:
    return (
        "data=image_folder",
        f"data.train_dir={train_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *TINY,
    )


def test_a_folder_of_copies_of_one_image_is_a_data_error_before_any_model(tmp_path):
    train = class_folders(tmp_path / "train", [b"cat", b"dog"], per_class=10, same=True)
    with pytest.raises(
        DegenerateDataError,
        match=r"^all 16 training inputs sampled \(of 16\) "
        r"are identical \(the training split of data=image_folder\)",
    ):
        train_in_process(
            tmp_path / "run", *image_folder_cfg_overrides(tmp_path, train), "data.augment=flip_crop"
        )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["probe_times_s"] == {} and summary["model_flops_per_sample"] is None


def test_a_csv_of_one_text_is_a_data_error(tmp_path):
    path = tmp_path / "same.csv"
    path.write_text("text,label\n" + "".join(f"the same words,{'ab'[i % 2]}\n" for i in range(40)))
    with pytest.raises(DegenerateDataError, match="identical .*data=csv_text"):
        train_in_process(
            tmp_path / "run",
            "data=csv_text",
            f"data.train_path={path}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "model=text_bow",
            *TINY[3:],
        )
