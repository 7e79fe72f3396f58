"""csv_text (CSV reading, errors, tokenizer, collate, the recipe's encoding) and the text
models. Bad rows, cleaning, the token cache and bucketing have their own files (test_text_*)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from kiln.config import ConfigError
from kiln.data import build_data
from kiln.data.csv_text import CsvTextError, collate_tokens
from kiln.data.spec import DataSpec
from kiln.models import build_model
from kiln.preprocessing import recipe_from_dict

from .conftest import compose_config

TEXT_MODELS = ["text_bow", "text_transformer"]


def data_cfg(**overrides):
    """data=csv_text as composed, with `overrides` applied and checked as the CLI would."""
    cfg = dataclasses.replace(compose_config("data=csv_text", "model=text_bow").data, **overrides)
    cfg.check("data")
    return cfg


def model_cfg(name: str, **overrides):
    cfg = dataclasses.replace(compose_config(f"model={name}", "data=csv_text").model, **overrides)
    cfg.check("model")
    return cfg


def write_csv(path: Path, rows: list[dict]) -> Path:
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


TRAIN_ROWS = [
    {"text": "the cat sat on the mat", "label": "pets"},
    {"text": "a dog chased the ball", "label": "pets"},
    {"text": "my cat likes warm milk", "label": "pets"},
    {"text": "the stock market fell today", "label": "money"},
    {"text": "interest rates rose again", "label": "money"},
    {"text": "the bank raised its fees", "label": "money"},
]
VAL_ROWS = [
    {"text": "the dog sat on the ball", "label": "pets"},
    {"text": "zebras quietly market their fees", "label": "money"},  # 'zebras' unseen in train
]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """The token cache of every CSV test lives in the test's own directory, never in ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.fixture(scope="module")
def demo_bundle():
    return build_data(data_cfg())


@pytest.fixture
def csv_bundle(tmp_path):
    train = write_csv(tmp_path / "train.csv", TRAIN_ROWS)
    val = write_csv(tmp_path / "val.csv", VAL_ROWS)
    return build_data(data_cfg(train_path=str(train), val_path=str(val)))


# --- the dataset ---------------------------------------------------------------------------


def test_demo_corpus_builds_a_token_spec(demo_bundle):
    cfg, spec = data_cfg(), demo_bundle.spec
    assert spec.task == "classification" and spec.input_kind == "tokens"
    assert spec.pad_id == 0 and spec.max_length == cfg.max_length
    assert spec.num_classes == len(spec.class_names) >= 2
    assert list(spec.class_names) == sorted(spec.class_names)
    assert 0 < spec.vocab_size <= cfg.vocab_size
    every_id = torch.cat([demo_bundle.train[i][0] for i in range(len(demo_bundle.train))])
    assert int(every_id.max()) < spec.vocab_size
    assert len(demo_bundle.val) == round(
        (len(demo_bundle.train) + len(demo_bundle.val)) * cfg.val_fraction
    )


def test_demo_split_is_stratified_and_seeded(demo_bundle):
    labels = demo_bundle.val.labels
    counts = torch.bincount(labels, minlength=demo_bundle.spec.num_classes)
    assert int(counts.max() - counts.min()) <= 1  # the demo topics are balanced
    again = build_data(data_cfg())
    assert torch.equal(again.val.labels, labels)
    other = build_data(data_cfg(split_seed=1))
    first_ids = [again.val[i][0].tolist() for i in range(len(again.val))]
    assert [other.val[i][0].tolist() for i in range(len(other.val))] != first_ids


