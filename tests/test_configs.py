"""Every option of every config group composes, validates and builds; mistakes fail at start-up,
as one line naming the key, the option and what is valid."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from kiln.cli.help import group_options
from kiln.cli.paths import CONF_DIR, REPO_ROOT
from kiln.config import ConfigError, register_configs
from kiln.data import build_data, example_batch
from kiln.engine.loss import build_criterion
from kiln.engine.optim import build_optimizer, build_scheduler
from kiln.engine.precision import resolve_precision
from kiln.models import build_model, logits_of
from kiln.registry import DATASETS, GROUP_REGISTRIES, MODELS, config_dirs

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
DETECTION = REPO_ROOT / "examples/detection"  # kiln.data.photo_boxes' folder
SMALL_DATA = {
    "synthetic_images": ("data.num_train=32", "data.num_val=16"),
    "image_folder": (f"data.train_dir={REPO_ROOT / 'examples/photos/train'}", "data.image_size=32"),
    "shapes_detection": ("data.num_train=4", "data.num_val=2"),
    "coco": (
        f"data.train_json={DETECTION / 'coco/train.json'}",
        f"data.train_images={DETECTION / 'coco/images/train'}",
    ),
    "yolo": (f"data.train_dir={DETECTION / 'yolo/images/train'}",),
}
DATA_FOR_MODEL = {"text_bow": "csv_text", "text_transformer": "csv_text", "hf": "csv_text"}
MODEL_FOR_DATA = {
    "csv_text": "text_bow",
    "shapes_detection": "detector",
    "coco": "detector",
    "yolo": "detector",
}


def yaml_options(group: str) -> list[str]:
    """The group's option files: kiln's conf/, and the folders plugins register (a user's
    `KILN_PLUGINS=my_parts make test` brings theirs)."""
    folders = [CONF_DIR, *(Path(d.removeprefix("file://")) for d in config_dirs())]
    return sorted({p.stem for folder in folders for p in (folder / group).glob("*.yaml")})


ALL_OPTIONS = [(group, option) for group in GROUPS for option in yaml_options(group)]


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
        assert required <= set(yaml_options(group)), group


@pytest.mark.parametrize("group", sorted(GROUP_REGISTRIES))
def test_a_groups_choices_are_its_registry_names(group):
    """One place for the choices: every registered entry has its YAML and every YAML an entry."""
    assert yaml_options(group) == GROUP_REGISTRIES[group].names() == group_options(group)


def data_for_model(model: str) -> str:
    spec_kind = {"detector": "shapes_detection", "torchvision_detection": "shapes_detection"}
    return spec_kind.get(model, DATA_FOR_MODEL.get(model, "digits"))


def overrides_for(group: str, option: str) -> list[str]:
    extra = [f"{group}={option}"]
    data = option if group == "data" else data_for_model(option) if group == "model" else None
    if group == "model":
        extra.append(f"data={data}")
    if group == "data":
        extra.append(f"model={MODEL_FOR_DATA.get(option, 'mlp')}")
    return extra + list(SMALL_DATA.get(data, ()))


@pytest.mark.parametrize(("group", "option"), ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_option_composes_validates_and_builds(group, option):
    cfg = compose_config(*overrides_for(group, option))
    bundle = build_data(cfg.data)
    model = build_model(bundle.spec, cfg.model)
    batch = example_batch(bundle, batch_size=2)
    model.eval()
    with torch.no_grad():  # called the way the engine calls it
        output = build_criterion(model, cfg.loss).forward(model, batch, train_mode=False)
    if bundle.spec.task == "classification":
        assert logits_of(output).shape == (2, bundle.spec.num_classes)
    else:
        assert len(output) == 2 and {"boxes", "labels", "scores"} <= set(output[0])
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.scheduler, total_steps=10)
    assert (scheduler is None) == (cfg.scheduler.name == "none")
    assert resolve_precision(cfg.precision.name, torch.device("cpu")).name == cfg.precision.name


def typed_leaves(value, path=""):
    """(path, type, value) of every leaf: 1 and 1.0, or a tuple and a list, differ here."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in typed_leaves(item, f"{path}.{key}")]
    if isinstance(value, list):
        return [("len", path, len(value))] + [
            leaf for i, item in enumerate(value) for leaf in typed_leaves(item, f"{path}[{i}]")
        ]
    return [(path, type(value), value)]


