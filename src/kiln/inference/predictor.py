"""`Predictor`: a checkpoint (or its ONNX export) plus the training preprocessing, turning raw
inputs (pixel arrays, texts) into labelled probabilities.

    predictor = Predictor.from_checkpoint("run/checkpoints/best.pt")             # torch
    predictor = Predictor.from_checkpoint("run/checkpoints/best.pt", backend="onnx")
    predictor.predict([image_a, image_b])  # [{"label": "3", "probs": [...]}, ...]

backend="onnx" runs `model.onnx` beside the checkpoint (`model.int8.onnx` with int8=True), made
by `python infer.py mode=export`; the preprocessing comes from the JSON written beside it, so an
.onnx path works without the .pt too. Given a .pt, the export must come from that very file."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.spec import DataSpec
from kiln.device import resolve_device
from kiln.inference.backends import OnnxBackend, TorchBackend
from kiln.inference.record import (
    ModelRecord,
    file_sha256,
    read_checkpoint,
    read_sidecar,
    rebuild_model,
)
from kiln.preprocessing import Preprocessor

log = logging.getLogger(__name__)

BACKENDS = ("torch", "onnx")
ONNX_NAME, ONNX_INT8_NAME = "model.onnx", "model.int8.onnx"


def onnx_path_for(ckpt_path: Path, int8: bool = False) -> Path:
    return ckpt_path.with_name(ONNX_INT8_NAME if int8 else ONNX_NAME)


class Predictor:
    def __init__(self, backend: TorchBackend | OnnxBackend, record: ModelRecord, source: Path):
        self.backend = backend
        self.record = record
        self.source = source
        self.preprocess: Preprocessor = record.recipe.preprocessor()

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, backend: str = "torch", device: str = "cpu", int8: bool = False
    ) -> Predictor:
        path = Path(path)
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; expected one of {', '.join(BACKENDS)}")
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        torch_device = resolve_device(device)
        if backend == "torch" and path.suffix == ".onnx":
            raise ValueError(f"{path} is an ONNX export; use backend=onnx (or pass the .pt)")
        if backend == "torch":
            if int8:
                raise ValueError("int8=true needs backend=onnx (the int8 model is an ONNX export)")
            record, state_dict = read_checkpoint(path)
            model = rebuild_model(record, state_dict)
            return cls(TorchBackend(model, torch_device), record, path)
        onnx_path = path if path.suffix == ".onnx" else _checked_export(path, int8)
        return cls(OnnxBackend(onnx_path, torch_device), read_sidecar(onnx_path), onnx_path)

    @property
    def spec(self) -> DataSpec:
        return self.record.spec

    @property
    def class_names(self) -> list[str]:
        return list(self.spec.class_names)

    def validate(self, raw_inputs: Sequence[Any]) -> None:
        """Raises InputError naming the first bad item; converts nothing."""
        self.preprocess.validate(raw_inputs)

    def predict_probs(self, raw_inputs: Sequence[Any], batch_size: int = 256) -> np.ndarray:
        """Probabilities (N, num_classes), float32, in chunks of batch_size inputs."""
        chunks = [
            self.backend.probs(self.preprocess(raw_inputs[start : start + batch_size]))
            for start in range(0, len(raw_inputs), batch_size)
        ]
        if not chunks:
            return np.zeros((0, self.spec.num_classes), dtype=np.float32)
        return np.concatenate(chunks)

    def predict(self, raw_inputs: Sequence[Any]) -> list[dict[str, Any]]:
        probs = self.predict_probs(raw_inputs)
        names = self.class_names
        return [{"label": names[int(row.argmax())], "probs": row.tolist()} for row in probs]

    def example_input(self) -> Any:
        """One valid raw input, for warm-up."""
        return self.preprocess.example()


def _checked_export(ckpt_path: Path, int8: bool) -> Path:
    """The ONNX export beside `ckpt_path`, refused if it was made from a different .pt (e.g. an
    older best.pt, or last.pt in the same directory)."""
    onnx_path = onnx_path_for(ckpt_path, int8)
    hint = f"run `python infer.py mode=export ckpt={ckpt_path}{' int8=true' if int8 else ''}`"
    if not onnx_path.is_file():
        raise FileNotFoundError(f"backend=onnx needs {onnx_path}, which does not exist; {hint}")
    record = read_sidecar(onnx_path)
    if record.checkpoint_sha256 != file_sha256(ckpt_path):
        raise ValueError(
            f"{onnx_path} was exported from a different checkpoint than {ckpt_path} "
            f"(it came from a {record.checkpoint_name} with other contents); {hint}"
        )
    return onnx_path
