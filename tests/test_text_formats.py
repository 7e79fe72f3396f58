"""Text from Parquet, JSON Lines and Hugging Face `datasets` folders (kiln.data.text_formats):
each file written by its own library (pyarrow's Parquet and IPC writers, pandas' JSON Lines),
read into the same rows, cleaning and bad-record report as a CSV.

`datasets` is not installed here: its save_to_disk folder is written with pyarrow exactly as
`datasets` lays it out (data-00000-of-00001.arrow as an Arrow IPC stream with the features in
the schema's b"huggingface" metadata, dataset_info.json, state.json naming the data files)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data import build_data
from kiln.data.csv_reader import CsvSettings, CsvTextError, row_log
from kiln.data.text_formats import read_rows, resolve_format, source_files

from .conftest import FAST, compose_config, train_in_process, train_main_here

NAMES = ["money", "pets"]  # a ClassLabel's names: label 0 is "money"
FEATURES = {
    "text": {"dtype": "string", "_type": "Value"},
    "label": {"names": NAMES, "_type": "ClassLabel"},
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def texts_and_labels(count: int, start: int = 0) -> tuple[list, list]:
    """Two learnable classes as a ClassLabel column holds them (ints)."""
    texts = [
        f"the cat sat on the mat {i}" if i % 2 else f"stocks fell again today {i}"
        for i in range(start, start + count)
    ]
    return texts, [i % 2 for i in range(start, start + count)]


def hf_table(texts, labels) -> pa.Table:
    """A table as `datasets` writes it: its features in the schema's b"huggingface" metadata."""
    meta = {b"huggingface": json.dumps({"info": {"features": FEATURES}}).encode()}
    return pa.table({"text": texts, "label": labels}).replace_schema_metadata(meta)


def settings(**overrides) -> CsvSettings:
    return CsvSettings(**{"text_column": "text", "label_column": "label", **overrides})


def read(path, fmt, **overrides):
    log = row_log(str(path))
    chunks = list(read_rows(path, settings(**overrides), log, fmt))
    rows = [(r, t, y) for c in chunks for r, t, y in zip(c.rows, c.texts, c.labels, strict=True)]
    return rows, log.to_dict()


def data_cfg(**overrides):
    cfg = compose_config("data=csv_text", "model=text_bow").data
    cfg = dataclasses.replace(cfg, **overrides)
    cfg.check("data")
    return cfg


