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

import collections
import functools
import itertools
import json
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from kiln.preprocessing.cleaning import PAIR_SEP, TextCleaning, clean_texts
from kiln.preprocessing.errors import InputError
from kiln.preprocessing.image import _lists

PAD_TOKEN, UNK_TOKEN = "[PAD]", "[UNK]"
PAD_ID = 0  # [PAD] is the first special token, so the trainer gives it id 0
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN]


TOKENIZERS = ("bpe", "words")

# Character n-grams, hashed: CRC-32 of the n-gram's UTF-8 bytes (the same on every machine and in
# every process; Python's own str hash is salted per process), kept to 30 bits so that a spelled
# id (below) fits the token store's int32. A model reduces the hash modulo its buckets: for a
# power of two up to 2**30 (the default 2**16) that is CRC-32 modulo the buckets.
CHAR_HASH_SPACE = 2**30
MAX_WORD_PIECES = 48  # rows of a word's bag: itself and at most 47 character n-grams


def char_ngram_hashes(word: str, char_ngrams: tuple[int, int]) -> list[int]:
    """fastText's subwords of `word`: the distinct character n-grams (lengths char_ngrams[0] to
    [1]) of "<word>" -- the markers make a prefix and a suffix differ from the same letters
    inside a word -- the word itself left out, shortest first then by position, at most
    MAX_WORD_PIECES - 1, each hashed into [0, CHAR_HASH_SPACE)."""
    low, high = char_ngrams
    marked = f"<{word}>"
    grams = {
        marked[start : start + n]
        for n in range(low, high + 1)
        for start in range(len(marked) - n + 1)
    }
    grams.discard(marked)
    chosen = sorted(grams, key=lambda g: (len(g), marked.find(g)))[: MAX_WORD_PIECES - 1]
    return [zlib.crc32(g.encode("utf-8")) % CHAR_HASH_SPACE for g in chosen]


@dataclass(frozen=True)
class WordSpelling:
    """What text_bow asks of the data: each word the vocabulary lacks is its [UNK] id followed by
    its character n-grams, spelled as ids `vocab_size + hash` (char_ngram_hashes), so a model
    that embeds character n-grams sees an unseen word's as it sees a known word's. The spelled
    ids count toward max_length like any other."""

    char_ngrams: tuple[int, int]
    kind = "word_spelling"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "char_ngrams": list(self.char_ngrams)}


def spelled_ids(word: str, unk_id: int, vocab_size: int, char_ngrams: tuple[int, int]) -> list[int]:
    """An unknown word's ids: [UNK], then its hashed character n-grams after the vocabulary."""
    return [unk_id, *(vocab_size + h for h in char_ngram_hashes(word, char_ngrams))]


def split_pair(text: str) -> str | tuple[str, str]:
    """A spooled text: itself, or the pair (a, b) it holds."""
    if PAIR_SEP not in text:
        return text
    first, _, second = text.partition(PAIR_SEP)
    return first, second


def join_pair(first: str, second: str) -> str:
    """data.join_columns (and kiln's own models' pairs): one text, the two joined by a space."""
    return f"{first} {second}"


