"""Real CSVs: every row kept or dropped for a named reason with its row and line (never
silently), bad_rows=error naming file, row, line and column, encodings, NA as text, chunked
reading, the token cache, and the data report of a training run."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli.paths import REPO_ROOT
from kiln.config import ConfigError
from kiln.data import build_data
from kiln.data import csv_text as csv_text_module
from kiln.data.bad_inputs import BadInputLog
from kiln.data.csv_reader import CsvSettings, CsvTextError, read_labelled_rows, row_log
from kiln.data.text_corpus import write_ticket_csv
from kiln.data.token_store import IdsFile

from .conftest import (
    FAST,
    SUBPROCESS_ENV,
    compose_config,
    run_python,
    train_in_process,
    train_main_here,
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def data_cfg(**overrides):
    cfg = dataclasses.replace(compose_config("data=csv_text", "model=text_bow").data, **overrides)
    cfg.check("data")
    return cfg


def write_lines(path: Path, lines: list[str], encoding: str = "utf-8") -> Path:
    path.write_bytes("\n".join(lines).encode(encoding) + b"\n")
    return path


def good_lines(count: int, start: int = 0) -> list[str]:
    """Plain `text,label` rows in two classes."""
    topics = [("the cat sat on the mat", "pets"), ("stocks fell again today", "money")]
    return [f"{topics[i % 2][0]} {i},{topics[i % 2][1]}" for i in range(start, start + count)]


def read_all(path: Path, **settings):
    settings = CsvSettings(**{"text_column": "text", "label_column": "label", **settings})
    log = row_log(str(path))
    chunks = list(read_labelled_rows(path, settings, log))
    return chunks, log


# --- nothing is dropped silently --------------------------------------------------------------


def stray_quote_file(path: Path) -> Path:
    """40 lines: a stray quote opens a field on line 5 that is never closed, and another sits
    inside an unquoted text on line 15 (literal there, as CSV says)."""
    lines = ["text,label", *good_lines(39)]
    lines[4] = '"the cat sat on the mat 3,pets'
    lines[14] = 'stocks fell "again today 13,money'
    return write_lines(path, lines)


def dropped(log: BadInputLog) -> dict[str, list[dict]]:
    """reason -> [{row, line, column}, ...] of a log's dropped records, in file order."""
    out: dict[str, list[dict]] = {}
    for record in log.to_dict()["dropped_records"]:
        where = {k: record[k] for k in ("row", "line", "column")}
        out.setdefault(record["reason"], []).append(where)
    return out


def test_a_stray_quote_costs_only_its_own_record(tmp_path):
    path = stray_quote_file(tmp_path / "stray.csv")
    chunks, log = read_all(path)
    assert log.read == 39 and log.kept == 38  # one record per line, one lost
    assert dropped(log) == {"unbalanced_quote": [{"row": 4, "line": 5, "column": "text"}]}
    kept_lines = [line for chunk in chunks for line in chunk.lines]
    assert 5 not in kept_lines and kept_lines == [n for n in range(2, 41) if n != 5]
    texts = [text for chunk in chunks for text in chunk.texts]
    assert 'stocks fell "again today 13' in texts

    with pytest.raises(CsvTextError) as err:
        read_all(path, bad_rows="error")
    message = str(err.value)
    assert message.startswith(
        f"{path}: row 4 (line 5) opens a quote in column 'text' that is never closed: the field "
        "would run past line 6, a row of its own; fix the quote"
    )


def test_legitimate_multiline_fields_are_kept_and_move_line_numbers(tmp_path):
    path = tmp_path / "multi.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerow(["first line\nsecond, with a comma\nthird", "pets"])  # lines 2-4
        writer.writerow(["next", "money"])  # line 5
    chunks, log = read_all(path)
    assert log.kept == 2 and log.counts == {}
    assert chunks[0].lines == [2, 5] and chunks[0].rows == [1, 2]
    # A generated corpus of multi-line tickets (HTML, commas) has no false alarm either.
    tickets = write_ticket_csv(tmp_path / "tickets.csv", 300)
    _, ticket_log = read_all(tickets)
    assert (ticket_log.read, ticket_log.kept) == (300, 300)


