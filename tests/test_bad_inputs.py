"""One bad-input report (kiln.data.bad_inputs) for a CSV file's rows and an image folder's
files: data_report.json reads the same for both."""

from __future__ import annotations

from kiln.data.csv_reader import BadRow, row_log
from kiln.data.image_scan import FolderLog
from kiln.preprocessing.image_files import ImageDecodeError

COMMON = ["path", "{unit}_read", "{unit}_kept", "{unit}_dropped", "dropped", "dropped_records"]


def common(entry: dict, unit: str) -> dict:
    return {key.format(unit=unit): entry[key.format(unit=unit)] for key in COMMON}


def test_rows_and_images_report_the_same_keys_counts_and_records():
    rows = row_log("train.csv")
    rows.read, rows.kept = 5, 3
    rows.add(BadRow("missing_label", 4, 5, "label", "has no label").to_dict())
    rows.add(BadRow("empty_row", 2, 3, None, "is empty").to_dict())
    images = FolderLog("train")
    images.read, images.kept = 5, 3
    images.drop("train/cat/a.png", ImageDecodeError("truncated", "cut"))
    images.drop("train/cat/b.png", ImageDecodeError("truncated", "cut"))
    for log, unit in ((rows, "rows"), (images, "images")):
        entry = log.to_dict()
        assert list(common(entry, unit)) == [k.format(unit=unit) for k in COMMON]
        assert (entry[f"{unit}_read"], entry[f"{unit}_kept"], entry[f"{unit}_dropped"]) == (5, 3, 2)
        assert sum(entry["dropped"].values()) == len(entry["dropped_records"]) == 2
        assert all(r["reason"] in entry["dropped"] for r in entry["dropped_records"])
    assert [r["line"] for r in rows.to_dict()["dropped_records"]] == [3, 5]  # in file order
    assert rows.to_dict()["dropped"] == {"empty_row": 1, "missing_label": 1}  # reasons' order
    assert (
        rows.summary()
        == "train.csv: 5 records read, 3 kept, 2 dropped (empty_row 1, missing_label 1)"
    )
    assert images.summary() == "train: 0 files, 3 images kept, 2 dropped (truncated 2)"


def test_an_image_folder_lists_the_first_files_per_reason_and_counts_them_all():
    images = FolderLog("train", listed_per_reason=2)
    for i in range(5):
        images.drop(f"train/cat/{i}.png", ImageDecodeError("truncated", "cut"))
    entry = images.to_dict()
    assert entry["dropped"] == {"truncated": 5} and entry["images_dropped"] == 5
    assert [r["path"] for r in entry["dropped_records"]] == ["train/cat/0.png", "train/cat/1.png"]
