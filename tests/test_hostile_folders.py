"""An image folder holding every hostile entry (tests/hostile_inputs.make_hostile_tree): symlink
loops to the folder and its parent, self-symlinks, a dangling link, a FIFO named x.jpg, an
unreadable file and folder, a PNG and a GIF bomb, a file reached twice, a class folder linked
from outside. The scan must finish, read each file once, never open the FIFO, never decode a
bomb, and account for every entry in data_report.json; a training run on it ends ok."""

from __future__ import annotations

import json
import os
import threading

import pytest

from kiln.data.image_scan import read_folder
from kiln.preprocessing.file_tree import walk_tree
from kiln.preprocessing.image_files import DEFAULT_MAX_PIXELS

from .conftest import compose_config, train_in_process
from .hostile_inputs import make_hostile_tree


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    tree = make_hostile_tree(tmp_path_factory.mktemp("hostile"))
    yield tree
    for path in (tree["train_dir"] / "dog" / "locked.png", tree["train_dir"] / "dog" / "sub"):
        if path.exists() and not path.is_symlink():
            path.chmod(0o755)  # let pytest remove it


def finishes(fn, *args, timeout: float = 60, fifos=(), **kwargs):
    """fn(*args, **kwargs) run in a thread; fails the test (after unblocking any reader of the
    FIFOs) instead of hanging when it does not return in time."""
    outcome = {}

    def call():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - raised again below
            outcome["error"] = err

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        for fifo in fifos:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK) if os.path.exists(fifo) else None
            if fd is not None:
                os.close(fd)
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not finish in {timeout} s (a hang)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def scan(tree, tmp_path, **options):
    return finishes(
        read_folder,
        str(tree["train_dir"]),
        "train_dir",
        channels=3,
        bad_rows="drop",
        cache_dir=tmp_path / "cache",
        fifos=[tree["train_dir"] / "cat" / "x.jpg"],
        **options,
    )


def listed(report: dict, reason: str) -> list[dict]:
    """The dropped inputs a data_report.json entry lists for `reason`."""
    return [r for r in report["dropped_records"] if r["reason"] == reason]


def test_the_scan_of_a_hostile_folder_finishes_and_accounts_for_every_entry(hostile, tmp_path):
    images = scan(hostile, tmp_path)
    report = images.log.to_dict()
    assert sorted(set(images.labels)) == hostile["classes"]
    kept = {name: images.labels.count(name) for name in hostile["classes"]}
    assert kept == hostile["kept"]  # each file once: no copy through loop/ or up/
    assert len(set(map(os.path.realpath, images.paths))) == len(images.paths)
    too_large = listed(report, "too_large")
    assert sorted(e["path"] for e in too_large) == hostile["too_large"]
    assert all(e["max_pixels"] == DEFAULT_MAX_PIXELS for e in too_large)
    assert {e["pixels"] for e in too_large} == {30_000**2, 240 * 4000**2}
    cannot_open = sorted(e["path"] for e in listed(report, "cannot_open"))
    assert cannot_open == hostile["cannot_open"]
    assert report["dropped"] == {"too_large": 2, "cannot_open": len(cannot_open)}
    assert report["images_dropped"] == len(report["dropped_records"]) == 2 + len(cannot_open)
    details = {e["path"]: e["detail"] for e in listed(report, "cannot_open")}
    assert "dangling" in details[str(hostile["train_dir"] / "cat" / "gone.jpg")]
    assert "loop" in details[str(hostile["train_dir"] / "cat" / "self1.jpg")]
    for key, count in hostile["skipped"].items():
        assert report["skipped"][key] == count, key
    assert images.log.kept == report["images_kept"] == sum(hostile["kept"].values())


def test_the_verdict_cache_keeps_too_large_with_its_size_and_the_limit_counts(hostile, tmp_path):
    first = scan(hostile, tmp_path).log.to_dict()
    again = scan(hostile, tmp_path)
    # 13 image files cached (bombs included); an unreadable file is checked every time
    assert again.cache["hits"] == 13
    assert again.cache["checked"] == (1 if hostile["how"]["file"] else 0)
    assert listed(again.log.to_dict(), "too_large") == listed(first, "too_large")
    other_limit = scan(hostile, tmp_path, max_pixels=DEFAULT_MAX_PIXELS + 1)
    assert other_limit.cache["hits"] == 0  # verdicts under another limit are not reused
    assert other_limit.log.to_dict()["dropped"]["too_large"] == 2