def test_every_kind_of_bad_row_is_counted_with_row_line_and_column(tmp_path):
    lines = [
        "text,label",
        "a,b,c,d",  # row 1, line 2: one field too many (pandas would silently index it)
        *good_lines(3),  # rows 2-4
        ",pets",  # row 5: missing text
        "a text,",  # row 6: missing label
        "",  # row 7: blank line
        "<p><br></p>,money",  # row 8: nothing left after cleaning
        "x,y,z,w,v,u,t,s,r",  # row 9: far too many fields
        *good_lines(2, start=3),  # rows 10-11
    ]
    chunks, log = read_all(write_lines(tmp_path / "bad.csv", lines), chunk_rows=3)
    assert (log.read, log.kept, log.num_dropped) == (11, 5, 6)
    first = {reason: rows[0] for reason, rows in dropped(log).items()}
    assert first == {
        "wrong_field_count": {"row": 1, "line": 2, "column": None},
        "missing_text": {"row": 5, "line": 6, "column": "text"},
        "missing_label": {"row": 6, "line": 7, "column": "label"},
        "empty_row": {"row": 7, "line": 8, "column": None},
        "empty_after_cleaning": {"row": 8, "line": 9, "column": "text"},
    }
    assert log.counts["wrong_field_count"] == 2
    assert dropped(log)["wrong_field_count"][1] == {"row": 9, "line": 10, "column": None}
    assert [line for chunk in chunks for line in chunk.lines] == [3, 4, 5, 11, 12]
    assert all(len(chunk.texts) <= 3 for chunk in chunks)  # read chunk by chunk


def test_na_none_and_null_are_text_unless_na_values_says_so(tmp_path):
    lines = ["text,label", "NA,None", "null,NA", "None,null", "nan,N/A", "hello,NA"]
    path = write_lines(tmp_path / "na.csv", lines)
    chunks, log = read_all(path)
    assert log.kept == 5
    assert chunks[0].texts == ["na", "null", "none", "nan", "hello"]  # cleaned: lower-cased
    assert chunks[0].labels == ["None", "NA", "null", "N/A", "NA"]
    _, log = read_all(path, na_values=frozenset({"NA"}))
    assert log.counts == {"missing_text": 1, "missing_label": 2}


def test_an_undecodable_byte_is_named_by_row_and_line(tmp_path):
    lines = ["text,label", *good_lines(2), "caf\xe9 au lait,money", *good_lines(2)]
    path = write_lines(tmp_path / "latin1.csv", lines, encoding="latin-1")
    with pytest.raises(CsvTextError) as err:
        read_all(path, bad_rows="error")
    assert str(err.value).startswith(
        f"{path}: row 3 (line 4) has bytes that are not valid utf-8 in column 'text'; "
        "set data.encoding"
    )
    _, log = read_all(path)
    assert log.counts == {"undecodable": 1} and log.kept == 4
    chunks, log = read_all(path, encoding="latin-1")
    assert log.kept == 5 and "café au lait" in chunks[0].texts


def test_a_quote_open_at_the_end_of_the_file_drops_its_record_only(tmp_path):
    lines = ["text,label", *good_lines(3), '"never closed,pets', *good_lines(2, start=3)]
    path = write_lines(tmp_path / "open.csv", [*lines, '"still open at the end, money'])
    chunks, log = read_all(path)  # bad_rows=drop, the default: the run goes on
    assert (log.read, log.kept) == (7, 5)
    assert [r["line"] for r in log.to_dict()["dropped_records"]] == [5, 8]
    assert [line for chunk in chunks for line in chunk.lines] == [2, 3, 4, 6, 7]
    with pytest.raises(CsvTextError, match=r"open\.csv: row 4 \(line 5\) opens a quote in column"):
        read_all(path, bad_rows="error")


def test_the_config_refuses_an_unknown_encoding():
    with pytest.raises(ConfigError, match=r"\(data.encoding\): unknown encoding 'utf-9'"):
        compose_config("data=csv_text", "model=text_bow", "data.encoding=utf-9")
    with pytest.raises(ConfigError, match=r"data.chunk_rows"):
        compose_config("data=csv_text", "model=text_bow", "data.chunk_rows=0")


# --- the token cache --------------------------------------------------------------------------


def test_chunk_size_does_not_change_the_result(tmp_path):
    path = write_ticket_csv(tmp_path / "t.csv", 120)
    one = build_data(data_cfg(train_path=str(path), cache_dir=str(tmp_path / "a")))
    many = build_data(data_cfg(train_path=str(path), cache_dir=str(tmp_path / "b"), chunk_rows=7))
    assert one.recipe == many.recipe
    for a, b in ((one.train, many.train), (one.val, many.val)):
        assert [a[i][0].tolist() for i in range(len(a))] == [
            b[i][0].tolist() for i in range(len(b))
        ]
        assert a.labels.tolist() == b.labels.tolist()