def save_to_disk(folder: Path, table: pa.Table, batch_rows: int = 1000) -> Path:
    """A `datasets` Dataset.save_to_disk folder, written with pyarrow as `datasets` writes it."""
    folder.mkdir(parents=True)
    name = "data-00000-of-00001.arrow"
    with (
        pa.OSFile(str(folder / name), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    info = {"citation": "", "description": "", "features": FEATURES, "homepage": ""}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    state = {
        "_data_files": [{"filename": name}],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (folder / "state.json").write_text(json.dumps(state))
    return folder


# --- each format, written by its own library --------------------------------------------------


def test_parquet_reads_class_label_names_and_reports_bad_rows_by_file_and_row(tmp_path):
    texts, labels = texts_and_labels(30)
    texts[3], labels[5] = None, -1  # a null text; the hub's "no label"
    texts[7] = "<p></p>"  # nothing left after cleaning
    texts[9] = "x" * 5000  # past data.max_field_bytes below
    path = tmp_path / "train.parquet"
    pq.write_table(hf_table(texts, labels), path, row_group_size=8)
    rows, report = read(path, "parquet", chunk_rows=7, max_field_bytes=4096)
    assert [r for r, _, _ in rows] == [r for r in range(1, 31) if r not in (4, 6, 8, 10)]
    assert {label for _, _, label in rows} == set(NAMES)  # ClassLabel ints read as names
    assert rows[0] == (1, "stocks fell again today 0", "money")
    assert report["rows_read"] == 30 and report["rows_kept"] == 26
    dropped = [(r["row"], r["reason"], r["column"], r["file"]) for r in report["dropped_records"]]
    assert dropped == [
        (4, "missing_text", "text", "train.parquet"),
        (6, "missing_label", "label", "train.parquet"),
        (8, "empty_after_cleaning", "text", "train.parquet"),
        (10, "field_too_large", "text", "train.parquet"),
    ]
    assert all("line" not in r for r in report["dropped_records"])  # Parquet has no lines


def test_a_row_group_past_max_block_bytes_is_never_read(tmp_path):
    """The row group's size comes from the footer; its pages are not touched: here they are
    overwritten with garbage, and reading still succeeds, the group's rows reported."""
    small_texts, small_labels = texts_and_labels(10)
    big_texts = [f"{'word ' * 500} {i}" for i in range(500)]  # ~1.25 MB of text
    table = pa.concat_tables(
        [
            hf_table(small_texts, small_labels),
            hf_table(big_texts, [i % 2 for i in range(500)]),
            hf_table(*texts_and_labels(10, start=10)),
        ]
    )
    path = tmp_path / "big.parquet"
    # three row groups: 10 rows, the 500 large ones, 10 rows
    with pq.ParquetWriter(path, table.schema, compression="none") as writer:
        writer.write_table(table.slice(0, 10))
        writer.write_table(table.slice(10, 500), row_group_size=500)
        writer.write_table(table.slice(510, 10))
    meta = pq.ParquetFile(path).metadata.row_group(1)
    assert meta.total_byte_size > 2**20
    chunks = [meta.column(j) for j in range(meta.num_columns)]
    starts = [c.dictionary_page_offset or c.data_page_offset for c in chunks]
    start = min(starts)
    end = max(s + c.total_compressed_size for s, c in zip(starts, chunks, strict=True))
    data = bytearray(path.read_bytes())
    data[start:end] = b"\xff" * (end - start)  # the group's pages: garbage
    path.write_bytes(bytes(data))
    rows, report = read(path, "parquet", max_block_bytes=2**20)
    assert [r for r, _, _ in rows] == [*range(1, 11), *range(511, 521)]
    assert report["dropped"] == {"block_too_large": 500}
    (record,) = report["dropped_records"]
    assert (record["row"], record["last_row"], record["file"]) == (11, 510, "big.parquet")
    with pytest.raises(CsvTextError, match=r"big.parquet: row 11 is in a row group of 500 rows"):
        read(path, "parquet", max_block_bytes=2**20, bad_rows="error")


def test_json_lines_from_pandas_with_every_kind_of_bad_line(tmp_path):
    import pandas as pd

    texts, labels = texts_and_labels(12)
    frame = pd.DataFrame({"text": texts, "label": [NAMES[y] for y in labels], "id": range(12)})
    path = tmp_path / "train.jsonl"
    frame.to_json(path, orient="records", lines=True, force_ascii=False)
    lines = path.read_text().splitlines()
    lines[2] = '{"text": "cut off here'  # not JSON
    lines[4] = '["a list", "money"]'  # not an object
    lines[6] = ""  # a blank line
    lines[8] = json.dumps({"text": "a" * 5000, "label": "pets"})  # too long
    lines[10] = json.dumps({"text": {"nested": 1}, "label": "pets"})  # not a text
    path.write_text("\n".join(lines) + "\n")
    rows, report = read(path, "jsonl", max_field_bytes=4096)
    assert [r for r, _, _ in rows] == [1, 2, 4, 6, 8, 10, 12]
    assert rows[0] == (1, "stocks fell again today 0", "money")
    dropped = [(r["line"], r["reason"]) for r in report["dropped_records"]]
    assert dropped == [
        (3, "not_json"),
        (5, "wrong_type"),
        (7, "empty_row"),
        (9, "field_too_large"),
        (11, "wrong_type"),
    ]


def test_a_json_array_and_a_missing_column_are_one_line_each(tmp_path):
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": "a", "label": "b"}]))
    with pytest.raises(CsvTextError, match="a JSON array, not JSON Lines"):
        read(array, "jsonl")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"sentence": "a", "label": "b"}) + "\n")
    with pytest.raises(CsvTextError, match="missing column 'text'; columns present: 'sentence'"):
        read(other, "jsonl")


def test_a_datasets_folder_is_read_batch_by_batch_with_its_class_names(tmp_path):
    texts, labels = texts_and_labels(25)
    texts[4] = None
    folder = save_to_disk(tmp_path / "train", hf_table(texts, labels), batch_rows=10)
    assert resolve_format(folder, "auto") == "datasets"
    rows, report = read(folder, "datasets")
    assert len(rows) == 24 and rows[0] == (1, "stocks fell again today 0", "money")
    assert [(r["row"], r["reason"]) for r in report["dropped_records"]] == [(5, "missing_text")]
    # a batch past max_block_bytes: its rows, unread
    big = hf_table([f"{'word ' * 500}{i}" for i in range(500)], [i % 2 for i in range(500)])
    both = pa.concat_tables([hf_table(texts, labels), big])
    folder = save_to_disk(tmp_path / "big", both, batch_rows=500)
    rows, report = read(folder, "datasets", max_block_bytes=2**20)
    assert report["dropped"] == {"missing_text": 1, "block_too_large": 500}


def test_a_dataset_dict_folder_names_its_splits(tmp_path):
    texts, labels = texts_and_labels(10)
    save_to_disk(tmp_path / "emotion" / "train", hf_table(texts, labels))
    save_to_disk(tmp_path / "emotion" / "test", hf_table(texts, labels))
    splits = json.dumps({"splits": ["train", "test"]})
    (tmp_path / "emotion" / "dataset_dict.json").write_text(splits)
    with pytest.raises(CsvTextError, match=r"a DatasetDict folder \(splits: train, test\)"):
        source_files(tmp_path / "emotion", resolve_format(tmp_path / "emotion", "auto"))


