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


def last_hidden_width(config) -> int:
    """The width of a transformers model's last hidden state: its hidden_size, but where the
    encoder's output is something else (Perceiver's latents, d_latents wide)."""
    return getattr(config, "d_latents", None) or config.hidden_size


class HfClassifier(nn.Module):
    """A transformers AutoModelForSequenceClassification over kiln's token batches: ids (N, L)
    padded with pad_id in, logits (N, C) out. The attention mask is derived from the padding
    here, and the library's ModelOutput is read here, once: the rest of kiln sees a tensor (or
    kiln's {"logits", "aux_logits"} with an aux head, a Linear on the first token's final
    hidden state)."""

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        pad_id: int,
        aux_head: bool,
        sep_id: int | None = None,
    ):
        super().__init__()
        self.net = net
        self.pad_id = pad_id
        # Models with token types (BERT's segment A/B): a pair's second text is what follows
        # the first separator; None: the model takes no token types.
        self.sep_id = sep_id
        self.aux = nn.Linear(last_hidden_width(net.config), num_classes) if aux_head else None
        # The classifier head: every child of the library's model with weights, but its base
        # (the encoder).
        head = [
            name
            for name, child in net.named_children()
            if name != net.base_model_prefix and any(True for _ in child.parameters())
        ]
        self.head_prefixes = (*(f"net.{name}" for name in head), "aux")
        self.fixed_input_size = False

    def library_key(self, key: str) -> str:
        """A key of the library's own state dict (model.safetensors) as this model names it."""
        return f"net.{key}"

    def forward(self, ids: Tensor) -> Tensor | dict[str, Tensor]:
        mask = (ids != self.pad_id).long()  # (N, L): 1 on real tokens
        types = None
        if self.sep_id is not None:
            # [CLS] a [SEP] b [SEP]: 0 up to and with the first [SEP], 1 after it (a single
            # text's padding also gets 1: masked, it changes nothing).
            seps = (ids == self.sep_id).long()
            types = ((seps.cumsum(dim=1) - seps) > 0).long()  # (N, L)
        out = self.net(
            input_ids=ids,
            attention_mask=mask,
            token_type_ids=types,
            output_hidden_states=self.aux is not None,
            return_dict=True,
        )
        if self.aux is None:
            return out.logits
        return {"logits": out.logits, "aux_logits": self.aux(out.hidden_states[-1][:, 0])}
