"""Small Hugging Face model folders, as `save_pretrained` writes them, made offline for the docs'
examples and the tests (nothing is downloaded): a BERT whose WordPiece vocabulary is built
with `tokenizers` on a CSV's texts, and a RoBERTa with a byte-level BPE one. Tiny configs
(width 32, 2 layers, 2 heads), so a run takes seconds:

    python -m kiln.models.zoo.tiny_hf my-bert --texts examples/reviews.csv [--arch roberta]
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from pathlib import Path

TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    # BERT's 0.02 suits width 768; at width 32 from scratch it left one init in three stuck at
    # the label prior (a test multi-label run at chance for seeds 42 and 1); 0.1 learnt 12 of 12
    "initializer_range": 0.1,
}
POSITIONS = 64  # the tests' max_position_embeddings: data.max_length may be at most this
CLI_POSITIONS = 512  # BERT's own: the command line's model takes data.max_length's default


def csv_texts(path: Path, column: str = "text") -> list[str]:
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        return [row.get(column) or "" for row in csv.DictReader(f)]


def write_bert(
    folder: Path,
    texts: list[str],
    *,
    num_labels: int = 2,
    vocab_size: int = 300,
    positions: int = POSITIONS,
):
    """A BERT (uncased WordPiece, [PAD]=0) with a `num_labels` head, saved to `folder`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    vocab = wordpiece_vocab(texts, normalizer, pre_tokenizer, specials, vocab_size)
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    tok.decoder = decoders.WordPiece()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=positions,
    )
    config = BertConfig(
        vocab_size=tok.get_vocab_size(),
        max_position_embeddings=positions,
        num_labels=num_labels,
        **TINY,
    )
    _save(folder, lambda: BertForSequenceClassification(config), tokenizer)
    return folder


def wordpiece_vocab(texts, normalizer, pre_tokenizer, specials, vocab_size: int) -> dict:
    """A WordPiece vocabulary from `texts`, the same for the same texts: the special tokens, every
    character alone and as a continuation (`##c`, so any word splits into known pieces), then
    the commonest whole words (ties alphabetical) up to `vocab_size`. Not the `tokenizers`
    trainer: it breaks ties between equally frequent merges in hash order, a different
    vocabulary each process, so a test's tiny BERT learnt differently run to run."""
    words: Counter[str] = Counter()
    for text in texts:
        words.update(w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for word in words for c in word})
    pieces = [*specials, *chars, *(f"##{c}" for c in chars)]
    known = set(pieces)
    ranked = sorted((w for w in words if w not in known), key=lambda w: (-words[w], w))
    pieces += ranked[: max(0, vocab_size - len(pieces))]
    return {piece: index for index, piece in enumerate(pieces)}


def write_roberta(
    folder: Path,
    texts: list[str],
    *,
    num_labels: int = 2,
    vocab_size: int = 400,
    positions: int = POSITIONS,
):
    """A RoBERTa (byte-level BPE, <pad>=1, positions after the padding id) saved to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import (
        PreTrainedTokenizerFast,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        sep_token="</s>",
        cls_token="<s>",
        pad_token="<pad>",
        mask_token="<mask>",
        model_max_length=positions,
    )
    config = RobertaConfig(
        vocab_size=tok.get_vocab_size(),
        max_position_embeddings=positions + 2,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        type_vocab_size=1,
        num_labels=num_labels,
        **TINY,
    )
    _save(folder, lambda: RobertaForSequenceClassification(config), tokenizer)
    return folder


def _save(folder: Path, build, tokenizer) -> None:
    """The model `build()` makes, initialised from one seed: the same folder from the same texts
    (unseeded, a test's result hung on whatever ran before it)."""
    from kiln.rng import forked

    with forked(seed=0):
        model = build()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


WRITERS = {"bert": write_bert, "roberta": write_roberta}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kiln.models.zoo.tiny_hf", description=__doc__)
    parser.add_argument("folder", type=Path, help="where save_pretrained writes the model")
    parser.add_argument(
        "--texts", type=Path, required=True, help="a CSV whose texts train the vocabulary"
    )
    parser.add_argument("--column", default="text", help="the CSV's text column")
    parser.add_argument("--arch", choices=sorted(WRITERS), default="bert")
    parser.add_argument("--num-labels", type=int, default=2)
    parser.add_argument(
        "--positions",
        type=int,
        default=CLI_POSITIONS,
        help="max_position_embeddings: the longest data.max_length it takes",
    )
    args = parser.parse_args(argv)
    texts = csv_texts(args.texts, args.column)
    WRITERS[args.arch](args.folder, texts, num_labels=args.num_labels, positions=args.positions)
    print(f"wrote a tiny {args.arch} to {args.folder}")


if __name__ == "__main__":
    main()
