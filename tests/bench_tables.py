"""Reading back what a bench script's --markdown printed: the provenance line
(scripts/provenance.py) and the Markdown tables after it, as docs/benchmarks.md holds them."""

from __future__ import annotations

import re

STAMP = re.compile(
    r"^\*Recorded \d{4}-\d{2}-\d{2}, commit [^,]+, on .+, load average \d+\.\d\.\*$", re.M
)


def markdown_tables(stdout: str) -> list[tuple[list[str], list[dict[str, str]]]]:
    """(header, rows as {column: cell}) of every table after the --markdown stamp; fails when
    the stamp is missing or a row has another number of cells than its header."""
    stamp = STAMP.search(stdout)
    assert stamp, f"no '*Recorded <date>, commit <sha>, on <machine>...*' line in:\n{stdout}"
    tables: list[tuple[list[str], list[dict[str, str]]]] = []
    header: list[str] | None = None
    for line in [*stdout[stamp.end() :].splitlines(), ""]:
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            tables.append((header, []))
        elif not all(set(cell) <= set("-:") and cell for cell in cells):
            assert len(cells) == len(header), f"{line!r} against the header {header}"
            tables[-1][1].append(dict(zip(header, cells, strict=True)))
    return tables


def number(cell: str) -> float:
    """A table cell read as a number (thousands separators allowed); fails on anything else."""
    return float(cell.replace(",", ""))