@pytest.mark.parametrize(("group", "option"), ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_to_plain_gives_what_omegaconf_gives_for_every_option(group, option):
    """kiln.config.to_plain walks the dataclasses; checkpoints, JSON and resume's contract read
    what OmegaConf's structured nodes gave before it, the same values of the same types."""
    from omegaconf import OmegaConf

    from kiln.config import to_plain

    cfg = compose_config(*overrides_for(group, option))
    omegaconf = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    assert typed_leaves(to_plain(cfg)) == typed_leaves(omegaconf)
    assert typed_leaves(to_plain(cfg.model)) == typed_leaves(omegaconf["model"])


@pytest.mark.parametrize("name", ["amp", "bf16", "fp32"])
def test_bf16_on_a_cpu_without_bf16_instructions_says_fp32_is_faster(name, caplog):
    """oneDNN emulates bf16 where the CPU has no bf16 instructions (this CI machine's AVX2):
    a convolution 65 times an fp32 one. The run says so once, at the build."""
    from kiln.device import cpu_runs_natively

    with caplog.at_level("WARNING", logger="kiln.engine.precision"):
        precision = resolve_precision(name, torch.device("cpu"))
    said = [r.getMessage() for r in caplog.records]
    emulated = precision.autocast_dtype == torch.bfloat16 and not cpu_runs_natively(torch.bfloat16)
    assert said == ([said[0]] if emulated else [])
    if emulated:
        assert said[0].startswith(f"precision={name} runs in bf16 on a CPU without bf16 ")
        assert "precision=fp32 trains faster on this machine" in said[0]


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        compose_config(*overrides)
    return str(info.value)


def test_unknown_group_option_names_the_valid_choices():
    message = config_error("model=resnet19")
    assert message.startswith("unknown option 'resnet19' (model): choose one of: ")
    assert "mlp" in message and "did you mean model=resnet18?" in message


@pytest.mark.parametrize(
    ("override", "option", "owner"),
    [
        ("data.vocab_size=3", "data=digits", "data=csv_text"),
        ("model.num_heads=8", "model=mlp", "model=text_transformer"),
        ("optimizer.momentum=0.5", "optimizer=adamw", "optimizer=sgd"),
        ("scheduler.warmup_steps=5", "scheduler=onecycle", "scheduler=cosine"),
    ],
)
def test_a_key_of_another_option_fails_naming_the_option_and_its_keys(override, option, owner):
    for form in (override, f"+{override}"):  # Hydra's `+` would add it: refused all the same
        message = config_error(form)
        key = override.split("=")[0]
        assert message.startswith(f"unknown key ({key}): {option} has: "), message
        assert f"belongs to {owner}" in message
    assert "name," not in config_error("model.num_heads=8")  # not a key a user sets


def test_unknown_key_suggests_the_closest():
    message = config_error("trainer.max_epoch=3")
    assert "unknown key (trainer.max_epoch)" in message and "trainer.max_epochs?" in message


def test_unknown_key_in_a_yaml_file_fails_at_composition(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "trainer" / "typo.yaml").write_text("name: typo\nmax_epoks: 3\n")
    register_configs()
    with (
        initialize_config_dir(config_dir=str(conf), version_base="1.3"),
        pytest.raises(Exception) as info,
    ):
        compose(config_name="config", overrides=["trainer=typo"])
    assert "max_epoks" in f"{info.value} {info.value.__cause__}"


def test_a_yaml_option_without_a_registered_builder_says_how_to_register_it(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "model" / "mine.yaml").write_text("dropout: 0.1\n")
    from kiln.config import composition_error

    register_configs()
    with (
        initialize_config_dir(config_dir=str(conf), version_base="1.3"),
        pytest.raises(Exception) as info,
    ):
        compose(config_name="config", overrides=["model=mine"])
    message = str(composition_error(info.value, ["model=mine"]))
    assert "model=mine has a YAML file but no registered model 'mine'" in message
    assert "@register_model('mine'" in message and "plugins=[...]" in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.max_epochs=ten", "invalid value (trainer.max_epochs): Value 'ten'"),
        ("trainer.nan_policy=explode", "expected one of [fail, skip]"),
        ("device=tpu", "expected one of [auto, cpu, cuda]"),
        ("model.init=orthogonal", "expected one of [default, kaiming, xavier]"),
        ("data.batch_size=0", "invalid value (data.batch_size): must be >= 1, got 0"),
        ("logger.backends=[csv,mlflow]", "choose from csv, tensorboard, wandb"),
        ("model.name=vgg", "choose model=<option> from detector, hf, mlp"),
        ("model.name=resnet18", "choose the option with model=resnet18"),
        ("trainer.max_steps=0", "must be -1 (no limit) or >= 1, got 0"),
        ("trainer.limit_train_batches=0", "must be -1 (no limit) or >= 1, got 0"),
        ("trainer.keep_last_k=-1", "must be >= 0, got -1"),
        ("optimizer.lr=-1", "invalid value (optimizer.lr): must be > 0, got -1"),
        ("data.val_fraction=1.5", "invalid value (data.val_fraction): must be in (0, 1)"),
        ("trainer.gradient_clip_val=0", "or null to switch clipping off"),
    ],
)
def test_invalid_values_name_the_key_and_what_is_valid(override, expected):
    assert expected in config_error(override)


