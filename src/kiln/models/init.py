"""Weight initialisation schemes chosen in config (model.init)."""

from __future__ import annotations

from torch import nn


def apply_init(model: nn.Module, scheme: str) -> None:
    if scheme == "default":
        return  # PyTorch's per-layer defaults
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d):
            if scheme == "kaiming":
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            elif scheme == "xavier":
                nn.init.xavier_uniform_(module.weight)
            else:
                raise ValueError(f"model.init={scheme!r}; choose default, kaiming or xavier")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
