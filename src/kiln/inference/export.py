"""Export a checkpoint to ONNX (dynamic batch; sequence length for token models; height and width
for detectors), prove the graph agrees with torch on real validation examples, and write the
preprocessing beside it.

    model.onnx            classifiers: input (N, C, H, W) float32 standardised | (N, L) int64
                          -> logits, probs; detectors: input (N, 3, H, W) raw pixels
                          -> boxes (N, K, 4), scores (N, K), labels (N, K): kiln's detector
                          with a fixed K, torchvision's with N = 1 and K varying
    model.onnx.json       data spec, preprocessing, config and the source .pt's sha256
    model.int8.onnx(.json)  int8=True (classifiers): dynamically quantised weights, looser check

`graph_for` names what is exported for each kind of model; kiln.inference.triton exports the same
graphs (with an image classifier's normalisation folded in) into a Triton model repository.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from kiln.atomic import atomic_path, disk_full_error, write_json
from kiln.errors import attempt
from kiln.inference.backends import (
    DETECTION_OUTPUTS,
    ONNX_INPUT,
    ONNX_OUTPUTS,
    DetectionHead,
    ProbabilityHead,
    RawImageHead,
    SingleImageDetectionHead,
    keep_above,
    ort_session,
)
from kiln.inference.box_agreement import (
    BOX_TOLERANCE_PX,
    MIN_BOX_IOU,
    BoxAgreement,
    match_image,
)
from kiln.inference.errors import InferenceError
from kiln.inference.record import ModelRecord, read_checkpoint, rebuild_model, sidecar_path
from kiln.preprocessing.text import CHAR_HASH_SPACE

log = logging.getLogger(__name__)

OPSET = 17
DYNAMO_OPSET = 18  # the dynamo exporter's lowest supported opset
PROBS_TOLERANCE = 1e-4  # max |p_onnx - p_torch| over every class of every example
# Detectors: each torch box against its ONNX twin (kiln.inference.box_agreement): the same
# label, a score within SCORE_TOLERANCE, IoU >= MIN_BOX_IOU; kiln's detector (fixed K) also
# corners within BOX_TOLERANCE_PX.
INT8_MIN_AGREEMENT = 0.95  # share of examples where the int8 model's argmax matches torch's
NUM_PARITY_EXAMPLES = 64
NUM_DETECTION_EXAMPLES = 8  # detectors: images of mixed sizes, one call per size
# Single-image detection graphs: the validation images tried, those where torch finds boxes
# checked first (parity over images without a box compares nothing).
NUM_DETECTION_CANDIDATES = 24
NUM_INT8_EXAMPLES = 512


class ExportParityError(InferenceError):
    """The exported graph disagrees with the torch model beyond the tolerance."""


class NothingComparedError(ExportParityError):
    """A detector's parity found no box to compare: whichever exporter made the graph."""


@dataclass
class ParityCheck:
    name: str  # which batch: "batch=1", "batch=64, length=12", "batch=1, 96x120"...
    max_abs_diff: float  # probabilities, box corners in pixels, or 1 - IoU ("iou")
    unit: str = "prob"
    boxes: BoxAgreement | None = None  # detectors: how torch's boxes met ONNX Runtime's

    def line(self) -> str:
        if self.boxes is not None:
            return f"  parity {self.name}: {self.boxes.summary()}"
        if self.unit == "iou":
            return f"  parity {self.name}: min box IoU = {1 - self.max_abs_diff:.4f}"
        px = " px" if self.unit == "box" else ""
        return f"  parity {self.name}: max |d{self.unit}| = {self.max_abs_diff:.2e}{px}"


