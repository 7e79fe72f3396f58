"""data=digits: scikit-learn's split, cached after the first run so later runs skip importing
scikit-learn (about 1.4 s of a short run): the cached arrays are exactly scikit-learn's, and a
damaged cache file is rebuilt, never trusted."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kiln.data.digits import SPLIT_KEYS, digits_split, split_cache_path, split_digits

from .conftest import SUBPROCESS_ENV, compose_config


def sklearn_split(cfg) -> dict[str, np.ndarray]:
    """scikit-learn's own split, as earlier kilns cached it."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    raw = load_digits()
    images, labels = raw.images.astype(np.float32)[:, None], raw.target.astype(np.int64)
    x_train, x_val, y_train, y_val, _, i_val = train_test_split(
        images,
        labels,
        np.arange(len(labels)),
        test_size=cfg.val_fraction,
        random_state=cfg.split_seed,
        stratify=labels,
    )
    return dict(zip(SPLIT_KEYS, (x_train, x_val, y_train, y_val, i_val), strict=True))


@pytest.mark.parametrize("settings", [(), ("data.split_seed=3", "data.val_fraction=0.25")])
def test_the_split_is_scikit_learns(settings):
    cfg = compose_config(*settings).data
    expected, split = sklearn_split(cfg), split_digits(cfg)
    for key, value in expected.items():
        assert np.array_equal(split[key], value) and split[key].dtype == value.dtype, key


def test_the_cached_split_is_scikit_learns_and_later_runs_do_not_import_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = compose_config("data.split_seed=3", "data.val_fraction=0.25").data
    expected = sklearn_split(cfg)
    first = digits_split(cfg)
    assert split_cache_path(cfg).is_file()
    again = digits_split(cfg)
    for key, value in expected.items():
        assert np.array_equal(first[key], value) and np.array_equal(again[key], value), key
        assert again[key].dtype == value.dtype
    code = (
        "import sys; from kiln.config import load_config; from kiln.data import build_data; "
        "b = build_data(load_config(['data.split_seed=3', 'data.val_fraction=0.25']).data); "
        "print(len(b.train), len(b.val), 'sklearn' in sys.modules)"
    )
    env = {**SUBPROCESS_ENV, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == [str(len(first["y_train"])), str(len(first["y_val"])), "False"]


def test_a_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = compose_config().data
    path = split_cache_path(cfg)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"PK\x03\x04 not a whole npz")
    split = digits_split(cfg)
    assert np.array_equal(split["i_val"], split_digits(cfg)["i_val"])
    with np.load(path) as cached:  # written again, whole
        assert np.array_equal(cached["i_val"], split["i_val"])
