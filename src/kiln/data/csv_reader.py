"""Reading a labelled CSV in chunks (pandas `chunksize`), so the raw text is never all in memory,
and accounting for every row: each is kept or dropped for a named reason, with its row and its
physical line number, never silently.

Rows are numbered from 1 after the header (row 1 is the first data row); lines are the file's
physical lines (the header is line 1), so a quoted field that spans lines moves every later row's
line. What counts as a bad row (`BAD_ROW_REASONS`):

- wrong_field_count: more fields than the header (an unquoted delimiter inside a text);
- empty_row: no text and no label (a blank line, or a row of empty fields);
- undecodable: bytes that are not valid in data.encoding;
- merged_rows: a quoted field swallowed line breaks and what look like whole rows (lines ending
  in `<delimiter><a label of this file>`): an unbalanced quote merged them;
- missing_text / missing_label: empty, only spaces, or one of data.na_values;
- unseen_label: a validation row whose label the training data does not have;
- empty_after_cleaning: a text that clean_text reduces to nothing (only tags or spaces).

With bad_rows=drop they are counted (`BadRowLog`, written to data_report.json); with
bad_rows=error the first one stops the run, naming the file, row, line and column."""

from __future__ import annotations

import csv
import itertools
import re
import warnings
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kiln.errors import UserError
from kiln.preprocessing.cleaning import TextCleaning, clean_text

BAD_ROW_REASONS = (
    "wrong_field_count",
    "empty_row",
    "undecodable",
    "merged_rows",
    "missing_text",
    "missing_label",
    "unseen_label",
    "empty_after_cleaning",
)
FIRST_ROWS_KEPT = 10  # the report lists this many rows per reason, then a count
EXTRA_FIELDS = 4  # room for fields beyond the header's, so such rows are seen with their line
DELIMITER = ","

_SURROGATE = re.compile("[\udc80-\udcff]")  # undecodable bytes, as surrogateescape maps them
_SKIPPED = re.compile(r"Skipping line (\d+): expected \d+ fields, saw (\d+)")
QUOTE_HINT = '(an unquoted delimiter inside a text? quote such a field: "a, b")'


class CsvTextError(UserError, ValueError):
    """A problem with a user's CSV; the message names the file, the row and the column."""


@dataclass(frozen=True)
class CsvSettings:
    text_column: str
    label_column: str
    encoding: str = "utf-8"
    na_values: frozenset[str] = frozenset()  # spellings that mean "missing"; none by default
    bad_rows: str = "drop"  # drop | error
    chunk_rows: int = 100_000
    cleaning: TextCleaning = TextCleaning()


@dataclass
class RowChunk:
    """The kept rows of one chunk: cleaned texts, stripped labels, row and line numbers."""

    texts: list[str]
    labels: list[str]
    rows: list[int]
    lines: list[int]


@dataclass
class BadRow:
    reason: str
    row: int
    line: int
    column: str | None
    what: str  # the sentence an error message uses: "has an empty text in column 'text'"
    last_line: int | None = None  # merged rows: where the swallowing field ends


@dataclass
class BadRowLog:
    """Per file: rows read and kept, and per reason a count and the first rows."""

    path: str
    rows_read: int = 0
    rows_kept: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, list[dict]] = field(default_factory=dict)

    def add(self, bad: BadRow) -> None:
        self.counts[bad.reason] = self.counts.get(bad.reason, 0) + 1
        shown = self.first.setdefault(bad.reason, [])
        if len(shown) < FIRST_ROWS_KEPT:
            where = {"row": bad.row, "line": bad.line, "column": bad.column}
            if bad.last_line is not None:
                where["last_line"] = bad.last_line
            shown.append(where)

    @property
    def rows_dropped(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "rows_read": self.rows_read,
            "rows_kept": self.rows_kept,
            "rows_dropped": self.rows_dropped,
            "dropped": {
                reason: {"count": self.counts[reason], "first": self.first[reason]}
                for reason in BAD_ROW_REASONS
                if reason in self.counts
            },
        }

    def summary(self) -> str:
        """One line for the log: totals and the count per reason."""
        reasons = ", ".join(f"{r} {self.counts[r]}" for r in BAD_ROW_REASONS if r in self.counts)
        dropped = f"{self.rows_dropped} dropped" + (f" ({reasons})" if reasons else "")
        return f"{self.path}: {self.rows_read} rows read, {self.rows_kept} kept, {dropped}"


# ---------------------------------------------------------------------------------------------
# The header


