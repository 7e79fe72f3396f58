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
import logging
import time
from collections.abc import Callable, Iterable
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from sklearn.model_selection import train_test_split
from torch import Tensor

from kiln.config.data import CsvTextConfig
from kiln.data.csv_reader import (
    BadRowLog,
    CsvSettings,
    CsvTextError,
    RowChunk,
    read_labelled_rows,
)
from kiln.data.spec import DataBundle, DataSpec, SourceNames
from kiln.data.text_corpus import demo_corpus
from kiln.data.token_store import (
    ENCODE_BATCH,
    STORE_VERSION,
    IdsWriter,
    StoreEntry,
    TextSpool,
    TokenDataset,
    built_in_memory,
    cache_key,
    cached_entry,
    default_cache_dir,
    file_digest,
    save_entry,
)
from kiln.preprocessing import TokenRecipe
from kiln.preprocessing.cleaning import TextCleaning, clean_texts
from kiln.preprocessing.text import PAD_ID, encode_ids, pad_token_ids, train_tokenizer
from kiln.sorting import natural_key

log = logging.getLogger(__name__)

__all__ = ["CsvTextError", "build_csv_text", "collate_tokens", "demo_corpus", "split_rows"]


def cleaning_of(cfg: CsvTextConfig) -> TextCleaning:
    return TextCleaning(
        strip_html=cfg.strip_html,
        unescape_entities=cfg.unescape_entities,
        unicode_form=str(cfg.unicode_form),
        lowercase=cfg.lowercase,
        normalize_whitespace=cfg.normalize_whitespace,
    )


def csv_settings(cfg: CsvTextConfig) -> CsvSettings:
    return CsvSettings(
        text_column=cfg.text_column,
        label_column=cfg.label_column,
        encoding=cfg.encoding,
        na_values=frozenset(v.strip() for v in cfg.na_values),
        bad_rows=str(cfg.bad_rows),
        chunk_rows=cfg.chunk_rows,
        cleaning=cleaning_of(cfg),
    )


# ---------------------------------------------------------------------------------------------
# Batching


