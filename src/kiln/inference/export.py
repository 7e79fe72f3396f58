"""Export a checkpoint to ONNX (dynamic batch, and sequence length for token models), prove the
graph agrees with torch on real validation examples, and write the preprocessing beside it.

    model.onnx            inputs: input (N, C, H, W) float32 | (N, L) int64; outputs: logits, probs
    model.onnx.json       data spec, preprocessing, config and the source .pt's sha256
    model.int8.onnx(.json)  with int8=True: dynamically quantised weights, looser agreement check
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kiln.data.spec import DataSpec
from kiln.inference.backends import ONNX_INPUT, ONNX_OUTPUTS, ProbabilityHead, ort_session
from kiln.inference.errors import InferenceError
from kiln.inference.record import ModelRecord, read_checkpoint, rebuild_model, sidecar_path

log = logging.getLogger(__name__)

OPSET = 17
DYNAMO_OPSET = 18  # the dynamo exporter's lowest supported opset
PROBS_TOLERANCE = 1e-4  # max |p_onnx - p_torch| over every class of every example
INT8_MIN_AGREEMENT = 0.95  # share of examples where the int8 model's argmax matches torch's
NUM_PARITY_EXAMPLES = 64
NUM_INT8_EXAMPLES = 512


class ExportParityError(InferenceError):
    """The exported graph disagrees with the torch model beyond the tolerance."""


@dataclass
class ParityCheck:
    name: str  # which batch: "batch=1", "batch=64, length=12", ...
    max_abs_diff: float  # on probabilities


@dataclass
class ExportReport:
    onnx_path: Path
    parity: list[ParityCheck] = field(default_factory=list)
    exporter: str = ""  # which torch.onnx exporter produced the graph: legacy | dynamo
    int8_path: Path | None = None
    int8_agreement: float | None = None
    int8_num_examples: int = 0
    examples_source: str = ""

    def lines(self) -> list[str]:
        sidecar = sidecar_path(self.onnx_path).name
        out = [f"wrote {self.onnx_path} (+ {sidecar}; {self.exporter} exporter)"]
        out += [f"  parity {c.name}: max |dprob| = {c.max_abs_diff:.2e}" for c in self.parity]
        out.append(f"  examples: {self.examples_source}")
        if self.int8_path is not None:
            out.append(
                f"wrote {self.int8_path}: argmax agrees with torch on "
                f"{self.int8_agreement:.1%} of {self.int8_num_examples} examples"
            )
        return out


# ---------------------------------------------------------------------------------------------
# Examples to check parity on


def validation_examples(record: ModelRecord, limit: int) -> tuple[Tensor, str]:
    """Up to `limit` preprocessed validation inputs, rebuilt from the run's data config. If the
    data is not reachable here (a CSV on another machine), random valid inputs instead."""
    from kiln.config import option_from_dict
    from kiln.data import build_data

    try:
        bundle = build_data(option_from_dict("data", record.config["data"]))
    except (OSError, ValueError) as err:
        log.warning("parity check on random inputs: the run's data is unavailable (%s)", err)
        return random_examples(record, limit), "random inputs (training data unavailable)"
    items = [bundle.val[i] for i in range(min(limit, len(bundle.val)))]
    if bundle.collate_fn is not None:
        inputs, _ = bundle.collate_fn(items)
    else:
        inputs = torch.stack([x for x, _ in items])
    return inputs, f"{len(items)} validation examples of data={record.config['data']['name']}"


def random_examples(record: ModelRecord, limit: int) -> Tensor:
    gen = torch.Generator().manual_seed(0)
    spec = record.spec
    if spec.input_kind == "tokens":
        return torch.randint(
            1, spec.vocab_size, (limit, max(2, spec.max_length // 2)), generator=gen
        )
    preprocess = record.recipe.preprocessor()
    low, high = preprocess.value_range or (-1.0, 1.0)
    raw = low + (high - low) * torch.rand((limit, *preprocess.shape), generator=gen)
    return preprocess(raw.numpy())


def parity_batches(examples: Tensor, input_kind: str) -> dict[str, Tensor]:
    """Two batch sizes; token models also at two sequence lengths."""
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


def exporter_options(name: str, spec: DataSpec) -> dict:
    """torch.onnx.export's arguments for each exporter. legacy (TorchScript-based) is fast and
    simple but bakes some shapes (e.g. the batch size inside nn.MultiheadAttention) into the
    graph, which the parity check catches; dynamo (torch.export-based) keeps batch and sequence
    sizes symbolic all the way through."""
    tokens = spec.input_kind == "tokens"
    if name == "legacy":
        dims = {0: "batch", 1: "sequence"} if tokens else {0: "batch"}
        axes = {ONNX_INPUT: dims, "logits": {0: "batch"}, "probs": {0: "batch"}}
        return {"dynamic_axes": axes, "opset_version": OPSET, "dynamo": False}
    dims = {0: torch.export.Dim("batch")}
    if tokens:
        dims[1] = torch.export.Dim("sequence", max=spec.max_length)
    return {
        "dynamic_shapes": (dims,),
        "opset_version": DYNAMO_OPSET,
        "dynamo": True,
        "external_data": False,  # one self-contained file, like the legacy exporter's
        "verbose": False,
    }


def export_graph(
    name: str, net: ProbabilityHead, example: Tensor, out_path: Path, spec: DataSpec
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation and tracer notices
        torch.onnx.export(
            net,
            (example,),
            str(out_path),
            input_names=[ONNX_INPUT],
            output_names=list(ONNX_OUTPUTS),
            **exporter_options(name, spec),
        )


EXPORTERS = ("legacy", "dynamo")  # tried in this order


def export_checked(
    net: ProbabilityHead, examples: Tensor, onnx_path: Path, spec: DataSpec, device: str
) -> tuple[str, list[ParityCheck]]:
    """The first exporter whose graph runs and agrees with torch: (its name, parity checks)."""
    import onnx

    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    batches = parity_batches(examples[:NUM_PARITY_EXAMPLES], spec.input_kind)
    failures = []
    for name in EXPORTERS:
        try:
            export_graph(name, net, examples[:2], onnx_path, spec)
            onnx.checker.check_model(str(onnx_path))
            return name, check_parity(net, onnx_path, batches, device)
        except Exception as err:  # any failure of one exporter: try the next, report all
            log.info("the %s ONNX exporter did not work: %s", name, err)
            failures.append(f"{name} exporter: {type(err).__name__}: {str(err)[:300]}")
    onnx_path.unlink(missing_ok=True)
    raise ExportParityError(
        f"no ONNX export of {onnx_path} agreed with torch: " + "; ".join(failures)
    )


def write_sidecar(record: ModelRecord, onnx_path: Path) -> Path:
    path = sidecar_path(onnx_path)
    path.write_text(json.dumps(record.to_json(), indent=1) + "\n")
    return path


@torch.inference_mode()
def torch_probs(net: ProbabilityHead, batch: Tensor) -> np.ndarray:
    return net(batch)[1].numpy()


def onnx_probs(session, batch: Tensor) -> np.ndarray:
    return session.run(["probs"], {ONNX_INPUT: batch.numpy()})[0]


def check_parity(net: ProbabilityHead, onnx_path: Path, batches: dict[str, Tensor], device: str):
    session = ort_session(onnx_path, device)
    checks = []
    for name, batch in batches.items():
        diff = float(np.abs(onnx_probs(session, batch) - torch_probs(net, batch)).max())
        checks.append(ParityCheck(name, diff))
        if not diff <= PROBS_TOLERANCE:  # also catches NaN
            raise ExportParityError(
                f"{onnx_path}: ONNX Runtime and torch disagree on {name}: max |dprob| = "
                f"{diff:.3g} > {PROBS_TOLERANCE:g}; the export is not trustworthy"
            )
    return checks


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


def quantize_int8(onnx_path: Path) -> Path:
    import onnx
    from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic

    int8_path = onnx_path.with_name(onnx_path.name.removesuffix(".onnx") + ".int8.onnx")
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


def check_int8(net: ProbabilityHead, int8_path: Path, examples: Tensor, device: str) -> float:
    session = ort_session(int8_path, device)
    agree = onnx_probs(session, examples).argmax(1) == torch_probs(net, examples).argmax(1)
    agreement = float(agree.mean())
    if agreement < INT8_MIN_AGREEMENT:
        int8_path.unlink()  # never leave a model behind that failed its check
        raise ExportParityError(
            f"{int8_path}: the int8 model's prediction matches torch on only {agreement:.1%} of "
            f"{len(examples)} examples (< {INT8_MIN_AGREEMENT:.0%}); use the fp32 model.onnx"
        )
    return agreement


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
    onnx_path = Path(out_path) if out_path is not None else ckpt_path.with_name("model.onnx")
    net = ProbabilityHead(rebuild_model(record, state_dict)).eval()
    limit = NUM_INT8_EXAMPLES if int8 else NUM_PARITY_EXAMPLES
    examples, source = validation_examples(record, limit)
    exporter, parity = export_checked(net, examples, onnx_path, record.spec, device)
    report = ExportReport(onnx_path, parity, exporter=exporter, examples_source=source)
    write_sidecar(record, onnx_path)
    if int8:
        report.int8_path = quantize_int8(onnx_path)
        report.int8_agreement = check_int8(net, report.int8_path, examples, device)
        report.int8_num_examples = len(examples)
        write_sidecar(record, report.int8_path)
    for line in report.lines():
        log.info(line)
    return report
