"""Reading a labelled CSV record by record, so that damage costs only the damaged record, and
accounting for every record: each is kept or dropped for a named reason, with its row, its
physical line numbers and a preview, never silently.

A record is what a strict CSV parser (Python's `csv`, strict=True) reads as one row. A good
record -- one that parser reads correctly standing alone, with a text and a label -- is always
kept, whatever damage surrounds it. After an unbalanced quote the reader re-synchronises: a
quoted field that would run past data.max_field_lines lines, or past a line that reads as a
complete row of the header's width with a known label, or to the end of the file, is taken as
broken at its opening quote; that record is dropped and reading resumes on the next line. A
quote inside a quoted field that is not doubled (`"said "hi" twice",a`) costs its record only:
the record ends where a quote is followed by a delimiter or a line end.

Rows are numbered from 1 after the header (row 1 is the first record); lines are the file's
physical lines (the header is line 1), so a quoted field spanning lines moves later rows' lines.
What counts as a bad record (`BAD_ROW_REASONS`):

- field_too_large: a record (a line, or the lines of one quoted field) longer than
  data.max_field_bytes: never held in memory whole -- read in pieces and passed over, so one
  100 MB field costs what one piece does; reading resumes after it;
- wrong_field_count: more or fewer fields than the header (an unquoted delimiter in a text);
- empty_row: no text and no label (a blank line, or a row of empty fields);
- undecodable: bytes that are not valid in data.encoding;
- unbalanced_quote: a quote that breaks the record's quoting (see above);
- missing_text / missing_label: empty, only spaces, or one of data.na_values;
- unlisted_label: a label that data.labels does not name;
- empty_after_cleaning: a text that clean_text reduces to nothing (only tags or spaces);
- suspect_label, unseen_label: decided once the whole file is read (kiln.data.csv_text).

Kept rows that sit next to a structurally broken record (a wrong field count or an unbalanced
quote), or that were read again after an unbalanced quote, are *flagged*: a label seen only in
flagged rows is a suspect, not a class. With bad_rows=drop bad records are counted and listed
(kiln.data.bad_inputs, written to data_report.json); with bad_rows=error the first one stops the
run, naming the file, row, line and column."""

from __future__ import annotations

import codecs
import csv
import re
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kiln.data.bad_inputs import BadInputLog
from kiln.errors import UserError
from kiln.preprocessing.cleaning import PAIR_SEP, TextCleaning, clean_text

BAD_ROW_REASONS = (
    "field_too_large",
    "wrong_field_count",
    "empty_row",
    "undecodable",
    "unbalanced_quote",
    "missing_text",
    "missing_label",
    "unlisted_label",
    "empty_after_cleaning",
    "suspect_label",
    "unseen_label",
    # the other formats (kiln.data.text_formats)
    "not_json",
    "wrong_type",
    "block_too_large",
)
STRUCTURAL = frozenset({"wrong_field_count", "unbalanced_quote", "field_too_large"})
DELIMITER, QUOTE = ",", '"'
PREVIEW_CHARS = 60  # of each dropped record, in the report

_SURROGATE = re.compile("[\udc80-\udcff]")  # undecodable bytes, as surrogateescape maps them
QUOTE_HINT = '(an unquoted delimiter inside a text? quote such a field: "a, b")'

csv.field_size_limit(sys.maxsize)  # a long text is a text; the parser's 128 KiB cap is not ours


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
    max_field_lines: int = 1000  # a quoted field running longer is taken as broken
    labels: frozenset[str] | None = None  # data.labels: the classes, when the user names them
    max_field_bytes: int = 1 << 20  # a longer record is dropped, read in pieces, never whole
    pair_column: str | None = None  # data.text_pair_column: a row's text is then a pair
    label_separator: str | None = None  # data.label_separator: a list of labels is joined by it
    max_block_bytes: int = 1 << 28  # Parquet row groups, Arrow record batches: larger ones unread


