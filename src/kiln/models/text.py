"""Text classifiers over token ids (N, L) padded with spec.pad_id. The padding mask is derived
from the ids, so a batch of any length up to spec.max_length works; nothing hard-codes a length.
Both take one int64 tensor of ids: what the ONNX export and the server feed them.

- text_bow (FastText): fastText's classifier (Joulin et al., 2017) -- the mean of the token
  embeddings and of hashed token n-gram embeddings, one EmbeddingBag -> linear. The n-grams are
  hashed from the ids inside the model, so inference needs nothing but the ids.
- text_transformer (TextTransformer): token + position embeddings -> nn.TransformerEncoder with
  a padding mask -> masked mean -> linear. Attention runs through scaled_dot_product_attention
  (no attention weights are ever computed), and in eval mode under no_grad the encoder takes
  PyTorch's fused fast path over a nested tensor that skips the padding."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.config.model import TextBowConfig, TextTransformerConfig

# The n-gram hash: a polynomial rolling hash of consecutive ids modulo a prime, so the id
# products stay far inside int64 (ids < 2**31, multiplier < 2**20: < 2**51).
HASH_MULTIPLIER = 1_000_003
HASH_MODULUS = 2_147_483_647  # 2**31 - 1

# PyTorch's own encoder builds the nested tensor of its fast path and warns, every process, that
# the nested-tensor API is a prototype: a notice for PyTorch developers, not for kiln's users.
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")


def masked_mean(x: Tensor, keep: Tensor) -> Tensor:
    """Mean over the sequence of x (N, L, D) where keep (N, L) is True: (N, D)."""
    weights = keep.unsqueeze(-1).to(x.dtype)  # (N, L, 1)
    count = weights.sum(dim=1).clamp(min=1.0)  # a row of only padding averages to zero, not NaN
    return (x * weights).sum(dim=1) / count


def _outputs(logits: Tensor, aux: nn.Module | None, aux_features: Tensor):
    return logits if aux is None else {"logits": logits, "aux_logits": aux(aux_features)}


def hashed_ngrams(ids: Tensor, pad_id: int, ngrams: int, num_buckets: int, offset: int) -> Tensor:
    """Ids (N, L) -> the bucket ids of every 2..ngrams-gram, (N, sum of (L - n + 1)), each in
    [offset, offset + num_buckets); an n-gram that touches padding is pad_id."""
    keep = ids != pad_id
    rolling, grams = ids, []
    for n in range(2, ngrams + 1):
        # rolling[:, i] hashes ids[:, i : i + n], built from the (n-1)-gram hashes.
        rolling = (rolling[:, :-1] * HASH_MULTIPLIER + ids[:, n - 1 :]) % HASH_MODULUS
        keep = keep[:, :-1] & (ids[:, n - 1 :] != pad_id)
        bucket = (rolling * n) % HASH_MODULUS % num_buckets + offset  # n: bigrams != trigrams
        grams.append(torch.where(keep, bucket, torch.full_like(bucket, pad_id)))
    return torch.cat(grams, dim=1) if grams else ids[:, :0]


class _WeightedBag(torch.autograd.Function):
    """EmbeddingBag's weighted sum (its fast CPU kernel) with a sparse gradient that holds one
    row per distinct feature, already coalesced: the rows a batch touched, reduced as one sparse
    (distinct features x texts) matrix times the gradient of the pooled vectors. Built so, it
    costs a third of EmbeddingBag's own sparse gradient plus the sort (coalesce) that the norm
    and the optimizer would each need."""

    @staticmethod
    def forward(ctx, table: Tensor, features: Tensor, weights: Tensor) -> Tensor:
        ctx.save_for_backward(features, weights)
        ctx.table_shape = table.shape
        return F.embedding_bag(features, table, mode="sum", per_sample_weights=weights)

    @staticmethod
    def backward(ctx, grad: Tensor):  # grad: (N, D), of the pooled vectors
        features, weights = ctx.saved_tensors  # (N, F) each
        flat = features.reshape(-1)
        order = flat.argsort()
        rows, counts = torch.unique_consecutive(flat[order], return_counts=True)
        starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        texts = order // features.shape[1]  # which text each sorted position belongs to
        # (distinct rows x N): row u holds, for each text, the weights of u's positions in it.
        with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta": for torch devs
            warnings.simplefilter("ignore", UserWarning)
            touched = torch.sparse_csr_tensor(
                starts,
                texts,
                weights.reshape(-1)[order],
                size=(len(rows), features.shape[0]),
                check_invariants=False,  # built sorted and in range above
            )
        # In fp32 under autocast too: the sparse product has no bf16/fp16 kernel (CPU's MKL).
        with torch.autocast(grad.device.type, enabled=False):
            values = touched @ grad.to(weights.dtype)  # (distinct rows, D)
        table_grad = torch.sparse_coo_tensor(
            rows.unsqueeze(0),
            values.to(grad.dtype),
            ctx.table_shape,
            is_coalesced=True,
            check_invariants=False,
        )
        return table_grad, None, None


def _flag_coalesced(table: nn.Parameter) -> None:
    """After autograd stores _WeightedBag's gradient in .grad it no longer says it is coalesced
    (AccumulateGrad drops the flag), so the grad norm and the optimizer would each sort it again.
    Row indices in strictly increasing order are exactly what coalesced means, so say so again
    (CPU only: the check would wait for a GPU, whose sort is cheap anyway)."""
    grad = table.grad
    if grad is None or not grad.is_sparse or grad.is_coalesced() or grad.device.type != "cpu":
        return
    rows = grad._indices()[0]
    if bool((rows[1:] > rows[:-1]).all()):  # else: gradients accumulated over micro-batches
        table.grad = torch.sparse_coo_tensor(
            grad._indices(), grad._values(), grad.shape, is_coalesced=True, check_invariants=False
        )


class FastText(nn.Module):
    """fastText's classifier: one EmbeddingBag over the tokens and their hashed n-grams (padding
    excluded), pooled, -> dropout -> linear. One table holds vocab_size token rows followed by
    num_buckets n-gram rows.

    Pooling is the sum over sqrt(count) rather than fastText's mean, with embeddings scaled by
    sqrt(embed_dim) (as Transformer embeddings are): under Adam every parameter moves about lr per
    step, and a mean divides a feature's step by the text's length (~100 features), so
    fastText-style embeddings would learn far slower than the head. With these two scales a
    first run converges in about three epochs at kiln's default learning rate.

    Speed: both scales and the padding mask are the bag's per-sample weights (0 at padding),
    which keeps EmbeddingBag on its fast CPU kernel (a padding_idx takes it off that path: 40x
    slower at a batch of 1024 texts). The table is built dense and marked `sparse_ok`: the
    engine switches it to sparse gradients where it can (one process, optimizer=adamw; see
    kiln.engine.optim.settle_sparse_gradients), and then the gradient holds only the rows a
    batch touched and the optimizer updates only those: a step costs what the batch costs,
    whatever the number of buckets."""

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        num_classes: int,
        *,
        ngrams: int,
        num_buckets: int,
        dropout: float,
        pad_id: int,
        aux_head: bool,
        sparse_ok: bool = True,
    ):
        super().__init__()
        self.pad_id, self.ngrams = pad_id, ngrams
        self.vocab_size, self.num_buckets = vocab_size, num_buckets
        self.scale = math.sqrt(embed_dim)
        rows = vocab_size + (num_buckets if ngrams > 1 else 0)
        # No padding_idx: padding weighs 0 in the sum (see forward), so its row gets no gradient.
        self.embed = nn.EmbeddingBag(rows, embed_dim, mode="sum")
        self.embed.sparse_ok = sparse_ok  # the engine may set embed.sparse (a gradient of rows)
        self.embed.weight.register_post_accumulate_grad_hook(_flag_coalesced)
        # fastText's initialisation, uniform in +-1/embed_dim once scaled: small vectors, so a
        # text's sum starts near zero.
        bound = 1.0 / (embed_dim * self.scale)
        nn.init.uniform_(self.embed.weight, -bound, bound)
        with torch.no_grad():
            self.embed.weight[pad_id].zero_()
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(embed_dim, num_classes)
        self.aux = nn.Linear(embed_dim, num_classes) if aux_head else None

    def features(self, ids: Tensor) -> Tensor:
        """(N, L) token ids -> (N, L + n-gram count) rows of the embedding table."""
        if self.ngrams < 2:
            return ids
        grams = hashed_ngrams(ids, self.pad_id, self.ngrams, self.num_buckets, self.vocab_size)
        return torch.cat([ids, grams], dim=1)

    def forward(self, ids: Tensor) -> Tensor | dict[str, Tensor]:
        features = self.features(ids)  # (N, F)
        keep = features != self.pad_id  # (N, F)
        count = keep.sum(dim=1, keepdim=True).clamp(min=1)  # (N, 1)
        weights = keep * (self.scale / count.to(torch.float32).sqrt())  # (N, F), 0 at padding
        if self.embed.sparse and torch.is_grad_enabled() and self.embed.weight.requires_grad:
            pooled = _WeightedBag.apply(self.embed.weight, features, weights)  # (N, D)
        else:
            pooled = self.embed(features, per_sample_weights=weights)  # (N, D)
        return _outputs(self.head(self.dropout(pooled)), self.aux, pooled)


class TextTransformer(nn.Module):
    """Token embeddings + a width-3 convolution over them (local word order) + learned position
    embeddings -> TransformerEncoder (padding masked) -> masked mean -> linear. The auxiliary
    head, when present, reads the mean of the input embeddings.

    Why the convolution: from learned absolute positions alone, a small encoder trained on tens
    of thousands of texts barely learns which word follows which (it stays near a bag of words:
    0.68 validation accuracy on the generated tickets after two epochs, where word pairs decide);
    the convolution hands it the neighbours directly (0.84 after two epochs)."""

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
        self.local = nn.Conv1d(embed_dim, embed_dim, kernel_size=3, padding=1)
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
            # Post-norm: the encoder's nested-tensor fast path (eval) needs it; the learning-rate
            # warm-up of the default schedule keeps it stable.
            norm_first=False,
        )
        # In eval mode, a padded batch becomes a nested tensor and padding costs nothing; outputs
        # at padded positions are then zeros, which the masked mean never reads.
        # (The fast path needs an even head count; asking for it otherwise only warns.)
        self.encoder = nn.TransformerEncoder(
            layer, num_layers, enable_nested_tensor=num_heads % 2 == 0
        )
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
        tokens = self.embed(ids) * keep.unsqueeze(-1)  # (N, L, D), zeros at padding
        neighbours = self.local(tokens.transpose(1, 2)).transpose(1, 2)  # (N, L, D)
        x = self.dropout(tokens + neighbours + self.position[:length])
        x = self._encode(x, ~keep)  # (N, L, D)
        pooled = masked_mean(x, keep)  # (N, D)
        return _outputs(self.head(pooled), self.aux, masked_mean(tokens, keep))

    def _encode(self, x: Tensor, padding: Tensor) -> Tensor:
        device = x.device.type
        if not self.training and device != "cuda" and torch.is_autocast_enabled(device):
            # The encoder's fused eval path asks only whether CUDA autocast is on; under CPU
            # autocast it takes bf16 activations with fp32 weights and fails ("expected scalar
            # type Float but found BFloat16"). Evaluation then runs the encoder in fp32.
            with torch.autocast(device, enabled=False):
                return self.encoder(x.float(), src_key_padding_mask=padding)
        return self.encoder(x, src_key_padding_mask=padding)


def _tracing() -> bool:
    # Shape checks on python ints would be baked into a traced/exported graph as guards.
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def _check_token_spec(spec, model_name: str) -> None:
    if spec.input_kind != "tokens" or spec.vocab_size is None or spec.max_length is None:
        raise ValueError(
            f"model {model_name} needs token data (input_kind tokens with vocab_size and "
            f"max_length), got input_kind={spec.input_kind}; use data=csv_text"
        )


def build_text_bow(spec, cfg: TextBowConfig, *, aux_head: bool = False) -> FastText:
    _check_token_spec(spec, "text_bow")
    return FastText(
        spec.vocab_size,
        cfg.embed_dim,
        spec.num_classes,
        ngrams=cfg.ngrams,
        num_buckets=cfg.num_buckets,
        dropout=cfg.dropout,
        pad_id=spec.pad_id,
        aux_head=aux_head,
        sparse_ok=cfg.sparse_grads,
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
