"""Text classifiers over token ids (N, L) padded with spec.pad_id. The padding mask is derived
from the ids, so a batch of any length up to spec.max_length works; nothing hard-codes a length."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kiln.config.model import TextBowConfig, TextTransformerConfig


def masked_mean(x: Tensor, keep: Tensor) -> Tensor:
    """Mean over the sequence of x (N, L, D) where keep (N, L) is True: (N, D)."""
    weights = keep.unsqueeze(-1).to(x.dtype)  # (N, L, 1)
    count = weights.sum(dim=1).clamp(min=1.0)  # a row of only padding averages to zero, not NaN
    return (x * weights).sum(dim=1) / count


def _outputs(logits: Tensor, aux: nn.Module | None, aux_features: Tensor):
    return logits if aux is None else {"logits": logits, "aux_logits": aux(aux_features)}


class BagOfEmbeddings(nn.Module):
    """Mean of the token embeddings (padding excluded) -> dropout -> linear."""

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        num_classes: int,
        dropout: float,
        pad_id: int,
        aux_head: bool,
    ):
        super().__init__()
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_id)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(embed_dim, num_classes)
        self.aux = nn.Linear(embed_dim, num_classes) if aux_head else None

    def forward(self, ids: Tensor) -> Tensor | dict[str, Tensor]:
        pooled = masked_mean(self.embed(ids), ids != self.pad_id)  # (N, D)
        return _outputs(self.head(self.dropout(pooled)), self.aux, pooled)


class TextTransformer(nn.Module):
    """Token + learned position embeddings -> TransformerEncoder (padding masked) -> masked mean
    -> linear. The auxiliary head, when present, reads the mean of the input embeddings."""

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        embed_dim: int,
        num_layers: int,
        num_heads: int,
        dropout: float,
        num_classes: int,
        pad_id: int,
        aux_head: bool,
    ):
        super().__init__()
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_id)
        # One row per position up to the data's max_length; forward uses the first L rows.
        self.position = nn.Parameter(torch.randn(max_length, embed_dim) * 0.02)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            embed_dim,
            num_heads,
            dim_feedforward=4 * embed_dim,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # Nested tensors would change the output at padded positions between train and eval.
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        self.aux = nn.Linear(embed_dim, num_classes) if aux_head else None

    def forward(self, ids: Tensor) -> Tensor | dict[str, Tensor]:
        length = ids.shape[1]
        if not _tracing() and length > self.position.shape[0]:
            raise ValueError(
                f"text_transformer got sequences of {length} tokens; it was built for at most "
                f"{self.position.shape[0]} (data.max_length)"
            )
        keep = ids != self.pad_id  # (N, L)
        # A row of only padding would leave attention nothing to attend to (NaN): let such a row
        # see its first position.
        keep = keep | (
            ~keep.any(dim=1, keepdim=True) & (torch.arange(length, device=ids.device) == 0)
        )
        tokens = self.embed(ids)  # (N, L, D)
        x = self.dropout(tokens + self.position[:length])
        x = self.encoder(x, src_key_padding_mask=~keep)  # (N, L, D)
        pooled = masked_mean(self.norm(x), keep)  # (N, D)
        return _outputs(self.head(pooled), self.aux, masked_mean(tokens, keep))


def _tracing() -> bool:
    # Shape checks on python ints would be baked into a traced/exported graph as guards.
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def _check_token_spec(spec, model_name: str) -> None:
    if spec.input_kind != "tokens" or spec.vocab_size is None or spec.max_length is None:
        raise ValueError(
            f"model {model_name} needs token data (input_kind tokens with vocab_size and "
            f"max_length), got input_kind={spec.input_kind}; use data=csv_text"
        )


def build_text_bow(spec, cfg: TextBowConfig, *, aux_head: bool = False) -> BagOfEmbeddings:
    _check_token_spec(spec, "text_bow")
    return BagOfEmbeddings(
        spec.vocab_size, cfg.embed_dim, spec.num_classes, cfg.dropout, spec.pad_id, aux_head
    )


def build_text_transformer(
    spec, cfg: TextTransformerConfig, *, aux_head: bool = False
) -> TextTransformer:
    _check_token_spec(spec, "text_transformer")  # the config checked heads, layers and width
    return TextTransformer(
        spec.vocab_size,
        spec.max_length,
        cfg.embed_dim,
        cfg.num_layers,
        cfg.num_heads,
        cfg.dropout,
        spec.num_classes,
        spec.pad_id,
        aux_head,
    )
