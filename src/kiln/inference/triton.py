"""A Triton Inference Server model repository from a kiln checkpoint
(`python infer.py mode=export format=triton ckpt=...`):

    <repo>/<name>/config.pbtxt    platform onnxruntime_onnx, max_batch_size, every input and
                                  output (dims without the batch axis, -1 where dynamic), a
                                  dynamic_batching block; comments say what a client sends
    <repo>/<name>/1/model.onnx    the graph. Image classifiers take raw pixels (the training
                                  normalisation is folded in), as kiln's own clients send them;
                                  detectors take raw pixels too; text models take token ids
    <repo>/<name>/labels.txt      classifiers: class names, Triton's classification extension
                                  (multi-label: probs are sigmoids, a class is predicted at
                                  >= data.threshold; the config.pbtxt comments say it)
    <repo>/<name>/tokenizer.json  text models: the tokenizer a client must run (ids padded with 0)
    <repo>/<name>/kiln.json       the record: data spec, preprocessing, source .pt sha256

The export is checked like `mode=export`: the repository's model, run by ONNX Runtime on raw
inputs, must give kiln's torch predictions (probabilities within 1e-4, boxes within 0.01 px)."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.atomic import on_failure
from kiln.inference.backends import ONNX_INPUT
from kiln.inference.errors import InferenceError
from kiln.inference.export import (
    NUM_DETECTION_EXAMPLES,
    NUM_PARITY_EXAMPLES,
    ParityCheck,
    export_checked,
    graph_for,
    parity_batches,
    raw_pixels_of,
    validation_examples,
)
from kiln.inference.record import ModelRecord, read_checkpoint, rebuild_model

log = logging.getLogger(__name__)

VERSION = "1"
# ONNX TensorProto element types -> Triton data types.
TRITON_TYPES = {1: "TYPE_FP32", 6: "TYPE_INT32", 7: "TYPE_INT64", 9: "TYPE_BOOL", 11: "TYPE_FP64"}


@dataclass
class TritonReport:
    model_dir: Path
    exporter: str
    parity: list[ParityCheck] = field(default_factory=list)
    examples_source: str = ""

    def lines(self) -> list[str]:
        out = [f"wrote Triton model {self.model_dir} ({self.exporter} exporter)"]
        out += [c.line() for c in self.parity]
        out.append(f"  examples: {self.examples_source}")
        return out


def client_notes(record: ModelRecord) -> list[str]:
    """What a Triton client sends and gets back, for the comments atop config.pbtxt."""
    spec, recipe = record.spec, record.recipe
    if spec.task == "detection":
        low, high = recipe.value_range
        return [
            f"input: raw pixels FP32 (N, 3, H, W) in [{low:g}, {high:g}], any H and W from 16",
            "  (one size per request); the model resizes and normalises inside the graph.",
            "outputs: boxes (N, K, 4) as x1, y1, x2, y2 pixels of the input; scores (N, K),",
            "  highest first; labels (N, K), 1-based: label k is line k of labels.txt. Keep",
            f"  the rows with score >= {record.config['model'].get('score_threshold', 0.05)}"
            " (kiln's threshold).",
        ]
    if spec.input_kind == "tokens":
        notes = [
            "input: token ids INT64 (N, L), L <= " + str(recipe.max_length) + ": run",
            "  tokenizer.json (HuggingFace tokenizers) on each text, truncate to that length,",
            f"  pad every row to the longest with {recipe.pad_id}; an empty text is one [UNK].",
        ]
        if recipe.pretrained is not None:
            notes.append("  tokenizer.json is the model's own: it adds the special tokens itself.")
        if getattr(recipe, "spell_char_ngrams", None) is not None:
            low, high = recipe.spell_char_ngrams
            notes += [
                "  Before truncating, follow each [UNK] with its word's spelling (the text at its",
                f"  offsets): for the distinct {low}..{high}-character n-grams g of '<' + word +"
                " '>' but",
                "  itself, shortest first then by first position, at most 47:",
                f"  {spec.vocab_size} + crc32(utf8(g)) % 2**30.",
            ]
        if recipe.pair_column is not None and not recipe.join_columns:
            notes.append("  a pair task: encode each (a, b) as a pair, encode(a, b).")
        elif recipe.pair_column is not None:
            notes.append("  a pair task trained joined: encode a + ' ' + b as one text.")
        return [*notes, *output_notes(record)]
    value_range = recipe.value_range or ("any", "any")
    return [
        f"input: raw pixels FP32 (N, {', '.join(map(str, (recipe.channels, *recipe.image_size)))})"
        f" in [{value_range[0]}, {value_range[1]}], as kiln's",
        "  server takes them: the training normalisation is inside the graph.",
        *output_notes(record),
    ]


def output_notes(record: ModelRecord) -> list[str]:
    """What a classifier's probs mean: a softmax over the classes, or (multi-label) a sigmoid
    per class, and the threshold kiln predicts a class at."""
    outputs = "outputs: logits and probs (N, K); probs' classes are the lines of labels.txt."
    if not record.spec.multi_label:
        return [outputs]
    threshold = record.spec.threshold
    return [
        outputs,
        "  multi-label: probs (N, K) are independent sigmoids, one per class (they do not sum",
        f"  to 1); a class is predicted when its prob >= {threshold:g} (data.threshold), so a",
        "  row's predicted set may hold several classes or none. Triton's classification",
        "  extension (class_count) ranks by prob and knows no threshold: apply it yourself.",
    ]


def tensor_entries(onnx_values, labels: set[str] = frozenset()) -> list[dict[str, Any]]:
    """ONNX graph inputs/outputs -> Triton entries: dims without the batch axis, -1 where a
    dimension is symbolic (dynamic)."""
    entries = []
    for value in onnx_values:
        tensor_type = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim]
        entry = {
            "name": value.name,
            "data_type": TRITON_TYPES[tensor_type.elem_type],
            "dims": dims[1:],
        }
        if value.name in labels:
            entry["label_filename"] = "labels.txt"
        entries.append(entry)
    return entries


def model_config(
    onnx_path: Path, name: str, max_batch_size: int, max_delay_ms: float, task: str
) -> dict[str, Any]:
    """Triton's ModelConfig, as plain data, read off the exported graph itself."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    labelled = {"probs"} if task in ("classification", "multilabel") else set()
    return {
        "name": name,
        "platform": "onnxruntime_onnx",
        "max_batch_size": max_batch_size,
        "input": tensor_entries(graph.input),
        "output": tensor_entries(graph.output, labelled),
        "dynamic_batching": {"max_queue_delay_microseconds": round(max_delay_ms * 1000)},
    }


