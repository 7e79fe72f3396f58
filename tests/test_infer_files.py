"""`infer.py` on folders and globs of image files: one bad file costs only itself (a row with its
error: too large, truncated, cannot be opened, not a regular file), the rest are predicted as the
model predicts their bytes; strict=true stops at the first; walks never loop or hang; file names
that are not UTF-8 are written escaped; `~` and a checkpoint folder are understood."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest

from kiln.cli.infer import main as infer_main
from kiln.data.bad_inputs import summary_line
from kiln.inference import Predictor

from .conftest import train_in_process
from .hostile_inputs import encoded, gif_bomb, photo, png_bomb, unreadable_file
from .test_hostile_folders import finishes


@pytest.fixture(scope="module")
def image_ckpt(tmp_path_factory):
    """A small classifier trained on image files (two classes of 24x24 PNGs)."""
    root = tmp_path_factory.mktemp("image_ckpt")
    for offset, name in enumerate(("cat", "dog")):
        (root / "train" / name).mkdir(parents=True)
        for i in range(6):
            image = photo((24, 24), seed=100 * offset + i)
            image.save(root / "train" / name / f"{i}.png")
    summary = train_in_process(
        root / "run",
        "data=image_folder",
        f"data.train_dir={root / 'train'}",
        f"data.cache_dir={root / 'cache'}",
        "data.image_size=16",
        "model=mlp",
        "trainer.max_steps=2",
        "data.batch_size=4",
        "env.progress_bar=false",
        "logger=none",
    )
    assert summary["status"] in ("ok", "at_chance")  # 2 steps: a checkpoint, not a classifier
    return root / "run" / "checkpoints" / "best.pt"


NON_UTF8 = os.fsdecode(b"caf\xe9.png")  # a name of Latin-1 bytes, as old archives hold


@pytest.fixture
def hostile_inputs(tmp_path):
    """A folder of good PNGs among bad entries; returns (folder, good names, bad name ->
    the reason its row must give)."""
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    good = {}
    for i, name in enumerate(["a.png", "b.jpg", "sub/c.png", NON_UTF8]):
        data = encoded(photo((30, 20), seed=7 + i), "JPEG" if name.endswith(".jpg") else "PNG")
        (folder / name).write_bytes(data)
        good[name] = data
    truncated = encoded(photo((64, 64), seed=3), "PNG")
    (folder / "half.png").write_bytes(truncated[: len(truncated) // 2])
    (folder / "bomb.png").write_bytes(png_bomb())
    (folder / "bomb.gif").write_bytes(gif_bomb())
    (folder / "gone.png").symlink_to("nowhere.png")
    (folder / "self.png").symlink_to("self.png")
    os.mkfifo(folder / "x.jpg")
    (folder / "sub" / "loop").symlink_to("..", target_is_directory=True)
    (folder / "notes.txt").write_text("not an image")
    bad = {
        "half.png": "truncated",
        "bomb.png": "too_large",
        "bomb.gif": "too_large",
        "gone.png": "cannot_open",
        "self.png": "cannot_open",
        "x.jpg": "not_regular",
    }
    if unreadable_file(folder / "locked.png"):
        bad["locked.png"] = "cannot_open"
    return folder, good, bad


def predict(*args: str, fifos=()):
    return finishes(infer_main, list(args), timeout=120, fifos=fifos)


def test_one_bad_file_costs_only_itself(image_ckpt, hostile_inputs, tmp_path, capsys):
    folder, good, bad = hostile_inputs
    out = tmp_path / "preds.csv"
    predict(
        f"ckpt={image_ckpt}",
        f"input={folder}",
        f"output={out}",
        "batch_size=3",
        fifos=[folder / "x.jpg"],
    )
    frame = pd.read_csv(out, keep_default_na=False)
    assert list(frame.columns) == ["index", "source", "label", "prob_cat", "prob_dog", "error"]
    assert frame["index"].tolist() == list(range(len(good) + len(bad)))  # one row each, once
    by_name = {
        os.path.relpath(s, os.fsencode(folder).decode("utf-8", "backslashreplace")): row
        for s, row in zip(frame["source"], frame.itertuples(), strict=True)
    }
    escaped = "caf\\xe9.png"
    assert escaped in by_name  # the Latin-1 byte written as an escape, not a crash
    for name, reason in bad.items():
        assert by_name[name].error.startswith(f"{reason}: "), (name, by_name[name].error)
        assert by_name[name].label == ""
    assert "30000x30000" in by_name["bomb.png"].error
    assert "4000x4000 x 240 frames" in by_name["bomb.gif"].error
    predictor = Predictor.from_checkpoint(image_ckpt)
    names = list(good)
    expected = predictor.predict_probs([good[n] for n in names])
    shown = [escaped if n == NON_UTF8 else n for n in names]
    got = np.array([[by_name[n].prob_cat, by_name[n].prob_dog] for n in shown], dtype=float)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert all(by_name[n].error == "" for n in shown)
    printed = capsys.readouterr()
    assert f"wrote {len(good)} predictions" in printed.out
    assert f"{len(bad)} of {len(good) + len(bad)} inputs could not be predicted" in printed.err
    assert "skipped 1 not input, 1 link into tree" in printed.out


def test_strict_stops_at_the_first_bad_file_and_writes_nothing(
    image_ckpt, hostile_inputs, tmp_path, capsys
):
    folder, _, _ = hostile_inputs
    out = tmp_path / "strict.csv"
    with pytest.raises(SystemExit) as stopped:
        predict(
            f"ckpt={image_ckpt}",
            f"input={folder}",
            f"output={out}",
            "strict=true",
            fifos=[folder / "x.jpg"],
        )
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "bomb.gif: too_large: GIF of 4000x4000 x 240 frames" in err[0]  # first in order
    assert "strict=true" in err[0]
    assert not out.exists() and not list(tmp_path.glob(".strict.csv-*"))


def test_a_glob_with_double_star_over_a_loop_lists_each_file_once(image_ckpt, tmp_path):
    folder = tmp_path / "g"
    (folder / "x" / "y").mkdir(parents=True)
    for name in ("x/1.png", "x/y/2.png", "3.png"):
        (folder / name).write_bytes(encoded(photo((20, 20)), "PNG"))
    (folder / "x" / "y" / "back").symlink_to("../..", target_is_directory=True)
    (folder / "x" / "self").symlink_to("self")
    out = tmp_path / "glob.csv"
    predict(f"ckpt={image_ckpt}", f"input={folder}/**/*.png", f"output={out}")
    sources = pd.read_csv(out)["source"].tolist()
    assert sources == [str(folder / n) for n in ("3.png", "x/1.png", "x/y/2.png")]
    one_level = tmp_path / "one.csv"
    predict(f"ckpt={image_ckpt}", f"input={folder}/*/*.png", f"output={one_level}")
    assert pd.read_csv(one_level)["source"].tolist() == [str(folder / "x" / "1.png")]


def test_no_input_predicted_is_exit_2_after_writing_every_error(image_ckpt, tmp_path, capsys):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "bomb.png").write_bytes(png_bomb())
    (folder / "empty.png").write_bytes(b"")
    out = tmp_path / "bad.csv"
    with pytest.raises(SystemExit) as stopped:
        predict(f"ckpt={image_ckpt}", f"input={folder}", f"output={out}")
    assert stopped.value.code == 2
    assert "none of the inputs could be predicted" in capsys.readouterr().err
    errors = pd.read_csv(out)["error"].tolist()
    assert errors[0].startswith("too_large: PNG of 30000x30000") and errors[1].startswith("empty")


def test_max_image_pixels_is_infer_pys_limit(image_ckpt, tmp_path):
    path = tmp_path / "p.png"
    path.write_bytes(encoded(photo((40, 30)), "PNG"))
    out = tmp_path / "limit.csv"
    with pytest.raises(SystemExit):  # its only input refused: exit 2, the row written
        predict(f"ckpt={image_ckpt}", f"input={path}", f"output={out}", "max_image_pixels=1000")
    assert pd.read_csv(out)["error"][0].startswith("too_large: PNG of 40x30 = 1,200 pixels")
    predict(f"ckpt={image_ckpt}", f"input={path}", f"output={out}", "max_image_pixels=1200")
    assert pd.read_csv(out, keep_default_na=False)["error"][0] == ""


def test_a_fifo_named_directly_is_a_row_not_a_hang(image_ckpt, tmp_path, capsys):
    fifo = tmp_path / "x.jpg"
    os.mkfifo(fifo)
    out = tmp_path / "fifo.csv"
    with pytest.raises(SystemExit):
        predict(f"ckpt={image_ckpt}", f"input={fifo}", f"output={out}", fifos=[fifo])
    assert pd.read_csv(out)["error"][0].startswith("not_regular: a FIFO")


def test_a_checkpoint_folder_and_tilde_paths(image_ckpt, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stopped:
        infer_main([f"ckpt={image_ckpt.parent}", f"input={tmp_path}"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"ckpt={image_ckpt.parent} is a folder, not a checkpoint file" in err
    assert f"e.g. ckpt={image_ckpt}" in err and "does not exist" not in err
    home = tmp_path / "home"
    shutil.copytree(image_ckpt.parent, home / "ckpts")
    (home / "p.png").write_bytes(encoded(photo((20, 20)), "PNG"))
    monkeypatch.setenv("HOME", str(home))
    infer_main(["ckpt=~/ckpts/best.pt", "input=~/p.png", "output=~/out.csv"])
    assert pd.read_csv(home / "out.csv")["source"].tolist() == [str(home / "p.png")]


def test_evaluate_counts_a_fifo_and_leaves_out_bad_files_naming_them(image_ckpt, tmp_path, capsys):
    data = tmp_path / "labelled"
    for offset, name in enumerate(("cat", "dog")):
        (data / name).mkdir(parents=True)
        for i in range(3):
            photo((24, 24), seed=100 * offset + i).save(data / name / f"{i}.png")
    (data / "cat" / "bomb.png").write_bytes(png_bomb())
    (data / "cat" / "half.png").write_bytes((data / "cat" / "0.png").read_bytes()[:60])
    (data / "dog" / "gone.png").symlink_to("nowhere.png")
    (data / "dog" / "loop").symlink_to("..", target_is_directory=True)
    os.mkfifo(data / "dog" / "x.jpg")
    out = tmp_path / "eval"
    predict(
        f"ckpt={image_ckpt}",
        "mode=evaluate",
        f"data={data}",
        f"output={out}",
        fifos=[data / "dog" / "x.jpg"],
    )
    metrics = json.loads((out / "metrics.json").read_text())
    # data_report.json's layout (kiln.data.bad_inputs): counts per reason, the records beside
    report = metrics["data"]
    counts = report["dropped"]
    first = {}
    for record in report["dropped_records"]:
        first.setdefault(record["reason"], record)
    assert counts["not_regular"] == 1 and first["not_regular"]["path"].endswith("x.jpg")
    assert counts["cannot_open"] == 1 and "dangling" in first["cannot_open"]["detail"]
    assert counts["link_into_tree"] == 1
    assert first["too_large"]["path"] == str(data / "cat" / "bomb.png")
    assert first["too_large"]["detail"].startswith("PNG of")
    assert counts["truncated"] == 1
    assert metrics["count"] == 6 == len(pd.read_csv(out / "predictions.csv"))
    assert report["images_kept"] == 6 and report["images_dropped"] == sum(counts.values()) == 5
    assert report["images_read"] == 6 + 5
    assert summary_line({**report, "path": str(data)}).startswith(f"{data}: 11 images read, 6 kept")
    assert "skipped, not evaluated" in capsys.readouterr().out
