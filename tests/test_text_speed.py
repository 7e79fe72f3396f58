"""What makes text_bow train at linear-model speed, each part held to the plain computation it
replaces: sparse table gradients (equal to EmbeddingBag's dense ones), the lazy AdamW step
(equal to torch's AdamW on the rows a batch touched, untouched rows left alone, a skipped step
left undone), exact resume with both, the engine's choice of sparse or dense gradients, the
word-cached encoder (the ids of encoding each text whole) and whole-batch fetching. The speed
itself is measured in scripts/bench_text.py, never here."""

from __future__ import annotations

import copy
import dataclasses
import random

import numpy as np
import pytest
import torch

from kiln.checkpoint import load_checkpoint
from kiln.data import build_data
from kiln.engine.optim import AdamW, settle_sparse_gradients
from kiln.models.text import FastText
from kiln.preprocessing.text import (
    WordCachedEncoder,
    WordPieces,
    WordSpelling,
    _words,
    encode_ids,
    train_tokenizer,
)

from .conftest import compose_config, train_in_process
from .damaged_csv import clean_rows
from .test_engine import make_trainer, one_step


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


# A vocabulary of 120 tokens with shared prefixes and suffixes, so character n-grams collide.
TOKENS = ("[PAD]", "[UNK]", *(f"{a}{b}" for a in ("re", "un", "pre", "x") for b in range(30)))[:120]


def pair(seed: int = 0) -> tuple[FastText, FastText]:
    """Two identical text_bow models (token bigrams and character n-grams), one taking sparse
    gradients."""
    torch.manual_seed(seed)
    kwargs = dict(
        ngrams=2,
        num_buckets=50,
        dropout=0.0,
        pad_id=0,
        aux_head=False,
        tokens=TOKENS,
        char_ngrams=(2, 4),
        specials=frozenset(TOKENS[:2]),
    )
    sparse = FastText(120, 8, 3, **kwargs)
    dense = copy.deepcopy(sparse)
    sparse.embed.sparse = True
    return sparse, dense