def test_cross_field_rule_names_valid_values():
    message = config_error("model=text_transformer", "data=csv_text", "model.num_heads=5")
    assert "(model.num_heads): choose num_heads in [1, 2, 4, 8" in message


def test_production_env_refuses_debug_tools():
    assert "debug=activations is not allowed in env=production" in config_error(
        "env=production", "debug=activations"
    )


def test_production_profile_is_deterministic_and_quiet():
    cfg = compose_config("env=production")
    assert cfg.trainer.deterministic and cfg.env.quiet and not cfg.env.progress_bar
    assert cfg.env.require_best_checkpoint
    from kiln.config import compose as compose_raw

    hydra_cfg = compose_raw(["env=production"], hydra_config=True)
    assert hydra_cfg.hydra.run.dir.startswith("outputs/production/digits-mlp/")


def test_named_experiment_pins_its_groups():
    cfg = compose_config("experiment=digits_resnet18")
    assert (cfg.name, cfg.model.name, cfg.data.name, cfg.seed) == (
        "digits_resnet18",
        "resnet18",
        "digits",
        7,
    )
    assert type(cfg.model).__name__ == "ResNetConfig"  # the experiment's option brings its schema


def test_debug_modes_are_trainer_overrides():
    fast = compose_config("debug=fast_dev_run", "trainer.accumulate_grad_batches=3").trainer
    assert (fast.max_steps, fast.limit_val_batches, fast.limit_train_batches) == (1, 1, 3)
    assert compose_config("debug=overfit_batch").trainer.overfit_batches == 1
    assert compose_config("debug=activations").trainer.log_activations


def test_every_schema_field_has_a_meaning():
    """--help GROUP=OPTION shows a one-line meaning for every key: none may be missing."""
    from kiln.config import GROUP_SCHEMAS, KilnConfig, field_help

    schemas = [KilnConfig, *GROUP_SCHEMAS.values()]
    schemas += [r.entry(n).config for r in GROUP_REGISTRIES.values() for n in r.names()]
    for schema in schemas:
        meanings = field_help(schema)
        undocumented = [f.name for f in fields(schema) if not meanings.get(f.name)]
        assert undocumented == [], schema.__name__


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), *args],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )


def test_help_lists_every_group_with_the_registry_choices_and_an_options_keys():
    plugins = [m for m in os.environ.get("KILN_PLUGINS", "").split(",") if m]
    overview = run_cli("--help", *([f"plugins=[{','.join(plugins)}]"] if plugins else []))
    assert overview.returncode == 0, overview.stderr
    for group in GROUPS:
        assert f"\n  {group} " in overview.stdout
    models = next(line for line in overview.stdout.splitlines() if line.startswith("  model "))
    assert (
        models.split()[1:]
        == " | ".join(f"{n}*" if n == "mlp" else n for n in MODELS.names()).split()
    )
    assert all(name in overview.stdout for name in DATASETS.names())
    keys = run_cli("--help", "model=text_transformer")
    assert keys.returncode == 0, keys.stderr
    assert "num_heads                  4                attention heads per layer" in keys.stdout
    assert "dropout" in keys.stdout and "vocab_size" not in keys.stdout


