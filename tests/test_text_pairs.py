"""Two text columns (data.text_pair_column) for every kiln text model, fed as a pair or, with
data.join_columns=true, joined into one text (a space between them): training's token store and
inference encode a row alike, and infer.py gives the evaluation's probabilities."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from .conftest import compose_config, train_in_process
from .hf_helpers import POSITIONS, write_bert
from .test_evaluate import run_infer
from .test_hf import write_pairs

PAIR = (
    "data=csv_text",
    "data.text_column=premise",
    "data.text_pair_column=hypothesis",
    "data.batch_size=16",
    "trainer.max_epochs=2",
)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    write_pairs(root / "train.csv", 120, seed=1)
    write_pairs(root / "held_out.csv", 12, seed=2)
    return root


def store_matches_inference(cfg, pretrained=None) -> None:
    """Each validation row's stored ids are what the recipe makes of the row's raw texts."""
    from kiln.data.csv_text import build_csv_text

    bundle = build_csv_text(cfg.data, pretrained=pretrained)
    frame = pd.read_csv(cfg.data.train_path, dtype=str, keep_default_na=False)
    rows = bundle.sources["val"].values[:8]
    raw = [[frame.premise[r - 1], frame.hypothesis[r - 1]] for r in rows]
    encoded = bundle.recipe.encode(raw)
    for i in range(len(rows)):
        stored = bundle.val[i][0].numpy()
        np.testing.assert_array_equal(encoded[i, : len(stored)].numpy(), stored)


def infer_matches_evaluate(run_dir, held_out, tmp_path, capsys) -> None:
    ckpt = f"ckpt={run_dir}/checkpoints/best.pt"
    code, _, err = run_infer(
        capsys, "mode=evaluate", ckpt, f"data={held_out}", f"output={tmp_path}/ev"
    )
    assert code == 0, err
    code, _, err = run_infer(capsys, ckpt, f"input={held_out}", f"output={tmp_path}/p.csv")
    assert code == 0, err
    evaluated, predicted = (
        pd.read_csv(tmp_path / "ev/predictions.csv"),
        pd.read_csv(tmp_path / "p.csv"),
    )
    probs = [c for c in evaluated.columns if c.startswith("prob_")]
    np.testing.assert_allclose(predicted[probs], evaluated[probs], atol=1e-4)


@pytest.mark.parametrize("model, join", [("text_transformer", False), ("text_bow", True)])
def test_kiln_text_models_take_pairs_and_joined_columns(pairs, tmp_path, capsys, model, join):
    overrides = (
        *PAIR,
        f"model={model}",
        f"data.train_path={pairs / 'train.csv'}",
        f"data.cache_dir={pairs / 'cache'}",
        f"data.join_columns={join}",
    )
    store_matches_inference(compose_config(*overrides))
    summary = train_in_process(tmp_path / "run", *overrides)
    assert summary["status"] in ("ok", "at_chance"), summary
    infer_matches_evaluate(tmp_path / "run", pairs / "held_out.csv", tmp_path, capsys)


def test_join_columns_feeds_a_pretrained_tokenizer_one_text(pairs, tmp_path, capsys):
    from kiln.inference import Predictor
    from kiln.models.zoo.transformers import hf_preprocessing

    frame = pd.read_csv(pairs / "train.csv")
    folder = write_bert(pairs / "bert", [*frame["premise"], *frame["hypothesis"]])
    overrides = (
        *PAIR,
        "model=hf",
        f"model.arch={folder}",
        f"data.max_length={POSITIONS}",
        f"data.train_path={pairs / 'train.csv'}",
        f"data.cache_dir={pairs / 'cache'}",
        "data.join_columns=true",
    )
    cfg = compose_config(*overrides)
    store_matches_inference(cfg, hf_preprocessing(cfg.model))
    summary = train_in_process(tmp_path / "run", *overrides)
    assert summary["status"] in ("ok", "at_chance"), summary
    predictor = Predictor.from_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")
    ids = predictor.preprocess([["The ndarray", "It checks the cookie twice"]])
    sep = predictor.record.recipe.pretrained["sep_id"]
    assert int((ids == sep).sum()) == 1  # [CLS] a b [SEP]: one text, not tokenizer(a, b)
    tokenizer = predictor.record.recipe.tokenizer()
    assert ids[0].tolist() == tokenizer.encode("The ndarray It checks the cookie twice").ids
    infer_matches_evaluate(tmp_path / "run", pairs / "held_out.csv", tmp_path, capsys)
