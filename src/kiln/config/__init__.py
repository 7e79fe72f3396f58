"""Typed configs. Every group option merges onto its own dataclass (the schema its registry entry
names, stored in Hydra's ConfigStore as schema/<group>/<option>), so a key that belongs to another
option, a wrong type or an unknown choice fails when the config is composed, before any work.

    cfg = load_config(["model=resnet18", "trainer.max_epochs=3"])   # a KilnConfig
    cfg.model                                                        # a ResNetConfig

Composition and validation errors are ConfigError: one line naming the key and what to do."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import os
import re
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kiln.config.base import (
    ConfigError,
    check_tree,
    composable,
    expand_user_paths,
    field_help,
    frozen,
    schema_of,
)
from kiln.config.data import DataConfig
from kiln.config.model import ModelConfig
from kiln.config.optim import OptimizerConfig, SchedulerConfig
from kiln.config.run import (
    DebugConfig,
    EnvConfig,
    KilnConfig,
    LoggerConfig,
    LossConfig,
    PrecisionConfig,
    TrainerConfig,
)
from kiln.errors import did_you_mean
from kiln.registry import GROUP_REGISTRIES, skipped_plugins

REPO_ROOT = Path(__file__).resolve().parents[3]
CONF_DIR = Path(os.environ.get("KILN_CONF_DIR", REPO_ROOT / "conf"))
SCHEMA_GROUP = "schema"  # schema/<group>/<option> in the ConfigStore
# Groups with one schema for all their options (their options are YAML files only).
GROUP_SCHEMAS: dict[str, type] = {
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "loss": LossConfig,
    "env": EnvConfig,
    "debug": DebugConfig,
}


# What the ConfigStore holds already: (group, option, schema class). Storing a schema converts
# it to an OmegaConf node (about 0.2 s for all of them), so each is stored once per process; a
# plugin's new option, or an option registered again with another schema, is stored then.
_stored: set[tuple[str | None, str, type]] = set()


def register_configs() -> None:
    """Store the top-level schema and every registered option's schema in the ConfigStore. The
    option itself is a YAML file, conf/<group>/<option>.yaml (or on hydra.searchpath)."""
    from hydra.core.config_store import ConfigStore

    share_the_config_store()
    build_choice_maps_only_where_read()
    store = ConfigStore.instance()

    def store_once(group: str | None, name: str, schema: type, node) -> None:
        if (group, name, schema) not in _stored:
            store.store(group=group, name=name, node=node)
            _stored.add((group, name, schema))

    store_once(None, "kiln_schema", KilnConfig, composable(KilnConfig))
    for group, registry in GROUP_REGISTRIES.items():
        for name in registry.names():
            schema = registry.entry(name).config
            twin = composable(schema)  # kiln.config.base: why a twin
            store_once(f"{SCHEMA_GROUP}/{group}", name, schema, twin(name=name))


def share_the_config_store() -> None:
    """Hydra 1.3 deep-copies its config repository at every composition (three per train.py),
    and the repository's structured-config source holds the ConfigStore singleton: every schema
    stored there was copied each time (a tenth of a composition's time), into a second
    "singleton". Hydra's main branch no longer holds the store there (facebookresearch/hydra
    pull request 2928); until a release has it, a copy of that source shares the one store."""
    from hydra._internal.core_plugins.structured_config_source import StructuredConfigSource

    if "__deepcopy__" not in vars(StructuredConfigSource):
        StructuredConfigSource.__deepcopy__ = lambda self, memo: copy.copy(self)


def build_choice_maps_only_where_read() -> None:
    """Hydra 1.3 builds an OmegaConf node of every group choice made so far at each config of
    the defaults tree (26 a kiln composition, a fifth of its time), and reads it only to
    resolve a defaults entry written as an interpolation (conf/config.yaml picks each schema
    so: `schema/model@model: ${model}`): here it is built for a config whose defaults list has
    such an entry, exactly as before, and for no other (tests/test_configs.py composes with
    and without this)."""
    from hydra._internal import defaults_list

    build = defaults_list._create_interpolation_map
    if getattr(build, "only_where_read", False):
        return

    def choice_map(overrides, defaults, self_added):
        if not any(
            not d.is_self() and not d.is_override() and d.is_interpolation() for d in defaults
        ):
            return None  # _create_defaults_tree_impl reads it for such an entry only
        return build(overrides, defaults, self_added)

    choice_map.only_where_read = True
    choice_map.built_by = build
    defaults_list._create_interpolation_map = choice_map


def compose(overrides: list[str] = (), *, hydra_config: bool = False) -> DictConfig:
    """The composed config (not yet typed-checked beyond Hydra's own merge)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import ConfigCompositionException

    register_configs()
    overrides = list(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose("config", overrides, return_hydra_config=hydra_config)
    except ConfigCompositionException as err:
        raise composition_error(err, overrides) from err


def load_config(overrides: list[str] = ()) -> KilnConfig:
    return to_typed(compose(overrides))


def load_config_and_mode(overrides: list[str] = ()) -> tuple[KilnConfig, Any]:
    """load_config, and the hydra.mode the composition sets (None where the command line's
    -m decides; an hparams_search option sets MULTIRUN): what Hydra.get_mode composes anew."""
    from omegaconf import open_dict

    composed = compose(overrides, hydra_config=True)
    mode = composed.hydra.mode
    with open_dict(composed):
        del composed["hydra"]
    return to_typed(composed), mode


@contextlib.contextmanager
def hydra_mode_known(mode: Any) -> Iterator[None]:
    """Within: Hydra's get_mode answers `mode` instead of composing the whole config once more
    (Hydra 1.3 composes three times per run: kiln's check, get_mode and the run; 0.2 s each).
    For a launch whose mode kiln's own composition read (load_config_and_mode)."""
    from hydra._internal.hydra import Hydra

    original = Hydra.get_mode

    def get_mode(self, config_name, overrides):
        return mode

    Hydra.get_mode = get_mode
    try:
        yield
    finally:
        Hydra.get_mode = original


def to_typed(cfg: DictConfig) -> KilnConfig:
    """The composed config as dataclasses, after every check: unknown keys (Hydra lets `+key`
    add them), values the types cannot hold, choices, ranges and cross-field rules."""
    from omegaconf.errors import OmegaConfBaseException

    check_known_keys(cfg)
    try:
        typed = frozen(OmegaConf.to_object(cfg))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or ""
        raise ConfigError("invalid value", key, _first_line(err)) from None
    typed = expand_user_paths(name_as_arch(typed))
    check_option_names(typed)
    check_pairing(typed)
    check_tree(typed)
    return typed


def to_plain(cfg: Any) -> dict[str, Any]:
    """A typed config as plain data (enums as their names, tuples as lists): safe in
    checkpoints and JSON, what OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True,
    enum_to_str=True) gives (tests/test_configs.py compares them for every option). A walk of
    the dataclasses: OmegaConf's nodes took 25 ms a config, four to five times a run."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return _plain(cfg)


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def option_from_dict(group: str, data: dict[str, Any]) -> Any:
    """Rebuild one group's typed config (e.g. a checkpoint's "model" section)."""
    registry = GROUP_REGISTRIES[group]
    twin = composable(registry.entry(data["name"]).config)
    merged = OmegaConf.merge(OmegaConf.structured(twin(name=data["name"])), data)
    return frozen(OmegaConf.to_object(merged))


def schema_defaults(group: str, option: str | None) -> dict[str, Any]:
    """A group's schema defaults as plain data: the dataclass's own values, not its YAML's
    (`option` picks the schema in a registry group, e.g. data=image_folder). These are the
    values a checkpoint saved before a key existed is read with (kiln.engine.resume), which is
    why a new key's schema default keeps what runs did before it. LookupError for a group or
    option kiln does not know."""
    if group in GROUP_SCHEMAS:
        node = OmegaConf.structured(GROUP_SCHEMAS[group])
    elif group in GROUP_REGISTRIES and option in GROUP_REGISTRIES[group].names():
        twin = composable(GROUP_REGISTRIES[group].entry(option).config)
        node = OmegaConf.structured(twin(name=option))
    else:
        raise LookupError(f"no schema for {group}={option}")
    return OmegaConf.to_container(node, resolve=False, enum_to_str=True)


# ---------------------------------------------------------------------------------------------
# Checks beyond what Hydra's merge enforces


def schema_keys(schema: type) -> list[str]:
    return [f.name for f in fields(schema)]


def check_known_keys(cfg: DictConfig, path: str = "") -> None:
    for key in cfg:
        node = cfg._get_node(key)
        if not isinstance(node, DictConfig):
            continue
        schema = schema_of(OmegaConf.get_type(node))
        if is_dataclass(schema):
            known = set(schema_keys(schema))
            for child in node:
                if child not in known:
                    raise unknown_key_error(f"{path}{key}.{child}", schema, node.get("name"))
            check_known_keys(node, f"{path}{key}.")


def name_as_arch(cfg: KilnConfig) -> KilnConfig:
    """`model=hf model.name=<folder>` (Hugging Face's model_name_or_path, timm's model_name): an
    option that takes `arch` reads an unregistered name as its arch. The checkpoint then holds
    name=hf, arch=<folder>, so a resume or infer.py builds the same model."""
    changes = {}
    for group, registry in GROUP_REGISTRIES.items():
        node = getattr(cfg, group)
        schema = type(node)
        options = [n for n in registry.names() if registry.entry(n).config is schema]
        if node.name in registry or len(options) != 1 or "arch" not in schema_keys(schema):
            continue
        default = next(f.default for f in fields(schema) if f.name == "arch")
        if node.arch not in (default, node.name):
            raise ConfigError(
                f"{group}.name={node.name!r} and {group}.arch={node.arch!r} name two models",
                f"{group}.name",
                f"{group}={options[0]} takes the model as {group}.arch (or {group}.name): "
                f"set one of them",
            )
        changes[group] = dataclasses.replace(node, name=options[0], arch=node.name)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def check_option_names(cfg: KilnConfig) -> None:
    """Each registry-backed group holds the schema of the option it names."""
    for group, registry in GROUP_REGISTRIES.items():
        node = getattr(cfg, group)
        entry = registry.entry(node.name) if node.name in registry else None
        if entry is None:
            raise ConfigError(
                f"{group}.name={node.name!r} is not a registered {registry.kind}",
                f"{group}.name",
                f"choose {group}=<option> from {', '.join(registry.names())}",
            )
        if type(node) is not entry.config:
            arch = f" (or set {group}.arch={node.name})" if hasattr(node, "arch") else ""
            raise ConfigError(
                f"{group}.name={node.name} does not match the {group} option's keys",
                f"{group}.name",
                f"choose the option with {group}={node.name} instead of setting {group}.name"
                + arch,
            )


def check_pairing(cfg: KilnConfig) -> None:
    """The model accepts the dataset's inputs (both declare them in their registry entries)."""
    from kiln.registry import compatible_pairs, dataset_provides, model_inputs

    provides, accepts = dataset_provides(cfg.data.name), model_inputs(cfg.model.name)
    if provides not in accepts:
        fits = sorted({m for m, d in compatible_pairs() if d == cfg.data.name})
        raise ConfigError(
            f"model={cfg.model.name} takes {' or '.join(accepts)} inputs but data={cfg.data.name} "
            f"gives {provides}",
            "model",
            f"models for data={cfg.data.name}: {', '.join(fits) or 'none registered'}",
        )


def unknown_key_error(key: str, schema: type, option: str | None) -> ConfigError:
    group, _, name = key.rpartition(".")
    known = [k for k in schema_keys(schema) if not (k == "name" and group in GROUP_REGISTRIES)]
    owners = _options_with_key(group, name)
    which = f"{group}={option}" if option and group in GROUP_REGISTRIES else group or "config"
    todo = f"{which} has: {', '.join(known)}"
    if owners:
        todo += f"; {name} belongs to {', '.join(f'{group}={o}' for o in owners)}"
    else:
        todo += did_you_mean(name, known, spell=lambda k: f"{group}.{k}" if group else k)
    return ConfigError("unknown key", key, todo)


def _options_with_key(group: str, key: str) -> list[str]:
    registry = GROUP_REGISTRIES.get(group)
    if registry is None:
        return []
    return [n for n in registry.names() if key in schema_keys(registry.entry(n).config)]


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def composition_error(err: Exception, overrides: list[str]) -> ConfigError:
    """Hydra's composition errors as one line naming the key or option and what to do."""
    text = str(err)
    cause = err.__cause__ or err.__context__
    found = re.search(r"Could not find '([\w/]+)/([^']+)'", text)
    if found and found.group(1).startswith(f"{SCHEMA_GROUP}/"):
        group, option = found.group(1).split("/", 1)[1], found.group(2)
        kind = GROUP_REGISTRIES[group].kind
        return ConfigError(
            f"{group}={option} has a YAML file but no registered {kind} {option!r}",
            group,
            f"register it with @register_{kind.replace(' ', '_')}({option!r}, config=...) in "
            "a module listed in plugins=[...]",
        )
    if found:
        group, option = found.group(1), found.group(2)
        choices = re.findall(r"^\t(\S+)$", text, flags=re.MULTILINE)
        hint = did_you_mean(option, choices, spell=lambda c: f"{group}={c}")
        hint += skipped_plugins(option)
        return ConfigError(
            f"unknown option {option!r}", group, f"choose one of: {', '.join(choices)}{hint}"
        )
    missing_key = re.search(r"Could not override '([\w.]+)'", text)
    if missing_key:
        return _unknown_override(missing_key.group(1), overrides)
    override = re.search(r"Error merging override (\S+)", text)
    if override:
        key, _, value = override.group(1).partition("=")
        return ConfigError("invalid value", key.lstrip("+~"), _first_line(cause or err))
    key_error = re.search(r"Key '(\w+)' not in '(\w+)'", f"{text} {cause}")
    if key_error:
        name, schema_name = key_error.groups()
        full_key = getattr(cause, "full_key", "") or name
        return ConfigError(
            f"unknown key {name!r} in a config file (no such field in {schema_name})",
            full_key,
            _first_line(err),
        )
    return ConfigError(_first_line(err), "", _first_line(cause) if cause else "")


def _unknown_override(key: str, overrides: list[str]) -> ConfigError:
    group, _, name = key.rpartition(".")
    others = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        node = compose(others).get(group) if group else None
    except ConfigError:
        node = None
    schema = schema_of(OmegaConf.get_type(node)) if isinstance(node, DictConfig) else None
    if schema is None or not is_dataclass(schema):
        return ConfigError("unknown key", key, "check the spelling (python train.py --help)")
    return unknown_key_error(key, schema, node.get("name"))


__all__ = [
    "CONF_DIR",
    "ConfigError",
    "DataConfig",
    "DebugConfig",
    "EnvConfig",
    "KilnConfig",
    "LoggerConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "REPO_ROOT",
    "SchedulerConfig",
    "TrainerConfig",
    "compose",
    "field_help",
    "load_config",
    "option_from_dict",
    "register_configs",
    "to_plain",
    "to_typed",
]