def test_the_tokenizer_learns_from_a_seeded_sample_of_the_training_rows(tmp_path):
    path = write_ticket_csv(tmp_path / "t.csv", 200)

    def build(cache: str, **overrides):
        return build_data(
            data_cfg(train_path=str(path), cache_dir=str(tmp_path / cache), **overrides)
        )

    sampled, again, full = build("a", tokenizer_rows=20), build("b", tokenizer_rows=20), build("c")
    assert sampled.recipe == again.recipe  # the same sample every time
    assert sampled.spec.vocab_size < full.spec.vocab_size  # learned from 20 rows, not 160
    assert len(sampled.train) == len(full.train) == 160  # and every row is still encoded
    assert sampled.report["cache"]["dir"] != full.report["cache"]["dir"]


def test_min_token_count_leaves_rare_words_out_and_keys_the_cache(tmp_path):
    path = write_ticket_csv(tmp_path / "t.csv", 200)
    built = {
        m: build_data(
            data_cfg(train_path=str(path), cache_dir=str(tmp_path / f"c{m}"), min_token_count=m)
        )
        for m in (1, 2, 5)
    }
    sizes = [built[m].spec.vocab_size for m in (1, 2, 5)]
    assert sizes[0] > sizes[1] > sizes[2]  # each floor leaves rarer words out
    assert len({b.report["cache"]["dir"] for b in built.values()}) == 3
    assert all(len(b.train) == 160 for b in built.values())  # every row still encoded


def test_a_second_run_loads_the_cache_without_reading_the_csv(tmp_path, monkeypatch):
    path = write_ticket_csv(tmp_path / "t.csv", 100)
    cfg = data_cfg(train_path=str(path), cache_dir=str(tmp_path / "cache"))
    first = build_data(cfg)
    assert first.report["cache"]["hit"] is False
    entry = Path(first.report["cache"]["dir"])
    assert (entry / "ids.int32").is_file() and not (entry / "texts.utf8").exists()
    assert isinstance(first.train.store.ids, IdsFile)  # read where it lies, not mapped

    def no_reading(*args, **kwargs):
        raise AssertionError("the CSV was read again")

    monkeypatch.setattr(csv_text_module, "read_rows", no_reading)
    second = build_data(cfg)
    assert second.report["cache"] == {"dir": str(entry), "hit": True}
    assert second.recipe == first.recipe
    assert [second.train[i][0].tolist() for i in range(5)] == [
        first.train[i][0].tolist() for i in range(5)
    ]
    # Another cleaning setting, or other file contents, is another entry (read afresh).
    monkeypatch.undo()
    other = build_data(dataclasses.replace(cfg, lowercase=False))
    assert other.report["cache"]["hit"] is False and other.report["cache"]["dir"] != str(entry)
    with path.open("a") as f:
        f.write("one more row,api\n")
    changed = build_data(cfg)
    assert changed.report["cache"]["hit"] is False
    assert changed.report["train_file"]["rows_read"] == 101


def test_the_store_reopens_its_memory_map_when_pickled(tmp_path):
    import pickle

    path = write_ticket_csv(tmp_path / "t.csv", 60)
    bundle = build_data(data_cfg(train_path=str(path), cache_dir=str(tmp_path / "cache")))
    blob = pickle.dumps(bundle.train)  # what a DataLoader worker receives
    assert len(blob) < 10_000  # the ids stay on disk, not in the pickle
    again = pickle.loads(blob)
    assert again[3][0].tolist() == bundle.train[3][0].tolist()


# --- a training run on a CSV with bad rows ---------------------------------------------------


def csv_with_bad_rows(path: Path) -> Path:
    """A few hundred good tickets with a blank text, a missing label and an HTML-only text."""
    write_ticket_csv(path, 300)
    with path.open("a", newline="") as f:
        writer = csv.writer(f)
        writer.writerows([["", "api"], ["a ticket without a label", ""], ["<br><br>", "build"]])
    return path