def test_typo_on_the_command_line_fails_before_any_work(tmp_path):
    result = run_cli(f"hydra.run.dir={tmp_path}/run", "optimizer=adamx")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: unknown option 'adamx' (optimizer): choose one of: adamw, sgd; "
        "did you mean optimizer=adamw?"
    ]
    assert not (tmp_path / "run").exists()


def _schemas() -> list[type]:
    """Every schema the ConfigStore holds (kiln_schema and each group option's) and the
    dataclasses nested in them."""
    import typing
    from dataclasses import is_dataclass

    from kiln.config import GROUP_SCHEMAS, KilnConfig

    found: list[type] = []
    todo = [KilnConfig, *GROUP_SCHEMAS.values()]
    todo += [r.entry(n).config for r in GROUP_REGISTRIES.values() for n in r.names()]
    while todo:
        schema = todo.pop()
        if schema in found:
            continue
        found.append(schema)
        hints = typing.get_type_hints(schema)
        todo += [hints[f.name] for f in fields(schema) if is_dataclass(hints[f.name])]
    return sorted(found, key=lambda schema: schema.__qualname__)


@pytest.mark.parametrize("schema", _schemas(), ids=lambda schema: schema.__qualname__)
def test_every_schema_is_frozen_after_composition(schema):
    """What the composition root derives is a new value (dataclasses.replace), never an
    assignment into the config a run was started with."""
    import dataclasses

    default = {"name": "x"} if "name" in {f.name for f in fields(schema)} else {}
    value = schema(**default)
    field = fields(schema)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, field.name, getattr(value, field.name))
    assert all(f.kw_only for f in fields(schema)), f"{schema.__qualname__}: keywords only"


@pytest.mark.parametrize("schema", _schemas(), ids=lambda schema: schema.__qualname__)
def test_hydra_composes_a_mutable_twin_of_every_schema(schema):
    """The twin Hydra composes (kiln.config.base.composable) has the schema's name, fields,
    defaults and bases, and freezes back into the schema; omegaconf itself is not patched."""
    import dataclasses
    import pickle

    from omegaconf import _utils, dictconfig

    from kiln.config.base import composable, frozen, schema_of

    assert dictconfig.is_structured_config_frozen is _utils.is_structured_config_frozen
    twin = composable(schema)
    assert twin is not schema and schema_of(twin) is schema and twin.__name__ == schema.__name__
    assert not twin.__dataclass_params__.frozen and pickle.loads(pickle.dumps(twin)) is twin
    ours, theirs = fields(schema), fields(twin)
    assert [f.name for f in theirs] == [f.name for f in ours]
    assert [f.default for f in theirs] == [f.default for f in ours]
    for base in schema.__bases__:
        if dataclasses.is_dataclass(base):
            assert issubclass(twin, composable(base))
    default = {"name": "x"} if "name" in {f.name for f in ours} else {}
    value = twin(**default)
    setattr(value, ours[0].name, getattr(value, ours[0].name))  # a twin is writable
    assert frozen(value) == schema(**default) and type(frozen(value)) is schema


def test_a_composed_config_is_frozen_through_the_tree():
    import dataclasses

    cfg = compose_config("trainer.max_epochs=1")
    for node, key in [
        (cfg, "seed"),
        (cfg.data, "batch_size"),
        (cfg.trainer, "max_epochs"),
        (cfg.model, "name"),
        (cfg.trainer.fsdp, "min_block_params"),
    ]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(node, key, getattr(node, key))