@dataclass
class RowChunk:
    """The kept rows of one chunk: cleaned texts, stripped labels, row and line numbers, and
    whether each was read next to a broken record (flagged)."""

    texts: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    flagged: list[bool] = field(default_factory=list)


@dataclass
class BadRow:
    reason: str
    row: int
    line: int | None  # None: a format without lines (Parquet, Arrow)
    column: str | None
    what: str  # the sentence an error message uses: "has an empty text in column 'text'"
    last_line: int | None = None  # a record spanning lines: its last one
    preview: str = ""
    file: str | None = None  # the file's name, for data read from several (Parquet shards)

    def to_dict(self) -> dict:
        where = {"line": self.line} if self.line is not None else {}
        where |= {"row": self.row, "reason": self.reason}
        if self.last_line is not None and self.last_line != self.line:
            where["last_line"] = self.last_line
        if self.file is not None:
            where["file"] = self.file
        return {**where, "column": self.column, "preview": self.preview}

    def place(self) -> str:
        """`row N (line L)`, or `row N` where there are no lines."""
        return f"row {self.row}" + (f" (line {self.line})" if self.line is not None else "")


def row_log(path: str) -> BadInputLog:
    """The bad-input report of one CSV file: every dropped record, in file order."""
    return BadInputLog(path, "rows", BAD_ROW_REASONS)


def preview(text: str) -> str:
    """The first PREVIEW_CHARS characters of a raw record, line breaks shown as \\n."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").rstrip("\n").replace("\n", "\\n")
    text = _SURROGATE.sub("\ufffd", text)
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "\u2026"


def account(log: BadInputLog, settings: CsvSettings, path: Path | str, bad: BadRow | None) -> None:
    """Counts one record read: kept (bad is None) or dropped; bad_rows=error raises instead."""
    log.read += 1
    if bad is None:
        log.kept += 1
        return
    _drop(log, settings, path, bad)


def drop_kept(log: BadInputLog, settings: CsvSettings, path: Path | str, bad: BadRow) -> None:
    """A row kept while reading, dropped once the whole file is known (a suspect label...)."""
    log.kept -= 1
    _drop(log, settings, path, bad)


def _drop(log: BadInputLog, settings: CsvSettings, path: Path | str, bad: BadRow) -> None:
    if settings.bad_rows == "error":
        raise CsvTextError(
            f"{path}: {bad.place()} {bad.what} (data.bad_rows=drop skips "
            "such rows, listing them in data_report.json)"
        )
    log.add(bad.to_dict())


# ---------------------------------------------------------------------------------------------
# Physical lines, and the records csv.reader makes of them


class _Runaway(Exception):
    """A quoted field ran past a limit: `why` says which (for the message)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class _TooLong(Exception):
    """A line (or the lines of one record) past max_field_bytes: the line was read in pieces
    and passed over; `head` is its beginning, for the report."""

    def __init__(self, line: int, head: str, size: int, limit: int, quotes: int):
        super().__init__(f"line {line}")
        self.line, self.head, self.size, self.limit = line, head, size, limit
        self.quotes = quotes  # quote characters in the line: is a quoted field left open?


SKIP_PIECE = 1 << 20  # characters read at a time from a line being passed over


