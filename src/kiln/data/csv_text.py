"""Text classification from a CSV (a text and a label column), tokenized by a WordPiece tokenizer
trained on the training split only. The tokenizer travels with every checkpoint as JSON, and
its `TokenRecipe.encode` repeats exactly the training encoding at inference time.

With `train_path=null` a small demo corpus is generated in code, so the dataset works offline."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pandas as pd
import torch
from sklearn.model_selection import train_test_split
from torch import Tensor
from torch.utils.data import Dataset

from kiln.config.data import CsvTextConfig
from kiln.data.spec import DataBundle, DataSpec
from kiln.errors import UserError
from kiln.preprocessing import TokenRecipe
from kiln.preprocessing.text import PAD_ID, encode, pad_token_ids, train_tokenizer
from kiln.sorting import natural_key

MAX_ROWS_REPORTED = 5  # a bad CSV lists this many bad rows, then a count


class CsvTextError(UserError, ValueError):
    """A problem with a user's CSV; the message names the file, the row and the column."""


# ---------------------------------------------------------------------------------------------
# Reading and checking the CSV


def _describe_rows(rows: list[int]) -> str:
    # Data row n (counting from 1) sits on line n + 1, under the header.
    shown = ", ".join(f"row {n} (line {n + 1})" for n in rows[:MAX_ROWS_REPORTED])
    more = len(rows) - MAX_ROWS_REPORTED
    return shown + (f" and {more} more" if more > 0 else "")