@dataclass
class ExportReport:
    onnx_path: Path
    parity: list[ParityCheck] = field(default_factory=list)
    exporter: str = ""  # which torch.onnx exporter produced the graph: legacy | dynamo
    int8_path: Path | None = None
    int8_agreement: float | None = None
    int8_num_examples: int = 0
    # multi-label: the threshold the int8 check compares label sets at (None: argmax)
    int8_threshold: float | None = None
    examples_source: str = ""

    @property
    def boxes(self) -> BoxAgreement | None:
        """Detectors: every parity image's boxes together."""
        found = [c.boxes for c in self.parity if c.boxes is not None]
        if not found:
            return None
        total = found[0]
        for more in found[1:]:
            total = total.add(more)
        return total

    def lines(self) -> list[str]:
        sidecar = sidecar_path(self.onnx_path).name
        out = [f"wrote {self.onnx_path} (+ {sidecar}; {self.exporter} exporter)"]
        out += [c.line() for c in self.parity]
        if self.boxes is not None:
            out.append(f"  parity, all images: {self.boxes.summary()}")
        out.append(f"  examples: {self.examples_source}")
        if self.int8_path is not None:
            what = (
                "argmax agrees with torch"
                if self.int8_threshold is None
                else f"predicted label sets (threshold {self.int8_threshold:g}) agree with torch's"
            )
            out.append(
                f"wrote {self.int8_path}: {what} on "
                f"{self.int8_agreement:.1%} of {self.int8_num_examples} examples"
            )
        return out


# ---------------------------------------------------------------------------------------------
# What is exported


@dataclass
class Graph:
    """A module to export with its input/output names and which input axes vary."""

    net: nn.Module
    outputs: tuple[str, ...]
    dynamic_axes: dict[int, str]  # input axis -> name, e.g. {0: "batch", 1: "sequence"}
    axis_max: dict[str, int] = field(default_factory=dict)  # bounds for the dynamo exporter
    # (net, onnx session, batch) -> the largest difference, and its unit
    difference: Callable[[nn.Module, Any, Tensor], float] | None = None
    tolerance: float = PROBS_TOLERANCE
    unit: str = "prob"
    # Output dims after the batch axis that are constant although the tracer could not tell
    # (a detector's K): written into the graph so Triton's config can say them.
    output_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)
    fixed_batch: int | None = None  # the batch axis is this size (None: dynamic)
    # Detectors (`difference` returns a BoxAgreement): twins' corners at most this far apart
    max_corner_px: float | None = None
    exporters: tuple[str, ...] = ("legacy", "dynamo")  # tried in this order


def graph_for(record: ModelRecord, model: nn.Module, *, raw_pixels: bool = False) -> Graph:
    """The exported graph of a model. raw_pixels=True folds an image classifier's normalisation
    into the graph (its input is then raw pixels, as kiln's clients send them)."""
    spec = record.spec
    if spec.task == "detection":
        if not hasattr(model, "detect"):  # no fixed-K graph (model=detector has one)
            return single_image_detection_graph(model)
        threshold = float(getattr(model, "score_threshold", 0.0))
        k = model.detections_per_image
        return Graph(
            DetectionHead(model).eval(),
            DETECTION_OUTPUTS,
            {0: "batch", 2: "height", 3: "width"},
            difference=lambda net, session, batch: detection_difference(
                net, session, batch, threshold
            ),
            tolerance=BOX_TOLERANCE_PX,
            unit="box",
            max_corner_px=BOX_TOLERANCE_PX,
            output_dims={"boxes": (k, 4), "scores": (k,), "labels": (k,)},
        )
    if spec.input_kind == "tokens":
        return Graph(
            ProbabilityHead(model, spec.multi_label).eval(),
            ONNX_OUTPUTS,
            {0: "batch", 1: "sequence"},
            axis_max={"sequence": spec.max_length},
            difference=probs_difference,
        )
    net = ProbabilityHead(model, spec.multi_label)
    if raw_pixels:
        mean, std = list(record.recipe.mean), list(record.recipe.std)
        net = RawImageHead(model, mean, std, spec.multi_label)
    return Graph(net.eval(), ONNX_OUTPUTS, {0: "batch"}, difference=probs_difference)


