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

from .conftest import SUBPROCESS_ENV, run_python


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
    assert set(EVALUATORS.names()) == {"classification", "detection", "multilabel"}


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
    train = run_python([sys.executable, str(REPO_ROOT / "train.py"), *args], user_project)
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
    # Inference imports the plugins the user names, never those the checkpoint names: without
    # plugins=[...] it says what to add; with it, it predicts.
    import numpy as np

    np.save(user_project / "x.npy", np.zeros((3, 1, 2, 2), dtype=np.float32))
    ckpt = user_project / "run" / "checkpoints" / "best.pt"

    def predict(*extra: str) -> subprocess.CompletedProcess:
        infer = [sys.executable, str(REPO_ROOT / "infer.py"), f"ckpt={ckpt}", "input=x.npy"]
        return run_python([*infer, *extra], user_project, timeout=120)

    refused = predict()
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("error: checkpoint best.pt was trained with 'plugins=[my_parts]'")
    assert "add 'plugins=[my_parts]' to the command" in line and str(user_project) in line
    predicted = predict("plugins=[my_parts]")
    assert predicted.returncode == 0, predicted.stderr
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


PLAIN_DATACLASS = """
from dataclasses import dataclass

from kiln.config.model import MlpConfig
from kiln.registry import register_model


@dataclass
class {name}Config(MlpConfig):
    width: int = 3


@register_model("{name}", config={name}Config, inputs=("image",))
def build(spec, cfg, *, aux_head=False):
    raise NotImplementedError
"""


def test_a_plugin_config_written_as_a_plain_dataclass_is_one_line_saying_what_to_write(
    tmp_path, monkeypatch, capsys
):
    """The form before configs were frozen died with a 34-line TypeError (cannot inherit
    non-frozen dataclass from a frozen one); a standalone plain @dataclass as a config is
    refused when registered."""
    from kiln.cli.train import main as train_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain_parts.py").write_text(PLAIN_DATACLASS.format(name="plainw"))
    with pytest.raises(SystemExit) as stopped:
        train_main(["plugins=[plain_parts]", "model=plainw"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        f"error: plugins: plain_parts: plainwConfig ({tmp_path / 'plain_parts.py'}:8) is a "
        "plain @dataclass under one of kiln's frozen configs: write @dataclass(frozen=True, "
        "kw_only=True) above it, as kiln's own configs are (a value derived from a config is a "
        "new value: dataclasses.replace(cfg, ...))"
    )

    from dataclasses import dataclass

    from kiln.registry import MODELS

    @dataclass
    class Standalone:
        name: str = "standalone"

    with pytest.raises(UserError, match=r"its config .*Standalone .* is a plain @dataclass: write"):
        MODELS.register("standalone", config=Standalone)(lambda spec, cfg, aux_head=False: None)
    assert "standalone" not in MODELS


def installed_plugin(folder, module: str = "my_parts") -> None:
    """`pip install my-parts` as importlib.metadata sees it: a dist-info advertising the
    module under the kiln.plugins entry-point group (the folder goes on PYTHONPATH)."""
    dist_info = folder / "my_parts-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-parts\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[kiln.plugins]\nparts = {module}\n")
    (dist_info / "top_level.txt").write_text(f"{module}\n")


def kiln_command(script: str, *args: str, cwd, pythonpath) -> subprocess.CompletedProcess:
    env = {**SUBPROCESS_ENV, "PYTHONPATH": str(pythonpath)}
    return run_python([sys.executable, str(REPO_ROOT / script), *args], cwd, env)


