"""The modules a zoo model is wrapped in: every one declares `head_prefixes` (what
model.freeze=backbone leaves trainable and optimizer.head_lr_mult scales), `fixed_input_size`
and `library_key` (a key of the library's own state dict as the wrapper names it)."""

from __future__ import annotations

from torch import Tensor, nn


class ZooClassifier(nn.Module):
    """A torchvision network split at its classifier layer:

    backbone(x) -> features (N, F) pooled (squeezenet: its feature map)
    -> dropout -> head -> logits (N, classes); aux (Linear on the pooled features)
    """

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Module,
        num_features: int,
        num_classes: int,
        dropout: float,
        aux_head: bool,
        fixed_input_size: bool,
        library_head: str = "fc",
    ):
        super().__init__()
        self.library_head = library_head  # the head's name in the library's own network
        self.backbone = backbone
        self.dropout = nn.Dropout(dropout)
        self.head = head
        self.aux = nn.Linear(num_features, num_classes) if aux_head else None
        self.head_prefixes = ("head", "aux")
        self.fixed_input_size = fixed_input_size

    def library_key(self, key: str) -> str:
        """A key of the library's own state dict (torchvision's file) as this model names it:
        init_from= such a file loads like a kiln checkpoint."""
        if self.library_head == "classifier.1":  # squeezenet: features -> classifier
            first, _, rest = key.partition(".")
            return {"features": f"backbone.{rest}", "classifier": f"head.{rest}"}.get(first, key)
        if key.startswith(f"{self.library_head}."):
            return "head." + key[len(self.library_head) + 1 :]
        return f"backbone.{key}"

    def forward(self, x: Tensor) -> Tensor | dict[str, Tensor]:
        features = self.backbone(x)
        logits = self.head(self.dropout(features))
        if self.aux is None:
            return logits
        pooled = features if features.dim() == 2 else features.mean(dim=(2, 3))
        return {"logits": logits, "aux_logits": self.aux(pooled)}


class TimmClassifier(nn.Module):
    """A timm model, whole; with an aux head, its pooled pre-logits features also feed a Linear
    (timm's forward_features / forward_head(pre_logits=True))."""

    def __init__(self, net: nn.Module, num_classes: int, aux_head: bool, classifiers, fixed):
        super().__init__()
        self.net = net
        width = getattr(net, "head_hidden_size", None) or net.num_features
        self.aux = nn.Linear(width, num_classes) if aux_head else None
        self.head_prefixes = (*(f"net.{c}" for c in classifiers), "aux")
        self.fixed_input_size = fixed

    def library_key(self, key: str) -> str:
        """A key of timm's own state dict as this model names it (see ZooClassifier)."""
        return f"net.{key}"

    def forward(self, x: Tensor) -> Tensor | dict[str, Tensor]:
        if self.aux is None:
            return self.net(x)
        features = self.net.forward_features(x)
        logits = self.net.forward_head(features)
        pooled = self.net.forward_head(features, pre_logits=True)
        return {"logits": logits, "aux_logits": self.aux(pooled)}