def test_preprocessing_is_plain_data_that_survives_a_weights_only_load(demo_bundle):
    pre = demo_bundle.recipe.to_dict()
    assert pre["kind"] == "tokens" and pre["pad_id"] == demo_bundle.spec.pad_id
    assert pre["class_names"] == list(demo_bundle.spec.class_names)
    json.dumps(pre)  # nothing but JSON types
    buffer = io.BytesIO()
    torch.save({"preprocessing": pre}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["preprocessing"] == pre


def test_csv_files_give_sorted_classes_and_the_val_file_rows(csv_bundle):
    assert csv_bundle.spec.class_names == ("money", "pets")
    assert len(csv_bundle.train) == len(TRAIN_ROWS) and len(csv_bundle.val) == len(VAL_ROWS)
    expected = [csv_bundle.spec.class_names.index(r["label"]) for r in VAL_ROWS]
    assert csv_bundle.val.labels.tolist() == expected


def test_numeric_labels_sort_as_numbers(tmp_path):
    rows = [
        {"text": f"sentence number {i}", "label": label}
        for i, label in enumerate(["10", "2", "2", "10", "1", "1"] * 2)
    ]
    bundle = build_data(data_cfg(train_path=str(write_csv(tmp_path / "n.csv", rows))))
    assert bundle.spec.class_names == ("1", "2", "10")


def test_tokenizer_is_trained_on_the_training_split_only(csv_bundle, tmp_path):
    unk_id = 1  # [PAD]=0, [UNK]=1
    # data.tokenizer=words (the default): a training word is one token, a word only the
    # validation file has is [UNK].
    assert csv_bundle.recipe.encode(["cat"])[0].tolist() != [unk_id]
    assert csv_bundle.recipe.encode(["zebras cat"])[0].tolist()[0] == unk_id
    # bpe: a training word is one token; a word only the validation file has is pieces, and
    # its letters the training texts never use ('z') are [UNK].
    train = write_csv(tmp_path / "train.csv", TRAIN_ROWS)
    val = write_csv(tmp_path / "val.csv", VAL_ROWS)
    bpe = build_data(data_cfg(train_path=str(train), val_path=str(val), tokenizer="bpe")).recipe
    assert bpe.encode(["cat"])[0].tolist() != [unk_id]
    assert len(bpe.encode(["cat"])[0]) == 1
    zebras = bpe.encode(["zebras"])[0].tolist()
    assert len(zebras) > 1 and zebras[0] == unk_id


def test_texts_are_truncated_to_max_length(tmp_path):
    rows = [dict(r) for r in TRAIN_ROWS]
    rows[0]["text"] = " ".join(["cat"] * 500)
    cfg = data_cfg(train_path=str(write_csv(tmp_path / "long.csv", rows)), val_fraction=0.5)
    bundle = build_data(cfg)
    lengths = [len(bundle.train[i][0]) for i in range(len(bundle.train))]
    lengths += [len(bundle.val[i][0]) for i in range(len(bundle.val))]
    assert max(lengths) == cfg.max_length
    long_text = bundle.recipe.encode([rows[0]["text"]])
    assert long_text.shape[1] == cfg.max_length


def test_small_vocab_size_is_respected(tmp_path):
    cfg = data_cfg(train_path=str(write_csv(tmp_path / "t.csv", TRAIN_ROWS)), vocab_size=24)
    assert build_data(cfg).spec.vocab_size <= cfg.vocab_size


# --- clear errors for bad input --------------------------------------------------------------


def test_missing_column_names_the_file_and_the_columns_present(tmp_path):
    path = write_csv(tmp_path / "bad.csv", [{"sentence": "hello", "label": "a"}])
    with pytest.raises(CsvTextError) as err:
        build_data(data_cfg(train_path=str(path)))
    message = str(err.value)
    assert str(path) in message and "'text'" in message
    assert "columns present: 'sentence', 'label'" in message


def test_empty_text_names_the_row_with_bad_rows_error(tmp_path):
    rows = [dict(r) for r in TRAIN_ROWS]
    rows[3]["text"] = "   "
    path = write_csv(tmp_path / "empty.csv", rows)
    with pytest.raises(CsvTextError, match=r"row 4 \(line 5\) has an empty text in column 'text'"):
        build_data(data_cfg(train_path=str(path), bad_rows="error"))


def test_nan_label_names_the_row_with_bad_rows_error(tmp_path):
    rows = [dict(r) for r in TRAIN_ROWS]
    rows[1]["label"] = float("nan")
    path = write_csv(tmp_path / "nan.csv", rows)
    with pytest.raises(CsvTextError, match=r"nan\.csv: row 2 \(line 3\) has a missing"):
        build_data(data_cfg(train_path=str(path), bad_rows="error"))


def test_nonexistent_path_is_named(tmp_path):
    missing = tmp_path / "nowhere.csv"
    with pytest.raises(CsvTextError, match="nowhere.csv: no such file"):
        build_data(data_cfg(train_path=str(missing)))


def test_val_label_unseen_in_training_names_the_row_and_label(tmp_path):
    train = write_csv(tmp_path / "train.csv", TRAIN_ROWS)
    val = write_csv(tmp_path / "val.csv", [*VAL_ROWS, {"text": "rain again", "label": "weather"}])
    with pytest.raises(CsvTextError, match=r"val\.csv: row 3 \(line 4\).*'weather'"):
        build_data(data_cfg(train_path=str(train), val_path=str(val), bad_rows="error"))
    dropped = build_data(data_cfg(train_path=str(train), val_path=str(val)))
    assert len(dropped.val) == len(VAL_ROWS)
    report = dropped.report["val_file"]
    assert report["dropped"] == {"unseen_label": 1}
    (record,) = report["dropped_records"]
    assert (record["row"], record["line"], record["column"]) == (3, 4, "label")


def test_single_class_is_refused(tmp_path):
    rows = [{"text": r["text"], "label": "same"} for r in TRAIN_ROWS]
    with pytest.raises(CsvTextError, match="two classes"):
        build_data(data_cfg(train_path=str(write_csv(tmp_path / "one.csv", rows))))


# --- batching and inference encoding --------------------------------------------------------


def test_collate_pads_to_the_longest_with_pad_id(demo_bundle):
    items = [demo_bundle.train[i] for i in range(4)]
    ids, labels = demo_bundle.collate_fn(items)
    lengths = [len(item[0]) for item in items]
    assert ids.dtype == torch.long and labels.dtype == torch.long
    assert ids.shape == (len(items), max(lengths)) and labels.shape == (len(items),)
    for row, (tokens, _label), length in zip(ids, items, lengths, strict=True):
        assert torch.equal(row[:length], tokens)
        assert bool((row[length:] == demo_bundle.spec.pad_id).all())
    assert labels.tolist() == [int(item[1]) for item in items]


def test_collate_fn_is_picklable_for_workers(demo_bundle):
    restored = pickle.loads(pickle.dumps(demo_bundle.collate_fn))
    assert restored is collate_tokens


def test_the_recipe_repeats_the_training_encoding(csv_bundle, tmp_path):
    texts = [row["text"] for row in VAL_ROWS]
    encoded = csv_bundle.recipe.encode(texts)
    expected, _ = csv_bundle.collate_fn([csv_bundle.val[i] for i in range(len(texts))])
    assert torch.equal(encoded, expected)
    # text_bow's data: the validation words training never saw are spelled after their [UNK],
    # in the store and by the checkpoint's recipe alike.
    from kiln.models.text import text_bow_input

    spelling = text_bow_input(model_cfg("text_bow", char_ngrams=[2, 5]))
    train = write_csv(tmp_path / "train.csv", TRAIN_ROWS)
    val = write_csv(tmp_path / "val.csv", VAL_ROWS)
    cfg = data_cfg(train_path=str(train), val_path=str(val))
    spelled = build_data(cfg, pretrained=spelling)
    assert spelled.recipe.spell_char_ngrams == (2, 5)
    stored = json.loads(json.dumps(spelled.recipe.to_dict()))  # as a checkpoint holds it
    assert recipe_from_dict(stored).spelling == spelling
    encoded = spelled.recipe.encode(texts)
    expected, _ = spelled.collate_fn([spelled.val[i] for i in range(len(texts))])
    assert torch.equal(encoded, expected)
    vocab_size = spelled.spec.vocab_size
    assert bool((expected >= vocab_size).any())  # the validation file's new words, spelled
    assert not bool((encoded[:, 0:1] >= vocab_size).any())  # a spelling follows its [UNK]
    assert text_bow_input(model_cfg("text_bow", char_ngrams=[])) is None


# --- models ----------------------------------------------------------------------------------


def _token_batch(spec: DataSpec, batch_size: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, spec.vocab_size, (batch_size, length), generator=gen)
    ids[0, length // 2 :] = spec.pad_id  # one padded row, like a real batch
    return ids


@pytest.mark.parametrize("aux_head", [False, True])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("name", TEXT_MODELS)
def test_text_model_forward_backward_at_two_lengths(demo_bundle, name, batch_size, aux_head):
    spec = demo_bundle.spec
    model = build_model(spec, model_cfg(name), aux_head=aux_head)
    for length in (spec.max_length, max(1, spec.max_length // 3)):
        model.zero_grad()
        out = model(_token_batch(spec, batch_size, length))
        logits = out["logits"] if aux_head else out
        assert logits.shape == (batch_size, spec.num_classes)
        loss = logits.sum()
        if aux_head:
            assert out["aux_logits"].shape == logits.shape
            loss = loss + out["aux_logits"].sum()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_padding_does_not_change_the_prediction(demo_bundle, name):
    spec = demo_bundle.spec
    model = build_model(spec, model_cfg(name)).eval()
    ids = _token_batch(spec, 2, spec.max_length // 2)
    padded = torch.cat([ids, torch.full_like(ids, spec.pad_id)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(padded), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_text_model_on_real_batch_and_all_padding_row(demo_bundle, name):
    spec = demo_bundle.spec
    model = build_model(spec, model_cfg(name))
    ids, _ = demo_bundle.collate_fn([demo_bundle.train[i] for i in range(3)])
    ids[0] = spec.pad_id
    assert torch.isfinite(model(ids)).all()


def test_transformer_refuses_sequences_longer_than_max_length(demo_bundle):
    spec = demo_bundle.spec
    model = build_model(spec, model_cfg("text_transformer"))
    with pytest.raises(ValueError, match="data.max_length"):
        model(_token_batch(spec, 1, spec.max_length + 1))


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_text_models_reject_image_data(name):
    image_spec = DataSpec(
        task="classification",
        input_kind="image",
        num_classes=3,
        class_names=("a", "b", "c"),
        channels=1,
        image_size=(8, 8),
    )
    with pytest.raises(ValueError, match="needs token data"):
        build_model(image_spec, model_cfg(name))


def test_transformer_heads_must_divide_embed_dim():
    with pytest.raises(ConfigError, match=r"not divisible by num_heads=4 \(model.num_heads\)"):
        model_cfg("text_transformer", embed_dim=30, num_heads=4)


# --- fastText: hashed n-grams from the ids, inside the model ---------------------------------


def test_fasttext_hashes_each_bigram_to_one_bucket_wherever_it_occurs():
    from kiln.models.text import hashed_ngrams

    ids = torch.tensor([[5, 6, 7, 0, 0], [9, 5, 6, 0, 0], [6, 5, 0, 0, 0]])
    grams = hashed_ngrams(ids, pad_id=0, ngrams=2, num_buckets=1000, offset=50)
    assert grams.shape == (3, 4)  # L - 1 bigrams per row
    assert int(grams[0, 0]) == int(grams[1, 1])  # "5 6" in row 0 and row 1: the same bucket
    assert int(grams[0, 0]) != int(grams[2, 0])  # "6 5" is another bigram
    real = grams[grams != 0]
    assert bool(((real >= 50) & (real < 1050)).all())  # after the vocabulary rows
    # Bigrams touching padding are padding (left out of the EmbeddingBag's sum).
    assert grams[0, 2:].tolist() == [0, 0] and grams[2, 1:].tolist() == [0, 0, 0]
    trigrams = hashed_ngrams(ids, pad_id=0, ngrams=3, num_buckets=1000, offset=50)
    assert trigrams.shape == (3, 4 + 3) and torch.equal(trigrams[:, :4], grams)


def test_fasttext_sees_word_order_only_through_its_ngrams(demo_bundle):
    spec = demo_bundle.spec
    ids = torch.tensor([[10, 11, 12, 13]])
    swapped = torch.tensor([[11, 10, 13, 12]])
    with torch.no_grad():
        bigrams = build_model(spec, model_cfg("text_bow")).eval()
        assert not torch.allclose(bigrams(ids), bigrams(swapped))
        tokens_only = build_model(spec, model_cfg("text_bow", ngrams=1)).eval()
        torch.testing.assert_close(tokens_only(ids), tokens_only(swapped))


def test_a_word_is_its_own_row_and_its_character_ngrams(demo_bundle):
    from kiln.models.text import FastText, word_pieces
    from kiln.preprocessing.text import spelled_ids

    tokens = ("[PAD]", "[UNK]", "running", "jumping", "run", "ing")
    specials = frozenset(tokens[:2])
    rows, shares = word_pieces(tokens, (3, 4), 1000, 6, 0, specials)
    assert rows[2, 0] == 2 and rows[3, 0] == 3  # each word's own row first
    bag = lambda i: set(rows[i][shares[i] > 0].tolist())  # noqa: E731
    # "ing>" (a suffix) is one bucket wherever it occurs; "<ing" (a prefix) is another.
    assert len(bag(2) & bag(3)) >= 2 and not bag(2) - {2} & {6, 7}
    assert bag(1) == {1} and bag(0) == set()  # [UNK] only its row; [PAD] nothing
    assert np.allclose(shares[2][shares[2] > 0], 1 / len(bag(2)))  # the mean of its pieces
    assert all(6 <= r < 1006 for r in bag(2) - {2})  # buckets after the vocabulary
    # The model: the padded (ONNX) path and the distinct-token path give the same outputs,
    # repeated tokens (the last text) weighed by their count or sublinearly, an unknown word
    # spelled after its [UNK] (the second and fourth texts) included.
    jumped = spelled_ids("jumped", 1, 6, (3, 4))
    ids = torch.tensor(
        [[2, 3, 4, 0, 0, 0, 0, 0, 0], [5, *jumped[:7], 0], [4, 4, 2, 5, *jumped[:5]]]
    )
    for sublinear in (False, True):
        torch.manual_seed(0)
        model = FastText(
            6,
            8,
            3,
            ngrams=2,
            num_buckets=1000,
            dropout=0.0,
            pad_id=0,
            aux_head=False,
            tokens=tokens,
            char_ngrams=(3, 4),
            specials=specials,
            sublinear_tf=sublinear,
        ).eval()
        words, spelled = model.split_spelled(ids)
        keep = words != 0
        grams = model.token_ngrams(words)
        weights = model._weights(words, keep, grams, spelled)
        extra = torch.cat([grams, spelled], dim=1)
        with torch.no_grad():
            torch.testing.assert_close(
                model._pool_distinct(words, keep, extra, weights),
                model._pool_padded(words, extra, weights),
            )
    # An unknown word's spelling reads the rows a known word's n-grams do: "jumping" spelled
    # is its vocabulary entry's bag, [UNK]'s row for its own.
    spelled_jumping = torch.tensor([spelled_ids("jumping", 1, 6, (3, 4))])
    assert set(model.features(spelled_jumping).tolist()) == bag(3) - {3} | {1}


def test_text_bow_weighs_a_repeated_word_sublinearly(monkeypatch):
    """model.sublinear_tf: a word seen tf times in a text counts 1 + ln(tf) (TF-IDF's sublinear
    tf), and the text's vector has norm sqrt(embed_dim) over its features' weights; without it
    each occurrence counts 1 (the text "a a a b" is then three parts a to one part b)."""
    from kiln.models.text import FastText

    ids = torch.tensor([[2, 2, 2, 3]])
    for sublinear, weight_a in ((True, 1 + math.log(3)), (False, 3.0)):
        torch.manual_seed(0)
        model = FastText(
            4,
            8,
            3,
            ngrams=1,
            num_buckets=10,
            dropout=0.0,
            pad_id=0,
            aux_head=False,
            sublinear_tf=sublinear,
        ).eval()
        table = model.embed.weight.detach()
        norm = math.sqrt(weight_a**2 + 1) if sublinear else math.sqrt(4)
        expected = (weight_a * table[2] + table[3]) * model.scale / norm
        with torch.no_grad():
            none = ids[:, :0]
            pooled = model._pool_distinct(
                ids, ids != 0, none, model._weights(ids, ids != 0, none, none)
            )
        torch.testing.assert_close(pooled[0], expected)
        assert model(ids).shape == (1, 3)
    # The counts the export traces (every pair of positions compared) are the eager ones.
    from kiln.models import text as text_models

    ids = torch.tensor([[4, 4, 2, 5, 0], [1, 1, 1, 0, 0], [3, 0, 0, 0, 0]])
    real = ids != 0
    eager = text_models._term_frequency(ids, real, 6)
    assert eager[real].tolist() == [2, 2, 1, 1, 3, 3, 3, 1]
    monkeypatch.setattr(text_models, "_tracing", lambda: True)
    torch.testing.assert_close(text_models._term_frequency(ids, real, 6)[real], eager[real])


def test_text_bow_reads_its_words_from_the_data(demo_bundle):
    """The vocabulary's strings come with the data (DataSpec.tokens, kept in checkpoints): each
    word's bag holds the bucket of its character n-grams, e.g. "<" and its first letter."""
    import zlib

    spec = demo_bundle.spec
    assert len(spec.tokens) == spec.vocab_size and spec.tokens[:2] == ("[PAD]", "[UNK]")
    assert DataSpec.from_dict(spec.to_dict()) == spec  # as a checkpoint stores it
    cfg = model_cfg("text_bow", char_ngrams=[2, 5])
    model = build_model(spec, cfg)
    word = spec.tokens[5]
    prefix = spec.vocab_size + zlib.crc32(f"<{word[0]}".encode()) % cfg.num_buckets
    assert prefix in model.pieces[5].tolist() and model.pieces[5, 0] == 5
    assert build_model(spec, model_cfg("text_bow", char_ngrams=[])).pieces.shape[1] == 1


def test_char_ngrams_must_be_a_range():
    with pytest.raises(ConfigError, match="char_ngrams"):
        model_cfg("text_bow", char_ngrams=[5, 2])
    with pytest.raises(ConfigError, match="char_ngrams"):
        model_cfg("text_bow", char_ngrams=[3])
    assert model_cfg("text_bow", char_ngrams=[]).char_ngrams == []


# --- text_transformer: fused attention and the nested-tensor fast path -----------------------


def test_transformer_attention_runs_through_sdpa_without_weights(demo_bundle, monkeypatch):
    """Training forward: every layer's attention goes through scaled_dot_product_attention (which
    never materialises attention weights); nothing asks for the weights."""
    import torch.nn.functional as F

    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append(args[0].shape)
        return real_sdpa(*args, **kwargs)

    real_mha = torch.nn.MultiheadAttention.forward

    def mha_forward(self, *args, need_weights=True, **kwargs):
        assert need_weights is False, "the encoder asked for attention weights"
        return real_mha(self, *args, need_weights=need_weights, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(torch.nn.MultiheadAttention, "forward", mha_forward)
    cfg = model_cfg("text_transformer")
    model = build_model(demo_bundle.spec, cfg).train()
    model(_token_batch(demo_bundle.spec, 3, 12)).sum().backward()
    assert len(calls) == cfg.num_layers


def test_transformer_eval_takes_the_nested_tensor_fast_path(demo_bundle):
    """In eval mode under no_grad the encoder packs the batch into a nested tensor and skips the
    padding: its output there is exactly zero (the slow path computes something there)."""
    spec = demo_bundle.spec
    model = build_model(spec, model_cfg("text_transformer"))
    ids = _token_batch(spec, 3, 16)  # row 0 is padded after position 8
    padding = ids == spec.pad_id

    def encoder_output():
        x = model.embed(ids) + model.position[: ids.shape[1]]
        return model.encoder(x, src_key_padding_mask=padding)

    with torch.no_grad():
        model.eval()
        assert torch.count_nonzero(encoder_output()[padding]) == 0
        model.train()
        assert torch.count_nonzero(encoder_output()[padding]) > 0
