"""Tiny trained checkpoints shared by test_inference.py and test_serving.py: each is trained once
per pytest session, in-process, from the real config shrunk to one epoch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from kiln.engine.run import train

from .conftest import compose_config

TINY = ("trainer.max_epochs=1", "env.progress_bar=false", "logger=none", "device=cpu")
_RUNS: dict[str, tuple[Path, dict]] = {}


def trained_run(tmp_path_factory, name: str, *overrides: str) -> tuple[Path, dict]:
    """(run_dir, summary) of a one-epoch run, trained on first use in this session."""
    if name not in _RUNS:
        run_dir = tmp_path_factory.mktemp(name)
        summary = train(compose_config(*TINY, *overrides), run_dir)
        _RUNS[name] = (run_dir, summary)
    return _RUNS[name]


def digits_run(tmp_path_factory) -> tuple[Path, dict]:
    return trained_run(tmp_path_factory, "infer_digits", "data=digits", "model=mlp")


def raw_digits_val(val_fraction: float = 0.2, split_seed: int = 0):
    """The digits validation split as raw pixels (N, 8, 8) in 0..16, as a user would send them:
    the same split kiln.data.digits makes, before normalisation."""
    raw = load_digits()
    _, x_val, _, y_val = train_test_split(
        raw.images.astype(np.float32),
        raw.target,
        test_size=val_fraction,
        random_state=split_seed,
        stratify=raw.target,
    )
    return x_val, y_val