def collate_tokens(batch: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """[(ids (L_i,), label ())] -> (ids (N, L_max) padded with PAD_ID, labels (N,)).
    Module-level so DataLoader workers can pickle it."""
    ids, labels = zip(*batch, strict=True)
    return pad_token_ids(list(ids)), torch.stack(labels)


def token_batch_metrics(batch: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
    """What the training log reports per interval: the padded share of the batch and the real
    tokens (logged as tokens_per_s). Computed on the device; no host sync."""
    padding = batch[0] == PAD_ID
    return {"padding_frac": padding.float().mean(), "tokens": (~padding).sum()}


# ---------------------------------------------------------------------------------------------
# The split


def split_rows(labels: np.ndarray, val_fraction: float, seed: int):
    """(train rows, val rows): round(n * val_fraction) rows for validation, stratified by label
    where every class can be in both splits, seeded by data.split_seed."""
    n = len(labels)
    num_val = round(n * val_fraction)
    if num_val < 1 or num_val >= n:
        raise CsvTextError(
            f"data.val_fraction={val_fraction} of {n} rows leaves an empty split; "
            "use more rows, another val_fraction, or data.val_path"
        )
    counts = np.bincount(labels)
    counts = counts[counts > 0]
    # Stratify only where sklearn can: every class twice, and room for each class in both splits.
    can_stratify = counts.min() >= 2 and len(counts) <= num_val <= n - len(counts)
    return train_test_split(
        np.arange(n),
        test_size=num_val,
        random_state=seed,
        stratify=labels if can_stratify else None,
    )


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
# Building a token store


def _spool(
    chunks: Iterable[RowChunk], spool: TextSpool, names: dict[str, int], rows: list[np.ndarray]
) -> np.ndarray:
    """Appends the chunks' cleaned texts to the spool, their CSV row numbers to `rows`; returns
    their labels as codes in `names` (first-seen order, extended as new labels appear)."""
    codes = []
    for chunk in chunks:
        spool.append(chunk.texts)
        rows.append(np.asarray(chunk.rows, dtype=np.int64))
        codes.append(np.array([names.setdefault(y, len(names)) for y in chunk.labels]))
    return np.concatenate(codes) if codes else np.zeros(0, dtype=np.int64)


def _class_names(names: dict[str, int], source: str) -> list[str]:
    class_names = sorted(names, key=natural_key)
    if len(class_names) < 2:
        only = f"label {class_names[0]!r}" if class_names else "no label"
        raise CsvTextError(f"{source}: every kept row has {only}; classification needs two classes")
    return class_names


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


def _read_into_spool(spool, train_chunks, val_chunks, source: str):
    """Reads the training (then validation) chunks into the spool: (labels as class indices,
    class names, each row's number in its CSV). Classes are the training file's labels."""
    names: dict[str, int] = {}
    rows: list[np.ndarray] = []
    codes = _spool(train_chunks, spool, names, rows)
    class_names = _class_names(names, source)
    if val_chunks is not None:
        codes = np.concatenate([codes, _spool(val_chunks(class_names), spool, names, rows)])
    spool.close()
    by_name = {name: i for i, name in enumerate(class_names)}
    labels = np.array([by_name[name] for name in names], dtype=np.int64)[codes]
    return labels, class_names, np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)


def _train_val_rows(cfg: CsvTextConfig, labels: np.ndarray, logs: dict[str, BadRowLog]):
    if cfg.val_path is None:
        return split_rows(labels, cfg.val_fraction, cfg.split_seed)
    num_train = logs["train_file"].rows_kept
    if num_train == len(labels):
        raise CsvTextError(f"{cfg.val_path}: no usable rows ({logs['val_file'].summary()})")
    return np.arange(num_train), np.arange(num_train, len(labels))


def _tokenizer_sample(train_rows: np.ndarray, size: int, seed: int) -> np.ndarray:
    """At most `size` training rows, a seeded sample: the merges a tokenizer learns settle long
    before a million rows, while its memory grows with every distinct word it sees."""
    if len(train_rows) <= size:
        return train_rows
    return np.random.default_rng(seed).choice(train_rows, size=size, replace=False)


def _encode_spool(spool: TextSpool, tokenizer, directory: Path) -> np.ndarray:
    """Every spooled text's ids into the store's ids file; returns the offsets."""
    writer = IdsWriter(directory)
    for texts in spool.batches(ENCODE_BATCH):
        writer.append(encode_ids(tokenizer, texts))
    spool.path.unlink()  # the cleaned texts were only needed until now
    return writer.finish()


def _store_report(cfg, logs, class_names, labels, train_rows, val_rows, tokenizer, offsets):
    lengths = np.diff(offsets)

    def counts(rows):
        per_class = np.bincount(labels[rows], minlength=len(class_names)).tolist()
        return dict(zip(class_names, per_class, strict=True))

    return {
        **{name: entry.to_dict() for name, entry in logs.items()},
        "classes": class_names,
        "rows": {"train": int(len(train_rows)), "val": int(len(val_rows))},
        "class_counts": {"train": counts(train_rows), "val": counts(val_rows)},
        "tokens": {
            "vocab_size": tokenizer.get_vocab_size(),
            "max_length": cfg.max_length,
            "mean_length": float(lengths.mean()),
            "rows_at_max_length": int((lengths >= cfg.max_length).sum()),
        },
        "cleaning": cleaning_of(cfg).to_dict(),
    }


def build_entry(
    directory: Path,
    cfg: CsvTextConfig,
    train_chunks: Iterable[RowChunk],
    val_chunks: Callable[[list[str]], Iterable[RowChunk]] | None,
    logs: dict[str, BadRowLog],
    source: str,
) -> None:
    """Writes a token store into `directory`: read + clean (chunks) -> spool on disk ->
    tokenizer trained on the training rows of the spool -> every row's ids.
    `val_chunks(class_names)` reads a validation file."""
    timings: dict[str, float] = {}
    spool = TextSpool(directory / "texts.utf8")
    with _timed(timings, "read_clean_s"):
        labels, class_names, source_rows = _read_into_spool(spool, train_chunks, val_chunks, source)
    train_rows, val_rows = _train_val_rows(cfg, labels, logs)
    with _timed(timings, "tokenizer_s"):
        learn_from = _tokenizer_sample(train_rows, cfg.tokenizer_rows, cfg.split_seed)
        keep = np.zeros(len(labels), dtype=bool)
        keep[learn_from] = True
        texts = spool.batches(ENCODE_BATCH, keep=keep)
        tokenizer = train_tokenizer(texts, cfg.vocab_size, cfg.max_length, len(learn_from))
    with _timed(timings, "encode_s"):
        offsets = _encode_spool(spool, tokenizer, directory)
    report = _store_report(cfg, logs, class_names, labels, train_rows, val_rows, tokenizer, offsets)
    report["build_timings_s"] = timings  # read + clean, tokenizer, encode: when it was built
    meta = {"class_names": class_names, "vocab_size": tokenizer.get_vocab_size(), "report": report}
    save_entry(
        directory, offsets, labels, train_rows, val_rows, tokenizer.to_str(), meta, source_rows
    )


def _demo_chunks(cfg: CsvTextConfig, log_: BadRowLog) -> list[RowChunk]:
    texts, labels = demo_corpus()
    rows = list(range(1, len(texts) + 1))
    log_.rows_read = log_.rows_kept = len(texts)
    return [RowChunk(clean_texts(texts, cleaning_of(cfg)), labels, rows, rows)]


def _key_inputs(cfg: CsvTextConfig) -> dict:
    """Everything that changes the stored ids, labels or split."""
    settings = csv_settings(cfg)
    return {
        "store_version": STORE_VERSION,
        "tokenizers": version("tokenizers"),
        "train_sha256": file_digest(Path(cfg.train_path)),
        "val_sha256": file_digest(Path(cfg.val_path)) if cfg.val_path else None,
        "split": None if cfg.val_path else [cfg.val_fraction, cfg.split_seed],
        "columns": [settings.text_column, settings.label_column],
        "encoding": settings.encoding,
        "na_values": sorted(settings.na_values),
        "bad_rows": settings.bad_rows,
        "cleaning": settings.cleaning.to_dict(),
        "vocab_size": cfg.vocab_size,
        "tokenizer_rows": cfg.tokenizer_rows,
        "max_length": cfg.max_length,
    }


def prepare(cfg: CsvTextConfig) -> tuple[StoreEntry, dict]:
    """The token store for `cfg` (from the cache when it is there) and its data report."""
    start = time.perf_counter()
    settings = csv_settings(cfg)
    if cfg.train_path is None:
        logs = {"train_file": BadRowLog("demo corpus")}
        entry = built_in_memory(
            lambda d: build_entry(d, cfg, _demo_chunks(cfg, logs["train_file"]), None, logs, "demo")
        )
        cache = {"dir": None, "hit": False}
    else:
        for path in filter(None, (cfg.train_path, cfg.val_path)):
            if not Path(path).is_file():
                raise CsvTextError(f"{path}: no such file (set data.train_path / data.val_path)")
        root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
        name = f"{Path(cfg.train_path).stem}-{cache_key(_key_inputs(cfg))}"
        logs = {"train_file": BadRowLog(str(cfg.train_path))}
        if cfg.val_path is not None:
            logs["val_file"] = BadRowLog(str(cfg.val_path))

        def read_val(class_names):
            return read_labelled_rows(cfg.val_path, settings, logs["val_file"], classes=class_names)

        def build(directory: Path) -> None:
            train = read_labelled_rows(cfg.train_path, settings, logs["train_file"])
            val = read_val if cfg.val_path is not None else None
            build_entry(directory, cfg, train, val, logs, str(cfg.train_path))

        entry, hit = cached_entry(root, name, build)
        cache = {"dir": str(root / name), "hit": hit}
    report = {**entry.meta["report"], "cache": cache, "prepare_s": time.perf_counter() - start}
    return entry, report


def log_report(report: dict) -> None:
    for name in ("train_file", "val_file"):
        if name in report:
            _log_file(report[name])
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


def _log_file(entry: dict) -> None:
    reasons = ", ".join(f"{r} {d['count']}" for r, d in entry["dropped"].items())
    line = (
        f"data: {entry['path']}: {entry['rows_read']} rows read, {entry['rows_kept']} kept, "
        f"{entry['rows_dropped']} dropped"
        + (f" ({reasons}; see data_report.json)" if reasons else "")
    )
    (log.warning if entry["rows_dropped"] else log.info)(line)


def build_csv_text(cfg: CsvTextConfig) -> DataBundle:
    entry, report = prepare(cfg)
    log_report(report)
    class_names = tuple(entry.meta["class_names"])
    train = TokenDataset(entry.store, entry.train_rows)
    val = TokenDataset(entry.store, entry.val_rows)
    spec = DataSpec(
        task="classification",
        input_kind="tokens",
        num_classes=len(class_names),
        class_names=class_names,
        vocab_size=entry.meta["vocab_size"],
        max_length=cfg.max_length,
        pad_id=PAD_ID,
    )
    recipe = TokenRecipe(
        entry.tokenizer_json, cfg.max_length, class_names, PAD_ID, cleaning=cleaning_of(cfg)
    )
    return DataBundle(
        spec=spec,
        train=train,
        val=val,
        recipe=recipe,
        collate_fn=collate_tokens,
        batch_metrics=token_batch_metrics,
        report=report,
        bucket_lengths=train.lengths if cfg.bucket_by_length else None,
        sources={"val": val_sources(cfg, entry)},
    )


def val_sources(cfg: CsvTextConfig, entry: StoreEntry) -> SourceNames:
    """ "<file> row N" per validation item: rows of data.val_path, or of the training file the
    split came from (numbered from 1 after the header, as data_report.json numbers them)."""
    path = cfg.val_path or cfg.train_path
    name = Path(path).name if path is not None else "demo corpus"
    return SourceNames(f"{name} row {{}}", entry.source_rows[entry.val_rows])
