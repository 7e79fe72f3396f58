"""Texts: the BPE tokenizer a text dataset trains on its training split, the recipe that carries
it and the cleaning settings in every checkpoint (as plain data), and the encoding that repeats
training exactly: clean_text, then the tokenizer, then padding.

The tokenizer has no normalizer of its own: `clean_text` (kiln.preprocessing.cleaning) is the one
place text is normalised. It splits on whitespace and punctuation (BERT's pre-tokenizer), then
applies byte-pair-encoding merges within each word -- small enough to repeat in plain Python (the
reference implementation the tests hold it to). BPE rather than WordPiece: the `tokenizers`
WordPiece trainer gives a different vocabulary from run to run on the same texts
(huggingface/tokenizers#1794), its BPE trainer the same one every time."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from kiln.preprocessing.cleaning import TextCleaning, clean_texts
from kiln.preprocessing.errors import InputError
from kiln.preprocessing.image import _lists

PAD_TOKEN, UNK_TOKEN = "[PAD]", "[UNK]"
PAD_ID = 0  # [PAD] is the first special token, so the trainer gives it id 0
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN]


def train_tokenizer(
    text_batches: Iterable[Sequence[str]],
    vocab_size: int,
    max_length: int,
    num_texts: int | None = None,
):
    """A BPE tokenizer with [PAD]=0 and [UNK], truncating to max_length, trained on already-
    cleaned texts. `text_batches` is consumed once, batch by batch, so the texts never need to
    be in memory together (the trainer keeps word counts, not texts)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # Rare characters each cost an entry; keep at least half the vocabulary for merges.
        limit_alphabet=max(1, (vocab_size - len(SPECIAL_TOKENS)) // 2),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text_batches, trainer=trainer, length=num_texts)
    tokenizer.enable_truncation(max_length)
    if tokenizer.token_to_id(PAD_TOKEN) != PAD_ID:  # invariant of the special-token order
        raise AssertionError("[PAD] must have id 0")
    return tokenizer


def encode_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Cleaned texts -> token ids (unpadded), by the Rust tokenizer's batch encoding. A text that
    cleans to nothing still gets one token ([UNK]), so no row is all padding (an all-padding row
    would give models a mean over zero tokens)."""
    unk_id = tokenizer.token_to_id(UNK_TOKEN)
    # encode_batch_fast: the same ids without character offsets, which nothing here reads.
    return [encoding.ids or [unk_id] for encoding in tokenizer.encode_batch_fast(list(texts))]


def encode(tokenizer, texts: Sequence[str]) -> list[Tensor]:
    """Cleaned texts -> one 1-d LongTensor of ids each (unpadded)."""
    return [torch.tensor(ids, dtype=torch.long) for ids in encode_ids(tokenizer, texts)]


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
    # How texts were cleaned before the tokenizer; None: not at all (checkpoints made before
    # cleaning existed, whose tokenizer normalised by itself).
    cleaning: TextCleaning | None = None
    # How training read its CSV: infer.py reads an input CSV the same way unless told otherwise.
    text_column: str = "text"
    label_column: str = "label"
    encoding: str = "utf-8"
    kind = "tokens"

    def __post_init__(self):
        if isinstance(self.cleaning, dict):  # as stored in a checkpoint or a sidecar JSON
            object.__setattr__(self, "cleaning", TextCleaning(**self.cleaning))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **_lists(asdict(self))}

    def tokenizer(self):
        return _tokenizer_from_json(self.tokenizer_json, self.max_length)

    def clean(self, texts: Sequence[str]) -> list[str]:
        return list(texts) if self.cleaning is None else clean_texts(list(texts), self.cleaning)

    def encode(self, texts: Sequence[str]) -> Tensor:
        """Raw texts -> LongTensor (N, L) padded with pad_id, exactly as in training."""
        if not texts:
            return torch.zeros((0, 0), dtype=torch.long)
        return pad_token_ids(encode(self.tokenizer(), self.clean(texts)), self.pad_id)

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