def train_tokenizer(
    text_batches: Iterable[Sequence[str]],
    vocab_size: int,
    max_length: int,
    num_texts: int | None = None,
    kind: str = "bpe",
    pieces: WordPieces | None = None,
    min_count: int = 1,
):
    """A tokenizer with [PAD]=0 and [UNK], truncating to max_length, trained on already-cleaned
    texts, split by BERT's pre-tokenizer (whitespace, then punctuation on its own). `kind`:
    bpe -- byte-pair-encoding merges within each piece, of pairs seen at least min_count times;
    words -- each piece a token, the vocab_size - 2 most frequent ones seen at least min_count
    times (the rest [UNK]), counted in one pass. `text_batches` is
    consumed once, batch by batch, so the texts never need to be in memory together. `pieces`
    (words): the words' pieces are kept there for a WordCachedEncoder given the same object."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if kind == "words":
        vocab = _word_vocab(text_batches, vocab_size, pieces or WordPieces(), min_count)
        tokenizer = Tokenizer(models.WordLevel(vocab, UNK_TOKEN))
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    else:
        tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            # Rare characters each cost an entry; keep at least half the vocabulary for merges.
            limit_alphabet=max(1, (vocab_size - len(SPECIAL_TOKENS)) // 2),
            min_frequency=min_count,
            show_progress=False,
        )
        tokenizer.train_from_iterator(text_batches, trainer=trainer, length=num_texts)
    tokenizer.enable_truncation(max_length)
    if tokenizer.token_to_id(PAD_TOKEN) != PAD_ID:  # invariant of the special-token order
        raise AssertionError("[PAD] must have id 0")
    return tokenizer


def _word_vocab(
    text_batches: Iterable[Sequence[str]], vocab_size: int, word_pieces: WordPieces, min_count: int
) -> dict[str, int]:
    """The most frequent pieces (BERT pre-tokenized) of the texts seen at least min_count
    times, ties by the piece itself:
    {"[PAD]": 0, "[UNK]": 1, piece: id, ...}. Whitespace words are counted first, and the
    distinct words split into pieces together."""
    words: collections.Counter[str] = collections.Counter()
    for texts in text_batches:
        for text in texts:
            words.update(_words(text))
    distinct = list(words)
    counts = np.fromiter(words.values(), dtype=np.int64, count=len(distinct))
    found, owner = word_pieces.split(distinct)
    pieces: dict[str, int] = {}
    for piece, count in zip(found, counts[owner].tolist(), strict=True):
        pieces[piece] = pieces.get(piece, 0) + count
    ranked = sorted(
        ((piece, count) for piece, count in pieces.items() if count >= min_count),
        key=lambda item: (-item[1], item[0]),
    )
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for piece, _ in ranked[: max(0, vocab_size - len(SPECIAL_TOKENS))]:
        vocab[piece] = len(vocab)
    return vocab


@functools.cache
def _bert_split():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.BertPreTokenizer().pre_tokenize_str


def _pieces(words: list[str]) -> tuple[list[str], np.ndarray]:
    """BERT's pre-tokenizer over whitespace-free words, joined into one call: (the pieces, the
    index of the word each comes from)."""
    split = _bert_split()(" ".join(words)) if words else []
    starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
    found = np.fromiter((start for _, (start, _) in split), np.int64, count=len(split))
    return [piece for piece, _ in split], np.searchsorted(starts, found, "right") - 1


# BERT's pre-tokenizer on an ASCII word: each ASCII punctuation character (Rust's
# is_ascii_punctuation, which holds Unicode's punctuation in ASCII) a piece of its own, each run
# of the other characters one piece.
_ASCII_PIECES = re.compile(r"[^!-/:-@\[-`{-~]+|[!-/:-@\[-`{-~]")


class WordPieces:
    """Whitespace-free words -> their pieces (BERT's pre-tokenizer), each distinct word split
    once and kept: the word vocabulary counts the pieces of the training words, and an encoder
    given the same object looks those words up instead of splitting them again (at most
    `max_words` kept; past that the store starts afresh)."""

    def __init__(self, max_words: int = 1_000_000):
        self.max_words = max_words
        self._of: dict[str, tuple[str, ...]] = {}

    def split(self, words: list[str]) -> tuple[list[str], np.ndarray]:
        """Distinct `words` -> (their pieces in word order, the index of the word each is of)."""
        of, fresh = self._of, {}
        new = []  # for the pre-tokenizer: words with a character past ASCII and punctuation
        for w in words:
            if w in of:
                continue
            if w.isalnum():  # no punctuation to split off
                fresh[w] = (w,)
            elif w.isascii():  # the pre-tokenizer's rule, here 3x faster than through it
                fresh[w] = tuple(_ASCII_PIECES.findall(w))
            else:
                new.append(w)
        for first in range(0, len(new), WORDS_PER_CALL):
            chunk = new[first : first + WORDS_PER_CALL]
            found, owner = _pieces(chunk)
            ends = np.searchsorted(owner, np.arange(1, len(chunk) + 1)).tolist()
            for word, start, end in zip(chunk, [0, *ends[:-1]], ends, strict=True):
                fresh[word] = tuple(found[start:end])
        split = [of[w] if w in of else fresh[w] for w in words]
        if len(of) + len(fresh) > self.max_words:  # the bound holds, even for one large call
            of.clear()
        if len(fresh) <= self.max_words:
            of.update(fresh)
        counts = np.fromiter(map(len, split), dtype=np.int64, count=len(split))
        return list(itertools.chain.from_iterable(split)), np.repeat(np.arange(len(words)), counts)


# Characters per call of the Rust tokenizer's batch encoding (about 0.2 s on 2 cores): a call
# holds the main thread, and a stop signal's handler runs only between two (a batch of 4096
# long texts took 40 s in one call). A pair counts both its texts.
ENCODE_CHARS = 500_000


def in_calls(texts: Sequence[str | tuple[str, str]], max_chars: int = ENCODE_CHARS):
    """`texts` in consecutive lists of at most `max_chars` characters (at least one text)."""
    call, chars = [], 0
    for text in texts:
        size = len(text) if isinstance(text, str) else sum(map(len, text))
        if call and chars + size > max_chars:
            yield call
            call, chars = [], 0
        call.append(text)
        chars += size
    if call:
        yield call


def encode_ids(
    tokenizer, texts: Sequence[str], unk_id: int | None = None, spelling: WordSpelling | None = None
) -> list[list[int]]:
    """Cleaned texts -> token ids (unpadded), by the Rust tokenizer's batch encoding (in calls of
    at most ENCODE_CHARS characters). A text that cleans to nothing still gets one token
    (`unk_id`, by default [UNK]), so no row is all padding (an all-padding row would give
    models a mean over zero tokens). `spelling`: each unknown word spelled after its [UNK]
    (WordSpelling), then the first max_length ids kept."""
    if unk_id is None:
        unk_id = tokenizer.token_to_id(UNK_TOKEN)
    if spelling is not None:
        return _spelled(tokenizer, texts, unk_id, spelling)
    # encode_batch_fast: the same ids without character offsets, which nothing here reads. A
    # pair (a, b) is encoded as one: tokenizer(a, b), truncated longest first.
    return [
        encoding.ids or [unk_id]
        for call in in_calls(texts)
        for encoding in tokenizer.encode_batch_fast(call)
    ]


def _spelled(tokenizer, texts: Sequence[str], unk_id: int, spelling: WordSpelling):
    """encode_ids with each [UNK] followed by its word's spelling (read back at its offsets).
    Truncating the tokens to max_length and then the spelled ids too gives the first max_length
    ids of the whole text spelled: what WordCachedEncoder keeps."""
    vocab_size = tokenizer.get_vocab_size()
    limit = (tokenizer.truncation or {}).get("max_length")  # None: the tokenizer keeps all
    encoded = []
    encodings = (e for call in in_calls(texts) for e in tokenizer.encode_batch(call))
    for text, encoding in zip(texts, encodings, strict=True):
        ids: list[int] = []
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id == unk_id:
                ids.extend(spelled_ids(text[start:end], unk_id, vocab_size, spelling.char_ngrams))
            else:
                ids.append(token_id)
        encoded.append(ids[:limit] or [unk_id])
    return encoded


# Whitespace as the tokenizer's pre-tokenizer splits on it (Rust's char::is_whitespace, the
# Unicode White_Space property); str.split() also takes \x1c-\x1f.
_RUST_SPACE = re.compile("[\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")
_PYTHON_ONLY_SPACE = re.compile("[\x1c-\x1f]")
WORDS_PER_CALL = 100  # distinct words joined into one text per tokenizer call (longer: slower)


def _words(text: str) -> list[str]:
    if _PYTHON_ONLY_SPACE.search(text):
        return [w for w in _RUST_SPACE.split(text) if w]
    return text.split()


class WordCachedEncoder:
    """encode_ids for a whole corpus, fast: each distinct whitespace-separated word is encoded
    once (many at a time, as one text), and each text's ids are its words' ids in order,
    truncated to max_length. The tokenizer's pre-tokenizer splits on whitespace first and its
    model works piece by piece, so these are exactly the ids of encoding each text whole
    (tests/test_text.py holds it to that), at a fraction of the cost: a corpus's words repeat,
    and the per-text work is numpy's. Returns (ids int32, lengths); the word cache is emptied
    past `max_words` words."""

    def __init__(
        self,
        tokenizer,
        max_length: int,
        max_words: int = 1_000_000,
        pieces: WordPieces | None = None,
        spelling: WordSpelling | None = None,
    ):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.no_truncation()  # words are encoded many to a text
        self.tokenizer.no_padding()
        # A WordLevel model is a lookup of each piece: done here, without the Rust encoder.
        model = json.loads(tokenizer.to_str())["model"]
        self.vocab = model["vocab"] if model["type"] == "WordLevel" else None
        self.max_length, self.max_words = max_length, max_words
        self.pieces = pieces or WordPieces(max_words)  # a WordLevel model's: see _learn
        self.unk_id = tokenizer.token_to_id(UNK_TOKEN)
        self.spelling, self.vocab_size = spelling, tokenizer.get_vocab_size()
        self.index: dict[str, int] = {}  # word -> its number in the cache
        self._starts, self._ids = [np.zeros(1, np.int64)], []  # CSR of the cached words' ids

    def _learn(self, words: list[str]) -> None:
        """Encodes new words, WORDS_PER_CALL at a time, joined by spaces into one text."""
        for first in range(0, len(words), WORDS_PER_CALL):
            chunk = words[first : first + WORDS_PER_CALL]
            if self.vocab is not None:
                pieces, owner = self.pieces.split(chunk)
                get, unk = self.vocab.get, self.unk_id
                ids = np.fromiter((get(p, unk) for p in pieces), np.int32, count=len(pieces))
            else:
                joined = " ".join(chunk)
                encoding = self.tokenizer.encode(joined)
                word_starts = np.cumsum([0] + [len(w) + 1 for w in chunk[:-1]])
                token_starts = np.array([start for start, _ in encoding.offsets], np.int64)
                owner = np.searchsorted(word_starts, token_starts, side="right") - 1
                ids = np.array(encoding.ids, dtype=np.int32)
                pieces = [joined[start:end] for start, end in encoding.offsets]
            if self.spelling is not None:
                ids, owner = self._spell(ids, owner, pieces)
            counts = np.bincount(owner, minlength=len(chunk))
            total = int(self._starts[-1][-1])
            self._starts.append(total + np.cumsum(counts))
            self._ids.append(ids)
            for word in chunk:
                self.index[word] = len(self.index)
        self.starts = np.concatenate(self._starts)
        self.ids = np.concatenate(self._ids) if self._ids else np.zeros(0, np.int32)
        self._starts, self._ids = [self.starts], [self.ids]

    def _spell(self, ids: np.ndarray, owner: np.ndarray, pieces: list[str]):
        """Each [UNK] of `ids` (the token of pieces[i]) followed by its piece's spelling."""
        unknown = np.flatnonzero(ids == self.unk_id)
        if not len(unknown):
            return ids, owner
        lists = [[i] for i in ids.tolist()]
        for at in unknown.tolist():
            lists[at] = spelled_ids(
                pieces[at], self.unk_id, self.vocab_size, self.spelling.char_ngrams
            )
        sizes = np.fromiter(map(len, lists), np.int64, count=len(lists))
        flat = np.fromiter(itertools.chain.from_iterable(lists), np.int32, count=int(sizes.sum()))
        return flat, np.repeat(owner, sizes)

    def __call__(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if len(self.index) > self.max_words:  # a fresh cache: memory stays bounded
            self.__init__(
                self.tokenizer, self.max_length, self.max_words, self.pieces, self.spelling
            )
        split = [_words(text) for text in texts]
        index = self.index
        new = list({w: None for words in split for w in words if w not in index})
        if new or not hasattr(self, "starts"):
            self._learn(new)
        words_per_text = np.fromiter(map(len, split), dtype=np.int64, count=len(split))
        word = np.fromiter(
            map(index.__getitem__, itertools.chain.from_iterable(split)),
            dtype=np.int64,
            count=int(words_per_text.sum()),
        )
        first, count = self.starts[word], self.starts[word + 1] - self.starts[word]
        ids = self.ids[_ranges(first, count)]
        text_of_word = np.repeat(np.arange(len(texts)), words_per_text)
        lengths = np.bincount(text_of_word, weights=count, minlength=len(texts)).astype(np.int64)
        # Truncate: keep each text's first max_length ids.
        position = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        keep = position < self.max_length
        ids, lengths = ids[keep], np.minimum(lengths, self.max_length)
        empty = np.flatnonzero(lengths == 0)
        if len(empty):  # as encode_ids: a text with no token gets [UNK]
            ids = np.insert(ids, (np.cumsum(lengths) - lengths)[empty], self.unk_id)
            lengths[empty] = 1
        return ids.astype(np.int32), lengths


def _ranges(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The concatenation of range(first[i], first[i] + count[i]) for every i."""
    total = int(count.sum())
    offsets = np.repeat(first - (np.cumsum(count) - count), count)
    return offsets + np.arange(total)


def encode(
    tokenizer, texts: Sequence[str], unk_id: int | None = None, spelling: WordSpelling | None = None
) -> list[Tensor]:
    """Cleaned texts -> one 1-d LongTensor of ids each (unpadded)."""
    encoded = encode_ids(tokenizer, texts, unk_id, spelling)
    return [torch.tensor(ids, dtype=torch.long) for ids in encoded]


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


class CleanText(str):
    """A text its recipe has cleaned (and a pair's two texts joined, for kiln's own tokenizers):
    TokenRecipe.encode tokenizes it as it is."""

    __slots__ = ()


class CleanPair(tuple):
    """A pair of texts its recipe has cleaned, for a pretrained tokenizer that reads pairs."""

    __slots__ = ()


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
    # the second text column of a pair task (data.text_pair_column): inputs are (a, b) pairs
    pair_column: str | None = None
    # data.join_columns: a pair's two texts joined by a space into one text for every model
    # (else a pretrained tokenizer reads them as a pair, kiln's own joined by a space anyway)
    join_columns: bool = False
    # model=hf: the model's PretrainedText.to_dict() (its tokenizer, special tokens and
    # config.json); tokenizer_json is then that model's own tokenizer, special tokens added.
    pretrained: dict[str, Any] | None = None
    # text_bow's WordSpelling: the character n-gram lengths unknown words are spelled with
    # after their [UNK] (None: an unknown word is [UNK] alone, as before the option)
    spell_char_ngrams: tuple[int, int] | None = None
    kind = "tokens"

    def __post_init__(self):
        if isinstance(self.cleaning, dict):  # as stored in a checkpoint or a sidecar JSON
            object.__setattr__(self, "cleaning", TextCleaning(**self.cleaning))
        if self.spell_char_ngrams is not None:
            object.__setattr__(self, "spell_char_ngrams", tuple(self.spell_char_ngrams))

    @property
    def spelling(self) -> WordSpelling | None:
        return None if self.spell_char_ngrams is None else WordSpelling(self.spell_char_ngrams)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **_lists(asdict(self))}

    def tokenizer(self):
        return _tokenizer_from_json(self.tokenizer_json, self.max_length)

    def clean(self, texts: Sequence[str]) -> list[str]:
        return list(texts) if self.cleaning is None else clean_texts(list(texts), self.cleaning)

    def clean_inputs(self, inputs: Sequence[Any]) -> list[Any]:
        """Raw inputs cleaned: texts, or (a, b) pairs each side cleaned -- fed to a pretrained
        tokenizer as a pair, to kiln's own joined by a space (as training spooled them). An
        input cleaned already (CleanText, CleanPair: TokenPreprocessor.convert's) stays."""
        return [
            item if isinstance(item, CleanText | CleanPair) else self._cleaned(item)
            for item in inputs
        ]

    def _cleaned(self, item: Any) -> CleanText | CleanPair:
        if self.pair_column is None:
            return CleanText(*self.clean([item]))
        first, second = self.clean(list(item))
        if self.pretrained is not None and not self.join_columns:
            return CleanPair((first, second))
        return CleanText(join_pair(first, second))

    def encode(self, texts: Sequence[str]) -> Tensor:
        """Raw texts -> LongTensor (N, L) padded with pad_id, exactly as in training."""
        if not texts:
            return torch.zeros((0, 0), dtype=torch.long)
        unk_id = None
        if self.pretrained is not None:  # the model's own unknown token, else its padding
            unk_id = self.pretrained.get("unk_id")
            unk_id = self.pad_id if unk_id is None else unk_id
        ids = encode(self.tokenizer(), self.clean_inputs(texts), unk_id, self.spelling)
        return pad_token_ids(ids, self.pad_id)

    def preprocessor(self) -> TokenPreprocessor:
        return TokenPreprocessor(self)


class TokenPreprocessor:
    """Raw texts (str) -> token ids (N, L) padded to the longest, by the stored tokenizer."""

    input_kind = "tokens"
    expected = "a text (string)"

    def __init__(self, recipe: TokenRecipe):
        self.recipe = recipe

    def validate(self, raw_inputs: Sequence[Any]) -> None:
        pairs = self.recipe.pair_column is not None
        for index, item in enumerate(raw_inputs):
            if pairs:
                if not (isinstance(item, list | tuple) and len(item) == 2):
                    raise InputError(
                        f"item {index}: expected a pair of texts [a, b] (this model reads "
                        f"{self.recipe.text_column!r} and {self.recipe.pair_column!r}), got "
                        f"{type(item).__name__}",
                        index,
                    )
                for text in item:
                    self._check_text(index, text)
            else:
                self._check_text(index, item)

    def _check_text(self, index: int, item: Any) -> None:
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

    def convert(self, raw_inputs: Sequence[Any]) -> list[CleanText | CleanPair]:
        """Texts (or pairs of texts), each validated on its own, then cleaned: here, so that a
        server does the work where it converts a request (off its event loop for a large body),
        not in the model call."""
        self.validate(raw_inputs)
        return self.recipe.clean_inputs(raw_inputs)

    def __call__(self, raw_inputs: Sequence[Any]) -> Tensor:
        return self.recipe.encode(self.convert(raw_inputs))

    def example(self) -> str | list[str]:
        return ["hello world", "hello there"] if self.recipe.pair_column else "hello world"