def batch(seed: int = 0, rows: int = 6, length: int = 9):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 120, (rows, length), generator=gen)
    ids[0, length // 2 :] = 0  # padded rows, as real batches have
    ids[2, 2:] = 0
    return ids, torch.randint(0, 3, (rows,), generator=gen)


def backward(model, ids, labels):
    torch.nn.functional.cross_entropy(model(ids), labels).backward()


def test_sparse_table_gradients_under_cpu_autocast_equal_the_dense_ones():
    """precision=amp on the CPU (bf16 autocast): the sparse product of the backward has no bf16
    kernel, and the matrix's text_bow/amp cell died at its first probe on it."""
    sparse, dense = pair()
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        backward(sparse, ids, labels)
        backward(dense, ids, labels)
    grad = sparse.embed.weight.grad
    assert grad.is_sparse and grad.dtype == torch.float32
    torch.testing.assert_close(grad.to_dense(), dense.embed.weight.grad, rtol=2e-2, atol=1e-3)


def test_sparse_table_gradients_equal_the_dense_ones():
    sparse, dense = pair()
    ids, labels = batch()
    backward(sparse, ids, labels)
    backward(dense, ids, labels)
    grad = sparse.embed.weight.grad
    assert grad.is_sparse and grad.is_coalesced()  # no sort left for the norm or the step
    torch.testing.assert_close(grad.to_dense(), dense.embed.weight.grad, rtol=1e-6, atol=1e-7)
    assert not dense.embed.weight.grad[0].any()  # padding weighs 0: its row learns nothing
    torch.testing.assert_close(
        torch.nn.utils.get_total_norm([grad]), torch.linalg.vector_norm(dense.embed.weight.grad)
    )
    # Two micro-batches accumulate to the sum of their gradients.
    sparse.zero_grad()
    dense.zero_grad()
    for half in (slice(0, 3), slice(3, 6)):
        backward(sparse, ids[half], labels[half])
        backward(dense, ids[half], labels[half])
    torch.testing.assert_close(
        sparse.embed.weight.grad.to_dense(), dense.embed.weight.grad, rtol=1e-6, atol=1e-7
    )


def test_the_lazy_step_is_adamw_on_the_touched_rows_and_leaves_the_others():
    sparse, dense = pair(1)
    lazy = AdamW(sparse.parameters(), lr=0.01, weight_decay=0.01)
    plain = torch.optim.AdamW(dense.parameters(), lr=0.01, weight_decay=0.01)
    ids, labels = batch(1)  # the same batch every step: the same rows each time
    before = sparse.embed.weight.detach().clone()
    for _ in range(3):
        backward(sparse, ids, labels)
        backward(dense, ids, labels)
        touched = sparse.embed.weight.grad.coalesce().indices()[0]
        lazy.step()
        plain.step()
        lazy.zero_grad()
        plain.zero_grad()
    table = sparse.embed.weight.detach()
    torch.testing.assert_close(table[touched], dense.embed.weight.detach()[touched])
    for name in ("weight", "bias"):  # dense parameters take torch's own AdamW step
        torch.testing.assert_close(getattr(sparse.head, name), getattr(dense.head, name))
    untouched = torch.ones(len(table), dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(table[untouched], before[untouched])  # no decay, no moment, no move
    state = lazy.state[sparse.embed.weight]
    assert float(state["step"]) == 3 and set(state) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_flagged_step_changes_nothing_on_the_device():
    """The trainer sets found_inf for a non-finite loss (fused optimizers skip on the device):
    the lazy step keeps rows, moments and its step count as they were."""
    sparse, _ = pair(2)
    optimizer = AdamW(sparse.parameters(), lr=0.01, fused=True)
    ids, labels = batch(2)
    backward(sparse, ids, labels)
    optimizer.step()
    optimizer.zero_grad()
    kept = {k: v.clone() for k, v in optimizer.state[sparse.embed.weight].items()}
    table = sparse.embed.weight.detach().clone()
    backward(sparse, ids, labels)
    optimizer.found_inf, optimizer.grad_scale = torch.ones(()), None
    optimizer.step()
    del optimizer.found_inf, optimizer.grad_scale
    assert torch.equal(sparse.embed.weight.detach(), table)
    for key, value in optimizer.state[sparse.embed.weight].items():
        assert torch.equal(value, kept[key]), key


def run_dir(tmp_path, name: str):
    path = tmp_path / name
    path.mkdir()
    return path


def test_the_engine_takes_sparse_gradients_in_one_process_with_adamw_only(tmp_path):
    trainer, _ = make_trainer(run_dir(tmp_path, "a"), "data=csv_text", "model=text_bow")
    table = trainer.raw_model.embed
    assert table.sparse and isinstance(trainer.optimizer, AdamW)
    before = table.weight.detach().clone()
    trainer.train_loader.sampler.set_epoch(0)
    ids, _ = next(iter(trainer.train_loader))
    features = trainer.raw_model.features(ids).unique()
    one_step(trainer, window=1)
    moved = (table.weight.detach() != before).any(dim=1)
    assert set(torch.nonzero(moved).flatten().tolist()) <= set(features.tolist())
    assert moved.sum() > 0
    # Several ranks (DDP reduces dense buckets), another optimizer, or the config: dense.
    model = trainer.raw_model
    cfg = compose_config("data=csv_text", "model=text_bow")
    assert not settle_sparse_gradients(model, cfg.optimizer, dense=True) and not table.sparse
    sgd = compose_config("data=csv_text", "model=text_bow", "optimizer=sgd").optimizer
    assert not settle_sparse_gradients(model, sgd, dense=False) and not table.sparse
    assert settle_sparse_gradients(model, cfg.optimizer, dense=False) and table.sparse
    off, _ = make_trainer(
        run_dir(tmp_path, "b"), "data=csv_text", "model=text_bow", "model.sparse_grads=false"
    )
    assert not off.raw_model.embed.sparse


def test_a_resumed_sparse_run_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    """Stopped mid-epoch and resumed from last.pt (the lazy AdamW's moments and step counts in
    it), a run ends with the weights of one that never stopped (CPU, deterministic); with
    character n-grams, the most the model's table is read through."""
    overrides = (
        "data=csv_text",
        "model=text_bow",
        "model.char_ngrams=[2,5]",
        "data.batch_size=16",
        "trainer.max_epochs=2",
        "trainer.deterministic=true",
        "scheduler=none",
        "env.progress_bar=false",
    )
    reference = tmp_path / "reference"
    train_in_process(reference, *overrides)

    first, _ = make_trainer(run_dir(tmp_path, "stopped"), *overrides)
    first.cfg = dataclasses.replace(first.cfg, max_steps=20)  # stop inside the first epoch
    first.fit()
    saved = load_checkpoint(tmp_path / "stopped" / "checkpoints" / "last.pt")
    assert saved["state"]["batch_in_epoch"] == 20 and saved["optimizer"]["state"]
    second, _ = make_trainer(run_dir(tmp_path, "resumed"), *overrides)
    second.load_state_dict(saved)
    second.fit()
    expected = load_checkpoint(reference / "checkpoints" / "last.pt")["model"]
    for name, value in second.raw_model.state_dict().items():
        assert torch.equal(value, expected[name]), f"{name} differs after resume"


# --- the data path -----------------------------------------------------------------------------

TRICKY = [
    "caf\u00e9 na\u0308ive \u0915\u093f\u0924\u093e\u092c",  # combining marks, Devanagari
    "\u4e2d\u6587\u5206\u8bcd\u3002\u6d4b\u8bd5 \u0627\u0644\u0639\u0631\u0628\u064a\u0629\u061f",
    "x\x1cy z\x1f w",  # whitespace to Python's str.split only
    "a\u3000b\u00a0c \x85d\u2028e",  # whitespace to both
    "",
    "   ",
    "hello,world!! (a, b) -- x.y/z:1",
    "\u2460 \u00bd \u00b2 \u00e9t\u00e9 \u00ab citation \u00bb d\u2019hiver",
    "word " * 400,  # past max_length
    "a" * 3000,
]


@pytest.mark.parametrize("spelled", [False, True], ids=["[UNK]", "unknown words spelled"])
@pytest.mark.parametrize("shared", [False, True], ids=["own pieces", "the vocabulary's pieces"])
@pytest.mark.parametrize("kind", ["words", "bpe"])
def test_the_word_cached_encoder_gives_the_ids_of_encoding_each_text_whole(kind, shared, spelled):
    texts = [text for text, _ in clean_rows(300, seed=1)] + TRICKY
    pieces = WordPieces() if shared else None
    tokenizer = train_tokenizer([texts[:200]], 300, 64, 200, kind, pieces)
    spelling = WordSpelling((2, 5)) if spelled else None
    encode = WordCachedEncoder(tokenizer, 64, pieces=pieces, spelling=spelling)
    if shared and kind == "words":  # the training words were split once, for the vocabulary
        split_for_the_vocabulary = dict(pieces._of)
        encode(texts[:200])
        assert pieces._of == split_for_the_vocabulary
    parts = [encode(texts[i : i + 97]) for i in range(0, len(texts), 97)]  # the cache carries on
    flat, lengths = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    cached = [ids.tolist() for ids in np.split(flat, np.cumsum(lengths)[:-1])]
    assert cached == encode_ids(tokenizer, texts, spelling=spelling)
    vocab_size = tokenizer.get_vocab_size()
    assert any(i >= vocab_size for ids in cached for i in ids) == spelled


def test_word_pieces_are_the_pre_tokenizer_s_for_every_ascii_character_and_beyond():
    """ASCII words are split here, the others by the Rust pre-tokenizer: the same pieces for
    words of every printable and control ASCII character (whitespace aside; \x1c-\x1f are
    not whitespace to it), mixed with letters, digits and non-ASCII punctuation."""
    from tokenizers import pre_tokenizers

    rng = random.Random(0)
    chars = [chr(i) for i in range(1, 128) if not chr(i).isspace() or 0x1C <= i <= 0x1F]
    chars += ["\u00e9", "\u00df", "\u2014", "\u3002", "\u066b", "\u203d", "\u00bf", "\u20ac"]
    words = {"".join(rng.choices(chars, k=rng.randint(1, 8))) for _ in range(5000)}
    words = sorted(w for w in words if len(_words(w)) == 1)
    pieces, owner = WordPieces().split(words)
    split = pre_tokenizers.BertPreTokenizer().pre_tokenize_str
    assert pieces == [p for w in words for p, _ in split(w)]
    assert owner.tolist() == [i for i, w in enumerate(words) for _ in split(w)]


def test_the_words_tokenizer_is_the_same_every_time():
    texts = [text for text, _ in clean_rows(200, seed=4)]
    first = train_tokenizer([texts], 100, 32, kind="words").to_str()
    assert first == train_tokenizer([texts[:120], texts[120:]], 100, 32, kind="words").to_str()


def test_a_batch_fetched_whole_equals_the_items_collated(tmp_path):
    cfg = compose_config("data=csv_text", "model=text_bow").data
    bundle = build_data(cfg)
    indices = [5, 0, 17, 3, 3, 40]
    whole = bundle.collate_fn(bundle.train.__getitems__(indices))
    items = bundle.collate_fn([bundle.train[i] for i in indices])
    assert torch.equal(whole[0], items[0]) and torch.equal(whole[1], items[1])
    assert whole[0].dtype == torch.long


@pytest.mark.parametrize("kind", ["words", "bpe"])
def test_a_token_seen_fewer_than_min_count_times_is_not_learned(kind):
    """data.min_token_count (TF-IDF's min_df): a word seen once in training stays out of the
    vocabulary (words) or is not merged whole (bpe); at 1 it is learned."""
    texts = ["the cat sat", "the dog ran", "zyxwvq the cat", *["the cat sat on the mat"] * 3]
    vocabs = {
        m: train_tokenizer([texts], 300, 32, kind=kind, min_count=m).get_vocab() for m in (1, 2)
    }
    assert {m: "zyxwvq" in vocab for m, vocab in vocabs.items()} == {1: True, 2: False}
    assert all("cat" in vocab for vocab in vocabs.values())  # seen often: learned either way
