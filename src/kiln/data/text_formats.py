"""Labelled text in the formats users keep it in, read into the same chunks of kept rows as a
CSV (kiln.data.csv_reader): the same columns, cleaning, bad-record reasons and report.

- csv: a CSV file, record by record (kiln.data.csv_reader);
- parquet: a .parquet file, a folder of them, or a glob (`train-*.parquet`: one split's shards
  in the Hugging Face hub cache), row group by row group in batches (pyarrow's iter_batches),
  only the columns read;
- jsonl: JSON Lines, one JSON object per line (.jsonl, .ndjson, .json), line by line;
- datasets: a folder written by Hugging Face `datasets`' save_to_disk (data-*.arrow,
  dataset_info.json, state.json), record batch by record batch from a memory map (Arrow IPC
  streaming, as `datasets` reads it).

`auto` (the default) picks by the path: a folder with state.json or dataset_info.json is a
`datasets` folder; a folder or glob of .parquet files, a .parquet/.pq file, or any file starting
with Parquet's magic bytes is Parquet; .jsonl/.ndjson/.json are JSON Lines; anything else is CSV.

Bounded inputs, checked before anything is allocated: a Parquet row group or an Arrow record
batch whose text and label columns hold more than data.max_block_bytes (uncompressed, from the
file's own metadata) is never read: its rows are dropped as `block_too_large` (one report entry
for them all); a JSON line longer than data.max_field_bytes is read in pieces and passed over
(`field_too_large`), as is a longer text in a row group that was read. Rows are numbered from 1
across a split's files (a JSON Lines row is its line); each dropped row names its file.

A `datasets` ClassLabel column (dataset_info.json's features, or the schema metadata the hub's
Parquet files carry) is read as its names: label 3 of ["sadness", ..., "surprise"] is
"surprise"; -1 (the hub's "no label", e.g. in test splits) is a missing label. A label column of
lists (multi-label) is joined by data.label_separator, which must then be set."""

from __future__ import annotations

import glob
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kiln.data.bad_inputs import BadInputLog
from kiln.data.csv_reader import (
    SKIP_PIECE,
    BadRow,
    CsvSettings,
    CsvTextError,
    RowChunk,
    _Checker,
    _Record,
    _TooLong,
    account,
    preview,
    read_labelled_rows,
)

FORMATS = ("csv", "parquet", "jsonl", "datasets")
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
DATASETS_FILES = ("state.json", "dataset_info.json")
PARQUET_MAGIC = b"PAR1"
BATCH_ROWS = 8192  # rows converted to Python strings at a time (Parquet, Arrow)
SHARD = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}\.(parquet|arrow)$")  # datasets' shard names


# ---------------------------------------------------------------------------------------------
# Which format, which files


def resolve_format(path: str | Path, setting: str) -> str:
    """data.format for `path`: the setting, or (auto) what the path is (the module's table)."""
    if setting != "auto":
        return setting
    text = str(path)
    if glob.has_magic(text):
        return "parquet" if text.lower().endswith(PARQUET_SUFFIXES) else "csv"
    path = Path(path)
    if path.is_dir():
        if any((path / name).is_file() for name in DATASETS_FILES):
            return "datasets"
        if (path / "dataset_dict.json").is_file():
            return "datasets"  # refused by source_files, naming the splits
        return "parquet" if _parquet_in(path) else "csv"
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".arrow":
        return "datasets"
    if path.is_file():
        with path.open("rb") as file:
            if file.read(4) == PARQUET_MAGIC:
                return "parquet"
    return "csv"


def _parquet_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in PARQUET_SUFFIXES)


def source_files(path: str | Path, fmt: str) -> list[Path]:
    """The files a data path stands for, in reading order; CsvTextError when there are none, or
    when a folder mixes the shards of several splits (the hub's `data/` folder)."""
    text = str(path)
    if fmt == "parquet" and glob.has_magic(text):
        files = sorted(Path(p) for p in glob.glob(text))
        files = [p for p in files if p.is_file()]
        if not files:
            raise CsvTextError(f"{text}: no file matches (data.train_path / data.val_path)")
        return files
    path = Path(path)
    if not path.exists():
        raise CsvTextError(f"{path}: no such file (set data.train_path / data.val_path)")
    if fmt == "datasets":
        return _datasets_files(path)
    if path.is_dir():
        if fmt != "parquet":
            raise CsvTextError(
                f"{path}: a folder; data.format={fmt} reads a file (a folder is read as "
                "data.format=parquet or datasets)"
            )
        files = _parquet_in(path)
        if not files:
            raise CsvTextError(f"{path}: a folder without .parquet files (data.format=parquet)")
        _one_split(path, files, "parquet")
        return files
    if not path.is_file():
        from kiln.preprocessing.file_tree import file_kind

        raise CsvTextError(
            f"{path}: {file_kind(path.stat().st_mode)}, not a regular file (data.train_path / "
            "data.val_path)"
        )
    return [path]


