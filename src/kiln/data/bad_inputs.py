"""The report of the inputs a dataset left out, one shape for every kind of data (a CSV file's
rows, an image folder's files), per file or folder in data_report.json:

    {"path": ..., "<unit>_read": n, "<unit>_kept": n, "<unit>_dropped": n,
     "dropped": {reason: count, ...},
     "dropped_records": [{"reason": ..., <where>}, ...]}

<unit> is `rows` or `images`; <where> names the input: a row's line, row, column and preview,
an image's path and detail. Rows are listed in file order, every one; images in the order
read, the first few per reason (a folder can hold millions). `infer.py mode=evaluate` reports
the labelled folder or CSV it left inputs out of the same way, in metrics.json's `data`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.errors import UserError


class FileChangedError(UserError, ValueError):
    """A file the data's scan checked that is gone or no longer reads when its item is loaded
    (deleted, replaced, truncated during the run): one `error:` line naming it.

    Raised in a DataLoader worker, torch raises it again in the training process as
    `type(err)("Caught FileChangedError in DataLoader worker process N.\nOriginal Traceback
    ...\n<module>.FileChangedError: <message>")`; the constructor keeps the message, so the
    run still ends on one line (tests/test_changing_files.py fails if torch changes this)."""

    def __init__(self, message: str):
        if message.startswith("Caught ") and "Original Traceback" in message:
            message = message.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)


def changed_file(path, err: Exception) -> FileChangedError:
    """The error for an item whose file changed since the scan checked it."""
    detail = getattr(err, "detail", None) or getattr(err, "strerror", None) or str(err)
    return FileChangedError(
        f"a file changed since the data was checked: {detail} ({path}): restore it, or start "
        "the run again (the scan leaves out files that are gone or unreadable)"
    )


@dataclass
class BadInputLog:
    path: str
    unit: str = "rows"
    reasons: tuple[str, ...] = ()  # the report's order of reasons (any other follows, as met)
    listed_per_reason: int | None = None  # records listed per reason (None: every one)
    read: int = 0
    kept: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # reason -> inputs dropped
    records: list[dict] = field(default_factory=list)

    def add(self, record: dict, count: int = 1) -> None:
        """`count` inputs dropped (one, or many that one record stands for): `record` holds
        their "reason" and where they are."""
        reason = record["reason"]
        listed = self.counts.get(reason, 0)
        self.counts[reason] = listed + count
        if self.listed_per_reason is None or listed < self.listed_per_reason:
            self.records.append(record)

    @property
    def num_dropped(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        order = [r for r in self.reasons if r in self.counts]
        order += [r for r in self.counts if r not in self.reasons]
        return {
            "path": self.path,
            f"{self.unit}_read": self.read,
            f"{self.unit}_kept": self.kept,
            f"{self.unit}_dropped": self.num_dropped,
            "dropped": {reason: self.counts[reason] for reason in order},
            "dropped_records": sorted(self.records, key=lambda r: r.get("line", 0)),
        }

    def summary(self) -> str:
        """One line for the log: totals and the count per reason."""
        return summary_line(self.to_dict())


def summary_line(entry: dict) -> str:
    """`<path>: N <unit> read, K kept, D dropped (reason n, ...)` from a report entry (rows are
    counted as CSV records: one may span lines)."""
    unit = next(key.removesuffix("_read") for key in entry if key.endswith("_read"))
    reasons = ", ".join(f"{r} {n}" for r, n in entry["dropped"].items())
    noun = "records" if unit == "rows" else unit
    return (
        f"{entry['path']}: {entry[f'{unit}_read']:,} {noun} read, {entry[f'{unit}_kept']:,} "
        f"kept, {entry[f'{unit}_dropped']:,} dropped" + (f" ({reasons})" if reasons else "")
    )
