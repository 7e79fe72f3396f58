"""Every option of every config group composes, validates and builds; mistakes fail at start-up."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from kiln.cli.paths import CONF_DIR, REPO_ROOT
from kiln.config.schema import ConfigError, validate
from kiln.data import build_data, example_batch
from kiln.engine.optim import build_optimizer, build_scheduler
from kiln.engine.precision import resolve_precision
from kiln.models import build_model

from .conftest import SUBPROCESS_ENV, compose_config

GROUPS = [
    "data",
    "model",
    "optimizer",
    "scheduler",
    "precision",
    "env",
    "trainer",
    "logger",
    "loss",
    "debug",
    "experiment",
    "hparams_search",
]
SMALL_DATA = ("data.num_train=32", "data.num_val=16")
DATA_FOR_MODEL = {
    "text_bow": "csv_text",
    "text_transformer": "csv_text",
    "detector": "shapes_detection",
}
MODEL_FOR_DATA = {"csv_text": "text_bow", "shapes_detection": "detector"}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


ALL_OPTIONS = [(group, option) for group in GROUPS for option in options(group)]


def test_contract_options_exist():
    for group, required in {
        "data": {"digits", "synthetic_images", "csv_text", "shapes_detection"},
        "model": {"mlp", "resnet18", "resnet50", "text_bow", "text_transformer", "detector"},
        "optimizer": {"adamw", "sgd"},
        "scheduler": {"onecycle", "cosine", "none"},
        "precision": {"fp32", "amp", "bf16"},
        "env": {"experiment", "production"},
        "trainer": {"default", "ddp"},
        "logger": {"csv", "tensorboard", "wandb", "none"},
        "debug": {"none", "fast_dev_run", "overfit_batch", "activations"},
    }.items():
        assert required <= set(options(group)), group


def overrides_for(group: str, option: str) -> list[str]:
    extra = [f"{group}={option}"]
    if group == "model":
        extra.append(f"data={DATA_FOR_MODEL.get(option, 'digits')}")
    if group == "data":
        extra.append(f"model={MODEL_FOR_DATA.get(option, 'mlp')}")
    if group in ("data", "model"):
        extra += SMALL_DATA
    return extra


def forward(model, batch):
    inputs, targets = batch
    if getattr(model, "computes_own_loss", False):
        model.eval()
        return model(inputs)
    return model(inputs)


@pytest.mark.parametrize(("group", "option"), ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_option_composes_validates_and_builds(group, option):
    cfg = compose_config(*overrides_for(group, option))
    validate(cfg)
    bundle = build_data(cfg.data)
    model = build_model(bundle.spec, cfg.model)
    batch = example_batch(bundle, batch_size=2)
    with torch.no_grad():
        output = forward(model, batch)
    if bundle.spec.task == "classification":
        logits = output["logits"] if isinstance(output, dict) else output
        assert logits.shape == (2, bundle.spec.num_classes)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.scheduler, total_steps=10)
    assert (scheduler is None) == (cfg.scheduler.name == "none")
    assert resolve_precision(cfg.precision.name, torch.device("cpu")).name == cfg.precision.name


def test_unknown_group_option_names_the_valid_choices():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("model=resnet19")
    message = str(info.value)
    assert "resnet19" in message and "resnet18" in message and "mlp" in message


def test_unknown_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("trainer.max_epoch=3")
    assert "max_epoch" in str(info.value)


def test_unknown_key_added_with_plus_is_rejected_by_validation():
    cfg = compose_config("+trainer.colour=blue")  # Hydra lets `+` add keys to typed nodes
    with pytest.raises(ConfigError, match="unknown key trainer.colour; TrainerConfig has: "):
        validate(cfg)


def test_unknown_key_in_a_yaml_file_fails_at_composition(tmp_path):
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "trainer" / "typo.yaml").write_text("name: typo\nmax_epoks: 3\n")
    with (
        initialize_config_dir(config_dir=str(conf), version_base="1.3"),
        pytest.raises(ConfigCompositionException) as info,
    ):
        compose(config_name="config", overrides=["trainer=typo"])
    assert "max_epoks" in f"{info.value} {info.value.__cause__}"


def test_wrong_type_fails_at_composition():
    with pytest.raises((ConfigCompositionException, ValidationError)) as info:
        compose_config("trainer.max_epochs=ten")
    text = f"{info.value} {info.value.__cause__}"
    assert "max_epochs" in text and "ten" in text


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.nan_policy=explode", "fail, skip"),
        ("device=tpu", "auto, cpu, cuda"),
        ("model.init=orthogonal", "default, kaiming, xavier"),
        ("data.batch_size=0", "data.batch_size must be >= 1"),
        ("logger.backends=[csv,mlflow]", "csv, tensorboard, wandb"),
        ("model.name=vgg", "known: "),
    ],
)
def test_validate_names_the_valid_choices(override, expected):
    cfg = compose_config(override)
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[")):
        validate(cfg)


def test_production_env_refuses_debug_tools():
    cfg = compose_config("env=production", "debug=activations")
    with pytest.raises(ConfigError, match="not allowed in env=production"):
        validate(cfg)


def test_production_profile_is_deterministic_and_quiet():
    cfg = compose_config("env=production")
    assert cfg.trainer.deterministic and cfg.env.quiet and not cfg.env.progress_bar
    assert cfg.env.require_best_checkpoint
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        hydra_cfg = compose("config", overrides=["env=production"], return_hydra_config=True)
    assert hydra_cfg.hydra.run.dir.startswith("outputs/production/digits-mlp/")


def test_named_experiment_pins_its_groups():
    cfg = compose_config("experiment=digits_resnet18")
    assert (cfg.name, cfg.model.name, cfg.data.name, cfg.seed) == (
        "digits_resnet18",
        "resnet18",
        "digits",
        7,
    )


def test_help_lists_groups_and_options():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "--help"],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for group in ("data", "model", "optimizer", "scheduler", "precision", "env", "trainer"):
        assert f"{group}:" in result.stdout
    assert "resnet50" in result.stdout and "synthetic_images" in result.stdout


def test_typo_on_the_command_line_fails_before_any_work(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "train.py"),
            f"hydra.run.dir={tmp_path}/run",
            "optimizer=adamx",
        ],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert result.returncode != 0
    assert "adamw" in result.stderr and "sgd" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
