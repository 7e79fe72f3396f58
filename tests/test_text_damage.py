"""A real CSV's damage, record by record (tests/damaged_csv.py writes it): every good record is
kept, a stray quote costs only its own record, no class is invented, the validation file is read
on its own, every dropped record is named in the report, and infer.py reads a CSV as training
did."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import sys
from pathlib import Path

import pandas as pd
import pytest

from kiln.cli.paths import REPO_ROOT
from kiln.data import build_data
from kiln.data.csv_reader import PREVIEW_CHARS, CsvSettings, read_labelled_rows, row_log
from kiln.preprocessing.cleaning import TextCleaning, clean_text

from .conftest import FAST, SUBPROCESS_ENV, compose_config, run_python, train_in_process
from .damaged_csv import CLASSES, clean_rows, write_clean_csv, write_damaged_csv

# The damage of the corpus, in proportion: unbalanced quotes of three kinds, missing
# labels, extra columns, markup-only rows (HTML rows come with the clean ones), CRLF endings.
DAMAGE = {
    "stray_quote": 6,
    "undoubled_quote": 4,
    "unclosed_quote": 2,
    "missing_label": 3,
    "extra_columns": 3,
    "markup_only": 2,
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def read(path: Path, **settings):
    """{line: (cleaned text, label, flagged)} of the kept rows, and the log."""
    settings = CsvSettings(**{"text_column": "text", "label_column": "label", **settings})
    log, kept = row_log(str(path)), {}
    for chunk in read_labelled_rows(path, settings, log):
        for line, text, label, flagged in zip(
            chunk.lines, chunk.texts, chunk.labels, chunk.flagged, strict=True
        ):
            kept[line] = (text, label, flagged)
    return kept, log


def data_cfg(**overrides):
    cfg = dataclasses.replace(compose_config("data=csv_text", "model=text_bow").data, **overrides)
    cfg.check("data")
    return cfg


# --- 1. every good record is kept --------------------------------------------------------------


@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
def test_every_good_record_is_kept_whatever_the_damage_around_it(tmp_path, crlf):
    written = write_damaged_csv(tmp_path / "train.csv", 400, DAMAGE, crlf=crlf)
    kept, log = read(written.path, chunk_rows=37)
    lost = [
        r
        for r in written.good
        if kept.get(r.first_line, (None, None))[:2] != (clean_text(r.text, TextCleaning()), r.label)
    ]
    assert lost == []
    # Each damaged record is dropped at its first line, with its reason.
    reasons = {d["line"]: d["reason"] for d in log.to_dict()["dropped_records"]}
    expected = {
        "stray_quote": "unbalanced_quote",
        "undoubled_quote": "unbalanced_quote",
        "unclosed_quote": "unbalanced_quote",
        "missing_label": "missing_label",
        "extra_columns": "wrong_field_count",
        "markup_only": "empty_after_cleaning",
    }
    for record in written.records:
        if record.damage:
            assert reasons[record.first_line] == expected[record.damage], record
    # A record with an undoubled quote ends where its quoting says, and costs nothing more.
    for record in written.damaged("undoubled_quote"):
        (entry,) = [d for d in log.records if d["line"] == record.first_line]
        assert entry["last_line"] == record.last_line


def test_rows_read_counts_records(tmp_path):
    """A stray or an undoubled quote costs one record and is one record read; a quote never
    closed is its first line, and the lines after it are read again as records of their own."""
    quotes = {"stray_quote": 8, "undoubled_quote": 5}
    written = write_damaged_csv(tmp_path / "quotes.csv", 300, quotes)
    _, log = read(written.path)
    assert log.read == len(written.records) == 300
    assert log.kept == 300 - 13 and log.counts == {"unbalanced_quote": 13}

    written = write_damaged_csv(tmp_path / "unclosed.csv", 300, {"unclosed_quote": 3})
    _, log = read(written.path)
    inner = sum(r.last_line - r.first_line for r in written.damaged("unclosed_quote"))
    assert log.read == 300 + inner


def test_one_stray_quote_does_not_stop_the_run(tmp_path):
    """The issue's `opens a quote that is never closed ... fix the unbalanced quote` under the
    default bad_rows=drop: now one dropped record."""
    written = write_damaged_csv(tmp_path / "one.csv", 60, {"stray_quote": 1}, seed=3)
    bundle = build_data(data_cfg(train_path=str(written.path)))
    report = bundle.report["train_file"]
    assert (report["rows_read"], report["rows_kept"]) == (60, 59)
    (stray,) = written.damaged("stray_quote")
    assert report["dropped_records"][0]["line"] == stray.first_line
    assert bundle.spec.class_names == CLASSES


# --- 2. no class is invented --------------------------------------------------------------------


def test_labels_come_from_clean_rows_and_suspects_stop_the_run(tmp_path):
    written = write_damaged_csv(tmp_path / "train.csv", 400, DAMAGE, seed=5)
    with pytest.raises(Exception) as err:
        build_data(data_cfg(train_path=str(written.path)))
    message = str(err.value)
    assert type(err.value).__name__ == "CsvTextError" and "\n" not in message
    assert "suspect label(s), seen only in rows next to broken records" in message
    assert f"data.labels=[{','.join(CLASSES)}]" in message
    assert "data.max_suspect_labels=" in message
    suspects = int(message.split(": ")[1].split()[0])
    # Allowed, they are dropped with their rows; named, the classes are exactly those.
    allowed = build_data(data_cfg(train_path=str(written.path), max_suspect_labels=suspects))
    assert allowed.spec.class_names == CLASSES
    assert len(allowed.report["suspect_labels"]) == suspects
    for info in allowed.report["suspect_labels"].values():
        assert info["clean_rows"] == 0 and info["lines"]
    named = build_data(data_cfg(train_path=str(written.path), labels=list(CLASSES)))
    assert named.spec.class_names == CLASSES
    assert named.report["train_file"]["dropped"]["unlisted_label"] >= suspects


def test_a_label_in_fewer_than_min_rows_per_class_rows_is_a_suspect(tmp_path):
    rows = [*clean_rows(40, seed=1), ("a lone text about the weather", "weather")]
    path = write_clean_csv(tmp_path / "rare.csv", rows)
    with pytest.raises(Exception, match=r"1 suspect label\(s\).*'weather' \(line \d+\)"):
        build_data(data_cfg(train_path=str(path)))
    kept = build_data(data_cfg(train_path=str(path), min_rows_per_class=1))
    assert "weather" in kept.spec.class_names


def test_the_class_table_is_printed_before_training(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    written = write_damaged_csv(tmp_path / "train.csv", 200, {"stray_quote": 3})
    train_in_process(
        tmp_path / "run",
        "data=csv_text",
        f"data.train_path={written.path}",
        "model=text_bow",
        *FAST,
    )
    log = [record.getMessage() for record in caplog.records]
    table = [i for i, line in enumerate(log) if line.startswith("data: label ")]
    assert table, "no class table in the log"
    rows = log[table[0] + 1 : table[0] + 1 + len(CLASSES)]
    assert [line.split()[1] for line in rows] == list(CLASSES)
    assert all(int(line.split()[2]) > 0 for line in rows)  # train rows per class
    first_step = next(i for i, line in enumerate(log) if " step 1 " in line)
    assert table[0] < first_step


# --- 3. the validation file is read on its own -------------------------------------------------


def test_the_val_file_is_read_on_its_own(tmp_path):
    """Multi-line validation texts with lines that end like `, a` or `, optional` are never
    judged by labels the damaged training file would have invented; a label the training data
    lacks is counted as unseen_label and left out, with that said."""
    train = write_damaged_csv(tmp_path / "train.csv", 300, DAMAGE, seed=2)
    val_rows = [row for row in clean_rows(120, seed=9) if "\n" in row[0]]
    val_rows.append(("<p>a scipy sparse matrix, optional</p>", "sparse"))
    val = write_clean_csv(tmp_path / "val.csv", val_rows)
    bundle = build_data(
        data_cfg(train_path=str(train.path), val_path=str(val), labels=list(CLASSES))
    )
    report = bundle.report["val_file"]
    assert report["rows_read"] == len(val_rows)
    assert report["dropped"] == {"unseen_label": 1}
    assert len(bundle.val) == len(val_rows) - 1
    assert bundle.report["unseen_labels"] == {"sparse": 1}
    assert bundle.sources["val"][0] == "val.csv row 1"


def test_unseen_val_labels_are_said_to_be_left_out(tmp_path, caplog):
    train = write_clean_csv(tmp_path / "train.csv", clean_rows(40, seed=1))
    val = write_clean_csv(tmp_path / "val.csv", [*clean_rows(8, seed=2), ("new", "other")])
    build_data(data_cfg(train_path=str(train), val_path=str(val)))
    assert "1 row(s) have labels the training data does not have ('other' 1)" in caplog.text
    assert "left out of validation" in caplog.text


# --- 4. the report names every dropped record ---------------------------------------------------


def test_the_report_names_every_dropped_record_and_the_run_prints_the_counts(tmp_path):
    written = write_damaged_csv(tmp_path / "train.csv", 300, DAMAGE, seed=4, crlf=True)
    run_dir = tmp_path / "run"
    done = run_python(
        [sys.executable, "train.py", "data=csv_text", f"data.train_path={written.path}"]
        + ["model=text_bow", "data.max_suspect_labels=20", "trainer.max_epochs=1"]
        + [f"hydra.run.dir={run_dir}"],
        REPO_ROOT,
        {**SUBPROCESS_ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run_dir / "data_report.json").read_text())["train_file"]
    records = report["dropped_records"]
    assert len(records) == report["rows_dropped"] == sum(report["dropped"].values())
    assert report["rows_read"] == report["rows_kept"] + report["rows_dropped"]
    for record in records:
        assert record["reason"] in report["dropped"] and isinstance(record["line"], int)
        assert 0 < len(record["preview"]) <= PREVIEW_CHARS or record["reason"] == "empty_row"
    lines = written.path.read_bytes().decode().split("\r\n")
    for record in written.records:
        if record.damage:
            (entry,) = [r for r in records if r["line"] == record.first_line]
            start = lines[record.first_line - 1].replace('"', "")[:20]
            assert entry["preview"].replace('"', "").startswith(start)
    counts = ", ".join(f"{reason} {n}" for reason, n in report["dropped"].items())
    assert f"{report['rows_kept']:,} kept, {report['rows_dropped']:,} dropped ({counts})" in (
        done.stdout
    )


# --- 5. infer.py reads a CSV as training did ----------------------------------------------------


def test_infer_uses_the_training_columns_encoding_and_cleaning(tmp_path):
    train = tmp_path / "train.csv"
    with train.open("w", newline="", encoding="latin-1") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "body", "topic"])
        for i, (text, label) in enumerate(clean_rows(80, seed=1)):
            writer.writerow([i, text.replace("the", "thé"), label])
    run_dir = tmp_path / "run"
    train_in_process(
        run_dir,
        "data=csv_text",
        f"data.train_path={train}",
        "data.text_column=body",
        "data.label_column=topic",
        "data.encoding=latin-1",
        "model=text_bow",
        *FAST,
    )
    ckpt = run_dir / "checkpoints" / "best.pt"
    inputs = tmp_path / "in.csv"
    with inputs.open("w", newline="", encoding="latin-1") as f:
        writer = csv.writer(f)
        writer.writerow(["body", "note"])
        writer.writerows([["thé dataframe, then the groupby", "é"], ["<p><br></p>", ""]])
        writer.writerow(["   ", ""])
    out = tmp_path / "preds.csv"

    def infer(*args):
        infer = [sys.executable, "infer.py", f"ckpt={ckpt}", f"input={inputs}", f"output={out}"]
        return run_python([*infer, *args], REPO_ROOT, timeout=180)

    done = infer()
    assert done.returncode == 0, done.stderr[-2000:]
    preds = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert list(preds.columns[:2]) == ["index", "label"] and preds.columns[-1] == "error"
    assert preds["label"][0] in CLASSES and preds["error"][0] == ""
    assert preds["error"].tolist()[1:] == ["empty after cleaning"] * 2
    assert preds["label"].tolist()[1:] == ["", ""]  # no prediction made up for them
    assert "2 of 3 inputs were empty after cleaning" in done.stdout
    # text_column= only overrides the recorded column.
    overridden = infer("text_column=note")
    assert overridden.returncode == 0, overridden.stderr[-2000:]
    assert (
        pd.read_csv(out, keep_default_na=False)["error"].tolist()
        == [""] + ["empty after cleaning"] * 2
    )
    missing = infer("text_column=nowhere")
    assert missing.returncode == 2
    assert "no 'nowhere' column; columns present: body, note" in missing.stderr
