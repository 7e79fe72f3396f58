"""Ways to run the network on validated inputs: the rebuilt torch module, an ONNX Runtime session
over the exported graph, or no model at all (`echo`: the serving stack's own ceiling).

Classifiers return probabilities (N, K); detectors return one `Detections` dict per image:
{"boxes": (k, 4) float32 pixels (x1, y1, x2, y2), "scores": (k,) float32, "labels": (k,) int64
in 1..num_classes}, scores >= the model's score_threshold, highest first."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from kiln.data.spec import DataSpec
from kiln.models import logits_of

ONNX_INPUT = "input"
ONNX_OUTPUTS = ("logits", "probs")  # classifiers
DETECTION_OUTPUTS = ("boxes", "scores", "labels")  # detectors: (N, K, 4), (N, K), (N, K)

Detections = dict[str, np.ndarray]


class ProbabilityHead(nn.Module):
    """model -> (logits, probs): softmax probs, or (multi_label) a sigmoid per class. The
    auxiliary head (training only) is dropped, and this same wrapper is what gets exported, so
    both backends compute the same graph."""

    def __init__(self, model: nn.Module, multi_label: bool = False):
        super().__init__()
        self.model = model
        self.multi_label = multi_label

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = logits_of(self.model(x))
        if self.multi_label:
            return logits, torch.sigmoid(logits)
        return logits, logits.softmax(dim=-1)


class RawImageHead(nn.Module):
    """Raw pixels -> (logits, probs), the training normalisation folded into the graph: what a
    Triton client sends is what a kiln client sends."""

    def __init__(
        self, model: nn.Module, mean: list[float], std: list[float], multi_label: bool = False
    ):
        super().__init__()
        self.head = ProbabilityHead(model, multi_label)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.head((x - self.mean) / self.std)


class DetectionHead(nn.Module):
    """A detector's `detect`: (N, 3, H, W) raw pixels -> boxes (N, K, 4), scores (N, K), labels
    (N, K), K fixed, no threshold. The graph ONNX export and Triton run."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.model.detect(x)


class SingleImageDetectionHead(nn.Module):
    """A contract detector's eval forward on one image: (1, 3, H, W) raw pixels -> boxes
    (1, K, 4), scores (1, K), labels (1, K), K varying (the model's own score threshold, NMS and
    detections per image applied). The graph ONNX export takes for torchvision's detectors:
    their post-processing loops over the images of a batch, which tracing unrolls, so the
    exported graph's batch is one image (any H and W)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        (found,) = self.model([x[0]])
        return found["boxes"][None], found["scores"][None], found["labels"][None]


def keep_above(boxes, scores, labels, threshold: float) -> Detections:
    keep = scores >= threshold
    return {
        "boxes": np.asarray(boxes[keep], dtype=np.float32).reshape(-1, 4),
        "scores": np.asarray(scores[keep], dtype=np.float32),
        "labels": np.asarray(labels[keep], dtype=np.int64),
    }


class TorchBackend:
    platform = "pytorch_torchscript"  # the nearest Open Inference Protocol platform name

    def __init__(self, model: nn.Module, device: torch.device, multi_label: bool = False):
        self.device = device
        self.net = ProbabilityHead(model, multi_label).to(device).eval()

    @torch.inference_mode()
    def probs(self, batch: Tensor) -> np.ndarray:
        _, probs = self.net(batch.to(self.device))
        return probs.float().cpu().numpy()


class TorchDetectionBackend:
    platform = "pytorch_torchscript"

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device
        self.model = model.to(device).eval()

    @torch.inference_mode()
    def detect(self, images: list[Tensor]) -> list[Detections]:
        found = self.model([image.to(self.device) for image in images])
        return [{key: value.cpu().numpy() for key, value in d.items()} for d in found]


def ort_providers(device: torch.device | str) -> list[str]:
    """CUDA first when asked for and present in this onnxruntime build; CPU always as fallback."""
    import onnxruntime as ort

    wants_cuda = torch.device(device).type == "cuda"
    if wants_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def ort_session(onnx_path: Path, device: torch.device | str = "cpu", threads: int | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    # Fatal only: errors reach us as exceptions, and its warnings (unused providers) are noise.
    options.log_severity_level = 4
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Idle threads sleep instead of spinning: a server shares its cores with HTTP.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(onnx_path), options, providers=ort_providers(device))


class OnnxBackend:
    platform = "onnxruntime_onnx"

    def __init__(self, onnx_path: Path, device: torch.device, threads: int | None = None):
        self.path = onnx_path
        self.session = ort_session(onnx_path, device, threads)

    def probs(self, batch: Tensor) -> np.ndarray:
        (probs,) = self.session.run(["probs"], {ONNX_INPUT: batch.cpu().numpy()})
        return probs


class OnnxDetectionBackend:
    """The exported graph takes one image size per call: images are grouped by size, and fed
    one at a time to a graph whose batch axis is fixed at 1 (torchvision's detectors)."""

    platform = "onnxruntime_onnx"

    def __init__(self, onnx_path: Path, device: torch.device, score_threshold: float, threads=None):
        self.path = onnx_path
        self.session = ort_session(onnx_path, device, threads)
        self.score_threshold = score_threshold
        batch_axis = self.session.get_inputs()[0].shape[0]
        self.max_batch = batch_axis if isinstance(batch_axis, int) else None

    def detect(self, images: list[Tensor]) -> list[Detections]:
        by_size: dict[tuple, list[int]] = defaultdict(list)
        for i, image in enumerate(images):
            by_size[tuple(image.shape)].append(i)
        found: list[Detections | None] = [None] * len(images)
        step = self.max_batch
        chunks = [
            group[start : start + step] if step else group
            for group in by_size.values()
            for start in range(0, len(group), step or len(group))
        ]
        for indices in chunks:
            batch = np.stack([images[i].numpy() for i in indices])
            boxes, scores, labels = self.session.run(list(DETECTION_OUTPUTS), {ONNX_INPUT: batch})
            for row, i in enumerate(indices):
                found[i] = keep_above(boxes[row], scores[row], labels[row], self.score_threshold)
        return found


class EchoBackend:
    """No model: a fixed answer per input (uniform probabilities, no boxes). Serving with it
    measures what the HTTP stack, validation and batching cost on their own."""

    platform = "echo"

    def __init__(self, spec: DataSpec):
        self.num_classes = spec.num_classes

    def probs(self, batch: Tensor) -> np.ndarray:
        return np.full((len(batch), self.num_classes), 1 / self.num_classes, dtype=np.float32)

    def detect(self, images: list[Tensor]) -> list[Detections]:
        empty = keep_above(np.zeros((0, 4)), np.zeros(0), np.zeros(0), 0.0)
        return [dict(empty) for _ in images]
