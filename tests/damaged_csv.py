"""Damaged CSVs for the reader's tests, with every record's fate known.

Clean records are docstring-like texts in a few classes (single-line and multi-line, with commas,
HTML, and lines that end like a row of their own: "x : int, optional", "(a, b)"), written by
csv.writer. Damage is then written raw, record by record, the way real files get it:

    stray_quote      a single-line text that starts with a quote never closed: `"text,label`
    undoubled_quote  a quoted multi-line text with a quote inside it not doubled
    unclosed_quote   a quoted multi-line text whose closing quote is missing
    missing_label    `text,` (an empty label)
    extra_columns    an unquoted comma in the text: one field too many
    markup_only      a text of tags only: nothing left after cleaning

`Written.records` says, for each record, its lines and whether it is good (undamaged): a good
record must be kept, with its line and its text, whatever damage surrounds it."""

from __future__ import annotations

import csv
import io
import random
from dataclasses import dataclass, field
from pathlib import Path

CLASSES = ("arrays", "frames", "http", "tensors")
_TOPIC = {
    "arrays": ["ndarray", "broadcast", "dtype", "axis", "ravel", "stride"],
    "frames": ["dataframe", "column", "index", "groupby", "merge", "pivot"],
    "http": ["request", "session", "header", "cookie", "redirect", "timeout"],
    "tensors": ["tensor", "autograd", "device", "kernel", "module", "gradient"],
}
# Docstring lines that, standing alone, parse as `text,label` rows with labels nobody has: what
# a reader that loses the quoting turns into invented classes.
_LABEL_LIKE_LINES = [
    "    x : int, optional",
    "    Default (a, b)",
    "    shape : tuple, default None",
    "        Returns the value, a",
]


@dataclass
class Record:
    first_line: int
    last_line: int
    text: str
    label: str
    damage: str | None = None  # None: a good record, which must be kept

    @property
    def good(self) -> bool:
        return self.damage is None


@dataclass
class Written:
    path: Path
    records: list[Record] = field(default_factory=list)

    @property
    def good(self) -> list[Record]:
        return [r for r in self.records if r.good]

    def damaged(self, kind: str) -> list[Record]:
        return [r for r in self.records if r.damage == kind]


def clean_rows(num_rows: int, seed: int, classes=CLASSES) -> list[tuple[str, str]]:
    """(text, label): about a third multi-line docstrings (one with a label-like line), a few
    with HTML, the rest one line with a comma."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        label = classes[i % len(classes)]
        words = _TOPIC.get(label, [label])
        a, b = rng.sample(words, 2)
        kind = rng.random()
        if kind < 0.35:
            lines = [f"Return the {a} of the {b}.", "", "    Parameters", "    ----------"]
            lines.append(rng.choice(_LABEL_LIKE_LINES))
            lines.append(f"        The {b} to use, {a} by default.")
            text = "\n".join(lines)
        elif kind < 0.45:
            text = f"<p>Convert the <b>{a}</b> to a {b} &amp; check it.</p>"
        else:
            text = f"Compute the {a}, then the {b} ({i})"
        rows.append((text, label))
    return rows


def _raw(text: str, label: str) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow([text, label])
    return buffer.getvalue()


def _damaged_raw(kind: str, text: str, label: str) -> str:
    if kind == "stray_quote":
        return f'"{text.replace(",", "").replace(chr(10), " ")},{label}\n'
    if kind == "undoubled_quote":
        body = text.replace('"', "").replace("\n", ' "quoted" \n', 1)
        return f'"{body}",{label}\n'
    if kind == "unclosed_quote":
        return f'"{text.replace(chr(34), "")},{label}\n'
    if kind == "missing_label":
        return _raw(text, "")
    if kind == "extra_columns":
        return f"{text.replace(chr(10), ' ').replace(chr(34), '')},{label},extra\n"
    if kind == "markup_only":
        return _raw("<p><br></p>", label)
    raise ValueError(kind)


MULTI_LINE_DAMAGE = ("undoubled_quote", "unclosed_quote")


def write_damaged_csv(
    path: str | Path,
    num_rows: int,
    damage: dict[str, int],
    *,
    seed: int = 0,
    crlf: bool = False,
    classes=CLASSES,
) -> Written:
    """`num_rows` records; damage[kind] of them damaged (multi-line kinds on multi-line texts,
    the others on single-line ones), never two damaged records in a row."""
    path = Path(path)
    rows = clean_rows(num_rows, seed, classes)
    rng = random.Random(seed + 1)
    multi = [i for i, (t, _) in enumerate(rows) if "\n" in t and i > 3]
    single = [i for i, (t, _) in enumerate(rows) if "\n" not in t and i > 3]
    rng.shuffle(multi)
    rng.shuffle(single)
    chosen: dict[int, str] = {}
    for kind, count in damage.items():
        pool = multi if kind in MULTI_LINE_DAMAGE else single
        while count:
            index = pool.pop()
            if index - 1 in chosen or index + 1 in chosen:
                continue
            chosen[index] = kind
            count -= 1
    written = Written(path)
    parts, line = ["text,label\n"], 2
    for index, (text, label) in enumerate(rows):
        kind = chosen.get(index)
        raw = _raw(text, label) if kind is None else _damaged_raw(kind, text, label)
        span = raw.count("\n")
        written.records.append(Record(line, line + span - 1, text, label, kind))
        parts.append(raw)
        line += span
    content = "".join(parts)
    if crlf:
        content = content.replace("\n", "\r\n")
    path.write_bytes(content.encode("utf-8"))
    return written


def write_clean_csv(path: str | Path, rows: list[tuple[str, str]]) -> Path:
    path = Path(path)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(rows)
    return path