def read_header(path: Path, settings: CsvSettings) -> list[str]:
    """The column names; CsvTextError if the file is missing, empty or lacks a column."""
    if not path.is_file():
        raise CsvTextError(f"{path}: no such file (set data.train_path / data.val_path)")
    try:
        header = pd.read_csv(
            path, nrows=0, encoding=settings.encoding, encoding_errors="surrogateescape"
        )
    except pd.errors.EmptyDataError:
        raise CsvTextError(f"{path}: the file is empty; expected a header row") from None
    except LookupError:
        raise CsvTextError(
            f"{path}: unknown encoding {settings.encoding!r} (data.encoding); "
            "use a Python codec name such as utf-8, latin-1 or cp1252"
        ) from None
    columns = [str(c) for c in header.columns]
    missing = [c for c in (settings.text_column, settings.label_column) if c not in columns]
    if missing:
        raise CsvTextError(
            f"{path}: missing column {', '.join(map(repr, missing))}; columns present: "
            f"{', '.join(map(repr, columns))} (set data.text_column / data.label_column)"
        )
    return columns


# ---------------------------------------------------------------------------------------------
# Row by row


class _Checker:
    """Decides, row by row, whether a row is kept; knows the labels seen so far (to recognise a
    swallowed row) and, for a validation file, the training classes."""

    def __init__(self, settings: CsvSettings, label_last: bool, classes: Collection[str] | None):
        self.settings = settings
        self.label_last = label_last
        self.classes = None if classes is None else frozenset(classes)
        self.labels_seen: set[str] = set(classes or ())

    def missing(self, value: str) -> bool:
        value = value.strip()
        return not value or value in self.settings.na_values

    def swallowed_rows(self, value: str) -> tuple[int, str] | None:
        """(how many, an example) of the lines inside a multi-line field that look like whole
        rows: ending in `,<label>` (label column last) or starting with `<label>,` (first)."""
        lines = value.split("\n")
        if self.label_last:
            candidates = [ln.rstrip("\r").rpartition(DELIMITER) for ln in lines[:-1]]
            hits = [f"{DELIMITER}{tail}" for _, sep, tail in candidates
                    if sep and tail in self.labels_seen]  # fmt: skip
        else:
            candidates = [ln.partition(DELIMITER) for ln in lines[1:]]
            hits = [f"{head}{DELIMITER}" for head, sep, _ in candidates
                    if sep and head in self.labels_seen]  # fmt: skip
        return (len(hits), hits[0]) if hits else None

    def problem(self, text: str, label: str, extra: bool, line: int, span: int):
        """(reason, column, what is wrong) of a row's first problem, or None: the checks run in
        the order of BAD_ROW_REASONS."""
        s = self.settings
        if extra:
            return "wrong_field_count", None, f"has more fields than the header {QUOTE_HINT}"
        if self.missing(text) and self.missing(label):
            return "empty_row", None, "is empty"
        for value, column in ((text, s.text_column), (label, s.label_column)):
            if not value.isascii() and _SURROGATE.search(value):
                return (
                    "undecodable",
                    column,
                    (
                        f"has bytes that are not valid {s.encoding} in column {column!r}; set "
                        "data.encoding to the file's encoding (e.g. latin-1 or cp1252)"
                    ),
                )
            swallowed = span > 1 and "\n" in value and self.swallowed_rows(value)
            if swallowed:
                count, example = swallowed
                return (
                    "merged_rows",
                    column,
                    (
                        f"has a quoted field in column {column!r} spanning lines {line}-"
                        f"{line + span - 1} with {count} line(s) that look like rows of their own "
                        f"(ending in {example!r}): an unbalanced quote merged them; fix the quote"
                    ),
                )
        if self.missing(text):
            return "missing_text", s.text_column, f"has an empty text in column {s.text_column!r}"
        if self.missing(label):
            return (
                "missing_label",
                s.label_column,
                (f"has a missing label in column {s.label_column!r}"),
            )
        if self.classes is not None and label.strip() not in self.classes:
            return (
                "unseen_label",
                s.label_column,
                (
                    f"has a label not in the training data ({label.strip()!r}) in column "
                    f"{s.label_column!r}; training classes: {', '.join(sorted(self.classes))}"
                ),
            )
        return None

    def check(self, text: str, label: str, extra: bool, row: int, line: int, span: int):
        """(BadRow or None, the cleaned text or None)."""
        found = self.problem(text, label, extra, line, span)
        cleaned = None if found else clean_text(text, self.settings.cleaning)
        if found is None and not cleaned:
            found = (
                "empty_after_cleaning",
                self.settings.text_column,
                (
                    f"has a text that is empty after cleaning in column "
                    f"{self.settings.text_column!r} (only markup or spaces)"
                ),
            )
        if found is not None:
            reason, column, what = found
            last_line = line + span - 1 if reason == "merged_rows" else None
            return BadRow(reason, row, line, column, what, last_line), None
        self.labels_seen.add(label.strip())
        return None, cleaned


def _newlines(frame: pd.DataFrame) -> np.ndarray:
    """Line breaks inside each row's fields: a row spans 1 + this many physical lines."""
    counts = np.zeros(len(frame), dtype=np.int64)
    for column in frame.columns:
        values = frame[column]
        has = values.str.contains("\n", regex=False).to_numpy(dtype=bool)
        if has.any():
            counts[has] += values[has].str.count("\n").to_numpy(dtype=np.int64)
    return counts