class _Lines:
    """The file's physical lines, numbered, as csv.reader pulls them one at a time. The lines
    of the record being parsed are kept (`record`), so a broken record can be read again from
    its second line; `guard` is called whenever the parser asks for one more line of a record
    (its field runs on), and may stop it by raising _Runaway. A line -- or a record's lines
    together -- longer than `max_chars` is never held whole: _TooLong, with the line skipped."""

    def __init__(self, file, first_line: int, max_chars: int = 1 << 20, encoding: str = "utf-8"):
        self._file = file
        self.next_number = first_line
        self.pushed: deque[tuple[int, str | _TooLong]] = deque()
        self.record: list[tuple[int, str]] = []
        self.reread_until = 0  # lines up to this one were read again after a broken quote
        self.guard = None
        self.max_chars, self.encoding = max_chars, encoding

    def __iter__(self):
        return self

    def __next__(self) -> str:
        record = self.record
        if record and self.guard is not None:
            self.guard(record)
        item = self.pull()
        record.append(item)
        if len(record) > 1 and sum(len(text) for _, text in record) > self.max_chars:
            number, text = record.pop()
            size = sum(len(t) for _, t in record) + len(text)
            raise _TooLong(number, text[:PREVIEW_CHARS], size, self.max_chars, text.count(QUOTE))
        return item[1]

    def pull(self) -> tuple[int, str]:
        if self.pushed:
            item = self.pushed.popleft()
            if isinstance(item[1], _TooLong):
                raise item[1]
            return item
        number = self.next_number
        text = self._file.readline(self.max_chars + 1)
        if not text:
            raise StopIteration  # the end of the file
        self.next_number += 1
        if len(text) > self.max_chars or self._too_many_bytes(text):
            size, quotes = self._pass_over(text)
            raise _TooLong(number, text[:PREVIEW_CHARS], size, self.max_chars, quotes)
        return number, text

    def _too_many_bytes(self, text: str) -> bool:
        """Characters within the limit may still be more bytes (UTF-8: up to 4 each)."""
        if len(text) * 4 <= self.max_chars:
            return False
        return len(text.encode(self.encoding, "surrogateescape")) > self.max_chars + 2

    def _pass_over(self, text: str) -> tuple[int, int]:
        """The rest of a too-long line read in pieces and dropped: (its length, the quote
        characters in it)."""
        size, quotes = len(text), text.count(QUOTE)
        while not text.endswith(("\n", "\r")):
            text = self._file.readline(SKIP_PIECE)
            if not text:
                break
            size, quotes = size + len(text), quotes + text.count(QUOTE)
        return size, quotes

    def push_back(self, items: list[tuple[int, str]]) -> None:
        if items:
            self.pushed.extendleft(reversed(items))
            self.reread_until = max(self.reread_until, items[-1][0])


class _Lenient:
    """A record's fields where a quote inside a quoted field is literal unless a delimiter or
    the line's end follows it: how a record with one undoubled quote ends. Fed line by line."""

    def __init__(self):
        self.fields: list[str] = []
        self.chars: list[str] = []
        self.in_quotes, self.at_start = False, True

    def feed(self, line: str) -> bool:
        """True when the record is complete after this line."""
        body = line.rstrip("\r\n")
        i, n = 0, len(body)
        while i < n:
            char = body[i]
            if self.in_quotes:
                if char == QUOTE:
                    if i + 1 < n and body[i + 1] == QUOTE:
                        self.chars.append(QUOTE)
                        i += 2
                        continue
                    if i + 1 == n or body[i + 1] == DELIMITER:
                        self.in_quotes = False
                        i += 1
                        continue
                self.chars.append(char)
            elif char == DELIMITER:
                self.fields.append("".join(self.chars))
                self.chars, self.at_start = [], True
                i += 1
                continue
            elif char == QUOTE and self.at_start:
                self.in_quotes = True
            else:
                self.chars.append(char)
            self.at_start = False
            i += 1
        if self.in_quotes:
            self.chars.append("\n")
            return False
        self.fields.append("".join(self.chars))
        return True


def _opens_a_field(line: str) -> bool:
    """Does `line` start with a quoted field (a quote, not a doubled one)?"""
    return line.startswith(QUOTE) and not line.startswith(QUOTE + QUOTE)


def _quote_column(line: str) -> int:
    """The index of the field whose quote breaks `line`: left open at its end, or followed by
    something other than a delimiter."""
    index, in_quotes, at_start, opened = 0, False, True, 0
    body = line.rstrip("\r\n")
    i = 0
    while i < len(body):
        char = body[i]
        if in_quotes and char == QUOTE:
            if body[i + 1 : i + 2] == QUOTE:
                i += 2
                continue
            if body[i + 1 : i + 2] not in ("", DELIMITER):
                return index
            in_quotes = False
        elif not in_quotes and char == DELIMITER:
            index, at_start = index + 1, True
            i += 1
            continue
        elif not in_quotes and char == QUOTE and at_start:
            in_quotes, opened = True, index
        at_start = False
        i += 1
    return opened if in_quotes else index