def _load_frame(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise CsvTextError(f"{path}: no such file (set data.train_path / data.val_path)")
    try:
        # Everything as strings: labels keep their spelling ("01" stays "01"), texts stay text.
        return pd.read_csv(path, dtype=str, keep_default_na=True)
    except pd.errors.EmptyDataError:
        raise CsvTextError(f"{path}: the file is empty; expected a header row") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as err:
        raise CsvTextError(f"{path}: cannot be read as CSV: {err}") from None


def read_labelled_csv(path: str | Path, text_column: str, label_column: str):
    """Returns (texts, labels) as lists of strings. Raises CsvTextError naming the file, the
    missing column (with the columns present) or the rows with an empty text or label."""
    path = Path(path)
    frame = _load_frame(path)
    missing = [col for col in (text_column, label_column) if col not in frame.columns]
    if missing:
        raise CsvTextError(
            f"{path}: missing column {', '.join(map(repr, missing))}; columns present: "
            f"{', '.join(map(repr, frame.columns))} (set data.text_column / data.label_column)"
        )
    if frame.empty:
        raise CsvTextError(f"{path}: has a header but no data rows")
    texts, labels = frame[text_column], frame[label_column]
    empty_text = texts.isna() | (texts.fillna("").str.strip() == "")
    empty_label = labels.isna() | (labels.fillna("").str.strip() == "")
    for bad, column, what in (
        (empty_text, text_column, "an empty text"),
        (empty_label, label_column, "a missing (NaN/empty) label"),
    ):
        if bad.any():
            rows = [int(i) + 1 for i in bad.to_numpy().nonzero()[0]]
            verb = "has" if len(rows) == 1 else "have"
            raise CsvTextError(f"{path}: {_describe_rows(rows)} {verb} {what} in column {column!r}")
    return texts.tolist(), labels.str.strip().tolist()


def _check_val_labels(path: str, labels: list[str], class_names: list[str]) -> None:
    known = set(class_names)
    rows = [n for n, label in enumerate(labels, start=1) if label not in known]
    if rows:
        unseen = sorted({labels[n - 1] for n in rows}, key=natural_key)
        raise CsvTextError(
            f"{path}: {_describe_rows(rows)} {'has' if len(rows) == 1 else 'have'} a label "
            "not in the training data "
            f"({', '.join(map(repr, unseen))}); training classes: {', '.join(class_names)}"
        )


# ---------------------------------------------------------------------------------------------
# The offline demo corpus

_DEMO_TOPICS: dict[str, tuple[list[str], list[str], list[str]]] = {
    # topic: (templates, subjects, details); every sentence is template.format(s=..., d=...)
    "sports": (
        [
            "the {s} won the match {d}",
            "fans cheered as the {s} scored {d}",
            "the coach said the {s} trained hard {d}",
            "a late goal by the {s} {d}",
        ],
        ["home team", "striker", "goalkeeper", "visiting side", "captain", "young midfielder"],
        [
            "in the final minute",
            "after a long season",
            "at the stadium",
            "before the break",
            "despite the rain",
            "in extra time",
        ],
    ),
    "weather": (
        [
            "heavy {s} is expected {d}",
            "the forecast warns of {s} {d}",
            "residents prepared for {s} {d}",
            "a band of {s} moved north {d}",
        ],
        ["rain", "snow", "wind", "fog", "thunder storms", "sunshine"],
        [
            "over the weekend",
            "along the coast",
            "in the mountains",
            "by the evening",
            "across the valley",
            "until tuesday",
        ],
    ),
    "cooking": (
        [
            "stir the {s} slowly {d}",
            "season the {s} with salt {d}",
            "bake the {s} in a hot oven {d}",
            "the recipe calls for fresh {s} {d}",
        ],
        ["onions", "tomato sauce", "bread dough", "garlic", "chicken", "mushrooms"],
        [
            "for ten minutes",
            "until golden",
            "with a little butter",
            "before serving",
            "in a heavy pan",
            "over low heat",
        ],
    ),
    "technology": (
        [
            "the new {s} ships {d}",
            "engineers updated the {s} {d}",
            "users reported a bug in the {s} {d}",
            "the company released a faster {s} {d}",
        ],
        ["laptop", "phone app", "graphics card", "database", "web browser", "compiler"],
        [
            "next month",
            "with better battery life",
            "after the security review",
            "for developers",
            "in the latest release",
            "on every platform",
        ],
    ),
}
DEMO_SHUFFLE_SEED = 1234  # the demo corpus never changes between runs


def demo_corpus() -> tuple[list[str], list[str]]:
    """576 short sentences, 144 for each of four topics: (texts, labels), deterministic."""
    rows = []
    for topic, (templates, subjects, details) in _DEMO_TOPICS.items():
        for template, subject, detail in itertools.product(templates, subjects, details):
            rows.append((template.format(s=subject, d=detail), topic))
    rng = random.Random(DEMO_SHUFFLE_SEED)
    rng.shuffle(rows)
    texts, labels = zip(*rows, strict=True)
    return list(texts), list(labels)


# ---------------------------------------------------------------------------------------------
# Batching


def collate_tokens(batch: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """[(ids (L_i,), label ())] -> (ids (N, L_max) padded with PAD_ID, labels (N,)).
    Module-level so DataLoader workers can pickle it."""
    ids, labels = zip(*batch, strict=True)
    return pad_token_ids(list(ids)), torch.stack(labels)


class TokenDataset(Dataset):
    """Pre-tokenized texts: item i is (token ids LongTensor (L_i,), label LongTensor ())."""

    def __init__(self, token_ids: list[Tensor], labels: list[int]):
        if len(token_ids) != len(labels):
            raise AssertionError("one label per text")
        self.token_ids = token_ids
        self.labels = torch.tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.token_ids[index], self.labels[index]


# ---------------------------------------------------------------------------------------------
# The builder


def _split(texts: list[str], labels: list[str], val_fraction: float, seed: int):
    num_val = round(len(texts) * val_fraction)
    if num_val < 1 or num_val >= len(texts):
        raise ValueError(
            f"data.val_fraction={val_fraction} of {len(texts)} rows leaves an empty split; "
            "use more rows, another val_fraction, or data.val_path"
        )
    counts = pd.Series(labels).value_counts()
    num_classes = len(counts)
    # Stratify only where sklearn can: every class twice, and room for each class in both splits.
    can_stratify = counts.min() >= 2 and num_classes <= num_val <= len(texts) - num_classes
    train_t, val_t, train_y, val_y = train_test_split(
        texts,
        labels,
        test_size=num_val,
        random_state=seed,
        stratify=labels if can_stratify else None,
    )
    return train_t, train_y, val_t, val_y


def _sorted_classes(labels: list[str], source: str) -> list[str]:
    class_names = sorted(set(labels), key=natural_key)
    if len(class_names) < 2:
        raise CsvTextError(
            f"{source}: every row has label {class_names[0]!r}; classification needs two classes"
        )
    return class_names


def _load_splits(cfg: CsvTextConfig):
    """(train_texts, train_labels, val_texts, val_labels, class_names)."""
    if cfg.train_path is None:
        texts, labels = demo_corpus()
    else:
        texts, labels = read_labelled_csv(cfg.train_path, cfg.text_column, cfg.label_column)
    if cfg.val_path is None:
        # Classes come from the whole file: a rare class that lands only in val still has a name.
        class_names = _sorted_classes(labels, cfg.train_path or "demo corpus")
        return *_split(texts, labels, cfg.val_fraction, cfg.split_seed), class_names
    class_names = _sorted_classes(labels, cfg.train_path)
    val_texts, val_labels = read_labelled_csv(cfg.val_path, cfg.text_column, cfg.label_column)
    _check_val_labels(cfg.val_path, val_labels, class_names)
    return texts, labels, val_texts, val_labels, class_names


def build_csv_text(cfg: CsvTextConfig) -> DataBundle:
    train_texts, train_labels, val_texts, val_labels, class_names = _load_splits(cfg)
    class_index = {name: i for i, name in enumerate(class_names)}

    tokenizer = train_tokenizer(train_texts, cfg.vocab_size, cfg.max_length)
    train = TokenDataset(encode(tokenizer, train_texts), [class_index[y] for y in train_labels])
    val = TokenDataset(encode(tokenizer, val_texts), [class_index[y] for y in val_labels])
    spec = DataSpec(
        task="classification",
        input_kind="tokens",
        num_classes=len(class_names),
        class_names=tuple(class_names),
        vocab_size=tokenizer.get_vocab_size(),
        max_length=cfg.max_length,
        pad_id=PAD_ID,
    )
    return DataBundle(
        spec=spec,
        train=train,
        val=val,
        collate_fn=collate_tokens,
        recipe=TokenRecipe(tokenizer.to_str(), cfg.max_length, tuple(class_names), PAD_ID),
    )