def _skipped_records(caught: list[warnings.WarningMessage]) -> list[tuple[int, int]]:
    """(data row, fields) of the rows pandas skipped for having too many fields."""
    skipped = []
    for warning in caught:
        for record, fields in _SKIPPED.findall(str(warning.message)):
            skipped.append((int(record) - 1, int(fields)))  # pandas counts the header as 1
    return skipped


def read_labelled_rows(
    path: str | Path,
    settings: CsvSettings,
    log: BadRowLog,
    *,
    classes: Collection[str] | None = None,
) -> Iterator[RowChunk]:
    """Yields the kept rows chunk by chunk; counts every row in `log`. `classes` (a validation
    file) marks rows with any other label as unseen_label. With settings.bad_rows == "error" the
    first bad row raises CsvTextError."""
    path = Path(path)
    columns = read_header(path, settings)
    extras = [f"__extra_{i}" for i in range(EXTRA_FIELDS)]
    text_at, label_at = columns.index(settings.text_column), columns.index(settings.label_column)
    checker = _Checker(settings, label_last=label_at == len(columns) - 1, classes=classes)
    reader = pd.read_csv(
        path,
        header=None,
        skiprows=1,
        names=columns + extras,  # unique placeholders: pandas may rename duplicate headers
        index_col=False,
        dtype=str,
        na_filter=False,  # "NA", "null", "None" are text; data.na_values decides what is missing
        keep_default_na=False,
        skip_blank_lines=False,  # blank lines are rows we count, and keep line numbers right
        on_bad_lines="warn",
        encoding=settings.encoding,
        encoding_errors="surrogateescape",  # undecodable bytes become marks we find per row
        chunksize=settings.chunk_rows,
        engine="c",
    )
    header_lines = 1 + sum(c.count("\n") for c in columns)
    next_row, next_line = 1, header_lines + 1
    pending: list[tuple[int, int]] = []  # skipped rows pandas told us about, not yet placed
    with reader:
        while True:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", pd.errors.ParserWarning)
                try:
                    frame = next(reader, None)
                except pd.errors.ParserError as err:
                    raise _parser_error(path, settings, err) from None
            pending += _skipped_records(caught)
            if frame is None:
                break
            kept = RowChunk([], [], [], [])
            spans = (1 + _newlines(frame)).tolist()
            texts = frame.iloc[:, text_at].tolist()
            labels = frame.iloc[:, label_at].tolist()
            extra = (frame[extras].to_numpy() != "").any(axis=1).tolist()
            for text, label, extra_fields, span in zip(texts, labels, extra, spans, strict=True):
                while pending and pending[0][0] == next_row:
                    _, fields = pending.pop(0)
                    _account(log, settings, path, _wrong_fields(next_row, next_line, fields))
                    next_row, next_line = next_row + 1, next_line + 1
                bad, cleaned = checker.check(text, label, extra_fields, next_row, next_line, span)
                if bad is None:
                    kept.texts.append(cleaned)
                    kept.labels.append(label.strip())
                    kept.rows.append(next_row)
                    kept.lines.append(next_line)
                _account(log, settings, path, bad)
                next_row, next_line = next_row + 1, next_line + span
            if kept.texts:
                yield kept
    for row, fields in pending:  # skipped rows after the last parsed one
        _account(log, settings, path, _wrong_fields(row, next_line + row - next_row, fields))
    if log.rows_read == 0:
        raise CsvTextError(f"{path}: has a header but no data rows")


def _wrong_fields(row: int, line: int, fields: int) -> BadRow:
    what = f"has {fields} fields, more than the header {QUOTE_HINT}"
    return BadRow("wrong_field_count", row, line, None, what)


def _account(log: BadRowLog, settings: CsvSettings, path: Path, bad: BadRow | None) -> None:
    log.rows_read += 1
    if bad is None:
        log.rows_kept += 1
        return
    if settings.bad_rows == "error":
        raise CsvTextError(
            f"{path}: row {bad.row} (line {bad.line}) {bad.what} (data.bad_rows=drop skips "
            "such rows, counting them in data_report.json)"
        )
    log.add(bad)


def _parser_error(path: Path, settings: CsvSettings, err: Exception) -> CsvTextError:
    message = str(err).strip().splitlines()[-1]
    unclosed = re.search(r"EOF inside string starting at row (\d+)", message)
    if unclosed:
        line = _line_of_record(path, settings.encoding, int(unclosed.group(1)))
        return CsvTextError(
            f"{path}: row {unclosed.group(1)} (line {line}) opens a quote that is never closed, "
            "so the rest of the file would be one field; fix the unbalanced quote"
        )
    return CsvTextError(f"{path}: cannot be read as CSV: {message}")


def _line_of_record(path: Path, encoding: str, record: int) -> int:
    """The physical line where record `record` (0 = the header) starts. Only for an error
    message: it reads the file again with the csv module, which counts lines."""
    with path.open(encoding=encoding, errors="surrogateescape", newline="") as f:
        reader = csv.reader(f)
        for _ in itertools.islice(reader, record):
            pass
        return reader.line_num + 1
