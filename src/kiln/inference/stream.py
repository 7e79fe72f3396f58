"""Predicting input files one batch at a time -- read, decode, predict, write -- so memory holds
one batch (and one decoded image per decoding thread), never the whole folder: 1,000 large JPEGs
cost what one batch does. One bad file costs only itself: a file that cannot be opened, is too
large (its header asks for more than max_image_pixels) or cannot be decoded gets a row with its
error and the rest are predicted; `strict` stops at the first instead. The CSV is written to a
temporary file beside the output and moved into place at the end: no half-written output."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.atomic import on_failure
from kiln.inference.files import NamedFile
from kiln.inference.predictor import Predictor, join
from kiln.inference.tables import CsvTable, PredictionsCsv, number
from kiln.preprocessing import InputError
from kiln.preprocessing.file_tree import FileAccessError
from kiln.preprocessing.image_files import ImageDecodeError

DECODE_THREADS = 4  # at most; decoders release the GIL


def describe_error(err: Exception) -> str:
    """`<reason>: <detail>` of why an input could not be predicted (the CSV's error column)."""
    if isinstance(err, (FileAccessError, ImageDecodeError)):
        return f"{err.reason}: {err.detail}"
    message = str(err)
    if message.startswith("item 0: "):
        message = message[len("item 0: ") :]
    return f"bad_input: {message}"


@dataclass
class ItemBatch:
    """One batch: the inputs it covers (indices into the file list), those predicted and their
    outputs (in order), and why each other one was not."""

    indices: range
    good: list[int]
    outputs: Any
    errors: dict[int, str] = field(default_factory=dict)


def predict_batches(
    predictor: Predictor,
    files: Sequence[NamedFile],
    load: Callable[[Path], Any],
    batch_size: int,
) -> Iterator[ItemBatch]:
    """Each batch of `files` loaded (`load(path)` -> a raw item, in threads), each item
    converted on its own (a bad one is only itself), the good ones predicted together."""

    def attempt(file: NamedFile) -> tuple[Any, str | None]:
        if file.error is not None:
            return None, file.error
        try:
            return predictor.convert([load(file.path)]), None
        except (FileAccessError, ImageDecodeError, InputError) as err:
            return None, describe_error(err)

    threads = max(1, min(DECODE_THREADS, os.cpu_count() or 1))
    with ThreadPoolExecutor(threads) as pool:
        for start in range(0, len(files), batch_size):
            indices = range(start, min(len(files), start + batch_size))
            loaded = list(pool.map(attempt, (files[i] for i in indices)))
            good = [i for i, (_, error) in zip(indices, loaded, strict=True) if error is None]
            errors = {i: e for i, (_, e) in zip(indices, loaded, strict=True) if e is not None}
            items = [item for item, error in loaded if error is None]
            outputs = predictor.run(join(items)) if items else predictor.empty_outputs()
            yield ItemBatch(indices, good, outputs, errors)


class DetectionsCsv(CsvTable):
    """index, source, x1, y1, x2, y2, label, score, error: one row per box; an image with no
    box, or one that could not be read, still gets one row."""

    def __init__(self, path: Path, class_names: Sequence[str]):
        super().__init__(
            path, ["index", "source", "x1", "y1", "x2", "y2", "label", "score", "error"]
        )
        self.class_names = list(class_names)
        self.boxes = 0

    def write(self, batch: ItemBatch, files: Sequence[NamedFile]) -> None:
        found = dict(zip(batch.good, batch.outputs, strict=True))
        for i in batch.indices:
            detections = found.get(i)
            if detections is None:
                self.writer.writerow([i, files[i].source, *[""] * 6, batch.errors[i]])
                continue
            for box, label, score in zip(
                detections["boxes"], detections["labels"], detections["scores"], strict=True
            ):
                name = self.class_names[int(label) - 1]
                self.writer.writerow(
                    [i, files[i].source, *map(number, box), name, number(score), ""]
                )
                self.boxes += 1
            if len(detections["boxes"]) == 0:
                self.writer.writerow([i, files[i].source, *[""] * 6, ""])


@dataclass
class FilesOutcome:
    path: Path
    inputs: int
    predicted: int
    errors: dict[str, int]  # reason -> count
    boxes: int | None = None  # detectors

    @property
    def failed(self) -> int:
        return self.inputs - self.predicted


def predict_files_to_csv(
    predictor: Predictor,
    files: Sequence[NamedFile],
    output: str | Path,
    *,
    load: Callable[[Path], Any],
    batch_size: int,
    strict: bool = False,
) -> FilesOutcome:
    """Every file predicted batch by batch into the CSV at `output` (see the module doc).
    strict: InputError at the first file that cannot be predicted, naming it; no output."""
    detection = predictor.task == "detection"
    if detection:
        table = DetectionsCsv(Path(output), predictor.class_names)
    else:
        table = PredictionsCsv(
            Path(output), predictor.class_names, multi_label=predictor.multi_label
        )
    predicted, errors = 0, {}
    with on_failure(table.discard):  # no half-written table
        for batch in predict_batches(predictor, files, load, batch_size):
            if strict and batch.errors:
                first = min(batch.errors)
                raise InputError(
                    f"{files[first].source}: {batch.errors[first]} (strict=true stops at the "
                    "first input that cannot be predicted; without it such an input gets a row "
                    "with its error and the others are predicted)",
                    first,
                )
            table.write(batch, files)
            predicted += len(batch.good)
            for error in batch.errors.values():
                reason = error.split(":", 1)[0]
                errors[reason] = errors.get(reason, 0) + 1
    path = table.commit()
    boxes = table.boxes if detection else None
    return FilesOutcome(path, len(files), predicted, errors, boxes)
