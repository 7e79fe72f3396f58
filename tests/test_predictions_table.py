"""The one predictions table (kiln.inference.tables): what infer.py predict and evaluate write,
read back as a CSV."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from kiln.inference.tables import PredictionsCsv, write_predictions

PROBS = np.array([[0.1, 0.9], [0.7, 0.3], [1 / 3, 2 / 3]], dtype=np.float32)


def read(path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_arrays_give_index_label_and_every_probability_exactly(tmp_path):
    path = write_predictions(PROBS, ["cat", "dog"], tmp_path / "out" / "preds.csv")
    header, *rows = read(path)
    assert header == ["index", "label", "prob_cat", "prob_dog"]
    assert [r[:2] for r in rows] == [["0", "dog"], ["1", "cat"], ["2", "dog"]]
    assert np.array_equal(np.array([r[2:] for r in rows], dtype=np.float32), PROBS)
    assert rows[2][2] == "0.33333334"  # float32's shortest text, not float64's digits
    assert b"\r" not in path.read_bytes()  # one line ending for every table: "\n"


def test_skipped_rows_keep_their_place_and_say_why(tmp_path):
    sources = ["a.txt row 1", "a.txt row 2", "a.txt, row 3", "a.txt row 4"]
    path = write_predictions(
        PROBS, ["cat", "dog"], tmp_path / "preds.csv", sources, skipped={1: "empty after cleaning"}
    )
    header, *rows = read(path)
    assert header == ["index", "source", "label", "prob_cat", "prob_dog", "error"]
    assert rows[1] == ["1", "a.txt row 2", "", "", "", "empty after cleaning"]
    assert [r[2] for r in rows] == ["dog", "", "cat", "dog"] and rows[2][1] == "a.txt, row 3"
    assert [r[5] for r in rows] == ["", "empty after cleaning", "", ""]


def test_evaluations_table_adds_the_true_class(tmp_path):
    path = write_predictions(
        PROBS, ["cat", "dog"], tmp_path / "p.csv", ["x", "y", "z"], truth=["dog", "dog", "cat"]
    )
    assert read(path)[:2] == [
        ["index", "source", "true", "label", "prob_cat", "prob_dog"],
        ["0", "x", "dog", "dog", "0.1", "0.9"],
    ]


def test_a_failed_write_leaves_the_previous_table_and_no_temporary_file(tmp_path):
    path = tmp_path / "preds.csv"
    path.write_text("before\n")
    with pytest.raises(RuntimeError), PredictionsCsv(path, ["cat", "dog"]) as table:
        table.row(0, PROBS[0], "a.png")
        raise RuntimeError("the run failed here")
    assert path.read_text() == "before\n" and [p.name for p in tmp_path.iterdir()] == ["preds.csv"]