def _one_split(folder: Path, files: Sequence[Path], suffix: str) -> None:
    splits = sorted({m["split"] for p in files if (m := SHARD.match(p.name))})
    if len(splits) > 1:
        raise CsvTextError(
            f"{folder}: holds the shards of {len(splits)} splits ({', '.join(splits)}); name "
            f"one split's files: data.train_path='{folder}/{splits[0]}-*.{suffix}'"
        )


def _datasets_files(path: Path) -> list[Path]:
    """The Arrow files of a save_to_disk folder, in state.json's order (a single .arrow file
    stands for itself)."""
    if path.is_file():
        return [path]
    if (path / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: a folder per split
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        return _refuse_dict(path, splits)
    state = path / "state.json"
    if state.is_file():
        try:
            names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as err:
            raise CsvTextError(f"{state}: not a datasets state.json ({err})") from None
        files = [path / Path(name).name for name in names]  # never outside the folder
    else:
        files = sorted(path.glob("*.arrow"))
    missing = [p.name for p in files if not p.is_file()]
    if missing or not files:
        raise CsvTextError(
            f"{path}: {'missing ' + ', '.join(missing) if missing else 'no .arrow file'}; a "
            "datasets folder holds the data-*.arrow files save_to_disk wrote"
        )
    return files


def _refuse_dict(path: Path, splits: list[str]):
    first = splits[0] if splits else "train"
    raise CsvTextError(
        f"{path}: a DatasetDict folder (splits: {', '.join(splits) or 'none'}); name one split's "
        f"folder: data.train_path={path / first}"
        + (f" data.val_path={path / splits[1]}" if len(splits) > 1 else "")
    )


def source_digest(path: str | Path, fmt: str) -> str:
    """The sha256 of a data path's files (its contents and their order): the token cache's key."""
    digest = hashlib.sha256()
    for file in source_files(path, fmt):
        with file.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def source_name(path: str | Path) -> str:
    """A short name for a data path (the cache entry's prefix, the sources of its rows)."""
    text = str(path)
    if glob.has_magic(text):
        return Path(text).parent.name or "data"
    return Path(text).name


# ---------------------------------------------------------------------------------------------
# Reading


def read_rows(
    path: str | Path, settings: CsvSettings, log: BadInputLog, fmt: str
) -> Iterator[RowChunk]:
    """The kept rows of a data path in `fmt`, chunk by chunk (settings.chunk_rows rows each),
    every row counted in `log` (data.bad_rows=error: the first bad one raises)."""
    if fmt == "csv":
        yield from read_labelled_rows(path, settings, log)
        return
    files = source_files(path, fmt)
    records = {"parquet": _parquet_records, "jsonl": _jsonl_records, "datasets": _arrow_records}
    reader = _TableReader(settings, log)
    yield from reader.chunks(records[fmt](files, settings))
    if log.read == 0:
        raise CsvTextError(f"{path}: has no data rows")


class _Block:
    """Rows passed over unread: a row group or record batch larger than data.max_block_bytes."""

    def __init__(self, file: Path, first_row: int, count: int, size: int, what: str):
        self.file, self.first_row, self.count, self.size, self.what = (
            file,
            first_row,
            count,
            size,
            what,
        )


class _Bad:
    """One row that is not a record of the columns: a JSON line that does not parse, a value of
    the wrong type."""

    def __init__(self, reason, file, row, line, column, what, raw):
        self.reason, self.file, self.row, self.line = reason, file, row, line
        self.column, self.what, self.raw = column, what, raw


class _Row:
    """One record: its fields in (text, label, pair) order, as strings ("" for missing)."""

    def __init__(self, file: Path, row: int, line: int | None, fields: list[str], raw: str):
        self.file, self.row, self.line, self.fields, self.raw = file, row, line, fields, raw


class _TableReader:
    """Judges records as the CSV reader does (kiln.data.csv_reader._Checker: missing texts and
    labels, undecodable bytes, data.labels, cleaning) and gathers the kept ones in chunks."""

    def __init__(self, settings: CsvSettings, log: BadInputLog):
        self.settings, self.log = settings, log
        self.columns = wanted_columns(settings)
        self.checker = _Checker(settings, self.columns)

    def chunks(self, records) -> Iterator[RowChunk]:
        chunk = RowChunk()
        for record in records:
            if isinstance(record, _Block):
                self._block(record)
                continue
            if isinstance(record, _Bad):
                bad = BadRow(
                    record.reason,
                    record.row,
                    record.line,
                    record.column,
                    record.what,
                    preview=preview(record.raw),
                )
                self._account(bad, record.file)
                continue
            bad, cleaned = self._check(record)
            self._account(bad, record.file)
            if bad is None:
                chunk.texts.append(cleaned)
                chunk.labels.append(record.fields[1].strip())
                chunk.rows.append(record.row)
                chunk.lines.append(record.row if record.line is None else record.line)
                chunk.flagged.append(False)  # no record here can run into its neighbours
                if len(chunk.texts) >= self.settings.chunk_rows:
                    yield chunk
                    chunk = RowChunk()
        if chunk.texts:
            yield chunk

    def _check(self, record: _Row) -> tuple[BadRow | None, str | None]:
        limit = self.settings.max_field_bytes
        for value, column in zip(record.fields, self.columns, strict=True):
            size = len(value) if len(value) * 4 <= limit else len(value.encode("utf-8", "replace"))
            if size > limit:
                what = (
                    f"has {size:,} bytes in column {column!r}, more than data.max_field_bytes="
                    f"{limit:,} (raise it to read such texts)"
                )
                raw = record.raw[:200]
                return BadRow(
                    "field_too_large", record.row, record.line, column, what, preview=preview(raw)
                ), None
        line = record.row if record.line is None else record.line
        bad, cleaned = self.checker.check(
            _Record(record.row, [(line, record.raw)], record.fields, False)
        )
        if bad is not None and record.line is None:
            bad.line = bad.last_line = None
        return bad, cleaned

    def _account(self, bad: BadRow | None, file: Path) -> None:
        if bad is not None:
            bad.file = file.name
        account(self.log, self.settings, file, bad)

    def _block(self, block: _Block) -> None:
        what = (
            f"is in a {block.what} of {block.count:,} rows whose columns hold {block.size:,} "
            f"bytes, more than data.max_block_bytes={self.settings.max_block_bytes:,}: passed "
            "over unread (raise data.max_block_bytes, or write the file in smaller row groups)"
        )
        bad = BadRow(
            "block_too_large",
            block.first_row,
            None,
            None,
            what,
            preview=f"rows {block.first_row}-{block.first_row + block.count - 1}",
        )
        bad.file = block.file.name
        self.log.read += block.count
        if self.settings.bad_rows == "error":
            account(self.log, self.settings, block.file, bad)  # raises
        record = bad.to_dict()
        record["last_row"] = block.first_row + block.count - 1
        self.log.add(record, count=block.count)


def wanted_columns(settings: CsvSettings) -> list[str]:
    pair = [settings.pair_column] if settings.pair_column else []
    return [settings.text_column, settings.label_column, *pair]


def _missing_columns(file: Path, present: Sequence[str], settings: CsvSettings) -> None:
    missing = [c for c in wanted_columns(settings) if c not in present]
    if missing:
        keys = "data.text_column / data.label_column"
        keys += " / data.text_pair_column" if settings.pair_column else ""
        raise CsvTextError(
            f"{file}: missing column {', '.join(map(repr, missing))}; columns present: "
            f"{', '.join(map(repr, present))} (set {keys})"
        )


# ---------------------------------------------------------------------------------------------
# Values to the strings a CSV would hold


class _Values:
    """Turns one column's values into strings: ClassLabel ints into their names, lists of labels
    joined by data.label_separator; anything else that is not a scalar is the wrong type."""

    def __init__(self, column: str, names: list[str] | None, separator: str | None, label: bool):
        self.column, self.names, self.separator, self.label = column, names, separator, label

    def __call__(self, value: Any) -> str:
        """The string, or raises _WrongType."""
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if self.label and isinstance(value, list | tuple):
            if self.separator is None:
                raise _WrongType(
                    f"holds a list of labels in column {self.column!r}: set "
                    "data.label_separator (e.g. '|') to read them as several labels per row"
                )
            return self.separator.join(self._scalar(v) for v in value)
        return self._scalar(value)

    def _scalar(self, value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int) and self.label and self.names is not None:
            return self.names[value] if 0 <= value < len(self.names) else ""  # -1: no label
        if isinstance(value, int | float):
            return str(value)
        if isinstance(value, str):
            return value
        raise _WrongType(
            f"holds a {type(value).__name__} in column {self.column!r}, not a text"
            + (" or a label" if self.label else "")
        )


class _WrongType(ValueError):
    pass


def _converters(settings: CsvSettings, features: dict) -> list[_Values]:
    """One converter per wanted column, with a `datasets` ClassLabel's names where it has one."""
    out = []
    for i, column in enumerate(wanted_columns(settings)):
        label = i == 1
        names = class_label_names(features.get(column)) if label else None
        out.append(_Values(column, names, settings.label_separator, label))
    return out


def class_label_names(feature: Any) -> list[str] | None:
    """The names of a `datasets` ClassLabel feature (or of a list of them: multi-label)."""
    if not isinstance(feature, dict):
        if isinstance(feature, list) and feature:  # datasets' old spelling of a list feature
            return class_label_names(feature[0])
        return None
    kind = feature.get("_type")
    if kind == "ClassLabel" and isinstance(feature.get("names"), list):
        return [str(name) for name in feature["names"]]
    if kind in ("Sequence", "List", "LargeList"):
        return class_label_names(feature.get("feature"))
    return None


def _schema_features(metadata: dict | None) -> dict:
    """The `datasets` features a Parquet or Arrow schema carries (b"huggingface" metadata)."""
    if not metadata or b"huggingface" not in metadata:
        return {}
    try:
        info = json.loads(metadata[b"huggingface"])
    except ValueError:
        return {}
    features = (info.get("info") or {}).get("features") or info.get("features") or {}
    return features if isinstance(features, dict) else {}


def _row_of(file, row, line, values, converters, raw_of):
    """A _Row of `values` (one per wanted column), or a _Bad when one has the wrong type."""
    fields = []
    for value, convert in zip(values, converters, strict=True):
        try:
            fields.append(convert(value))
        except _WrongType as err:
            return _Bad("wrong_type", file, row, line, convert.column, str(err), raw_of())
    return _Row(file, row, line, fields, raw_of())


def _raw(columns: Sequence[str], values: Sequence[Any]) -> str:
    """A record as its preview shows it: JSON, each value cut to a preview's length."""
    shown = {c: (v[:80] if isinstance(v, str) else v) for c, v in zip(columns, values, strict=True)}
    return json.dumps(shown, ensure_ascii=False, default=str)


# ---------------------------------------------------------------------------------------------
# Parquet, Arrow IPC (datasets folders), JSON Lines


def _parquet_records(files: list[Path], settings: CsvSettings):
    """Row group by row group, only the wanted columns, BATCH_ROWS rows at a time; a row group
    whose wanted columns hold more than data.max_block_bytes uncompressed is passed over."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns, row = wanted_columns(settings), 0
    for file in files:
        try:
            parquet = pq.ParquetFile(file, pre_buffer=False, buffer_size=1 << 20)
        except (pa.ArrowException, OSError) as err:
            raise CsvTextError(f"{file}: cannot be read as Parquet ({err})") from None
        _missing_columns(file, parquet.schema_arrow.names, settings)
        converters = _converters(settings, _schema_features(parquet.schema_arrow.metadata))
        meta = parquet.metadata
        for group in range(meta.num_row_groups):
            group_meta = meta.row_group(group)
            size = sum(
                group_meta.column(j).total_uncompressed_size
                for j in range(group_meta.num_columns)
                if group_meta.column(j).path_in_schema.split(".")[0] in columns
            )
            if size > settings.max_block_bytes:
                yield _Block(file, row + 1, group_meta.num_rows, size, "row group")
                row += group_meta.num_rows
                continue
            try:
                batches = parquet.iter_batches(BATCH_ROWS, row_groups=[group], columns=columns)
                for batch in batches:
                    row = yield from _batch_rows(file, batch, columns, converters, row)
            except pa.ArrowException as err:
                raise CsvTextError(f"{file}: row group {group} cannot be read ({err})") from None


def _batch_rows(file, batch, columns, converters, row):
    values = [batch.column(name).to_pylist() for name in columns]
    for record in zip(*values, strict=True):
        row += 1
        yield _row_of(file, row, None, record, converters, lambda r=record: _raw(columns, r))
    return row


def _arrow_records(files: list[Path], settings: CsvSettings):
    """Record batch by record batch from a memory map (Arrow IPC streams, as save_to_disk writes
    and `datasets` reads them): a batch's buffers stay in the file until read; one whose wanted
    columns hold more than data.max_block_bytes is passed over."""
    import pyarrow as pa

    columns, row = wanted_columns(settings), 0
    features = _folder_features(files[0].parent)
    for file in files:
        try:
            source = pa.memory_map(str(file))
            reader = pa.ipc.open_stream(source)
        except (pa.ArrowException, OSError) as err:
            raise CsvTextError(f"{file}: cannot be read as an Arrow stream ({err})") from None
        with source:
            _missing_columns(file, reader.schema.names, settings)
            converters = _converters(settings, features or _schema_features(reader.schema.metadata))
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except pa.ArrowException as err:
                    raise CsvTextError(f"{file}: after row {row}: {err}") from None
                size = sum(batch.column(name).nbytes for name in columns)
                if size > settings.max_block_bytes:
                    yield _Block(file, row + 1, batch.num_rows, size, "record batch")
                    row += batch.num_rows
                    continue
                for start in range(0, batch.num_rows, BATCH_ROWS):
                    part = batch.slice(start, BATCH_ROWS)
                    row = yield from _batch_rows(file, part, columns, converters, row)


def _folder_features(folder: Path) -> dict:
    info = folder / "dataset_info.json"
    if not info.is_file():
        return {}
    try:
        features = json.loads(info.read_text()).get("features") or {}
    except ValueError:
        return {}
    return features if isinstance(features, dict) else {}


def _jsonl_records(files: list[Path], settings: CsvSettings):
    """Line by line; a line longer than data.max_field_bytes is read in pieces and passed over."""
    columns, limit, row = wanted_columns(settings), settings.max_field_bytes, 0
    for file in files:
        with file.open(encoding=settings.encoding, errors="surrogateescape", newline="") as f:
            line, checked = 0, False
            while text := f.readline(limit + 1):
                line += 1
                row += 1
                if len(text) > limit and not text.endswith(("\n", "\r")):
                    size = len(text)
                    while piece := f.readline(SKIP_PIECE):
                        size += len(piece)
                        if piece.endswith(("\n", "\r")):
                            break
                    long = _TooLong(line, text[:60], size, limit, 0)
                    yield _too_long(file, row, line, long, limit)
                    continue
                body = text.strip()
                if not body:
                    yield _Row(file, row, line, [""] * len(columns), "")
                    continue
                if line == 1 and body.startswith("["):
                    raise CsvTextError(
                        f"{file}: a JSON array, not JSON Lines (one object per line); write one "
                        "record per line (pandas: to_json(orient='records', lines=True))"
                    )
                try:
                    value = json.loads(body)
                except (ValueError, RecursionError) as err:
                    what = f"is not JSON ({str(err).split(':')[0]})"
                    yield _Bad("not_json", file, row, line, None, what, body[:200])
                    continue
                if not isinstance(value, dict):
                    what = f"holds a JSON {type(value).__name__}, not an object of columns"
                    yield _Bad("wrong_type", file, row, line, None, what, body[:200])
                    continue
                if not checked:  # the first object names the columns, as a CSV's header does
                    _missing_columns(file, list(value), settings)
                    converters, checked = _converters(settings, {}), True
                values = [value.get(c) for c in columns]
                yield _row_of(file, row, line, values, converters, lambda b=body: b[:200])


def _too_long(file, row, line, long: _TooLong, limit: int) -> _Bad:
    what = (
        f"is longer than data.max_field_bytes={limit:,} (line {line}: {long.size:,} "
        "characters); it was passed over unread (raise data.max_field_bytes to read such texts)"
    )
    return _Bad("field_too_large", file, row, line, None, what, long.head)