def single_image_detection_graph(model: nn.Module) -> Graph:
    """A detector of the detection contract without kiln's fixed-K `detect` (torchvision's, a
    plugin's): its own eval forward on one image of any size, checked box by box (IoU) against
    torch. A model that knows it does not export says why in `onnx_refusal`."""
    arch = getattr(model, "arch", type(model).__name__)
    refusal = getattr(model, "onnx_refusal", None)
    if refusal:
        raise InferenceError(
            f"ONNX export of {arch} is not supported: {refusal}; predict and serve it with "
            "backend=torch (infer.py, mode=serve)"
        )
    if not callable(getattr(model, "check_output", None)):
        raise InferenceError(
            f"ONNX export of {arch} ({type(model).__name__}) is not supported: it declares no "
            "detection contract (kiln.models.detection_contract.DetectionContract) and has no "
            "detect(x) graph; predict and serve it with backend=torch"
        )
    return Graph(
        SingleImageDetectionHead(model).eval(),
        DETECTION_OUTPUTS,
        {2: "height", 3: "width"},
        difference=detection_iou_difference,
        tolerance=1 - MIN_BOX_IOU,
        unit="iou",
        fixed_batch=1,
        exporters=("legacy",),  # torchvision's detectors trace (its own ONNX tests); not dynamo
    )


# ---------------------------------------------------------------------------------------------
# Examples to check parity on


def validation_examples(record: ModelRecord, limit: int) -> tuple[Any, str]:
    """Up to `limit` model inputs from the validation split, rebuilt from the run's data config
    (standardised tensors for classifiers, a list of raw images for detectors). If the data is
    not reachable here (a CSV on another machine), random valid inputs instead."""
    from kiln.config import option_from_dict
    from kiln.data import build_data
    from kiln.preprocessing.pretrained import pretrained_from_dict

    pretrained = pretrained_from_dict(getattr(record.recipe, "pretrained", None))
    try:
        bundle = build_data(option_from_dict("data", record.config["data"]), pretrained=pretrained)
    except (OSError, ValueError) as err:
        log.warning("parity check on random inputs: the run's data is unavailable (%s)", err)
        return random_examples(record, limit), "random inputs (training data unavailable)"
    items = [bundle.val[i] for i in range(min(limit, len(bundle.val)))]
    if bundle.collate_fn is not None:
        inputs, _ = bundle.collate_fn(items)
    else:
        inputs = torch.stack([x for x, _ in items])
    return inputs, f"{len(items)} validation examples of data={record.config['data']['name']}"


