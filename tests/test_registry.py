"""Registries: explicit, queryable, independent of import order; a user's model and dataset,
written outside src/kiln, register themselves and train through train.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kiln.cli.paths import REPO_ROOT
from kiln.errors import UserError
from kiln.registry import (
    DATASETS,
    EVALUATORS,
    GROUP_REGISTRIES,
    LOGGERS,
    MODELS,
    Registry,
    UnknownNameError,
    load_plugins,
)

from .conftest import SUBPROCESS_ENV


def test_duplicate_name_raises():
    registry = Registry("widget")
    registry.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.register("a")(lambda: 2)


def test_unknown_name_lists_known_names_and_closest_match():
    with pytest.raises(UnknownNameError) as info:
        MODELS.get("resnet19")
    message = str(info.value)
    assert "unknown model 'resnet19'" in message
    assert "mlp" in message and "resnet50" in message
    assert message.endswith("; did you mean resnet18?")
    # the user's mistake (exit 2 in both CLIs), not a KeyError a bug could raise too
    assert isinstance(info.value, UserError) and not isinstance(info.value, KeyError)


def test_registries_hold_the_contract_names():
    assert {"digits", "synthetic_images", "csv_text", "shapes_detection"} <= set(DATASETS.names())
    expected = {"mlp", "resnet18", "resnet50", "text_bow", "text_transformer", "detector"}
    expected |= {"torchvision", "timm"}
    assert expected <= set(MODELS.names())
    assert set(LOGGERS.names()) == {"csv", "tensorboard", "wandb"}
    assert set(EVALUATORS.names()) == {"classification", "detection"}


@pytest.mark.parametrize("group", sorted(GROUP_REGISTRIES))
def test_every_entry_has_a_schema_and_a_builder_that_loads(group):
    registry = GROUP_REGISTRIES[group]
    for name in registry.names():
        entry = registry.entry(name)
        assert entry.config is not None, name
        assert callable(entry.load()), name


def kiln_names(registry) -> list[str]:
    """The names kiln itself registers: declared by import path in kiln's own modules."""

    def own(entry) -> bool:
        target = entry.target
        module = target.partition(":")[0] if isinstance(target, str) else target.__module__
        return module.startswith("kiln.")

    return [name for name in registry.names() if own(registry.entry(name))]


def fresh_python(code: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        cwd=cwd,
        timeout=120,
    )


def test_registries_fill_themselves_whatever_was_imported_first_and_without_torch():
    result = fresh_python(
        """
        import json, sys
        from kiln.registry import MODELS, DATASETS, OPTIMIZERS
        print(json.dumps([MODELS.names(), DATASETS.names(), OPTIMIZERS.names(),
                          "torch" in sys.modules]))
        """
    )
    assert result.returncode == 0, result.stderr
    models, datasets, optimizers, torch_loaded = json.loads(result.stdout)
    # kiln's own entries (a user's plugins, KILN_PLUGINS=..., are registered in this process)
    assert (models, datasets, optimizers) == (
        kiln_names(MODELS),
        kiln_names(DATASETS),
        ["adamw", "sgd"],
    )
    assert torch_loaded is False  # listing choices never pays torch's import


PLUGIN = '''
"""A user's model and dataset, outside src/kiln: one file."""
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from kiln.config.data import DataConfig
from kiln.config.model import ClassifierConfig
from kiln.data import DataBundle, DataSpec
from kiln.preprocessing import ImageRecipe
from kiln.registry import register_dataset, register_model


@dataclass(frozen=True, kw_only=True)
class TinyConfig(ClassifierConfig):
    """Flatten -> Linear -> ReLU -> Linear."""

    width: int = 32  # hidden width


@register_model("tiny", config=TinyConfig)
def build_tiny(spec, cfg, *, aux_head=False):
    features = spec.channels * math.prod(spec.image_size)
    hidden = nn.Linear(features, cfg.width)
    return nn.Sequential(nn.Flatten(), hidden, nn.ReLU(), nn.Linear(cfg.width, spec.num_classes))


@dataclass(frozen=True, kw_only=True)
class BlobsConfig(DataConfig):
    """Two Gaussian blobs as 1x2x2 images."""

    num_samples: int = 256  # samples per split


@register_dataset("blobs", config=BlobsConfig)
def build_blobs(cfg):
    def split(seed):
        gen = torch.Generator().manual_seed(seed)
        y = torch.randint(0, 2, (cfg.num_samples,), generator=gen)
        x = torch.randn(cfg.num_samples, 1, 2, 2, generator=gen) + 3 * y.view(-1, 1, 1, 1)
        return TensorDataset(x, y)

    names = ("left", "right")
    spec = DataSpec("classification", "image", 2, names, channels=1, image_size=(2, 2))
    recipe = ImageRecipe((0.0,), (1.0,), 1, (2, 2), names)
    return DataBundle(spec, split(cfg.split_seed), split(cfg.split_seed + 1), recipe)
'''


@pytest.fixture
def user_project(tmp_path):
    """What a user writes: one Python file, one YAML per option, in their own folder."""
    (tmp_path / "my_parts.py").write_text(PLUGIN)
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "tiny.yaml").write_text("width: 24\n")
    (tmp_path / "conf" / "data" / "blobs.yaml").write_text("batch_size: 32\nnum_samples: 128\n")
    return tmp_path


def test_a_users_model_and_dataset_train_through_train_py_and_predict(user_project):
    args = [
        "plugins=[my_parts]",
        f"hydra.searchpath=[file://{user_project}/conf]",
        "model=tiny",
        "data=blobs",
        "trainer.max_epochs=6",
        "optimizer.lr=0.03",
        "env.progress_bar=false",
        "hydra.run.dir=run",
    ]
    train = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), *args],
        cwd=user_project,
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=300,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    summary = json.loads((user_project / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["val_acc"] > 0.85  # chance: 0.5
    config = (user_project / "run" / ".hydra" / "config.yaml").read_text()
    assert "width: 24" in config and "num_samples: 128" in config
    # The help lists the user's options and their keys.
    described = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "plugins=[my_parts]", "--help"],
        cwd=user_project,
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert "tiny" in described.stdout and "blobs" in described.stdout
    # Inference imports the plugin the checkpoint names.
    import numpy as np

    np.save(user_project / "x.npy", np.zeros((3, 1, 2, 2), dtype=np.float32))
    ckpt = user_project / "run" / "checkpoints" / "best.pt"
    predict = subprocess.run(
        [sys.executable, str(REPO_ROOT / "infer.py"), f"ckpt={ckpt}", "input=x.npy"],
        cwd=user_project,
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert predict.returncode == 0, predict.stderr
    assert (user_project / "preds.csv").read_text().startswith("index,label,prob_left,prob_right")


def test_plugins_can_also_come_from_an_entry_point(user_project, monkeypatch):
    """A package advertising `[kiln.plugins]` in its metadata registers without plugins=[...]."""
    dist_info = user_project / "my_parts-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-parts\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[kiln.plugins]\nparts = my_parts\n")
    result = fresh_python(
        """
        import sys
        sys.path.insert(0, ".")
        from kiln.registry import MODELS, load_plugins
        load_plugins()
        print(MODELS.names())
        """,
        cwd=user_project,
    )
    assert result.returncode == 0, result.stderr
    assert "tiny" in result.stdout


def test_a_missing_plugin_module_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ImportError, match="plugins: cannot import 'not_there'"):
        load_plugins(["not_there"])