@dataclass
class _Record:
    row: int
    lines: list[tuple[int, str]]
    fields: list[str] | None  # None: broken (see `broken`)
    reread: bool
    broken: str = ""  # what is wrong with a broken record, for its message
    column: int = 0  # broken: the field index the bad quote is in
    too_long: _TooLong | None = None  # a record past max_field_bytes

    @property
    def first_line(self) -> int:
        return self.lines[0][0]

    @property
    def last_line(self) -> int:
        return self.lines[-1][0]


class _Records:
    """The records of an open CSV file after its header, re-synchronising after bad quotes.
    `known` holds the labels a row-like line must have to stop a runaway field."""

    def __init__(self, file, settings: CsvSettings, path: Path):
        self.settings, self.path = settings, path
        self.lines = _Lines(file, 1, settings.max_field_bytes, settings.encoding)
        self.reader = csv.reader(self.lines, strict=True)
        try:
            header = next(self.reader)
        except StopIteration:
            raise CsvTextError(f"{path}: the file is empty; expected a header row") from None
        except csv.Error as err:
            raise CsvTextError(f"{path}: the header row cannot be read as CSV ({err})") from None
        except _TooLong as long:
            raise CsvTextError(
                f"{path}: the header row is longer than data.max_field_bytes={long.limit:,} "
                f"({long.size:,} characters, starting {preview(long.head)!r}): is this a CSV?"
            ) from None
        if header and header[0].startswith("\ufeff"):  # a byte-order mark (Excel's UTF-8)
            header[0] = header[0][1:]
        self.columns = header
        self.width = len(header)
        self.known: set[str] = set(settings.labels or ())
        self.label_at = 0
        self.lines.guard = self._guard

    def _row_like(self, text: str) -> bool:
        """Does `text`, standing alone, read as a complete row with a known label?"""
        if text.count(DELIMITER) < self.width - 1 or not self.known:
            return False
        try:
            fields = next(csv.reader([text], strict=True), None)
        except csv.Error:
            return False
        return (
            fields is not None
            and len(fields) == self.width
            and fields[self.label_at].strip() in self.known
        )

    def _guard(self, record: list[tuple[int, str]]) -> None:
        if len(record) >= self.settings.max_field_lines:
            raise _Runaway(
                f"would run past data.max_field_lines={self.settings.max_field_lines} lines"
            )
        if len(record) > 1 and self._row_like(record[-1][1]):
            raise _Runaway(f"would run past line {record[-1][0]}, a row of its own")

    def __iter__(self) -> Iterator[_Record]:
        lines, row = self.lines, 0
        while True:
            lines.record = []
            try:
                fields = next(self.reader)
            except StopIteration:
                return
            except _Runaway as stop:
                yield self._broken(row := row + 1, stop.why)
                continue
            except _TooLong as long:
                taken = [*lines.record, (long.line, long.head)]
                last = self._rest_of_field(long, sum(t.count(QUOTE) for _, t in lines.record))
                taken += [(last, "")] if last > long.line else []
                yield _Record(row := row + 1, taken, None, False, "too long", 0, long)
                continue
            except csv.Error as err:
                yield self._after_error(row := row + 1, str(err))
                continue
            record = lines.record
            row += 1
            yield _Record(row, record, fields, record[0][0] <= lines.reread_until)

    def _rest_of_field(self, long: _TooLong, quotes_before: int) -> int:
        """After a too-long line that leaves a quoted field open (an odd count of quotes in the
        record so far: doubled quotes come in pairs), the field's remaining lines are passed
        over too, up to the line that closes it, a line that reads as a row of its own (read
        again), or max_field_lines; the last line passed over."""
        open_field = (quotes_before + long.quotes) % 2 == 1
        last, skipped = long.line, 0
        while open_field and skipped < self.settings.max_field_lines:
            try:
                number, text = self.lines.pull()
            except StopIteration:
                break
            except _TooLong as more:
                number, text, quotes = more.line, "", more.quotes
            else:
                if self._row_like(text):
                    self.lines.push_back([(number, text)])
                    break
                quotes = text.count(QUOTE)
            last, skipped = number, skipped + 1
            open_field = open_field != (quotes % 2 == 1)
        return last

    def _broken(self, row: int, why: str) -> _Record:
        """A record broken at its opening quote: its first line only; the rest is read again."""
        record = self.lines.record
        self.lines.push_back(record[1:])
        return _Record(row, record[:1], None, False, why, _quote_column(record[0][1]))

    def _after_error(self, row: int, message: str) -> _Record:
        if "unexpected end of data" in message:
            return self._broken(row, "would run to the end of the file")
        column = _quote_column(self.lines.record[0][1])
        extent = self._lenient_extent()
        if extent is None:
            return self._broken(row, message)
        return _Record(row, extent, None, False, "is not doubled", column)

    def _lenient_extent(self) -> list[tuple[int, str]] | None:
        """The lines of a record with an undoubled quote, read leniently, when it ends cleanly
        (the header's width, a label) before a line that starts with a quoted field, a row-like
        line passed over, or max_field_lines; else None. Lines read past the extent go back."""
        lines, consumed = self.lines, len(self.lines.record)
        taken, lenient = list(self.lines.record), _Lenient()
        for used in range(self.settings.max_field_lines):
            if used == len(taken):
                try:
                    taken.append(lines.pull())
                except StopIteration:
                    break
                except _TooLong as long:  # read again in order, reported in its turn
                    taken.append((long.line, long))
                    break
            if used and _opens_a_field(taken[used][1]):  # a record of its own starts here
                break
            if used > 1 and self._row_like(taken[used - 1][1]):  # the field ran past a row
                break
            if lenient.feed(taken[used][1]):
                if len(lenient.fields) == self.width and lenient.fields[self.label_at].strip():
                    lines.push_back(taken[used + 1 :])
                    return taken[: used + 1]
                break
        lines.push_back(taken[consumed:])
        return None


