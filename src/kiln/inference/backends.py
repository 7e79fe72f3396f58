"""Two ways to run the network on a preprocessed batch, both returning probabilities (N, K):
the rebuilt torch module, or an ONNX Runtime session over the exported graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from kiln.models import logits_of

ONNX_INPUT, ONNX_OUTPUTS = "input", ("logits", "probs")


class ProbabilityHead(nn.Module):
    """model -> (logits, softmax probs). The auxiliary head (training only) is dropped, and this
    same wrapper is what gets exported, so both backends compute the same graph."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = logits_of(self.model(x))
        return logits, logits.softmax(dim=-1)


class TorchBackend:
    platform = "pytorch_torchscript"  # the nearest Open Inference Protocol platform name

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device
        self.net = ProbabilityHead(model).to(device).eval()

    @torch.inference_mode()
    def probs(self, batch: Tensor) -> np.ndarray:
        _, probs = self.net(batch.to(self.device))
        return probs.float().cpu().numpy()


def ort_providers(device: torch.device | str) -> list[str]:
    """CUDA first when asked for and present in this onnxruntime build; CPU always as fallback."""
    import onnxruntime as ort

    wants_cuda = torch.device(device).type == "cuda"
    if wants_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def ort_session(onnx_path: Path, device: torch.device | str = "cpu"):
    import onnxruntime as ort

    options = ort.SessionOptions()
    # Fatal only: errors reach us as exceptions, and its warnings (unused providers) are noise.
    options.log_severity_level = 4
    return ort.InferenceSession(str(onnx_path), options, providers=ort_providers(device))


class OnnxBackend:
    platform = "onnxruntime_onnx"

    def __init__(self, onnx_path: Path, device: torch.device):
        self.path = onnx_path
        self.session = ort_session(onnx_path, device)

    def probs(self, batch: Tensor) -> np.ndarray:
        (probs,) = self.session.run(["probs"], {ONNX_INPUT: batch.cpu().numpy()})
        return probs
