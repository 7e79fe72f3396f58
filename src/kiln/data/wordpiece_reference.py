"""The tokenizer kiln trains (kiln.preprocessing.text: BERT pre-tokenizer + WordPiece), written
again in plain Python over the same vocabulary. Two uses: the tests hold the Rust tokenizer to it
(identical ids on every text), and `scripts/bench_text.py` measures how much the Rust batch
encoding buys on the data path.

The rules it repeats (tokenizers' `BertPreTokenizer` and `models.WordPiece`):
- split on Unicode White_Space, then isolate every punctuation character (ASCII punctuation or
  Unicode category P*) as a token of its own;
- per word, greedy longest-match-first against the vocabulary, continuation pieces prefixed with
  `##`; a word with a piece not in the vocabulary, or longer than 100 characters, is [UNK];
- keep the first max_length ids; a text with no token at all is one [UNK] (as kiln's encoding)."""

from __future__ import annotations

import json
import re
import sys
import unicodedata
from collections.abc import Sequence

# Rust's char::is_whitespace (the White_Space property); Python's str.isspace also counts
# \x1c-\x1f, which Rust does not.
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


def _punctuation_class() -> str:
    """A regex character class body of every punctuation character, as code-point ranges."""
    codes = [
        cp
        for cp in range(sys.maxunicode + 1)
        if (cp < 128 and chr(cp).isascii() and not chr(cp).isalnum() and 33 <= cp <= 126)
        or unicodedata.category(chr(cp)).startswith("P")
    ]
    ranges, start, prev = [], codes[0], codes[0]
    for cp in codes[1:]:
        if cp != prev + 1:
            ranges.append((start, prev))
            start = cp
        prev = cp
    ranges.append((start, prev))
    return "".join(
        re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
        for a, b in ranges
    )


_PUNCT = _punctuation_class()
# A token is one punctuation character, or a run of characters that are neither punctuation nor
# whitespace.
_PRE_TOKEN = re.compile(f"[{_PUNCT}]|[^{_PUNCT}{_WHITESPACE}]+")


class ReferenceWordPiece:
    def __init__(
        self,
        vocab: dict[str, int],
        *,
        unk_token: str,
        max_length: int,
        prefix: str = "##",
        max_input_chars_per_word: int = 100,
    ):
        self.vocab = vocab
        self.unk_id = vocab[unk_token]
        self.max_length = max_length
        self.prefix = prefix
        self.max_chars = max_input_chars_per_word

    @classmethod
    def from_tokenizer_json(cls, tokenizer_json: str, max_length: int) -> ReferenceWordPiece:
        model = json.loads(tokenizer_json)["model"]
        if model["type"] != "WordPiece":
            raise ValueError(f"expected a WordPiece tokenizer, got {model['type']}")
        return cls(
            model["vocab"],
            unk_token=model["unk_token"],
            max_length=max_length,
            prefix=model["continuing_subword_prefix"],
            max_input_chars_per_word=model["max_input_chars_per_word"],
        )

    def word_ids(self, word: str) -> list[int]:
        """Greedy longest-match-first pieces of one word."""
        if len(word) > self.max_chars:
            return [self.unk_id]
        ids, start = [], 0
        while start < len(word):
            end = len(word)
            while start < end:
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                found = self.vocab.get(piece)
                if found is not None:
                    break
                end -= 1
            else:
                return [self.unk_id]  # no piece of the rest is in the vocabulary
            ids.append(found)
            start = end
        return ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in _PRE_TOKEN.findall(text):
            ids.extend(self.word_ids(word))
            if len(ids) >= self.max_length:
                break
        return ids[: self.max_length] or [self.unk_id]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]
