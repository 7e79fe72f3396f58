"""Real text corpora from what installed Python packages ship, each text labelled by a property
of where it was found, never by hand. Nobody here wrote these texts: they are how the field's
own libraries document themselves and explain their errors, so a text model's defaults are
tuned (and benchmarked) on text with a real vocabulary, real noise and real class imbalance.

- `docstrings`: the first paragraph of each docstring in eleven libraries (numpy, scipy,
  pandas, scikit-learn, torch, ...), labelled by the library it ships in;
- `errors`: the message of each `raise SomeError("...")` in the same libraries, labelled by
  the exception's class (ValueError, TypeError, NotImplementedError, ...);
- `sections`: the sections of numpydoc docstrings (numpy, scipy, pandas, scikit-learn,
  matplotlib, networkx), labelled by the section's own heading (Parameters, Returns, Notes,
  Examples, See Also, ...), the heading itself left out.

The libraries are kiln's locked dependencies, so a corpus is the same on every machine with the
same lock (`write_corpus` records the versions in its rows' order). Files are read as text and
scanned with regular expressions (no import, no parse: 10,000 source files parse in minutes),
in a seeded order until a byte budget per library; exact duplicate texts are kept once, and a
text found under two labels is dropped."""

from __future__ import annotations

import csv
import importlib.util
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The distribution each library's version is read from.
LIBRARIES = {
    "matplotlib": "matplotlib",
    "networkx": "networkx",
    "numpy": "numpy",
    "pandas": "pandas",
    "PIL": "pillow",
    "pygments": "pygments",
    "scipy": "scipy",
    "sklearn": "scikit-learn",
    "sqlalchemy": "sqlalchemy",
    "sympy": "sympy",
    "torch": "torch",
}
NUMPYDOC_LIBRARIES = ("matplotlib", "networkx", "numpy", "pandas", "scipy", "sklearn")
CORPORA = ("docstrings", "errors", "sections")
SEED = 0  # the file order and the row order; a corpus never changes between runs

# A triple-quoted string standing alone on its lines: module, class, function and attribute
# docstrings (an assignment's string does not start its line).
_DOCSTRING = re.compile(r"^[ \t]*[rRuU]?(\"\"\"|''')(.*?)\1[ \t]*$", re.S | re.M)
# `raise Name("message"` with a one-literal message (f-strings keep their {fields}).
_RAISE = re.compile(
    r"\braise[ \t]+([A-Z]\w*(?:Error|Exception))[ \t]*\(\s*[rRfFbBuU]{0,2}"
    r"(\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*')"
)
# A numpydoc heading: a title line, then a line of dashes as long as it.
_HEADING = re.compile(r"^[ \t]*([A-Z][A-Za-z ]+?)[ \t]*\n[ \t]*(-{3,})[ \t]*$", re.M)
SECTIONS = (
    "Attributes",
    "Examples",
    "Notes",
    "Parameters",
    "Raises",
    "References",
    "Returns",
    "See Also",
    "Warns",
    "Yields",
    "Other Parameters",
    "Methods",
)

MIN_WORDS, MAX_CHARS = 3, 600  # shorter texts say nothing; longer ones are cut


def library_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def source_texts(library: str, max_bytes: int, seed: int = SEED) -> Iterator[str]:
    """The library's .py files as text, in a seeded order, until `max_bytes` have been read."""
    root = library_dir(library)
    if root is None:
        return
    files = sorted(root.rglob("*.py"))
    random.Random(f"{seed}-{library}").shuffle(files)
    read = 0
    for path in files:
        if read >= max_bytes:
            return
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        read += len(text)
        yield text


def _squeeze(text: str) -> str:
    return " ".join(text.split())


def _usable(text: str) -> str | None:
    text = _squeeze(text)[:MAX_CHARS]
    return text if len(text.split()) >= MIN_WORDS else None


def docstring_rows(library: str, max_bytes: int) -> Iterator[tuple[str, str]]:
    """(first paragraph of a docstring, the library)."""
    for source in source_texts(library, max_bytes):
        for match in _DOCSTRING.finditer(source):
            first = re.split(r"\n[ \t]*\n", match.group(2).strip(), maxsplit=1)[0]
            text = _usable(first)
            if text is not None:
                yield text, library


def error_rows(library: str, max_bytes: int) -> Iterator[tuple[str, str]]:
    """(an exception's message, the exception's class)."""
    for source in source_texts(library, max_bytes):
        for match in _RAISE.finditer(source):
            text = _usable(match.group(2)[1:-1])
            if text is not None:
                yield text, match.group(1)


def section_rows(library: str, max_bytes: int) -> Iterator[tuple[str, str]]:
    """(a numpydoc section's body, its heading)."""
    for source in source_texts(library, max_bytes):
        for match in _DOCSTRING.finditer(source):
            yield from _sections(match.group(2))


def _sections(docstring: str) -> Iterator[tuple[str, str]]:
    headings = [h for h in _HEADING.finditer(docstring) if len(h.group(2)) == len(h.group(1))]
    if not headings:
        return
    for heading, following in zip(headings, [*headings[1:], None], strict=True):
        end = following.start() if following is not None else len(docstring)
        text = _usable(docstring[heading.end() : end])
        if heading.group(1) in SECTIONS and text is not None:
            yield text, heading.group(1)


def corpus_rows(
    name: str,
    *,
    max_bytes_per_library: int = 6_000_000,
    max_rows_per_class: int = 3000,
    min_rows_per_class: int = 200,
    seed: int = SEED,
) -> list[tuple[str, str]]:
    """The corpus `name` (one of CORPORA) as shuffled (text, label) rows: duplicates once, a
    text seen under two labels dropped, at most `max_rows_per_class` rows of a class (a seeded
    sample), classes with fewer than `min_rows_per_class` rows left out."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    libraries = NUMPYDOC_LIBRARIES if name == "sections" else tuple(LIBRARIES)
    rows_of = {"docstrings": docstring_rows, "errors": error_rows, "sections": section_rows}[name]
    rows = _distinct(
        row for library in libraries for row in rows_of(library, max_bytes_per_library)
    )
    rng = random.Random(seed)
    by_label: dict[str, list[str]] = {}
    for text, label in rows:
        by_label.setdefault(label, []).append(text)
    kept = []
    for label in sorted(by_label):
        texts = by_label[label]
        if len(texts) < min_rows_per_class:
            continue
        if len(texts) > max_rows_per_class:
            texts = rng.sample(texts, max_rows_per_class)
        kept += [(text, label) for text in texts]
    rng.shuffle(kept)
    return kept


def _distinct(rows: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each text once, in first-seen order; a text seen under two labels not at all."""
    labels: dict[str, set[str]] = {}
    for text, label in rows:
        labels.setdefault(text, set()).add(label)
    return [(text, next(iter(found))) for text, found in labels.items() if len(found) == 1]


def library_versions() -> dict[str, str]:
    """The installed version of each library the corpora read."""
    found = {}
    for library, distribution in LIBRARIES.items():
        try:
            found[library] = version(distribution)
        except PackageNotFoundError:
            found[library] = "not installed"
    return found


def write_corpus(name: str, path: str | Path, **kwargs) -> dict:
    """Writes the corpus as a `text,label` CSV; returns its rows per class and the versions."""
    rows = corpus_rows(name, **kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(rows)
    counts = Counter(label for _, label in rows)
    return {
        "rows": len(rows),
        "classes": dict(sorted(counts.items())),
        "versions": library_versions(),
    }