def random_examples(record: ModelRecord, limit: int) -> Any:
    gen = torch.Generator().manual_seed(0)
    spec = record.spec
    if spec.input_kind == "tokens":
        return torch.randint(
            1, spec.vocab_size, (limit, max(2, spec.max_length // 2)), generator=gen
        )
    preprocess = record.recipe.preprocessor()
    low, high = preprocess.value_range or (-1.0, 1.0)
    if spec.input_kind == "image_list":
        height, width = spec.image_size
        sizes = [(height - 7 * i % 29, width - 5 * i % 23) for i in range(limit)]
        return [low + (high - low) * torch.rand((3, h, w), generator=gen) for h, w in sizes]
    raw = low + (high - low) * torch.rand((limit, *preprocess.shape), generator=gen)
    return preprocess(raw.numpy())


@torch.inference_mode()
def boxes_first(graph: Graph, images: list[Tensor], source: str) -> tuple[list[Tensor], str]:
    """A single-image detection graph's parity images: those where torch finds a box first (an
    image without one compares nothing), and the source saying how many had one."""
    found = [len(graph.net(image[None])[0][0]) > 0 for image in images]
    ordered = [im for im, has in zip(images, found, strict=True) if has]
    ordered += [im for im, has in zip(images, found, strict=True) if not has]
    return ordered, f"{source}, torch finds boxes on {sum(found)} (checked first)"


def raw_pixels_of(record: ModelRecord, standardised: Tensor) -> Tensor:
    """Undo the training normalisation: the raw pixels a client would send."""
    mean = torch.tensor(record.recipe.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(record.recipe.std, dtype=torch.float32).view(1, -1, 1, 1)
    return standardised * std + mean


def parity_batches(
    examples: Any, input_kind: str, fixed_batch: int | None = None
) -> dict[str, Tensor]:
    """Two batch sizes; token models also at two sequence lengths; detectors: single images of
    different sizes, and a batch of images cut to one size (unless the graph's batch is fixed
    at 1: then more single images)."""
    if input_kind == "image_list":
        batches = {}
        for image in examples[: 3 if fixed_batch is None else 6]:
            batches[f"batch=1, {image.shape[1]}x{image.shape[2]}"] = image[None]
        if fixed_batch == 1:
            return batches
        height = min(image.shape[1] for image in examples)
        width = min(image.shape[2] for image in examples)
        batches[f"batch={len(examples)}, {height}x{width}"] = torch.stack(
            [image[:, :height, :width] for image in examples]
        )
        return batches
    n = len(examples)
    batches = {"batch=1": examples[:1], f"batch={n}": examples}
    if input_kind == "tokens":
        length = examples.shape[1]
        batches = {
            f"batch=1, length={length}": examples[:1],
            f"batch={n}, length={length}": examples,
        }
        short = max(1, length // 2)  # truncated rows are still valid token sequences
        batches[f"batch={n}, length={short}"] = examples[:, :short].contiguous()
    return batches


# ---------------------------------------------------------------------------------------------
# Export and checks


def exporter_options(name: str, graph: Graph) -> dict:
    """torch.onnx.export's arguments for each exporter. legacy (TorchScript-based) is fast and
    simple but bakes some shapes (e.g. the batch size inside nn.MultiheadAttention) into the
    graph, which the parity check catches; dynamo (torch.export-based) keeps batch and sequence
    sizes symbolic all the way through."""
    if name == "legacy":
        axes = {ONNX_INPUT: dict(graph.dynamic_axes)}
        if graph.fixed_batch is None:
            axes.update({output: {0: "batch"} for output in graph.outputs})
        else:  # one image in, its K detections out
            axes.update({output: {1: "detections"} for output in graph.outputs})
        return {"dynamic_axes": axes, "opset_version": OPSET, "dynamo": False}
    dims = {}
    for axis, label in graph.dynamic_axes.items():
        bound = graph.axis_max.get(label)
        dims[axis] = torch.export.Dim(label, max=bound) if bound else torch.export.Dim(label)
    return {
        "dynamic_shapes": (dims,),
        "opset_version": DYNAMO_OPSET,
        "dynamo": True,
        "external_data": False,  # one self-contained file, like the legacy exporter's
        "verbose": False,
    }


def export_graph(name: str, graph: Graph, example: Tensor, out_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation and tracer notices
        torch.onnx.export(
            graph.net,
            (example,),
            str(out_path),
            input_names=[ONNX_INPUT],
            output_names=list(graph.outputs),
            **exporter_options(name, graph),
        )


def export_checked(
    graph: Graph, batches: dict[str, Tensor], onnx_path: Path, device: str
) -> tuple[str, list[ParityCheck]]:
    """The first exporter whose graph runs and agrees with torch: (its name, parity checks)."""
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    # Two rows of the largest batch: a batch of one would let torch.export specialise the batch
    # axis to 1 (its 0/1 rule), and a graph traced on it would take nothing else.
    example = max(batches.values(), key=len)[: graph.fixed_batch or 2]
    failures = []
    for name in graph.exporters:
        checks, err = attempt(_export_and_compare, name, graph, example, onnx_path, batches, device)
        if err is None:
            return name, checks
        if isinstance(err, NothingComparedError):
            onnx_path.unlink(missing_ok=True)
            raise err
        # any failure of one exporter: try the next, report all
        log.info("the %s ONNX exporter did not work: %s", name, err)
        failures.append(f"{name} exporter: {type(err).__name__}: {str(err)[:300]}")
    onnx_path.unlink(missing_ok=True)  # (Triton's folder; mode=export writes a temporary file)
    raise ExportParityError(
        f"no ONNX export of {onnx_path} agreed with torch: " + "; ".join(failures)
    )


def _export_and_compare(
    name: str, graph: Graph, example, onnx_path: Path, batches: dict[str, Tensor], device: str
) -> list[ParityCheck]:
    import onnx

    export_graph(name, graph, example, onnx_path)
    declare_output_dims(onnx_path, graph.output_dims)
    onnx.checker.check_model(str(onnx_path))
    return check_parity(graph, onnx_path, batches, device)


def declare_output_dims(onnx_path: Path, output_dims: dict[str, tuple[int, ...]]) -> None:
    import onnx

    if not output_dims:
        return
    model = onnx.load(str(onnx_path))
    for output in model.graph.output:
        if output.name in output_dims:
            dims = output.type.tensor_type.shape.dim
            for dim, size in zip(dims[1:], output_dims[output.name], strict=True):
                dim.Clear()
                dim.dim_value = size
    onnx.save(model, str(onnx_path))


def write_sidecar(record: ModelRecord, onnx_path: Path, fixed_batch: int | None = None) -> Path:
    """model.onnx.json: the record kiln reads back (its `preprocessing` is what kiln does to raw
    inputs, `value_range` the raw pixels'), and `graph_input`: what the graph itself takes, for
    anyone feeding it without kiln."""
    path = sidecar_path(onnx_path)
    described = graph_input(record, fixed_batch)
    write_json(path, {"graph_input": described, **record.to_json()}, indent=1)
    return path


def graph_input(record: ModelRecord, fixed_batch: int | None = None) -> dict[str, Any]:
    """The graph's input as it must arrive: name, dtype, shape and the range of its values. An
    image classifier's graph takes standardised pixels ((pixel - mean) / std per channel), so
    its range is the raw range standardised, per channel -- not the raw pixels' range."""
    spec, recipe = record.spec, record.recipe
    if spec.input_kind == "tokens":
        spelled = getattr(recipe, "spell_char_ngrams", None) is not None  # text_bow's spelling
        highest = spec.vocab_size - 1 + (CHAR_HASH_SPACE if spelled else 0)
        holds = "token ids of the recipe's tokenizer, padded with pad_id"
        if spelled:
            holds += "; each [UNK] followed by its word's spelled character n-grams"
        return {
            "name": ONNX_INPUT,
            "dtype": "int64",
            "shape": ["batch", "sequence"],
            "holds": holds,
            "value_range": [0, highest],
        }
    low, high = recipe.value_range or (None, None)
    if spec.input_kind == "image_list":
        batch = fixed_batch or "batch"
        return {
            "name": ONNX_INPUT,
            "dtype": "float32",
            "shape": [batch, 3, "height", "width"],
            "holds": "raw pixels (the graph resizes and normalises them itself)",
            "value_range": [low, high],
        }
    channels = [
        [None if low is None else (low - m) / s, None if high is None else (high - m) / s]
        for m, s in zip(recipe.mean, recipe.std, strict=True)
    ]
    return {
        "name": ONNX_INPUT,
        "dtype": "float32",
        "shape": ["batch", spec.channels, *spec.image_size],
        "holds": "standardised pixels: (pixel - preprocessing.mean[c]) / preprocessing.std[c], "
        "for pixels in preprocessing.value_range; NOT raw pixels",
        "value_range_per_channel": channels,
    }


@torch.inference_mode()
def torch_probs(net: nn.Module, batch: Tensor) -> np.ndarray:
    return net(batch)[1].numpy()


def onnx_probs(session, batch: Tensor) -> np.ndarray:
    return session.run(["probs"], {ONNX_INPUT: batch.numpy()})[0]


def probs_difference(net: nn.Module, session, batch: Tensor) -> float:
    return float(np.abs(onnx_probs(session, batch) - torch_probs(net, batch)).max())


@torch.inference_mode()
def detection_difference(net: nn.Module, session, batch: Tensor, threshold: float):
    """kiln's detector (a fixed K per image): the detections each side keeps (score >=
    threshold), matched image by image (kiln.inference.box_agreement)."""
    torch_out = [t.numpy() for t in net(batch)]
    onnx_out = session.run(list(DETECTION_OUTPUTS), {ONNX_INPUT: batch.numpy()})
    total = BoxAgreement()
    for ours, theirs in zip(zip(*torch_out, strict=True), zip(*onnx_out, strict=True), strict=True):
        total = total.add(match_image(keep_above(*ours, threshold), keep_above(*theirs, threshold)))
    return total


@torch.inference_mode()
def detection_iou_difference(net: nn.Module, session, batch: Tensor) -> BoxAgreement:
    """A single-image graph's detections against torch's on the same image, matched."""
    boxes, scores, labels = (t[0].numpy() for t in net(batch))
    o_boxes, o_scores, o_labels = (
        t[0] for t in session.run(list(DETECTION_OUTPUTS), {ONNX_INPUT: batch.numpy()})
    )
    return match_image(
        {"boxes": boxes, "scores": scores, "labels": labels},
        {"boxes": o_boxes, "scores": o_scores, "labels": o_labels},
    )


def check_parity(graph: Graph, onnx_path: Path, batches: dict[str, Tensor], device: str):
    session = ort_session(onnx_path, device)
    checks = []
    for name, batch in batches.items():
        diff = graph.difference(graph.net, session, batch)
        if isinstance(diff, BoxAgreement):
            checks.append(box_check(name, diff, graph, onnx_path))
            continue
        checks.append(ParityCheck(name, diff, graph.unit))
        if not diff <= graph.tolerance:  # also catches NaN
            found = f"max |d{graph.unit}| = {diff:.3g} > {graph.tolerance:g}"
            raise ExportParityError(
                f"{onnx_path}: ONNX Runtime and torch disagree on {name}: {found}; the export is "
                "not trustworthy"
            )
    boxes = ExportReport(onnx_path, checks).boxes
    if boxes is not None and not boxes.boxes:
        raise NothingComparedError(
            f"{onnx_path}: parity {boxes.problem()}: a graph checked on no box is not "
            "trustworthy. Export a checkpoint that finds boxes on the validation images (the "
            "model's score threshold keeps none: trained too little?)"
        )
    return checks


def box_check(name: str, boxes: BoxAgreement, graph: Graph, onnx_path: Path) -> ParityCheck:
    """A detector's parity on one batch: refused when a box has no twin (ties aside). A batch
    without any box is no failure by itself; parity over no box at all is (check_parity)."""
    problem = boxes.problem(graph.max_corner_px) if boxes.boxes or boxes.second_boxes else None
    if problem is not None:
        raise ExportParityError(
            f"{onnx_path}: ONNX Runtime and torch disagree on {name}: {problem}; the export is "
            "not trustworthy"
        )
    diff = boxes.max_corner_px if graph.unit == "box" else 1 - boxes.min_iou
    return ParityCheck(name, diff, graph.unit, boxes)


@contextlib.contextmanager
def quiet_root_logger():
    """onnxruntime.quantization logs per-tensor notes on the root logger; keep them out."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        root.setLevel(level)


def quantize_int8(onnx_path: Path, int8_path: Path) -> Path:
    """The int8 (dynamically quantised) model of `onnx_path`, written to `int8_path`."""
    import onnx
    from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp, quiet_root_logger():
        # The dynamo exporter's intermediate shape annotations can contradict onnx's own shape
        # inference, which quantisation runs; drop them and let it infer afresh.
        graph = onnx.load(str(onnx_path))
        del graph.graph.value_info[:]
        stripped, prepared = Path(tmp) / "stripped.onnx", Path(tmp) / "prepared.onnx"
        onnx.save(graph, str(stripped))
        # Shape inference + graph clean-up first, as onnxruntime recommends before quantising.
        quant_pre_process(str(stripped), str(prepared), skip_symbolic_shape=True)
        quantize_dynamic(str(prepared), str(int8_path), weight_type=QuantType.QInt8)
    return int8_path


def check_int8(
    net: nn.Module, int8_path: Path, examples: Tensor, device: str, threshold: float | None = None
) -> float:
    """The share of examples the int8 model predicts as torch does: the same most probable
    class, or (multi-label, `threshold`) the same predicted set."""
    session = ort_session(int8_path, device)
    ours, theirs = onnx_probs(session, examples), torch_probs(net, examples)
    if threshold is None:
        agree = ours.argmax(1) == theirs.argmax(1)
    else:
        agree = ((ours >= threshold) == (theirs >= threshold)).all(axis=1)
    agreement = float(agree.mean())
    if agreement < INT8_MIN_AGREEMENT:
        int8_path.unlink(missing_ok=True)  # never leave a model behind that failed its check
        raise ExportParityError(
            f"{int8_path}: the int8 model's prediction matches torch on only {agreement:.1%} of "
            f"{len(examples)} examples (< {INT8_MIN_AGREEMENT:.0%}); use the fp32 model.onnx"
        )
    return agreement


def none_left(err: Exception, path: Path) -> None:
    """A model that failed its export or its check leaves none behind, not even an older one
    (it came from another export, maybe of another checkpoint)."""
    path.unlink(missing_ok=True)
    sidecar_path(path).unlink(missing_ok=True)
    disk_full_error(err, path)


def export(
    ckpt_path: str | Path,
    out_path: str | Path | None = None,
    *,
    int8: bool = False,
    device: str = "cpu",
) -> ExportReport:
    """Export, check parity (raises ExportParityError), write the sidecar JSON; optionally int8."""
    ckpt_path = Path(ckpt_path)
    record, state_dict = read_checkpoint(ckpt_path)
    detection = record.spec.task == "detection"
    if int8 and detection:
        raise InferenceError(
            "int8=true quantises classifiers only; export the detector without it (fp32)"
        )
    onnx_path = Path(out_path) if out_path is not None else ckpt_path.with_name("model.onnx")
    graph = graph_for(record, rebuild_model(record, state_dict))
    limit = NUM_DETECTION_EXAMPLES if detection else NUM_INT8_EXAMPLES if int8 else None
    if detection and graph.fixed_batch == 1:
        limit = NUM_DETECTION_CANDIDATES
    examples, source = validation_examples(record, limit or NUM_PARITY_EXAMPLES)
    if detection and graph.fixed_batch == 1:
        examples, source = boxes_first(graph, examples, source)
    batches = parity_batches(
        examples if detection else examples[:NUM_PARITY_EXAMPLES],
        record.spec.input_kind,
        graph.fixed_batch,
    )
    # Each model file is written and checked under a temporary name, and renamed into place
    # only once it passed: a failure or a stop (SIGTERM, Ctrl-C) leaves no half-written or
    # unchecked model.onnx. Its sidecar goes in place just before it.
    with atomic_path(onnx_path, failed=none_left) as written:
        exporter, parity = export_checked(graph, batches, written, device)
        write_sidecar(record, onnx_path, graph.fixed_batch)
    report = ExportReport(onnx_path, parity, exporter=exporter, examples_source=source)
    if int8:
        int8_path = onnx_path.with_name(onnx_path.name.removesuffix(".onnx") + ".int8.onnx")
        threshold = record.spec.threshold if record.spec.multi_label else None
        with atomic_path(int8_path, failed=none_left) as written:
            quantize_int8(onnx_path, written)
            report.int8_agreement = check_int8(graph.net, written, examples, device, threshold)
            write_sidecar(record, int8_path)
        report.int8_path, report.int8_threshold = int8_path, threshold
        report.int8_num_examples = len(examples)
    for line in report.lines():
        log.info(line)
    return report


__all__ = ["ExportParityError", "ExportReport", "export", "graph_for"]