def test_training_on_a_csv_with_bad_rows_writes_a_correct_data_report(tmp_path, caplog):
    path = csv_with_bad_rows(tmp_path / "tickets.csv")
    run_dir = tmp_path / "run"
    summary = train_in_process(
        run_dir,
        "data=csv_text",
        f"data.train_path={path}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model=text_bow",
        *FAST,
    )
    assert summary["status"] == "ok"
    report = json.loads((run_dir / "data_report.json").read_text())
    train_file = report["train_file"]
    assert (train_file["rows_read"], train_file["rows_kept"], train_file["rows_dropped"]) == (
        303,
        300,
        3,
    )
    # Data row n sits on line n + 1 plus the extra lines of the multi-line tickets above it.
    assert train_file["dropped"] == {
        "missing_text": 1,
        "missing_label": 1,
        "empty_after_cleaning": 1,
    }
    records = train_file["dropped_records"]
    assert [(r["row"], r["reason"]) for r in records] == [
        (301, "missing_text"),
        (302, "missing_label"),
        (303, "empty_after_cleaning"),
    ]
    total_lines = len(path.read_text().splitlines())
    assert records[-1]["line"] == total_lines and records[-1]["preview"] == "<br><br>,build"
    assert report["rows"]["train"] + report["rows"]["val"] == 300
    assert "300 kept, 3 dropped (missing_text 1, missing_label 1" in caplog.text


def test_bad_rows_error_is_one_line_from_the_command_line(tmp_path, capfd):
    path = stray_quote_file(tmp_path / "stray.csv")
    code, stderr = train_main_here(
        capfd,
        f"hydra.run.dir={tmp_path / 'run'}",
        "data=csv_text",
        f"data.train_path={path}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.bad_rows=error",
        "model=text_bow",
    )
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr
    assert lines[0].startswith(f"error: {path}: row 4 (line 5) opens a quote in column 'text'")


def test_the_readme_command_trains_on_the_shipped_sample(tmp_path):
    """`python train.py data=csv_text data.train_path=examples/reviews.csv model=text_bow`, as
    typed in the repo root (one epoch, to keep it short); its two bad rows are reported."""
    run_dir = tmp_path / "run"
    done = run_python(
        [sys.executable, "train.py", "data=csv_text", "data.train_path=examples/reviews.csv"]
        + ["model=text_bow", "trainer.max_epochs=1", f"hydra.run.dir={run_dir}"],
        REPO_ROOT,
        {**SUBPROCESS_ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")},
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((run_dir / "data_report.json").read_text())["train_file"]
    assert (report["rows_read"], report["rows_kept"]) == (300, 298)
    first = report["dropped_records"][0]
    assert {k: first[k] for k in ("reason", "row", "line", "column")} == {
        "reason": "missing_text",
        "row": 43,
        "line": 51,
        "column": "text",
    }
    assert report["dropped"]["missing_label"] == 1
    assert (
        "298 kept, 2 dropped (missing_text 1, missing_label 1"
        in (run_dir / "train.log").read_text()
    )


READ_EVERY_BATCH = """
import json, os, resource, sys
from kiln.config import load_config
from kiln.data import build_data

def resident_mb():
    with open("/proc/self/status") as status:
        return int(next(l for l in status if l.startswith("VmRSS:")).split()[1]) / 1024

train = build_data(load_config(sys.argv[1:]).data).train
train.__getitems__(list(range(8)))  # the first batch: any lazily loaded code is in
before = peak = resident_mb()
for start in range(0, len(train), 256):
    train.__getitems__(list(range(start, min(start + 256, len(train)))))
    peak = max(peak, resident_mb())
print(json.dumps({"growth_mb": peak - before, "ids_mb": os.path.getsize(
    os.path.join(train.store.directory, "ids.int32")) / 2**20}))
"""


def test_reading_every_batch_of_a_token_store_does_not_grow_resident_memory(tmp_path):
    """A run's resident memory grew by the token store as it read it (a memory map keeps every
    page it touched): text_bow's spelled store of a 1.5 GB CSV (9.8 GB) took a run past 6 GB.
    Read row by row (IdsFile), a fresh process reading every training batch of a 12 MB CSV's
    store stays flat; mapped, it grew by the ~8 MB of training ids."""
    path = write_ticket_csv(tmp_path / "t.csv", 45_000, seed=1)
    assert path.stat().st_size > 10 * 2**20
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            READ_EVERY_BATCH,
            "data=csv_text",
            "model=text_bow",
            "model.char_ngrams=[]",
            f"data.train_path={path}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["ids_mb"] > 8
    assert measured["growth_mb"] < measured["ids_mb"] / 4, measured
