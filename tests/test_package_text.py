"""tests/package_text.py: real corpora from the text installed packages ship, each row's label
a property of where its text was found. The tests rebuild small versions and check every
sampled row against its source (the text is in a file of the library it is labelled with,
after a `raise <label>(` or under a `<label>` numpydoc heading), that the same call builds the
same corpus, and that no text is in it twice or under two labels."""

from __future__ import annotations

import csv
import re
from collections import Counter

import pytest

from .package_text import (
    CORPORA,
    LIBRARIES,
    corpus_rows,
    library_dir,
    source_texts,
    write_corpus,
)

SMALL = {"max_bytes_per_library": 300_000, "max_rows_per_class": 40, "min_rows_per_class": 5}


@pytest.fixture(scope="module")
def corpora():
    return {name: corpus_rows(name, **SMALL) for name in CORPORA}


def squeezed(text: str) -> str:
    return " ".join(text.split())


def sources_of(library: str) -> str:
    return "\n".join(squeezed(t) for t in source_texts(library, SMALL["max_bytes_per_library"]))


def test_every_corpus_has_several_classes_and_no_text_twice(corpora):
    for name, rows in corpora.items():
        labels = Counter(label for _, label in rows)
        assert len(labels) >= 3, (name, labels)
        assert max(labels.values()) <= SMALL["max_rows_per_class"]
        texts = [text for text, _ in rows]
        assert len(set(texts)) == len(texts), name  # each text once, under one label
        assert all(len(text.split()) >= 3 for text in texts)


def test_a_corpus_is_the_same_every_time(corpora):
    assert corpus_rows("errors", **SMALL) == corpora["errors"]


def test_docstrings_are_labelled_by_the_library_they_ship_in(corpora):
    rows = corpora["docstrings"]
    assert {label for _, label in rows} <= set(LIBRARIES)
    found = {library: sources_of(library) for library in {label for _, label in rows}}
    for text, label in rows[:60]:
        assert text[:80] in found[label], (label, text)


def test_error_messages_are_labelled_by_the_exception_raised(corpora):
    rows = corpora["errors"]
    sources = "\n".join(sources_of(library) for library in LIBRARIES)
    for text, label in rows[:60]:
        start = re.escape(text[:40])
        assert re.search(rf"raise {label}\( ?[rRfFbBuU]{{0,2}}[\"']{start}", sources), (label, text)


def test_sections_are_labelled_by_their_numpydoc_heading(corpora):
    rows = corpora["sections"]
    from .package_text import NUMPYDOC_LIBRARIES

    sources = "\n".join(sources_of(library) for library in NUMPYDOC_LIBRARIES)
    for text, label in rows[:60]:
        dashes = "-" * len(label)
        assert f"{label} {dashes} {text[:60]}" in sources, (label, text)


def test_the_corpus_file_reads_back_with_its_counts(tmp_path):
    meta = write_corpus("sections", tmp_path / "sections.csv", **SMALL)
    with (tmp_path / "sections.csv").open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == meta["rows"]
    assert Counter(row["label"] for row in rows) == meta["classes"]
    assert meta["versions"]["numpy"] not in ("", "not installed")


def test_an_unknown_corpus_names_the_known_ones():
    with pytest.raises(ValueError, match="docstrings, errors, sections"):
        corpus_rows("novels")


def test_every_library_is_installed():
    """The corpora read kiln's locked dependencies: a missing one would quietly shrink them."""
    assert all(library_dir(name) is not None for name in LIBRARIES)