def test_an_installed_plugin_that_fails_to_import_is_named_and_skipped(user_project):
    """A broken plugin package stops no command that does not need it, --help included; a
    name it may have provided says why it is missing."""
    installed_plugin(user_project)
    (user_project / "my_parts.py").write_text("import not_a_dependency_here\n" + PLUGIN)
    project = user_project / "project"
    project.mkdir()
    why = (
        "the installed plugin 'parts' (my-parts 0.1, my_parts) failed to import: "
        "ModuleNotFoundError: No module named 'not_a_dependency_here'"
    )
    helped = kiln_command("train.py", "--help", cwd=project, pythonpath=user_project)
    assert helped.returncode == 0, helped.stderr
    assert "usage: python train.py" in helped.stdout and f"{why}; skipped" in helped.stderr
    other = kiln_command(
        "train.py",
        "trainer.max_steps=1",
        "logger=none",
        "env.progress_bar=false",
        "hydra.run.dir=run",
        cwd=project,
        pythonpath=user_project,
    )
    assert other.returncode == 0, other.stderr[-2000:]
    needed = kiln_command("train.py", "model=tiny", cwd=project, pythonpath=user_project)
    assert needed.returncode == 2
    assert needed.stderr.strip().splitlines()[-1] == (
        "error: unknown option 'tiny' (model): choose one of: "
        + ", ".join(kiln_names(MODELS))
        + f"; {why} (it may provide 'tiny')"
    )


def test_a_checkpoint_records_its_plugin_package_and_names_it_when_it_is_gone(user_project):
    installed_plugin(user_project)
    (user_project / "my_parts.py").write_text(
        PLUGIN + "\nfrom pathlib import Path\nfrom kiln.registry import register_config_dir\n"
        "register_config_dir(Path(__file__).parent / 'conf')\n"
    )
    project = user_project / "project"
    project.mkdir()
    trained = kiln_command(
        "train.py",
        "model=tiny",
        "data=blobs",
        "trainer.max_epochs=1",
        "logger=none",
        "env.progress_bar=false",
        "hydra.run.dir=run",
        cwd=project,
        pythonpath=user_project,
    )  # no plugins=[...]: the entry point brings it
    assert trained.returncode == 0, trained.stderr[-2000:]
    ckpt = project / "run" / "checkpoints" / "best.pt"
    import numpy as np
    import torch

    recorded = torch.load(ckpt, weights_only=True)["plugins"]["packages"]
    assert recorded == {
        "my_parts": {"distribution": "my-parts", "version": "0.1", "entry_point": "parts"}
    }
    np.save(project / "x.npy", np.zeros((3, 1, 2, 2), dtype=np.float32))
    predicted = kiln_command(
        "infer.py", f"ckpt={ckpt}", "input=x.npy", cwd=project, pythonpath=user_project
    )
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    # uninstalled: one line naming the package and the command that brings it back
    (user_project / "my_parts.py").unlink()
    for dist_file in (user_project / "my_parts-0.1.dist-info").iterdir():
        dist_file.unlink()
    (user_project / "my_parts-0.1.dist-info").rmdir()
    gone = kiln_command(
        "infer.py", f"ckpt={ckpt}", "input=x.npy", cwd=project, pythonpath=user_project
    )
    assert gone.returncode == 2 and gone.stderr.strip().splitlines() == [
        "error: checkpoint best.pt was trained with the plugin 'my_parts' from the package "
        "my-parts==0.1 (entry point 'parts'), which is not installed here; install it: "
        "pip install 'my-parts==0.1'"
    ]


LAZY_PLUGIN = '''
"""The entry-point module: torch-free, so listing options and --help stay fast."""
from dataclasses import dataclass

from kiln.config.model import ClassifierConfig
from kiln.registry import MODELS


@dataclass(frozen=True, kw_only=True)
class LazyConfig(ClassifierConfig):
    """A model whose builder (and torch) is imported only when it is built."""

    width: int = 8  # hidden width


MODELS.declare("lazy", "lazy_parts_models:build_lazy", config=LazyConfig)
'''


def test_a_plugin_can_register_without_importing_torch(tmp_path):
    """What docs/ shows plugin authors: declare the builder by its import path."""
    (tmp_path / "lazy_parts.py").write_text(LAZY_PLUGIN)
    (tmp_path / "lazy_parts_models.py").write_text(
        "import torch\n\ndef build_lazy(spec, cfg, *, aux_head=False):\n"
        "    return torch.nn.Linear(4, spec.num_classes)\n"
    )
    installed_plugin(tmp_path, module="lazy_parts")
    result = fresh_python(
        """
        import sys
        sys.path.insert(0, ".")
        from kiln.registry import MODELS, load_plugins
        load_plugins()
        print("lazy" in MODELS.names(), "torch" in sys.modules)
        MODELS.get("lazy")
        print("torch" in sys.modules)
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False", "True"]