ENUM_KEYS = ("data_type",)


def to_pbtxt(message: dict[str, Any], indent: int = 0) -> str:
    """Protobuf text format of a plain-data message (what `config.pbtxt` holds)."""
    pad = "  " * indent
    lines = []
    for key, value in message.items():
        if isinstance(value, dict):
            lines += [f"{pad}{key} {{", to_pbtxt(value, indent + 1), f"{pad}}}"]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            blocks = [to_pbtxt(item, indent + 2) for item in value]
            inner = f"\n{pad}  }},\n{pad}  {{\n".join(blocks)
            lines.append(f"{pad}{key} [\n{pad}  {{\n{inner}\n{pad}  }}\n{pad}]")
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [ {', '.join(str(v) for v in value)} ]")
        elif isinstance(value, str) and key not in ENUM_KEYS:
            lines.append(f"{pad}{key}: {json.dumps(value)}")
        else:
            lines.append(f"{pad}{key}: {value}")
    return "\n".join(lines)


def parity_examples(record: ModelRecord) -> tuple[dict[str, torch.Tensor], str]:
    """Raw inputs as a Triton client sends them (pixels, token ids, images)."""
    detection = record.spec.task == "detection"
    examples, source = validation_examples(
        record, NUM_DETECTION_EXAMPLES if detection else NUM_PARITY_EXAMPLES
    )
    if record.spec.input_kind == "image":
        examples = raw_pixels_of(record, examples)
    return parity_batches(examples, record.spec.input_kind), source


def export_triton(
    ckpt_path: str | Path,
    repository: str | Path | None = None,
    *,
    model_name: str = "kiln",
    max_batch_size: int = 32,
    max_delay_ms: float = 5.0,
    device: str = "cpu",
) -> TritonReport:
    ckpt_path = Path(ckpt_path)
    record, state_dict = read_checkpoint(ckpt_path)
    repository = Path(repository) if repository else ckpt_path.parent / "triton"
    model_dir = repository / model_name
    if model_dir.exists():
        shutil.rmtree(model_dir)  # a stale version folder must not survive a re-export
    graph = graph_for(record, rebuild_model(record, state_dict), raw_pixels=True)
    if graph.fixed_batch is not None:
        arch = record.config["model"].get("arch", record.config["model"]["name"])
        raise InferenceError(
            f"Triton export of {arch} is not supported: its ONNX graph takes one image per call "
            "(batch fixed at 1), which Triton's batching cannot feed; export it with "
            "mode=export and serve it with kiln's server (backend=onnx)"
        )
    batches, source = parity_examples(record)
    # Built in a hidden folder beside it and renamed into place whole: a failure or a stop
    # (SIGTERM, Ctrl-C) leaves no half-written model folder for Triton to load.
    staging = repository / f".{model_name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)  # what a stopped export left
    with on_failure(lambda: shutil.rmtree(staging, ignore_errors=True)):
        onnx_path = staging / VERSION / "model.onnx"
        exporter, parity = export_checked(graph, batches, onnx_path, device)
        task = record.spec.task
        config = model_config(onnx_path, model_name, max_batch_size, max_delay_ms, task)
        header = [f"# Triton model config written by kiln from {ckpt_path.name}"]
        header += [f"# {line}" for line in client_notes(record)]
        (staging / "config.pbtxt").write_text("\n".join(header) + "\n" + to_pbtxt(config) + "\n")
        (staging / "labels.txt").write_text("\n".join(record.spec.class_names) + "\n")
        if record.spec.input_kind == "tokens":
            (staging / "tokenizer.json").write_text(record.recipe.tokenizer_json)
        (staging / "kiln.json").write_text(json.dumps(record.to_json(), indent=1) + "\n")
        staging.rename(model_dir)
    report = TritonReport(model_dir, exporter, parity, source)
    for line in report.lines():
        log.info(line)
    return report


__all__ = ["ONNX_INPUT", "TritonReport", "export_triton", "model_config", "to_pbtxt"]
