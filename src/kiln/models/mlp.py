"""A multilayer perceptron over flattened images; the input width comes from the data spec."""

from __future__ import annotations

import math

from torch import Tensor, nn

from kiln.config.model import MlpConfig


class MLP(nn.Module):
    head_prefixes = ("head", "aux")  # the classifier heads (model.freeze, optimizer.head_lr_mult)

    def __init__(
        self,
        in_features: int,
        hidden_dims: list[int],
        num_classes: int,
        dropout: float,
        aux_head: bool,
    ):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for hidden in hidden_dims:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)
        first_hidden = hidden_dims[0] if hidden_dims else in_features
        self.aux = nn.Linear(first_hidden, num_classes) if aux_head else None

    def forward(self, x: Tensor) -> Tensor | dict[str, Tensor]:
        h = x.flatten(1)  # (N, C*H*W), whatever the image size
        if self.aux is None:
            return self.head(self.body(h))
        first = self.body[:3](h) if len(self.body) else h
        return {"logits": self.head(self.body[3:](first)), "aux_logits": self.aux(first)}


def build_mlp(spec, cfg: MlpConfig, *, aux_head: bool = False) -> MLP:
    if spec.input_kind != "image":
        raise ValueError(f"model mlp needs image data, got {spec.input_kind} ({spec})")
    in_features = spec.channels * math.prod(spec.image_size)
    return MLP(in_features, list(cfg.hidden_dims), spec.num_classes, cfg.dropout, aux_head)
