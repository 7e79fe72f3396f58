"""Text classification from a CSV (a text and a label column).

The data path, each step in its own module:

1. read the CSV in chunks and account for every row (kiln.data.csv_reader): kept, or dropped for
   a named reason, never silently;
2. clean each kept text (kiln.preprocessing.cleaning), spooling the cleaned texts to disk;
3. train a BPE tokenizer on the training rows, streamed from the spool, and encode every
   row with the Rust tokenizer's batch encoding into a memory-mapped token store
   (kiln.data.token_store), cached by the files' contents and every setting that changes ids.

A second run with the same files and settings loads the store and skips 1-3. The tokenizer and
the cleaning settings travel with every checkpoint (TokenRecipe), so `infer.py` and the server
clean and encode exactly as training did. With `train_path=null` a small demo corpus is
generated in code (built in memory, not cached), so the dataset works offline."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kiln.config.base import ConfigError
from kiln.config.data import CsvTextConfig
from kiln.data.bad_inputs import BadInputLog, summary_line
from kiln.data.csv_reader import (
    BadRow,
    CsvSettings,
    CsvTextError,
    RowChunk,
    drop_kept,
    preview,
    row_log,
)
from kiln.data.multilabel import multi_hot, split_labels
from kiln.data.spec import MULTILABEL, DataBundle, DataSpec, SourceNames, TextSample
from kiln.data.split import stratified_split, val_count
from kiln.data.text_corpus import demo_corpus
from kiln.data.text_formats import (
    read_rows,
    resolve_format,
    source_digest,
    source_files,
    source_name,
)
from kiln.data.token_store import (
    BASELINE,
    ENCODE_BATCH,
    STORE_VERSION,
    IdsWriter,
    PaddedTokens,
    StoreEntry,
    TextSpool,
    TokenDataset,
    built_in_memory,
    cache_key,
    cached_entry,
    default_cache_dir,
    save_entry,
)
from kiln.preprocessing import TokenRecipe
from kiln.preprocessing.cleaning import PAIR_SEP, TextCleaning, clean_texts
from kiln.preprocessing.pretrained import PretrainedText
from kiln.preprocessing.text import (
    PAD_ID,
    WordCachedEncoder,
    WordPieces,
    WordSpelling,
    _tokenizer_from_json,
    encode_ids,
    join_pair,
    pad_token_ids,
    split_pair,
    train_tokenizer,
)
from kiln.sorting import natural_key

log = logging.getLogger(__name__)

__all__ = ["CsvTextError", "build_csv_text", "collate_tokens", "demo_corpus", "split_rows"]


def cleaning_of(cfg: CsvTextConfig, pretrained: PretrainedText | None = None) -> TextCleaning:
    """data.*'s cleaning; with a pretrained tokenizer (model=hf), the steps that would change
    what the model was trained to read follow the tokenizer instead: no lower-casing (an
    uncased model's normalizer lower-cases by itself; a cased model must see the case) and no
    Unicode normalisation (the tokenizer's normalizer does what the model was trained with)."""
    if pretrained is not None:
        return TextCleaning(
            strip_html=cfg.strip_html,
            unescape_entities=cfg.unescape_entities,
            unicode_form="none",
            lowercase=False,
            normalize_whitespace=cfg.normalize_whitespace,
        )
    return TextCleaning(
        strip_html=cfg.strip_html,
        unescape_entities=cfg.unescape_entities,
        unicode_form=str(cfg.unicode_form),
        lowercase=cfg.lowercase,
        normalize_whitespace=cfg.normalize_whitespace,
    )


def text_pretrained(pretrained) -> PretrainedText | None:
    """The model's pretrained tokenizer, if the model has one (model=hf on a folder or hub id)."""
    return pretrained if isinstance(pretrained, PretrainedText) else None


def check_max_length(cfg: CsvTextConfig, pretrained: PretrainedText) -> None:
    if cfg.max_length > pretrained.position_limit:
        raise ConfigError(
            f"data.max_length={cfg.max_length} exceeds the {pretrained.position_limit} "
            f"positions of {pretrained.source}",
            "data.max_length",
            f"set data.max_length={pretrained.position_limit} or less",
        )


def log_pretrained_cleaning(cfg: CsvTextConfig, pretrained: PretrainedText) -> None:
    case = "lower-cases (an uncased model)" if pretrained.lowercase else "keeps case (cased)"
    followed = [
        f"data.{key}={value} not applied"
        for key, value in (("lowercase", cfg.lowercase), ("unicode_form", cfg.unicode_form))
        if str(value) not in ("False", "none")
    ]
    log.info(
        "data: the tokenizer of %s (pad id %d; max_length %d of %d positions); cleaning "
        "follows it: its normalizer %s%s",
        pretrained.source,
        pretrained.pad_id,
        cfg.max_length,
        pretrained.position_limit,
        case,
        f" ({', '.join(followed)})" if followed else "",
    )


def source_format(cfg: CsvTextConfig, path: str) -> str:
    """The format `path` is read in: data.format, or (auto) what the path is."""
    return resolve_format(path, str(cfg.format))


def csv_settings(cfg: CsvTextConfig, pretrained: PretrainedText | None = None) -> CsvSettings:
    return CsvSettings(
        text_column=cfg.text_column,
        label_column=cfg.label_column,
        encoding=cfg.encoding,
        na_values=frozenset(v.strip() for v in cfg.na_values),
        bad_rows=str(cfg.bad_rows),
        chunk_rows=cfg.chunk_rows,
        cleaning=cleaning_of(cfg, pretrained),
        max_field_lines=cfg.max_field_lines,
        max_field_bytes=cfg.max_field_bytes,
        # multi-label: a field holds several labels, judged once split (_multi_label_rows)
        labels=None
        if cfg.labels is None or cfg.label_separator is not None
        else frozenset(str(x).strip() for x in cfg.labels),
        pair_column=cfg.text_pair_column,
        label_separator=cfg.label_separator,
        max_block_bytes=cfg.max_block_bytes,
    )


# ---------------------------------------------------------------------------------------------
# Batching


def collate_tokens(
    batch: list[tuple[Tensor, Tensor]] | PaddedTokens, pad_id: int = PAD_ID
) -> tuple[Tensor, Tensor]:
    """[(ids (L_i,), label ())] -> (ids (N, L_max) padded with pad_id, labels (N,)); a batch
    the dataset already padded (TokenDataset.__getitems__) passes through. Module-level so
    DataLoader workers can pickle it (a pretrained tokenizer's pad_id: a functools.partial)."""
    if isinstance(batch, PaddedTokens):
        return batch.ids, batch.labels
    ids, labels = zip(*batch, strict=True)
    return pad_token_ids(list(ids), pad_id), torch.stack(labels)


def token_batch_metrics(batch: tuple[Tensor, Tensor], pad_id: int = PAD_ID) -> dict[str, Tensor]:
    """What the training log reports per interval: the padded share of the batch and the real
    tokens (logged as tokens_per_s). Computed on the device; no host sync."""
    padding = batch[0] == pad_id
    return {"padding_frac": padding.float().mean(), "tokens": (~padding).sum()}


# ---------------------------------------------------------------------------------------------
# The split


def split_rows(labels: np.ndarray, val_fraction: float, seed: int):
    """(train rows, val rows): round(n * val_fraction) rows for validation, stratified by label
    where every class can be in both splits, seeded by data.split_seed (kiln.data.split)."""
    num_val = val_count(len(labels), val_fraction, "rows", "data.val_path", CsvTextError)
    return stratified_split(labels, num_val, seed)


def _split(texts: list[str], labels: list[str], val_fraction: float, seed: int):
    """The split build_csv_text makes, on raw lists: (train texts, train labels, val texts,
    val labels). For callers that hold the raw texts (e.g. checking a predictor on them)."""
    names = {name: i for i, name in enumerate(sorted(set(labels), key=natural_key))}
    train, val = split_rows(np.array([names[y] for y in labels]), val_fraction, seed)
    return (
        [texts[i] for i in train],
        [labels[i] for i in train],
        [texts[i] for i in val],
        [labels[i] for i in val],
    )


# ---------------------------------------------------------------------------------------------
# Reading the files, then deciding the classes


@dataclass
class _FileRows:
    """What reading one file left in the spool: per kept row its label (a code into `names`,
    first-seen order), row, line and whether the reader flagged it."""

    path: str
    names: dict[str, int]
    codes: np.ndarray
    rows: np.ndarray
    lines: np.ndarray
    flagged: np.ndarray
    unit: str = "line"  # what `lines` counts: "row" for formats without lines (Parquet, Arrow)

    def label_counts(self, clean_only: bool = False) -> np.ndarray:
        codes = self.codes[~self.flagged] if clean_only else self.codes
        return np.bincount(codes, minlength=len(self.names))


def _spool_file(
    path: str, chunks: Iterable[RowChunk], spool: TextSpool, unit: str = "line"
) -> _FileRows:
    """Appends the chunks' cleaned texts to the spool and keeps the rest of each row."""
    names: dict[str, int] = {}
    codes, rows, lines, flagged = [], [], [], []
    for chunk in chunks:
        spool.append(chunk.texts)
        codes.append(np.array([names.setdefault(y, len(names)) for y in chunk.labels]))
        rows.append(np.array(chunk.rows))
        lines.append(np.array(chunk.lines))
        flagged.append(np.array(chunk.flagged, dtype=bool))

    def joined(parts, dtype):
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    return _FileRows(
        path,
        names,
        joined(codes, np.int64),
        joined(rows, np.int64),
        joined(lines, np.int64),
        joined(flagged, bool),
        unit,
    )


def _where(lines: Sequence[int], count: int, unit: str = "line") -> str:
    shown = ", ".join(map(str, lines[:5])) + (", ..." if count > 5 else "")
    return f"{unit} {shown}" if count == 1 else f"{count} rows: {unit}s {shown}"


def _hydra_list(labels: Iterable[str]) -> str:
    """Labels as a Hydra override list: plain names bare, others quoted."""
    quoted = [
        name if re.fullmatch(r"[\w.-]+", name) else "'" + name.replace("'", "\\'") + "'"
        for name in labels
    ]
    return "[" + ",".join(quoted) + "]"


def _suspects(cfg: CsvTextConfig, read: _FileRows) -> dict[str, dict]:
    """Labels seen only in flagged rows, or in fewer than data.min_rows_per_class rows."""
    total, clean = read.label_counts(), read.label_counts(clean_only=True)
    found = {}
    for name, code in read.names.items():
        if clean[code] == 0 or total[code] < cfg.min_rows_per_class:
            lines = read.lines[read.codes == code][:5].tolist()
            found[name] = {"rows": int(total[code]), "clean_rows": int(clean[code]), "lines": lines}
    return dict(sorted(found.items(), key=lambda item: natural_key(item[0])))


def _suspect_error(cfg: CsvTextConfig, read: _FileRows, suspects: dict, classes) -> CsvTextError:
    shown = "; ".join(
        f"{name!r} ({_where(info['lines'], info['rows'], read.unit)})"
        for name, info in suspects.items()
    )
    return CsvTextError(
        f"{read.path}: {len(suspects)} suspect label(s), seen only in rows next to broken records "
        f"or in fewer than {cfg.min_rows_per_class} rows (data.min_rows_per_class): {shown}; name "
        f"the classes with data.labels={_hydra_list(classes)}, or drop these rows and go on with "
        f"data.max_suspect_labels={len(suspects)}"
    )


def _train_classes(cfg: CsvTextConfig, read: _FileRows) -> tuple[list[str], dict[str, dict]]:
    """(the classes, the suspect labels whose rows are left out). CsvTextError when the
    suspects are more than data.max_suspect_labels, or a class of data.labels has no row."""
    if cfg.labels is not None:
        listed = sorted({str(label).strip() for label in cfg.labels}, key=natural_key)
        empty = [name for name in listed if name not in read.names]
        if empty:
            raise CsvTextError(
                f"{read.path}: data.labels names {', '.join(map(repr, empty))}, but no kept "
                f"training row has it; labels seen: {', '.join(map(repr, read.names))}"
            )
        return listed, {}
    suspects = _suspects(cfg, read)
    classes = sorted((n for n in read.names if n not in suspects), key=natural_key)
    if len(suspects) > cfg.max_suspect_labels:
        raise _suspect_error(cfg, read, suspects, classes)
    if len(classes) < 2:
        only = f"label {classes[0]!r}" if classes else "no label"
        raise CsvTextError(
            f"{read.path}: every kept row has {only}; classification needs two classes"
        )
    return classes, suspects


def _leave_out(read, keep, reason, what, spool_texts, settings, log: BadInputLog) -> None:
    """Drops the rows of `read` where not keep[i], after the fact, each named in `log`."""
    column = settings.label_column
    by_code = {code: name for name, code in read.names.items()}
    for i in np.flatnonzero(~keep).tolist():
        label = by_code[int(read.codes[i])]
        bad = BadRow(
            reason,
            int(read.rows[i]),
            int(read.lines[i]) if read.unit == "line" else None,
            column,
            what(label),
            preview=preview(f"{spool_texts[i]},{label}"),
        )
        drop_kept(log, settings, read.path, bad)


def _class_index(read: _FileRows, classes: list[str]) -> np.ndarray:
    """Per row its class index, -1 where the label is not a class."""
    index = {name: i for i, name in enumerate(classes)}
    by_code = np.array([index.get(name, -1) for name in read.names], dtype=np.int64)
    return by_code[read.codes] if len(read.codes) else read.codes


def _texts_of(spool: TextSpool, first: int, rows: np.ndarray) -> dict[int, str]:
    """The spooled texts of a few rows (offsets within a file that starts at `first`)."""
    if len(rows) == 0:
        return {}
    keep = np.zeros(len(spool), dtype=bool)
    keep[first + rows] = True
    texts = [text for batch in spool.batches(ENCODE_BATCH, keep=keep) for text in batch]
    return dict(zip(rows.tolist(), texts, strict=True))


def _read_files(cfg, spool, train: _FileRows, val: _FileRows | None, logs, settings):
    """Decides the classes from the training rows, then judges the validation rows by them:
    (class index per spooled row, -1 for a row left out; classes; what was left out).
    Multi-label: per row the index of its label set in out["label_sets"]."""
    if cfg.label_separator is not None:
        return _multi_label_rows(cfg, spool, train, val, logs, settings)
    classes, suspects = _train_classes(cfg, train)
    labels = _class_index(train, classes)
    out = {"suspect_labels": suspects, "unseen_labels": {}}
    if suspects:
        dropped = np.flatnonzero(labels < 0)
        texts = _texts_of(spool, 0, dropped)
        _leave_out(
            train,
            labels >= 0,
            "suspect_label",
            lambda label: (
                f"has the label {label!r}, seen only in rows next to broken records or in "
                f"fewer than {cfg.min_rows_per_class} rows: a suspect, not a class"
            ),
            texts,
            settings,
            logs["train_file"],
        )
        log.warning(
            "data: %s: left out %d row(s) of %d suspect label(s) (data.max_suspect_labels=%d): %s",
            train.path,
            int((labels < 0).sum()),
            len(suspects),
            cfg.max_suspect_labels,
            "; ".join(
                f"{n!r} ({_where(i['lines'], i['rows'], train.unit)})" for n, i in suspects.items()
            ),
        )
    if val is None:
        return labels, classes, out
    val_labels = _class_index(val, classes)
    unseen = np.flatnonzero(val_labels < 0)
    if len(unseen):
        texts = _texts_of(spool, len(train.codes), unseen)
        _leave_out(
            val,
            val_labels >= 0,
            "unseen_label",
            lambda label: (
                f"has a label not in the training data ({label!r}) in column "
                f"{settings.label_column!r}; training classes: {', '.join(classes)}"
            ),
            texts,
            settings,
            logs["val_file"],
        )
        by_code = {code: name for name, code in val.names.items()}
        names = [by_code[int(c)] for c in val.codes[unseen]]
        counts = {name: names.count(name) for name in sorted(set(names), key=natural_key)}
        out["unseen_labels"] = counts
        log.warning(
            "data: %s: %d row(s) have labels the training data does not have (%s); they are "
            "left out of validation (val_acc, val_loss) and listed as unseen_label",
            val.path,
            len(unseen),
            ", ".join(f"{n!r} {c}" for n, c in counts.items()),
        )
    return np.concatenate([labels, val_labels]), classes, out


def _label_parts(read: _FileRows, separator: str) -> dict[int, tuple[str, ...]]:
    """Per label code of `read` (a distinct label field) the labels it holds."""
    return {code: split_labels(name, separator) for name, code in read.names.items()}


def _multi_label_classes(cfg: CsvTextConfig, read: _FileRows, parts) -> tuple[list[str], dict]:
    """The classes of multi-label training rows: every label of a clean row, or data.labels;
    a label seen only in flagged rows or in fewer than data.min_rows_per_class rows is a
    suspect, as for one label per row."""
    total, clean = read.label_counts(), read.label_counts(clean_only=True)
    rows, clean_rows, codes_of = Counter(), Counter(), defaultdict(list)
    for code, labels in parts.items():
        for label in labels:
            rows[label] += int(total[code])
            clean_rows[label] += int(clean[code])
            codes_of[label].append(code)
    if cfg.labels is not None:
        listed = sorted({str(label).strip() for label in cfg.labels}, key=natural_key)
        empty = [name for name in listed if name not in rows]
        if empty:
            raise CsvTextError(
                f"{read.path}: data.labels names {', '.join(map(repr, empty))}, but no kept "
                f"training row has it; labels seen: {', '.join(map(repr, rows))}"
            )
        return listed, {}
    suspects = {}
    for label in sorted(rows, key=natural_key):
        if clean_rows[label] == 0 or rows[label] < cfg.min_rows_per_class:
            lines = read.lines[np.isin(read.codes, codes_of[label])][:5].tolist()
            suspects[label] = {"rows": rows[label], "clean_rows": clean_rows[label], "lines": lines}
    classes = sorted((n for n in rows if n not in suspects), key=natural_key)
    if len(suspects) > cfg.max_suspect_labels:
        raise _suspect_error(cfg, read, suspects, classes)
    if len(classes) < 2:
        only = f"label {classes[0]!r}" if classes else "no label"
        raise CsvTextError(
            f"{read.path}: every kept row has {only}; classification needs two classes"
        )
    return classes, suspects


def _multi_label_rows(cfg, spool, train: _FileRows, val: _FileRows | None, logs, settings):
    """_read_files for data.label_separator: the classes are the union of the training rows'
    labels; per spooled row the index of its label set (-1: left out). A row whose field splits
    into no label is missing_label; one holding a suspect label suspect_label, a label
    data.labels lacks unlisted_label, and (validation) a label training lacks unseen_label."""
    separator, column = cfg.label_separator, settings.label_column
    train_parts = _label_parts(train, separator)
    classes, suspects = _multi_label_classes(cfg, train, train_parts)
    index = {name: i for i, name in enumerate(classes)}
    sets: dict[tuple[int, ...], int] = {}
    out = {"suspect_labels": suspects, "unseen_labels": {}}

    def judge(read: _FileRows, parts, unknown_reason: str, first: int, log_: BadInputLog):
        reasons: dict[int, str] = {}
        per_code = np.full(len(read.names), -1, dtype=np.int64)
        for code, labels in parts.items():
            if not labels:
                reasons[code] = "missing_label"
            elif any(label not in index for label in labels):
                unknown = [label for label in labels if label not in index]
                reasons[code] = "suspect_label" if set(unknown) <= set(suspects) else unknown_reason
            else:
                key = tuple(sorted(index[label] for label in labels))
                per_code[code] = sets.setdefault(key, len(sets))
        row_sets = per_code[read.codes] if len(read.codes) else read.codes
        for reason in sorted(set(reasons.values())):
            codes = [code for code, why in reasons.items() if why == reason]
            out_rows = np.isin(read.codes, codes)
            texts = _texts_of(spool, first, np.flatnonzero(out_rows))
            _leave_out(
                read,
                ~out_rows,
                reason,
                lambda label, reason=reason: _multi_label_why(
                    reason, label, column, separator, classes
                ),
                texts,
                settings,
                log_,
            )
            if reason == "unseen_label":
                unseen = Counter(
                    label for code in codes for label in parts[code] if label not in index
                )
                out["unseen_labels"] = dict(sorted(unseen.items()))
            log.warning(
                "data: %s: left out %d row(s) as %s (see data_report.json)",
                read.path,
                int(out_rows.sum()),
                reason,
            )
        return row_sets

    unknown = "unlisted_label" if cfg.labels is not None else "suspect_label"
    labels = judge(train, train_parts, unknown, 0, logs["train_file"])
    if val is not None:
        val_sets = judge(
            val, _label_parts(val, separator), "unseen_label", len(train.codes), logs["val_file"]
        )
        labels = np.concatenate([labels, val_sets])
    out["label_sets"] = [list(key) for key in sets]
    return labels, classes, out


def _multi_label_why(reason: str, field: str, column: str, separator: str, classes) -> str:
    if reason == "missing_label":
        return f"has no label in column {column!r} once split on {separator!r} ({field!r})"
    if reason == "suspect_label":
        return (
            f"has a suspect label in {field!r} (column {column!r}), seen only in rows next to "
            "broken records or in too few rows (data.min_rows_per_class): a suspect, not a class"
        )
    if reason == "unlisted_label":
        return f"has a label that data.labels does not name in {field!r} (column {column!r})"
    return (
        f"has a label not in the training data in {field!r} (column {column!r}); training "
        f"classes: {', '.join(classes)}"
    )


# ---------------------------------------------------------------------------------------------
# Building a token store


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


def _train_val_rows(cfg: CsvTextConfig, labels: np.ndarray, num_train: int, logs):
    """(train rows, val rows) among the rows with a class."""
    if cfg.val_path is None:
        usable = np.flatnonzero(labels >= 0)
        train, val = split_rows(labels[usable], cfg.val_fraction, cfg.split_seed)
        return usable[train], usable[val]
    train = np.flatnonzero(labels[:num_train] >= 0)
    val = num_train + np.flatnonzero(labels[num_train:] >= 0)
    if len(val) == 0:
        raise CsvTextError(f"{cfg.val_path}: no usable rows ({logs['val_file'].summary()})")
    return train, val


BASELINE_TEXT_CHARS = 2000  # of each text, for the baseline: bounds its character n-grams
SAMPLE_READ = 64  # sampled texts per read of the spool (one read spans the rows between them)


def baseline_sample(spool, labels, train_rows, val_rows, cfg: CsvTextConfig) -> dict:
    """At most data.baseline_rows training and as many validation texts (seeded samples), each
    cut to BASELINE_TEXT_CHARS, with their class indices: kiln.data.spec.TextSample's fields."""
    rng = np.random.default_rng(cfg.split_seed)

    def pick(rows: np.ndarray) -> np.ndarray:
        chosen = np.arange(len(rows))
        if len(rows) > cfg.baseline_rows:
            chosen = np.sort(rng.choice(len(rows), size=cfg.baseline_rows, replace=False))
        return chosen

    def texts(rows: np.ndarray) -> list[str]:
        keep = np.zeros(len(labels), dtype=bool)
        keep[rows] = True
        order = np.argsort(rows, kind="stable")  # the spool reads in row order
        read = [
            t[:BASELINE_TEXT_CHARS]
            for b in _joined(spool.batches(SAMPLE_READ, keep=keep))
            for t in b
        ]
        out = [""] * len(rows)
        for text, i in zip(read, order.tolist(), strict=True):
            out[i] = text
        return out

    train_pick, val_pick = pick(train_rows), pick(val_rows)
    return {
        "train_texts": texts(train_rows[train_pick]),
        "train_labels": labels[train_rows[train_pick]].tolist(),
        "val_texts": texts(val_rows[val_pick]),
        "val_labels": labels[val_rows[val_pick]].tolist(),
        "val_positions": val_pick.tolist(),
        "train_total": int(len(train_rows)),
        "val_total": int(len(val_rows)),
    }


def _tokenizer_sample(train_rows: np.ndarray, size: int, seed: int) -> np.ndarray:
    """At most `size` training rows, a seeded sample: the merges a tokenizer learns settle long
    before a million rows, while its memory grows with every distinct word it sees."""
    if len(train_rows) <= size:
        return train_rows
    return np.random.default_rng(seed).choice(train_rows, size=size, replace=False)


def _joined(batches: Iterable[list[str]]) -> Iterator[list[str]]:
    """Spooled texts for kiln's own tokenizer (and data.join_columns): a pair's two texts
    joined into one (join_pair)."""
    for texts in batches:
        yield [join_pair(*split_pair(text)) if PAIR_SEP in text else text for text in texts]


def _encode_spool(
    spool: TextSpool,
    tokenizer,
    max_length: int,
    directory: Path,
    pieces: WordPieces,
    spelling: WordSpelling | None = None,
) -> np.ndarray:
    """Every spooled text's ids into the store's ids file (unknown words spelled when the model
    asks: `spelling`); returns the offsets."""
    writer = IdsWriter(directory)
    encode = WordCachedEncoder(tokenizer, max_length, pieces=pieces, spelling=spelling)
    for texts in _joined(spool.batches(ENCODE_BATCH)):
        writer.append_flat(*encode(texts))
    spool.path.unlink()  # the cleaned texts were only needed until now
    return writer.finish()


def _encode_spool_pretrained(
    spool: TextSpool, tokenizer, pretrained: PretrainedText, directory: Path, join: bool = False
) -> np.ndarray:
    """Every spooled text's ids by the model's own tokenizer (its special tokens added,
    truncated to data.max_length) into the store's ids file; returns the offsets. A pair is
    fed as tokenizer(a, b), or (`join`: data.join_columns) as one text."""
    writer = IdsWriter(directory)
    unk_id = pretrained.pad_id if pretrained.unk_id is None else pretrained.unk_id
    batches = spool.batches(ENCODE_BATCH)
    for texts in _joined(batches) if join else batches:
        writer.append(encode_ids(tokenizer, [split_pair(text) for text in texts], unk_id))
    spool.path.unlink()
    return writer.finish()


def _store_report(
    cfg,
    logs,
    class_names,
    labels,
    train_rows,
    val_rows,
    tokenizer,
    offsets,
    pretrained=None,
    label_sets=None,
):
    lengths = np.diff(offsets)
    table = None if label_sets is None else multi_hot(label_sets, len(class_names))

    def counts(rows):
        if table is not None:  # multi-label: the rows holding each class
            per_class = table[labels[rows]].sum(axis=0).astype(np.int64).tolist()
            return dict(zip(class_names, per_class, strict=True))
        per_class = np.bincount(labels[rows], minlength=len(class_names)).tolist()
        return dict(zip(class_names, per_class, strict=True))

    files = {name: entry.to_dict() for name, entry in logs.items()}
    return {
        **files,
        "summary": [summary_line(entry) for entry in files.values()],
        "classes": class_names,
        "rows": {"train": int(len(train_rows)), "val": int(len(val_rows))},
        "class_counts": {"train": counts(train_rows), "val": counts(val_rows)},
        "tokens": {
            "vocab_size": tokenizer.get_vocab_size(),
            "max_length": cfg.max_length,
            "mean_length": float(lengths.mean()),
            "rows_at_max_length": int((lengths >= cfg.max_length).sum()),
        },
        "cleaning": cleaning_of(cfg, pretrained).to_dict(),
        "tokenizer": pretrained.source if pretrained else f"learned ({cfg.tokenizer})",
    }


def build_entry(
    directory: Path,
    cfg: CsvTextConfig,
    train_chunks: Iterable[RowChunk],
    val_chunks: Iterable[RowChunk] | None,
    logs: dict[str, BadInputLog],
    settings: CsvSettings,
    pretrained: PretrainedText | None = None,
    spelling: WordSpelling | None = None,
) -> None:
    """Writes a token store into `directory`: read + clean (chunks) -> spool on disk -> the
    classes, from the clean training rows -> tokenizer trained on the training rows of the
    spool -> every row's ids. The validation file is read on its own, then judged by the
    training classes."""
    timings: dict[str, float] = {}
    spool = TextSpool(directory / "texts.utf8")
    with _timed(timings, "read_clean_s"):
        train = _spool_file(
            logs["train_file"].path, train_chunks, spool, _unit(cfg, cfg.train_path)
        )
        val = None
        if val_chunks is not None:
            val = _spool_file(cfg.val_path, val_chunks, spool, _unit(cfg, cfg.val_path))
        spool.close()
        labels, class_names, left_out = _read_files(cfg, spool, train, val, logs, settings)
    lines = train.lines if val is None else np.concatenate([train.lines, val.lines])
    rows = train.rows if val is None else np.concatenate([train.rows, val.rows])
    train_rows, val_rows = _train_val_rows(cfg, labels, len(train.codes), logs)
    if cfg.baseline_rows and cfg.label_separator is None:  # before the encoding drops the spool
        with _timed(timings, "baseline_sample_s"):
            sample = baseline_sample(spool, labels, train_rows, val_rows, cfg)
        (directory / BASELINE).write_text(json.dumps(sample, ensure_ascii=False))
    if pretrained is not None:  # the model's own tokenizer: nothing to learn
        tokenizer = _tokenizer_from_json(pretrained.tokenizer_json, cfg.max_length)
        with _timed(timings, "encode_s"):
            offsets = _encode_spool_pretrained(
                spool, tokenizer, pretrained, directory, cfg.join_columns
            )
    else:
        with _timed(timings, "tokenizer_s"):
            learn_from = _tokenizer_sample(train_rows, cfg.tokenizer_rows, cfg.split_seed)
            keep = np.zeros(len(labels), dtype=bool)
            keep[learn_from] = True
            texts = _joined(spool.batches(ENCODE_BATCH, keep=keep))
            pieces = WordPieces()  # the training words, split once for the vocabulary and ids
            tokenizer = train_tokenizer(
                texts,
                cfg.vocab_size,
                cfg.max_length,
                len(learn_from),
                str(cfg.tokenizer),
                pieces,
                min_count=cfg.min_token_count,
            )
        with _timed(timings, "encode_s"):
            offsets = _encode_spool(spool, tokenizer, cfg.max_length, directory, pieces, spelling)
    label_sets = left_out.pop("label_sets", None)  # multi-label: each set's classes
    report = _store_report(
        cfg,
        logs,
        class_names,
        labels,
        train_rows,
        val_rows,
        tokenizer,
        offsets,
        pretrained,
        label_sets,
    )
    report.update(left_out)
    report["build_timings_s"] = timings  # read + clean, tokenizer, encode: when it was built
    meta = {"class_names": class_names, "vocab_size": tokenizer.get_vocab_size(), "report": report}
    if label_sets is not None:
        meta["label_sets"] = label_sets
    save_entry(
        directory, offsets, labels, lines, rows, train_rows, val_rows, tokenizer.to_str(), meta
    )


def _unit(cfg: CsvTextConfig, path: str | None) -> str:
    """What a file's records are placed by: lines (CSV, JSON Lines) or rows only."""
    if path is None:
        return "line"
    return "row" if source_format(cfg, path) in ("parquet", "datasets") else "line"


def _demo_chunks(
    cfg: CsvTextConfig, log_: BadInputLog, pretrained: PretrainedText | None = None
) -> list[RowChunk]:
    texts, labels = demo_corpus()
    rows = list(range(1, len(texts) + 1))
    log_.read = log_.kept = len(texts)
    lines = [row + 1 for row in rows]  # after the header line a CSV of them would have
    cleaned = clean_texts(texts, cleaning_of(cfg, pretrained))
    return [RowChunk(cleaned, labels, rows, lines, [False] * len(rows))]


def _key_inputs(
    cfg: CsvTextConfig,
    pretrained: PretrainedText | None = None,
    spelling: WordSpelling | None = None,
) -> dict:
    """Everything that changes the stored ids, labels or split (a pretrained tokenizer: its
    hash; unknown words spelled: the n-gram lengths)."""
    settings = csv_settings(cfg, pretrained)
    inputs = {
        "store_version": STORE_VERSION,
        "tokenizers": version("tokenizers"),
        "train_sha256": source_digest(cfg.train_path, source_format(cfg, cfg.train_path)),
        "val_sha256": source_digest(cfg.val_path, source_format(cfg, cfg.val_path))
        if cfg.val_path
        else None,
        "formats": [source_format(cfg, p) for p in filter(None, (cfg.train_path, cfg.val_path))],
        "max_block_bytes": cfg.max_block_bytes,
        "split": None if cfg.val_path else [cfg.val_fraction, cfg.split_seed],
        "columns": [settings.text_column, settings.label_column]
        + ([settings.pair_column] if settings.pair_column else []),
        "join_columns": cfg.join_columns,
        "label_separator": cfg.label_separator,
        "encoding": settings.encoding,
        "na_values": sorted(settings.na_values),
        "bad_rows": settings.bad_rows,
        "labels": None if settings.labels is None else sorted(settings.labels),
        "min_rows_per_class": cfg.min_rows_per_class,
        "max_suspect_labels": cfg.max_suspect_labels,
        "max_field_lines": cfg.max_field_lines,
        "max_field_bytes": cfg.max_field_bytes,
        "cleaning": settings.cleaning.to_dict(),
        "tokenizer": str(cfg.tokenizer),
        "vocab_size": cfg.vocab_size,
        "min_token_count": cfg.min_token_count,
        "tokenizer_rows": cfg.tokenizer_rows,
        "max_length": cfg.max_length,
        "baseline_rows": cfg.baseline_rows,
    }
    if pretrained is not None:  # the model's own tokenizer, by its hash
        inputs["pretrained_tokenizer"] = pretrained.tokenizer_sha256
    if spelling is not None:
        inputs["spelled_char_ngrams"] = list(spelling.char_ngrams)
    return inputs


def prepare(
    cfg: CsvTextConfig,
    pretrained: PretrainedText | None = None,
    spelling: WordSpelling | None = None,
) -> tuple[StoreEntry, dict]:
    """The token store for `cfg` (from the cache when it is there) and its data report.
    `spelling`: the model's WordSpelling (text_bow), unknown words spelled after their [UNK]."""
    start = time.perf_counter()
    settings = csv_settings(cfg, pretrained)
    if cfg.train_path is None:
        logs = {"train_file": row_log("demo corpus")}
        entry = built_in_memory(
            lambda d: build_entry(
                d,
                cfg,
                _demo_chunks(cfg, logs["train_file"], pretrained),
                None,
                logs,
                settings,
                pretrained,
                spelling,
            )
        )
        cache = {"dir": None, "hit": False}
    else:
        formats = {p: source_format(cfg, p) for p in filter(None, (cfg.train_path, cfg.val_path))}
        for path, fmt in formats.items():
            source_files(path, fmt)  # there, and the files it stands for: or one error line
            if fmt != "csv" and cfg.encoding != "utf-8":
                log.warning(
                    "data.encoding=%s is not applied to %s (%s holds UTF-8 text)",
                    cfg.encoding,
                    path,
                    fmt,
                )
        root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
        stem = Path(source_name(cfg.train_path)).stem
        name = f"{stem}-{cache_key(_key_inputs(cfg, pretrained, spelling))}"
        logs = {"train_file": row_log(str(cfg.train_path))}
        if cfg.val_path is not None:
            logs["val_file"] = row_log(str(cfg.val_path))

        def build(directory: Path) -> None:
            fmt = formats[cfg.train_path]
            train = read_rows(cfg.train_path, settings, logs["train_file"], fmt)
            val = None
            if cfg.val_path is not None:
                # Read on its own: its own labels re-synchronise it, and a label the training
                # classes lack is judged after (unseen_label), data.labels or not.
                own = dataclasses.replace(settings, labels=None)
                val = read_rows(cfg.val_path, own, logs["val_file"], formats[cfg.val_path])
            build_entry(directory, cfg, train, val, logs, settings, pretrained, spelling)

        entry, hit = cached_entry(root, name, build)
        cache = {"dir": str(root / name), "hit": hit}
    report = {**entry.meta["report"], "cache": cache, "prepare_s": time.perf_counter() - start}
    return entry, report


def log_report(report: dict) -> None:
    """The files' totals, then the class table (label, train rows, val rows)."""
    for name in ("train_file", "val_file"):
        if name in report:
            entry = report[name]
            line = "data: " + summary_line(entry)
            if entry["rows_dropped"]:
                log.warning("%s; each is listed in data_report.json", line)
            else:
                log.info("%s", line)
    rows, cache = report["rows"], report["cache"]
    log.info(
        "data: %d train / %d val rows, %d classes, %.0f tokens per text on average; prepared in "
        "%.1f s (%s)",
        rows["train"],
        rows["val"],
        len(report["classes"]),
        report["tokens"]["mean_length"],
        report["prepare_s"],
        "cache off"
        if cache["dir"] is None
        else f"cache {'hit' if cache['hit'] else 'built'}: {cache['dir']}",
    )
    for line in class_table(report):
        log.info("data: %s", line)


def class_table(report: dict) -> list[str]:
    """The classes with their rows in each split, one line each, aligned."""
    counts = report["class_counts"]
    width = max(len("label"), *(len(name) for name in report["classes"]))
    lines = [f"{'label':<{width}}  {'train':>8}  {'val':>8}"]
    for name in report["classes"]:
        train, val = counts["train"][name], counts["val"][name]
        lines.append(f"{name:<{width}}  {train:>8,}  {val:>8,}")
    return lines


def vocabulary(tokenizer_json: str) -> tuple[str, ...]:
    """The tokenizer's tokens by id (its model's vocabulary and its added special tokens)."""
    tokenizer = json.loads(tokenizer_json)
    by_id = {i: token for token, i in tokenizer["model"]["vocab"].items()}
    by_id.update({added["id"]: added["content"] for added in tokenizer.get("added_tokens", [])})
    return tuple(by_id.get(i, "") for i in range(max(by_id) + 1))


def build_csv_text(cfg: CsvTextConfig, *, pretrained=None) -> DataBundle:
    """The bundle for data=csv_text. `pretrained`: the model's PretrainedText (model=hf on a
    folder or hub id): its own tokenizer instead of one learned from the data; or the model's
    WordSpelling (text_bow): unknown words spelled after their [UNK]."""
    spelling = pretrained if isinstance(pretrained, WordSpelling) else None
    pretrained = text_pretrained(pretrained)
    if pretrained is not None:
        check_max_length(cfg, pretrained)
        log_pretrained_cleaning(cfg, pretrained)
    entry, report = prepare(cfg, pretrained, spelling)
    log_report(report)
    class_names = tuple(entry.meta["class_names"])
    pad_id = PAD_ID if pretrained is None else pretrained.pad_id
    multi_label = cfg.label_separator is not None
    targets = multi_hot(entry.meta["label_sets"], len(class_names)) if multi_label else None
    train = TokenDataset(entry.store, entry.train_rows, pad_id, targets)
    val = TokenDataset(entry.store, entry.val_rows, pad_id, targets)
    spec = DataSpec(
        task=MULTILABEL if multi_label else "classification",
        input_kind="tokens",
        num_classes=len(class_names),
        class_names=class_names,
        vocab_size=entry.meta["vocab_size"],
        max_length=cfg.max_length,
        pad_id=pad_id,
        # the vocabulary's strings, for models that look inside words (text_bow): kiln's own
        tokens=vocabulary(entry.tokenizer_json) if pretrained is None else None,
        label_separator=cfg.label_separator,
        threshold=cfg.threshold,
    )
    recipe = TokenRecipe(
        pretrained.tokenizer_json if pretrained is not None else entry.tokenizer_json,
        cfg.max_length,
        class_names,
        pad_id,
        cleaning=cleaning_of(cfg, pretrained),
        text_column=cfg.text_column,
        label_column=cfg.label_column,
        encoding=cfg.encoding,
        pair_column=cfg.text_pair_column,
        join_columns=cfg.join_columns,
        pretrained=pretrained.to_dict() if pretrained is not None else None,
        spell_char_ngrams=spelling.char_ngrams if spelling is not None else None,
    )
    same_pad = pad_id == PAD_ID  # the plain functions, else bound to the tokenizer's padding
    return DataBundle(
        spec=spec,
        train=train,
        val=val,
        recipe=recipe,
        collate_fn=collate_tokens if same_pad else functools.partial(collate_tokens, pad_id=pad_id),
        batch_metrics=token_batch_metrics
        if same_pad
        else functools.partial(token_batch_metrics, pad_id=pad_id),
        report=report,
        bucket_lengths=train.lengths if cfg.bucket_by_length else None,
        val_lengths=val.lengths if cfg.bucket_by_length else None,
        sources={
            "train": split_sources(cfg, entry, "train"),
            "val": split_sources(cfg, entry, "val"),
        },
        baseline=None if entry.baseline is None else TextSample.from_dict(entry.baseline),
    )


def split_sources(cfg: CsvTextConfig, entry: StoreEntry, split: str) -> SourceNames:
    """ "<file> row N" per item of the split: its row of data.val_path, or of the training file
    the split came from (numbered from 1 after the header, as data_report.json numbers them)."""
    path = cfg.val_path if split == "val" and cfg.val_path else cfg.train_path
    name = source_name(path) if path is not None else "demo corpus"
    return SourceNames(f"{name} row {{}}", entry.source_rows[getattr(entry, f"{split}_rows")])
