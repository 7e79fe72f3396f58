"""The CSV reader bounds a record's size (data.max_field_bytes): a 110 MB field is a bad row
named in the report, passed over in pieces (memory stays near one piece), and every other row
is kept; a UTF-16 file read as UTF-8 is named as such, with the setting that fixes it."""

from __future__ import annotations

import tracemalloc

import pytest

from kiln.data.csv_reader import CsvSettings, CsvTextError, read_labelled_rows, row_log

MIB = 1 << 20


def write_csv_with_a_huge_field(path, megabytes: int = 110) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write("text,label\n")
        f.write("a good text,pos\n")
        f.write('"the start of a huge one ')
        piece = "word " * (MIB // 5)
        for _ in range(megabytes):
            f.write(piece)
        f.write('",neg\n')
        f.write("another good text,neg\n")
        f.write("more,pos\n")


def read_all(path, **options):
    settings = CsvSettings("text", "label", **options)
    log = row_log(str(path))
    chunks = list(read_labelled_rows(path, settings, log))
    texts = [t for c in chunks for t in c.texts]
    return texts, [r for c in chunks for r in c.rows], log


def test_a_110_mb_field_is_a_bad_row_read_in_pieces(tmp_path):
    path = tmp_path / "huge.csv"
    write_csv_with_a_huge_field(path)
    assert path.stat().st_size > 110 * 1_000_000
    tracemalloc.start()
    try:
        texts, rows, log = read_all(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 * MIB, f"peak {peak / MIB:.0f} MiB while reading"  # ~1 MiB pieces
    assert texts == ["a good text", "another good text", "more"] and rows == [1, 3, 4]
    report = log.to_dict()
    assert report["dropped"] == {"field_too_large": 1}
    (record,) = report["dropped_records"]
    assert (record["row"], record["line"], record["reason"]) == (2, 3, "field_too_large")
    assert record["preview"].startswith('"the start of a huge one')


def test_the_limit_holds_for_a_quoted_field_over_many_lines_and_in_error_mode(tmp_path):
    path = tmp_path / "lines.csv"
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write("text,label\nfirst,pos\n")
        f.write('"' + ("x" * 999 + "\n") * 3000 + '",neg\n')  # 3 MB over 3000 lines
        f.write("last,neg\n")
    texts, _, log = read_all(path, max_field_lines=10**6)
    assert texts == ["first", "last"] and log.counts == {"field_too_large": 1}
    assert read_all(path, max_field_lines=10**6, max_field_bytes=4 * MIB)[2].counts == {}
    with pytest.raises(CsvTextError, match=r"row 2 \(line 3\) is longer than data.max_field_"):
        read_all(path, max_field_lines=10**6, bad_rows="error")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le"])
def test_a_utf16_file_read_as_utf8_is_named_with_the_fix(tmp_path, encoding):
    path = tmp_path / "wide.csv"
    path.write_text("text,label\nhello,pos\nbye,neg\n", encoding=encoding)
    with pytest.raises(
        CsvTextError,
        match=r"is UTF-16 .* read as utf-8 \(data.encoding\): "
        r"set data.encoding=utf-16",
    ):
        read_all(path)
    if encoding == "utf-16":  # with its byte-order mark: utf-16 reads it
        texts, _, _ = read_all(path, encoding="utf-16")
        assert texts == ["hello", "bye"]


def test_a_fifo_named_like_a_csv_is_refused_without_opening_it(tmp_path):
    import os

    from kiln.inference.labelled import LabelledDataError, read_labelled_csv

    fifo = tmp_path / "train.csv"
    os.mkfifo(fifo)
    with pytest.raises(CsvTextError, match=r"train.csv: a FIFO \(named pipe\), not a regular"):
        read_all(fifo)  # would block forever if opened
    with pytest.raises(LabelledDataError, match="not a regular file"):
        read_labelled_csv(fifo, ["a", "b"], text_column="text", label_column="label")
