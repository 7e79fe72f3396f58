"""Texts: the WordPiece tokenizer a text dataset trains on its training split, the recipe that
carries it in every checkpoint (as JSON), and the encoding that repeats training exactly."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from kiln.preprocessing.errors import InputError
from kiln.preprocessing.image import _lists

PAD_TOKEN, UNK_TOKEN = "[PAD]", "[UNK]"
PAD_ID = 0  # [PAD] is the first special token, so the trainer gives it id 0
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN]


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int):
    """A lower-casing WordPiece tokenizer with [PAD]=0 and [UNK], truncating to max_length."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token=UNK_TOKEN))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # Each alphabet letter costs two entries (x and ##x); cap it so rare characters cannot
        # push the vocabulary past vocab_size.
        limit_alphabet=max(1, (vocab_size - len(SPECIAL_TOKENS)) // 4),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.enable_truncation(max_length)
    if tokenizer.token_to_id(PAD_TOKEN) != PAD_ID:  # invariant of the special-token order
        raise AssertionError("[PAD] must have id 0")
    return tokenizer


def encode(tokenizer, texts: Sequence[str]) -> list[Tensor]:
    """Texts -> one 1-d LongTensor of ids each (unpadded)."""
    unk_id = tokenizer.token_to_id(UNK_TOKEN)
    # A text that normalises to nothing still gets one token, so no row is all padding (an
    # all-padding row would give models a mean over zero tokens).
    return [
        torch.tensor(encoding.ids or [unk_id], dtype=torch.long)
        for encoding in tokenizer.encode_batch(list(texts))
    ]


def pad_token_ids(sequences: list[Tensor], pad_id: int = PAD_ID) -> Tensor:
    """Pads 1-d LongTensors to the longest: (N, L_max)."""
    return pad_sequence(sequences, batch_first=True, padding_value=pad_id)


@functools.lru_cache(maxsize=8)
def _tokenizer_from_json(tokenizer_json: str, max_length: int):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.enable_truncation(max_length)
    tokenizer.no_padding()  # we pad ourselves, with PAD_ID, to the longest in the batch
    return tokenizer


@dataclass(frozen=True)
class TokenRecipe:
    tokenizer_json: str
    max_length: int
    class_names: tuple[str, ...]
    pad_id: int = PAD_ID
    kind = "tokens"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **_lists(asdict(self))}

    def tokenizer(self):
        return _tokenizer_from_json(self.tokenizer_json, self.max_length)

    def encode(self, texts: Sequence[str]) -> Tensor:
        """Texts -> LongTensor (N, L) padded with pad_id, exactly as in training."""
        if not texts:
            return torch.zeros((0, 0), dtype=torch.long)
        return pad_token_ids(encode(self.tokenizer(), texts), self.pad_id)

    def preprocessor(self) -> TokenPreprocessor:
        return TokenPreprocessor(self)


class TokenPreprocessor:
    """Raw texts (str) -> token ids (N, L) padded to the longest, by the stored tokenizer."""

    input_kind = "tokens"
    expected = "a text (string)"

    def __init__(self, recipe: TokenRecipe):
        self.recipe = recipe

    def validate(self, raw_inputs: Sequence[Any]) -> None:
        for index, item in enumerate(raw_inputs):
            if not isinstance(item, str):
                raise InputError(
                    f"item {index}: expected a text (string), got {type(item).__name__}", index
                )
            try:  # the tokenizer takes Unicode text only; a lone surrogate would fail its batch
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise InputError(
                    f"item {index}: not valid Unicode text: a lone surrogate "
                    f"{item[err.start]!r} at character {err.start}",
                    index,
                ) from None

    def convert(self, raw_inputs: Sequence[Any]) -> list[str]:
        """Texts, each validated on its own."""
        self.validate(raw_inputs)
        return list(raw_inputs)

    def __call__(self, raw_inputs: Sequence[Any]) -> Tensor:
        self.validate(raw_inputs)
        return self.recipe.encode(list(raw_inputs))

    def example(self) -> str:
        return "hello world"