def test_hub_cache_shards_are_read_by_glob_and_a_mixed_folder_is_refused(tmp_path):
    """The hub cache's parquet layout: <snapshot>/data/<split>-0000N-of-0000M.parquet."""
    data = tmp_path / "snapshots" / "abc123" / "data"
    data.mkdir(parents=True)
    pq.write_table(hf_table(*texts_and_labels(10)), data / "train-00000-of-00002.parquet")
    pq.write_table(hf_table(*texts_and_labels(10, 10)), data / "train-00001-of-00002.parquet")
    pq.write_table(hf_table(*texts_and_labels(6, 20)), data / "test-00000-of-00001.parquet")
    with pytest.raises(CsvTextError, match=r"holds the shards of 2 splits \(test, train\)"):
        source_files(data, resolve_format(data, "auto"))
    pattern = str(data / "train-*.parquet")
    assert resolve_format(pattern, "auto") == "parquet"
    rows, _ = read(pattern, "parquet")
    assert [r for r, _, _ in rows] == list(range(1, 21))  # numbered across the shards


def test_auto_picks_the_format_by_suffix_folder_and_magic_bytes(tmp_path):
    parquet_named_csv = tmp_path / "export.csv"
    pq.write_table(hf_table(*texts_and_labels(4)), parquet_named_csv)
    assert resolve_format(parquet_named_csv, "auto") == "parquet"
    (tmp_path / "a.ndjson").write_text("{}\n")
    assert resolve_format(tmp_path / "a.ndjson", "auto") == "jsonl"
    assert resolve_format(tmp_path / "a.ndjson", "csv") == "csv"  # data.format overrides
    (tmp_path / "plain.csv").write_text("text,label\n")
    assert resolve_format(tmp_path / "plain.csv", "auto") == "csv"


# --- through the dataset and train.py ---------------------------------------------------------


def test_the_token_store_of_parquet_is_the_store_of_the_same_rows_as_csv(tmp_path):
    """Same rows, same cleaning: the same ids and labels, whichever format holds them."""
    import pandas as pd

    texts, labels = texts_and_labels(60)
    frame = pd.DataFrame({"text": texts, "label": [NAMES[y] for y in labels]})
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_parquet(tmp_path / "t.parquet")
    frame.to_json(tmp_path / "t.jsonl", orient="records", lines=True)
    save_to_disk(tmp_path / "t_ds", hf_table(texts, labels))
    built = {}
    for name in ("t.csv", "t.parquet", "t.jsonl", "t_ds"):
        bundle = build_data(data_cfg(train_path=str(tmp_path / name)))
        ids, targets = bundle.collate_fn([bundle.train[i] for i in range(len(bundle.train))])
        built[name] = (bundle.spec.class_names, ids.tolist(), targets.tolist())
    assert built["t.parquet"] == built["t.csv"] == built["t.jsonl"] == built["t_ds"]


def test_train_py_on_parquet_writes_the_data_report_and_a_bad_row_error_is_one_line(
    tmp_path, capfd
):
    texts, labels = texts_and_labels(80)
    texts[10] = None
    path = tmp_path / "train.parquet"
    pq.write_table(hf_table(texts, labels), path)
    summary = train_in_process(
        tmp_path / "run", "data=csv_text", f"data.train_path={path}", "model=text_bow", *FAST
    )
    assert summary["status"] == "ok"
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["classes"] == NAMES
    assert report["train_file"]["dropped_records"][0]["row"] == 11
    code, stderr = train_main_here(
        capfd,
        *("data=csv_text", f"data.train_path={path}", "model=text_bow", "data.bad_rows=error"),
        *(f"hydra.run.dir={tmp_path / 'run2'}", *FAST),
    )
    assert code == 2
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {path}: row 11 has an empty text in column 'text' (data.bad_rows=drop skips "
        "such rows, listing them in data_report.json)"
    ]


def test_evaluate_reads_parquet_and_json_lines_as_training_does(tmp_path):
    import pandas as pd

    from kiln.data.text_corpus import demo_corpus
    from kiln.inference.evaluate import evaluate_checkpoint

    train_in_process(tmp_path / "run", "data=csv_text", "model=text_bow", *FAST)
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    texts, labels = demo_corpus()
    frame = pd.DataFrame({"text": texts[:30], "label": labels[:30]})
    frame.loc[4, "label"] = None  # no label: left out, counted
    frame.to_parquet(tmp_path / "eval.parquet")
    frame.to_json(tmp_path / "eval.jsonl", orient="records", lines=True)
    for name in ("eval.parquet", "eval.jsonl"):
        report = evaluate_checkpoint(best, data=tmp_path / name, output=tmp_path / f"out-{name}")
        metrics = report.metrics
        assert metrics["count"] == 29 and metrics["data"]["layout"] == name.split(".")[1]
        assert metrics["data"]["dropped"] == {"missing_label": 1}
        assert metrics["baseline"]["eval_rows"] == 29