def test_follow_symlinks_false_follows_no_link_and_counts_each(hostile, tmp_path):
    images = scan(hostile, tmp_path, follow_symlinks=False)
    report = images.log.to_dict()
    assert sorted(set(images.labels)) == ["cat", "dog"]  # bird is a link
    assert report["skipped"]["symlink"] == hostile["links"]
    assert "duplicate" not in report["skipped"] and "link_into_tree" not in report["skipped"]


def test_the_walk_never_opens_a_fifo_and_never_enters_a_folder_twice(hostile):
    entries = finishes(list, walk_tree(hostile["train_dir"]))
    statuses = {"/".join(e.parts): e.status for e in entries}
    assert statuses["cat/x.jpg"] == "not_regular"
    assert statuses["cat/loop"] == statuses["dog/up"] == "link_into_tree"
    assert statuses["dog/again.png"] == "duplicate" and statuses["bird"] == "folder"
    assert not any("loop/" in key or "up/" in key for key in statuses)


def test_a_link_to_an_ancestor_and_two_links_to_one_outside_folder(tmp_path):
    (tmp_path / "tree" / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "e.png").write_bytes(b"x")
    (tmp_path / "tree" / "a" / "root").symlink_to("/", target_is_directory=True)
    (tmp_path / "tree" / "one").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "tree" / "two").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    statuses = {"/".join(e.parts): e.status for e in walk_tree(tmp_path / "tree")}
    assert statuses == {
        "a": "folder",
        "a/root": "link_into_tree",  # "/" holds the tree
        "one": "folder",
        "one/e.png": "file",
        "two": "duplicate",
    }


def test_bad_rows_error_names_a_dangling_link_and_a_bomb(hostile, tmp_path):
    from kiln.data.image_scan import ImageFolderError

    with pytest.raises(ImageFolderError, match=r"cannot open file: .*gone\.jpg.*link or perm"):
        finishes(
            read_folder,
            str(hostile["train_dir"]),
            "train_dir",
            channels=3,
            bad_rows="error",
            cache_dir=None,
        )
    only_bomb = tmp_path / "t"
    (only_bomb / "a").mkdir(parents=True)
    (only_bomb / "a" / "bomb.png").symlink_to(hostile["train_dir"] / "cat" / "bomb.png")
    with pytest.raises(
        ImageFolderError,
        match=r"too large image: PNG of 30000x30000 .*raise "
        r"data\.max_image_pixels",
    ):
        read_folder(str(only_bomb), "train_dir", channels=3, bad_rows="error", cache_dir=None)


def test_data_max_image_pixels_is_the_scans_limit(hostile, tmp_path):
    cfg = compose_config(
        "data=image_folder", f"data.train_dir={hostile['train_dir']}", "data.max_image_pixels=500"
    )
    assert cfg.data.max_image_pixels == 500 and cfg.data.follow_symlinks is True
    images = scan(hostile, tmp_path, max_pixels=cfg.data.max_image_pixels)
    assert images.log.kept == 0  # 24 x 24 = 576 pixels each
    assert images.log.to_dict()["dropped"]["too_large"] == 2 + 11
    with pytest.raises(Exception, match="max_image_pixels"):
        compose_config("data=image_folder", "data.train_dir=x", "data.max_image_pixels=0")


def test_training_on_a_hostile_folder_ends_ok_and_reports_every_bad_file(hostile, tmp_path):
    run = tmp_path / "run"
    summary = finishes(
        train_in_process,
        run,
        "data=image_folder",
        f"data.train_dir={hostile['train_dir']}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.image_size=16",
        "model=mlp",
        "data.batch_size=4",
        "trainer.max_epochs=2",
        "env.progress_bar=false",
        timeout=300,
        fifos=[hostile["train_dir"] / "cat" / "x.jpg"],
    )
    assert summary["status"] in ("ok", "at_chance"), summary  # 2 validation images: chance
    report = json.loads((run / "data_report.json").read_text())["train_dir"]
    assert report["dropped"]["too_large"] == 2
    assert sorted(e["path"] for e in listed(report, "cannot_open")) == hostile["cannot_open"]
    assert report["skipped"]["not_regular"] == 1
    assert report["images_kept"] == sum(hostile["kept"].values())
