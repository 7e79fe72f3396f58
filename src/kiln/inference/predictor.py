"""`Predictor`: a checkpoint (or its ONNX export) plus the training preprocessing, turning raw
inputs (pixel arrays, texts, images of any size) into labelled predictions.

    predictor = Predictor.from_checkpoint("run/checkpoints/best.pt")             # torch
    predictor = Predictor.from_checkpoint("run/checkpoints/best.pt", backend="onnx")
    predictor.predict([image_a, image_b])  # [{"label": "3", "probs": [...]}, ...]
    detector.predict([image])              # [{"boxes": [[x1, y1, x2, y2]], "labels": [...],
                                           #   "scores": [...]}]

backend="onnx" runs `model.onnx` beside the checkpoint (`model.int8.onnx` with int8=True), made
by `python infer.py mode=export`; the preprocessing comes from the JSON written beside it, so an
.onnx path works without the .pt too. Given a .pt, the export must come from that very file.
backend="echo" runs no model at all (a fixed answer): the serving stack's ceiling.

The steps are separate so a server can check each request on its own before batching:
`convert` (raw -> validated items, InputError naming the item) -> `run` (items -> outputs: probs
(N, K) or one Detections dict per image) -> `answers` (outputs -> JSON-ready dicts)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.multilabel import predicted_sets
from kiln.data.spec import DataSpec
from kiln.device import resolve_device
from kiln.errors import MissingFileError
from kiln.inference.backends import (
    Detections,
    EchoBackend,
    OnnxBackend,
    OnnxDetectionBackend,
    TorchBackend,
    TorchDetectionBackend,
)
from kiln.inference.errors import InferenceError
from kiln.inference.record import (
    ModelRecord,
    file_sha256,
    read_checkpoint,
    read_sidecar,
    rebuild_model,
)
from kiln.preprocessing import InputError, Preprocessor
from kiln.preprocessing.file_tree import display_name

log = logging.getLogger(__name__)

BACKENDS = ("torch", "onnx", "echo")
ONNX_NAME, ONNX_INT8_NAME = "model.onnx", "model.int8.onnx"
DEFAULT_SCORE_THRESHOLD = 0.05


def onnx_path_for(ckpt_path: Path, int8: bool = False) -> Path:
    return ckpt_path.with_name(ONNX_INT8_NAME if int8 else ONNX_NAME)


def join(parts: Sequence[Any]) -> Any:
    """Items or outputs of several chunks as one: arrays are concatenated, lists chained."""
    if parts and isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return [x for part in parts for x in part]


def auto_threads(flops: float | None, batch_size: int, reserve: int) -> int:
    """Threads for a model call of `batch_size` inputs by kiln's rule (kiln.threads): one for a
    small call, the usable physical cores (less `reserve`) for a large one. `flops`: one
    forward's on one input (forward_flops); None (not counted, or an .onnx given alone) gives
    the usable cores less `reserve`. Logged with the reason."""
    from kiln.threads import cpu_budget, intra_op_threads

    what = f"a model call of {batch_size} input(s)"
    per_call = flops * batch_size if flops else None
    plan = intra_op_threads("auto", cpu_budget(), per_call, what=what, reserve=reserve)
    log.info("threads: %d intra-op (%s)", plan.count, plan.reason)
    return plan.count


def forward_flops(record: ModelRecord, model) -> float | None:
    """Model FLOPs of one forward of `model` (the checkpoint's, rebuilt, in eval mode) on one
    input (the preprocessing's own example); None when they cannot be counted."""
    import torch

    from kiln.engine.flop_count import count_flops

    def example() -> tuple:  # the preprocessing's own example, as the model takes it
        preprocess = record.recipe.preprocessor()
        items = preprocess.convert([preprocess.example()])
        kind = preprocess.input_kind
        if kind == "image_list":
            return (preprocess.to_tensors(items),)
        if kind == "image":
            return (preprocess.normalise(items),)
        return (preprocess.recipe.encode(items),)

    with torch.no_grad():
        total = count_flops(model, example)
    return float(total) if total else None


class Predictor:
    def __init__(self, backend, record: ModelRecord, source: Path):
        self.backend = backend
        self.record = record
        self.source = source
        self.preprocess: Preprocessor = record.recipe.preprocessor()

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        backend: str = "torch",
        device: str = "cpu",
        int8: bool = False,
        threads: int | str | None = None,
        *,
        batch_size: int = 1,
        reserve: int = 0,
    ) -> Predictor:
        """threads: CPU threads per model call (None: the library's default; "auto": kiln's rule
        for a call of `batch_size` inputs, keeping `reserve` cores for other work: see
        kiln.threads and `auto_threads`)."""
        path = Path(path)
        if backend not in BACKENDS:
            raise InferenceError(f"backend={backend!r}; expected one of {', '.join(BACKENDS)}")
        if path.is_dir():
            from kiln.config.infer import checkpoint_folder_message

            raise MissingFileError(checkpoint_folder_message(path))
        if not path.is_file():
            raise MissingFileError(f"checkpoint {path} does not exist")
        torch_device = resolve_device(device)
        if backend in ("torch", "echo") and path.suffix == ".onnx":
            raise InferenceError(f"{path} is an ONNX export; use backend=onnx (or pass the .pt)")
        if int8 and backend != "onnx":
            raise InferenceError("int8=true needs backend=onnx (the int8 model is an ONNX export)")
        if backend == "echo":
            record, _ = read_checkpoint(path)
            if threads == "auto":
                auto_threads(None, batch_size, reserve)  # said, as for a model
            return cls(EchoBackend(record.spec), record, path)
        if backend == "torch":
            record, state_dict = read_checkpoint(path)
            model = rebuild_model(record, state_dict)  # once: its FLOPs are counted on it too
            if threads == "auto":
                threads = auto_threads(forward_flops(record, model), batch_size, reserve)
            if threads:
                import torch

                torch.set_num_threads(threads)  # process-wide: torch has one intra-op pool
            if record.spec.task == "detection":
                return cls(TorchDetectionBackend(model, torch_device), record, path)
            return cls(TorchBackend(model, torch_device, record.spec.multi_label), record, path)
        onnx_path = path if path.suffix == ".onnx" else _checked_export(path, int8)
        if threads == "auto":
            flops = None
            if path.suffix != ".onnx":  # counted on the .pt's model (the export's graph is not)
                pt_record, state_dict = read_checkpoint(path)
                flops = forward_flops(pt_record, rebuild_model(pt_record, state_dict))
            threads = auto_threads(flops, batch_size, reserve)
        record = read_sidecar(onnx_path)
        if record.spec.task == "detection":
            threshold = record.config["model"].get("score_threshold", DEFAULT_SCORE_THRESHOLD)
            backend_ = OnnxDetectionBackend(onnx_path, torch_device, threshold, threads)
            return cls(backend_, record, onnx_path)
        return cls(OnnxBackend(onnx_path, torch_device, threads), record, onnx_path)

    @property
    def spec(self) -> DataSpec:
        return self.record.spec

    @property
    def task(self) -> str:
        return self.spec.task

    @property
    def class_names(self) -> list[str]:
        """The checkpoint's class names as text (one kept from a folder name that is not UTF-8,
        by a checkpoint made before training wrote it so: display_name's escapes)."""
        return [display_name(name) for name in self.spec.class_names]

    @property
    def multi_label(self) -> tuple[str, float] | None:
        """A multi-label model's (label separator, threshold), for the predictions table."""
        if not self.spec.multi_label:
            return None
        return self.spec.label_separator or "|", self.spec.threshold

    # --- the steps --------------------------------------------------------------------------

    def validate(self, raw_inputs: Sequence[Any]) -> None:
        """Raises InputError naming the first bad item; converts nothing."""
        self.preprocess.validate(raw_inputs)

    def convert(self, raw_inputs: Sequence[Any]) -> Any:
        """Raw inputs, each validated on its own -> items `run` takes (a float32 array of raw
        pixels, a list of texts, a list of images). InputError names the first bad item."""
        return self.preprocess.convert(raw_inputs)

    def convert_tensor(self, array: np.ndarray) -> Any:
        """A numeric (N, ...) array of raw images, validated item by item."""
        return self.preprocess.check_batch(array)

    def run(self, items: Any) -> Any:
        """Validated items -> probabilities (N, K) float32, or one Detections dict per image."""
        kind = self.preprocess.input_kind
        if kind == "image_list":
            return self.backend.detect(self.preprocess.to_tensors(items))
        if kind == "image":
            return self.backend.probs(self.preprocess.normalise(items))
        return self.backend.probs(self.preprocess.recipe.encode(items))

    def run_prepared(self, model_inputs: Any) -> Any:
        """Inputs a dataset already prepared the way training fed them (a collated batch of a
        DataBundle split: standardised pixels, padded token ids, a list of images) -> what `run`
        returns. `convert` + `run` on the raw inputs give the same (the dataset's transform is
        the recipe's); this skips repeating it for data that is already prepared."""
        if self.preprocess.input_kind == "image_list":
            return self.backend.detect(list(model_inputs))
        return self.backend.probs(model_inputs)

    def answers(self, outputs: Any) -> list[dict[str, Any]]:
        """Outputs of `run` -> one JSON-ready dict per input."""
        names = self.class_names
        if self.task == "detection":
            return [
                {
                    "boxes": d["boxes"].tolist(),
                    "labels": [names[int(k) - 1] for k in d["labels"]],
                    "scores": d["scores"].tolist(),
                }
                for d in outputs
            ]
        if self.spec.multi_label:  # the predicted set, with each one's probability
            chosen = predicted_sets(outputs, self.spec.threshold)
            return [
                {
                    "labels": [names[i] for i in np.flatnonzero(picked)],
                    "scores": row[picked].tolist(),
                    "probs": row.tolist(),
                }
                for row, picked in zip(outputs, chosen, strict=True)
            ]
        return [{"label": names[int(row.argmax())], "probs": row.tolist()} for row in outputs]

    def first_nonfinite(self, outputs: Any) -> int | None:
        """The index of the first input whose outputs hold NaN or Inf (None: all finite)."""
        if self.task == "detection":
            rows = [
                bool(np.isfinite(d["boxes"]).all() and np.isfinite(d["scores"]).all())
                for d in outputs
            ]
            return next((i for i, ok in enumerate(rows) if not ok), None)
        finite = np.isfinite(np.asarray(outputs)).reshape(len(outputs), -1).all(axis=1)
        return None if finite.all() else int(finite.argmin())

    def empty_outputs(self) -> Any:
        """What `run` returns for no inputs, without running the model."""
        if self.task == "detection":
            return []
        return np.zeros((0, self.spec.num_classes), dtype=np.float32)

    # --- whole-file conveniences ------------------------------------------------------------

    def run_in_chunks(self, raw_inputs: Sequence[Any], batch_size: int = 256) -> Any:
        """`run` on `batch_size` inputs at a time, in order; texts in order of length."""
        if self.preprocess.input_kind == "tokens" and len(raw_inputs) > batch_size:
            return self.run_texts_by_length(raw_inputs, batch_size)
        chunks = []
        for start in range(0, len(raw_inputs), batch_size):
            chunks.append(self.run(self.convert_chunk(raw_inputs, start, batch_size)))
        return join(chunks) if chunks else self.empty_outputs()

    def run_texts_by_length(self, raw_inputs: Sequence[Any], batch_size: int) -> np.ndarray:
        """Texts run shortest first, `batch_size` at a time, and their outputs put back in the
        inputs' order. A model call pads its texts to the longest among them, so texts of like
        length pad little: 600 tickets (60 tokens on average, the longest 112) through a 6-layer,
        384-wide BERT took 15.1 CPU-s in the file's order and 11.2 by length, on one thread
        (sentence-transformers sorts alike)."""
        items = join(
            [
                self.convert_chunk(raw_inputs, s, batch_size)
                for s in range(0, len(raw_inputs), batch_size)
            ]
        )
        lengths = [len(x) if isinstance(x, str) else sum(map(len, x)) for x in items]  # pairs
        order = np.argsort(lengths, kind="stable")
        outputs = join(
            [
                self.run([items[i] for i in order[start : start + batch_size]])
                for start in range(0, len(items), batch_size)
            ]
        )
        restored = np.empty_like(outputs)
        restored[order] = outputs
        return restored

    def convert_chunk(self, raw_inputs: Sequence[Any], start: int, batch_size: int) -> Any:
        """`convert` of the inputs from `start`; an InputError names the item in the whole."""
        try:
            return self.convert(raw_inputs[start : start + batch_size])
        except InputError as err:
            raise _in_whole(err, start) from None

    def predict_probs(self, raw_inputs: Sequence[Any], batch_size: int = 256) -> np.ndarray:
        """Probabilities (N, num_classes), float32, in chunks of batch_size inputs."""
        if self.task == "detection":
            raise ValueError("a detector has no class probabilities; use detect() or predict()")
        return self.run_in_chunks(raw_inputs, batch_size)

    def detect(self, raw_inputs: Sequence[Any], batch_size: int = 256) -> list[Detections]:
        """One Detections dict per image (boxes in that image's own pixels)."""
        if self.task != "detection":
            raise ValueError(f"a {self.task} model detects nothing; use predict_probs()")
        return self.run_in_chunks(raw_inputs, batch_size)

    def predict(self, raw_inputs: Sequence[Any]) -> list[dict[str, Any]]:
        return self.answers(self.run_in_chunks(raw_inputs))

    def example_input(self) -> Any:
        """One valid raw input, for warm-up."""
        return self.preprocess.example()


def _in_whole(err: InputError, start: int) -> InputError:
    """An InputError about item i of a chunk starting at `start`, about item start + i."""
    if err.index is None or not start:
        return err
    prefix = f"item {err.index}:"
    message = str(err)
    if message.startswith(prefix):
        message = f"item {start + err.index}:" + message[len(prefix) :]
    return InputError(message, start + err.index)


def _checked_export(ckpt_path: Path, int8: bool) -> Path:
    """The ONNX export beside `ckpt_path`, refused if it was made from a different .pt (e.g. an
    older best.pt, or last.pt in the same directory)."""
    onnx_path = onnx_path_for(ckpt_path, int8)
    hint = f"run `python infer.py mode=export ckpt={ckpt_path}{' int8=true' if int8 else ''}`"
    if not onnx_path.is_file():
        raise MissingFileError(f"backend=onnx needs {onnx_path}, which does not exist; {hint}")
    record = read_sidecar(onnx_path)
    if record.checkpoint_sha256 != file_sha256(ckpt_path):
        raise InferenceError(
            f"{onnx_path} was exported from a different checkpoint than {ckpt_path} "
            f"(it came from a {record.checkpoint_name} with other contents); {hint}"
        )
    return onnx_path