# ---------------------------------------------------------------------------------------------
# The header, and row by row


def _open(path: Path, settings: CsvSettings):
    if path.exists() and not path.is_file():  # a FIFO would block the reader: never opened
        from kiln.preprocessing.file_tree import file_kind

        raise CsvTextError(
            f"{path}: {file_kind(path.stat().st_mode)}, not a regular file (data.train_path / "
            "data.val_path): give a CSV file"
        )
    if not path.is_file():
        raise CsvTextError(f"{path}: no such file (set data.train_path / data.val_path)")
    try:
        codecs.lookup(settings.encoding)
    except LookupError:
        raise CsvTextError(
            f"{path}: unknown encoding {settings.encoding!r} (data.encoding); "
            "use a Python codec name such as utf-8, latin-1 or cp1252"
        ) from None
    wide = wide_encoding(path)
    if wide is not None and not codecs.lookup(settings.encoding).name.startswith(wide[:6]):
        raise CsvTextError(encoding_mismatch(path, wide, settings.encoding, "data.encoding"))
    return path.open(encoding=settings.encoding, errors="surrogateescape", newline="")


def wide_encoding(path: Path) -> str | None:
    """ "utf-16" or "utf-32" when a file's first bytes say so (a byte-order mark, or the zero
    bytes every other byte of ASCII text has in UTF-16); None otherwise. A file in a wide
    encoding read as UTF-8 has no column a user named: this says why."""
    with path.open("rb") as file:
        head = file.read(4096)
    if head.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return "utf-32"
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    sample = head[: len(head) // 2 * 2]
    if len(sample) >= 8 and (
        sample[1::2].count(0) > 0.8 * len(sample) / 2
        or sample[0::2].count(0) > 0.8 * len(sample) / 2
    ):
        return "utf-16"
    return None


def encoding_mismatch(path: Path, wide: str, encoding: str, key: str) -> str:
    return (
        f"{path}: the file is {wide.upper()} (its first bytes say so) but is read as {encoding} "
        f"({key}): set {key}={wide}"
    )


def _check_columns(path: Path, columns: list[str], settings: CsvSettings) -> None:
    wanted = (settings.text_column, settings.pair_column, settings.label_column)
    missing = [c for c in wanted if c is not None and c not in columns]
    if missing:
        keys = "data.text_column / data.label_column"
        keys += " / data.text_pair_column" if settings.pair_column else ""
        raise CsvTextError(
            f"{path}: missing column {', '.join(map(repr, missing))}; columns present: "
            f"{', '.join(map(repr, columns))} (set {keys})"
        )


def read_header(path: str | Path, settings: CsvSettings) -> list[str]:
    """The column names; CsvTextError if the file is missing, empty or lacks a column."""
    path = Path(path)
    with _open(path, settings) as file:
        columns = _Records(file, settings, path).columns
    _check_columns(path, columns, settings)
    return columns


class _Checker:
    """Decides whether a record is kept: its fields, text, label and cleaned text."""

    def __init__(self, settings: CsvSettings, columns: list[str]):
        self.settings, self.columns, self.width = settings, columns, len(columns)
        self.text_at = columns.index(settings.text_column)
        self.label_at = columns.index(settings.label_column)
        pair = settings.pair_column
        self.pair_at = columns.index(pair) if pair is not None else None

    def missing(self, value: str) -> bool:
        value = value.strip()
        return not value or value in self.settings.na_values

    def problem(self, record: _Record):
        """(reason, column, what is wrong) of a record's first problem, or None."""
        s, fields = self.settings, record.fields
        if record.too_long is not None:
            long = record.too_long
            return (
                "field_too_large",
                None,
                f"is longer than data.max_field_bytes={long.limit:,} (line {long.line}: "
                f"{long.size:,} characters); it was passed over unread, reading resumes after "
                f"line {record.last_line} (raise data.max_field_bytes to read such texts)",
            )
        if fields is None:
            column = self.columns[record.column] if record.column < self.width else None
            where = f" in column {column!r}" if column else ""
            if record.broken == "is not doubled":
                what = (
                    f"has a quote inside the quoted field{where} that is not doubled (lines "
                    f'{record.first_line}-{record.last_line}); write a quote in a field as ""'
                )
            elif record.broken.startswith("would"):
                what = (
                    f"opens a quote{where} that is never closed: the field {record.broken}; fix "
                    f"the quote (the record is dropped and reading resumes on line "
                    f"{record.first_line + 1})"
                )
            else:
                what = f"has a malformed quote{where} ({record.broken}); fix the quote"
            return "unbalanced_quote", column, what
        if not any(f.strip() for f in fields):
            return "empty_row", None, "is empty"
        if len(fields) != self.width:
            more = len(fields) > self.width
            return (
                "wrong_field_count",
                None,
                f"has {len(fields)} fields, the header {self.width}"
                + (f" {QUOTE_HINT}" if more else ""),
            )
        text, label = fields[self.text_at], fields[self.label_at]
        checked = [(text, s.text_column), (label, s.label_column)]
        if self.pair_at is not None:
            checked.append((fields[self.pair_at], s.pair_column))
        for value, column in checked:
            if not value.isascii() and _SURROGATE.search(value):
                return (
                    "undecodable",
                    column,
                    f"has bytes that are not valid {s.encoding} in column {column!r}; set "
                    "data.encoding to the file's encoding (e.g. latin-1 or cp1252)",
                )
        if self.missing(text) and self.missing(label):
            return "empty_row", None, "is empty"
        if self.missing(text):
            return "missing_text", s.text_column, f"has an empty text in column {s.text_column!r}"
        if self.pair_at is not None and self.missing(fields[self.pair_at]):
            column = s.pair_column
            return "missing_text", column, f"has an empty text in column {column!r}"
        if self.missing(label):
            return (
                "missing_label",
                s.label_column,
                (f"has a missing label in column {s.label_column!r}"),
            )
        if s.labels is not None and label.strip() not in s.labels:
            return (
                "unlisted_label",
                s.label_column,
                (f"has the label {label.strip()!r}, which data.labels does not name"),
            )
        return None

    def _cleaned(self, fields: list[str]) -> tuple[str, str | None]:
        """(the cleaned text -- a pair's two joined by PAIR_SEP --, the column left empty by
        cleaning or None)."""
        s = self.settings
        cleaned = clean_text(fields[self.text_at], s.cleaning)
        if not cleaned:
            return cleaned, s.text_column
        if self.pair_at is None:
            return cleaned, None
        second = clean_text(fields[self.pair_at], s.cleaning)
        if not second:
            return second, s.pair_column
        # a separator inside a text (cleaning without data.normalize_whitespace) is a space
        first, second = cleaned.replace(PAIR_SEP, " "), second.replace(PAIR_SEP, " ")
        return f"{first}{PAIR_SEP}{second}", None

    def check(self, record: _Record) -> tuple[BadRow | None, str | None]:
        """(BadRow or None, the cleaned text or None)."""
        found = self.problem(record)
        cleaned = None
        if found is None:
            cleaned, column = self._cleaned(record.fields)
            if column is not None:
                found = (
                    "empty_after_cleaning",
                    column,
                    f"has a text that is empty after cleaning in column {column!r} (only markup "
                    "or spaces)",
                )
        if found is None:
            return None, cleaned
        reason, column, what = found
        raw = "".join(text for _, text in record.lines)
        bad = BadRow(
            reason, record.row, record.first_line, column, what, record.last_line, preview(raw)
        )
        return bad, None


def read_labelled_rows(
    path: str | Path, settings: CsvSettings, log: BadInputLog
) -> Iterator[RowChunk]:
    """Yields the kept rows chunk by chunk (settings.chunk_rows records each); counts every
    record in `log`. With settings.bad_rows == "error" the first bad record raises."""
    path = Path(path)
    with _open(path, settings) as file:
        records = _Records(file, settings, path)
        _check_columns(path, records.columns, settings)
        checker = _Checker(settings, records.columns)
        records.label_at = checker.label_at
        yield from _chunks(records, checker, settings, log, path)
    if log.read == 0:
        raise CsvTextError(f"{path}: has a header but no data rows")


def _chunks(records: _Records, checker: _Checker, settings, log, path) -> Iterator[RowChunk]:
    """Kept rows in chunks. A kept row waits for the next record before it joins its chunk:
    a broken record after it flags it too."""
    chunk, pending, after_broken = RowChunk(), None, False
    learn = settings.labels is None  # else the known labels are exactly data.labels

    def place(row) -> None:
        text, label, number, line, flagged = row
        chunk.texts.append(text)
        chunk.labels.append(label)
        chunk.rows.append(number)
        chunk.lines.append(line)
        chunk.flagged.append(flagged)
        if learn and not flagged:
            records.known.add(label)

    for record in records:
        bad, cleaned = checker.check(record)
        broken = bad is not None and bad.reason in STRUCTURAL
        if pending is not None:
            place((*pending[:4], pending[4] or broken))
            pending = None
            if len(chunk.texts) >= settings.chunk_rows:
                yield chunk
                chunk = RowChunk()
        account(log, settings, path, bad)
        if bad is None:
            label = record.fields[checker.label_at].strip()
            pending = (cleaned, label, record.row, record.first_line, after_broken or record.reread)
        after_broken = broken
    if pending is not None:
        place(pending)
    if chunk.texts:
        yield chunk
