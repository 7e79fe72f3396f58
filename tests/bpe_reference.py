"""The tokenizer kiln trains (kiln.preprocessing.text: BERT's pre-tokenizer + BPE merges) written
again in plain Python over the same vocabulary and merges. Two uses: the tests hold the Rust
tokenizer to it (identical ids on every text), and `scripts/bench_text.py` measures how much the
Rust batch encoding buys on the data path.

The rules it repeats (tokenizers' `BertPreTokenizer` and `models.BPE` as kiln configures it: no
dropout, no prefix or suffix, no byte fallback, unknown characters not fused):
- split on Unicode White_Space, then isolate every punctuation character (ASCII punctuation or
  Unicode category P*) as a token of its own;
- per word, start from its characters (one not in the vocabulary is [UNK]) and repeatedly merge
  the adjacent pair with the lowest merge rank, leftmost first, until no pair has a rank;
- keep the first max_length ids; a text with no token at all is one [UNK] (as kiln's encoding).
Words are cached once encoded, as the Rust model does."""

from __future__ import annotations

import functools
import json
import unicodedata
from collections.abc import Sequence

# Rust's char::is_whitespace (the White_Space property); Python's str.isspace also counts
# \x1c-\x1f, which Rust does not.
WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
    + "".join(chr(c) for c in range(0x2000, 0x200B))
)


# Decided per character met: a table of all 1.1M code points took a second at import, in every
# test process.
@functools.cache
def is_punctuation(ch: str) -> bool:
    return (ch.isascii() and ch.isprintable() and not ch.isalnum() and ch != " ") or (
        unicodedata.category(ch).startswith("P")
    )


def pre_tokenize(text: str) -> list[str]:
    """Words and single punctuation characters, as BertPreTokenizer splits them."""
    words, current = [], []
    for ch in text:
        if ch in WHITESPACE or is_punctuation(ch):
            if current:
                words.append("".join(current))
                current = []
            if is_punctuation(ch):
                words.append(ch)
        else:
            current.append(ch)
    if current:
        words.append("".join(current))
    return words


class ReferenceBPE:
    def __init__(
        self, vocab: dict[str, int], merges: list[tuple[str, str]], *, unk: str, max_length: int
    ):
        self.vocab = vocab
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.unk_id = vocab[unk]
        self.max_length = max_length
        self.cache: dict[str, list[int]] = {}

    @classmethod
    def from_tokenizer_json(cls, tokenizer_json: str, max_length: int) -> ReferenceBPE:
        model = json.loads(tokenizer_json)["model"]
        expected = {
            "type": "BPE",
            "dropout": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
        }
        found = {key: model.get(key) for key in expected}
        if found != expected:
            raise ValueError(f"this reference covers plain BPE only, not {found}")
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
        return cls(model["vocab"], merges, unk=model["unk_token"], max_length=max_length)

    def word_ids(self, word: str) -> list[int]:
        cached = self.cache.get(word)
        if cached is not None:
            return cached
        symbols = list(word)
        while len(symbols) > 1:
            ranked = [
                (self.ranks.get((a, b), len(self.ranks)), i)
                for i, (a, b) in enumerate(zip(symbols, symbols[1:], strict=False))
            ]
            rank, first = min(ranked)
            if rank == len(self.ranks):
                break  # no pair left that was ever merged
            pair, merged, i = (symbols[first], symbols[first + 1]), [], 0
            while i < len(symbols):  # merge every occurrence, left to right
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        ids = [self.vocab.get(symbol, self.unk_id) for symbol in symbols]
        self.cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in pre_tokenize(text):
            ids.extend(self.word_ids(word))
            if len(ids) >= self.max_length:
                break
        return ids[: self.max_length] or [self.unk_id]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]