def test_hydras_repository_copy_shares_the_one_config_store():
    """Hydra deep-copies its config repository at every composition; the structured source in
    it shares the ConfigStore (kiln.config.share_the_config_store): no schema is copied, and an
    option stored after the copy was made is found through it."""
    import copy

    from hydra._internal.core_plugins.structured_config_source import StructuredConfigSource
    from hydra.core.config_store import ConfigStore

    register_configs()
    clone = copy.deepcopy(StructuredConfigSource(provider="kiln-test", path="structured://"))
    assert clone.store is ConfigStore.instance()
    ConfigStore.instance().store(group="kiln_test_late", name="late", node={"x": 1})
    try:
        assert clone.load_config("kiln_test_late/late").config.x == 1
    finally:
        ConfigStore.instance().repo.pop("kiln_test_late")


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model=resnet18", "data=synthetic_images", "optimizer=sgd", "scheduler=cosine"),
        ("data=csv_text", "model=text_transformer", "precision=bf16", "env=production"),
        ("hparams_search=digits_optuna", "hydra/launcher=joblib"),
    ],
)
def test_hydra_composes_the_same_with_its_choice_maps_built_only_where_read(overrides, monkeypatch):
    """kiln.config.build_choice_maps_only_where_read: every node of the composed config,
    Hydra's own included, as Hydra builds it with a choice map at every config."""
    from hydra._internal import defaults_list
    from omegaconf import OmegaConf

    from kiln.config import compose as kiln_compose

    register_configs()
    assert defaults_list._create_interpolation_map.only_where_read
    as_read = OmegaConf.to_container(kiln_compose(list(overrides), hydra_config=True))
    monkeypatch.setattr(
        defaults_list, "_create_interpolation_map", defaults_list._create_interpolation_map.built_by
    )
    as_built = OmegaConf.to_container(kiln_compose(list(overrides), hydra_config=True))
    for runtime in (as_read, as_built):
        runtime["hydra"]["runtime"].pop("cwd")
    assert as_read == as_built


def test_a_defaults_entry_written_as_an_interpolation_still_resolves(tmp_path):
    """Where a defaults list names an option by interpolation, its choice map is built."""
    for group, option in [
        ("db", "mysql"),
        ("db", "postgres"),
        ("server", "mysql"),
        ("server", "postgres"),
    ]:
        (tmp_path / group).mkdir(exist_ok=True)
        (tmp_path / group / f"{option}.yaml").write_text(f"{group}_is: {option}\n")
    (tmp_path / "app.yaml").write_text("defaults:\n  - db: mysql\n  - server: ${db}\n  - _self_\n")
    register_configs()
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        composed = compose("app", ["db=postgres"])
    assert composed.db.db_is == "postgres" and composed.server.server_is == "postgres"


@pytest.mark.parametrize(
    ("overrides", "mode"), [((), None), (("hparams_search=digits_optuna",), "MULTIRUN")]
)
def test_train_py_reads_hydras_mode_from_its_own_composition(overrides, mode):
    """train.py composes the config once to check it, and Hydra's get_mode composed it once
    more only to read hydra.mode: kiln reads it from its own composition (an hparams_search
    option sets MULTIRUN, without -m) and Hydra's get_mode answers it while the run starts."""
    from hydra._internal.hydra import Hydra

    from kiln.cli.train import mode_is_read
    from kiln.config import hydra_mode_known, load_config, load_config_and_mode

    cfg, read = load_config_and_mode(list(overrides))
    assert (None if read is None else read.name) == mode
    assert cfg == load_config(list(overrides))  # the same typed config, hydra's node dropped
    real = Hydra.get_mode
    with hydra_mode_known(read):
        assert Hydra.get_mode(None, "config", []) is read
    assert Hydra.get_mode is real
    assert mode_is_read(["model=mlp", "hydra.run.dir=x"])
    for unread in (["-m", "model=mlp"], ["hydra.mode=MULTIRUN"], ["hydra/launcher=joblib_local"]):
        assert not mode_is_read(unread), unread


def test_the_tests_compose_a_config_again_when_an_option_it_chose_is_registered_anew():
    """tests/conftest.compose_config composes the same overrides once per process: each caller
    gets its own copy, and the key holds the registry entry of each option the composition
    chose (a test registers a model of its own, under a name another test used)."""
    import dataclasses

    from .conftest import chosen_entries

    cfg = compose_config("model=mlp")
    assert cfg == compose_config("model=mlp") and cfg is not compose_config("model=mlp")
    chosen = chosen_entries(cfg)
    original = MODELS._entries["mlp"]
    MODELS._entries["mlp"] = dataclasses.replace(original)  # registered anew
    try:
        assert chosen_entries(cfg) != chosen
    finally:
        MODELS._entries["mlp"] = original
    assert chosen_entries(cfg) == chosen
