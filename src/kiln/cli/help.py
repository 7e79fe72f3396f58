"""`python train.py --help [GROUP[=OPTION]]`: the groups and their options, or one option's keys
with their defaults and meanings. Answered from the registries, the schemas and conf/, without
importing torch."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from kiln.config import CONF_DIR, GROUP_SCHEMAS, ConfigError, KilnConfig, compose, field_help
from kiln.config.base import schema_of
from kiln.registry import GROUP_REGISTRIES

GROUP_ORDER = (
    "data",
    "model",
    "optimizer",
    "scheduler",
    "precision",
    "trainer",
    "logger",
    "loss",
    "env",
    "debug",
    "experiment",
    "hparams_search",
)
EXAMPLES = """examples:
  python train.py model=resnet18 precision=amp trainer.max_epochs=3
  python train.py --help model=text_transformer      # the keys of one option
  python train.py -m data.num_workers=0,2 precision=fp32,amp
  torchrun --nproc_per_node=2 train.py trainer=ddp
  python train.py --cfg job                          # the composed config, without running"""


def group_options(group: str) -> list[str]:
    """A group's choices: its registry's names, or (for config-only groups) its YAML files."""
    if group in GROUP_REGISTRIES:
        return GROUP_REGISTRIES[group].names()
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def defaults() -> dict[str, str]:
    """The option each group takes when the command line names none."""
    chosen = {}
    primary = OmegaConf.load(CONF_DIR / "config.yaml")
    for item in OmegaConf.to_container(primary.defaults, resolve=False):
        if isinstance(item, dict):
            for key, value in item.items():
                if "@" not in key and not key.startswith("schema/"):
                    chosen[key] = value
    return chosen


def overview() -> str:
    chosen = defaults()
    lines = [
        "kiln: train, sweep, export and serve PyTorch models.",
        "usage: python train.py [GROUP=OPTION ...] [KEY=VALUE ...] [-m]",
        "",
        "groups (* marks the default; `--help GROUP=OPTION` lists an option's keys):",
    ]
    for group in GROUP_ORDER:
        options = [f"{o}*" if o == chosen.get(group) else o for o in group_options(group)]
        lines.append(f"  {group:<15} {' | '.join(options)}")
    lines += ["", "run-wide keys:"]
    meanings = field_help(KilnConfig)
    for f in fields(KilnConfig):
        if f.name not in GROUP_ORDER:  # groups are listed above
            lines.append(f"  {f.name:<15} {meanings.get(f.name, '')}")
    return "\n".join(lines + ["", EXAMPLES])


@dataclass(frozen=True)
class OptionKeys:
    """One option's keys as `--help GROUP=OPTION` prints them (and docs/config-reference.md)."""

    group: str
    option: str
    title: str = ""  # the schema's docstring, first line
    about: str = ""  # ... its first paragraph
    keys: tuple[tuple[str, str, str], ...] = ()  # (key, default as typed, meaning)
    note: str | None = None  # the registry entry's help, if any
    yaml: Path | None = None  # a config-only option (env, debug, ...): its file
    text: str = ""  # ... and its text


# Groups whose options are plain YAML files with no schema of their own: their text is their keys.
CONFIG_ONLY = ("env", "debug", "experiment", "hparams_search")


def option_keys(group: str, option: str = "") -> OptionKeys:
    """`group` or `group=option` -> its keys with defaults and meanings (a plugin's options
    too: their YAML folders are on the search path, kiln.registry.register_config_dir)."""
    if group not in GROUP_ORDER:
        raise ConfigError(f"unknown group {group!r}", "--help", f"groups: {', '.join(GROUP_ORDER)}")
    option = option or defaults().get(group, "")
    path = CONF_DIR / group / f"{option}.yaml"
    if group in CONFIG_ONLY and path.is_file():  # its text as it stands: no composition needed
        return OptionKeys(group, option, yaml=path, text=path.read_text())
    cfg = compose([f"{group}={option}"] if option else [])
    node = cfg.get(group)
    if group in CONFIG_ONLY or not isinstance(node, DictConfig):
        if path.is_file():
            return OptionKeys(group, option, yaml=path, text=path.read_text())
        return OptionKeys(group, option, text=OmegaConf.to_yaml(node))
    schema = schema_of(OmegaConf.get_type(node))
    meanings = field_help(schema)
    title = (schema.__doc__ or "").strip().splitlines()[0] if schema.__doc__ else ""
    about = " ".join((schema.__doc__ or "").strip().split("\n\n")[0].split())
    keys = tuple(
        (key, _show(node._get_node(key)), meanings.get(key, ""))
        for key in node
        if not (key == "name" and group in GROUP_REGISTRIES)
    )
    note = (
        GROUP_REGISTRIES[group].entry(option).meta.get("help")
        if group in GROUP_REGISTRIES
        else None
    )
    return OptionKeys(group, option, title, about, keys, note)


def describe(target: str) -> str:
    """`group` or `group=option` -> its keys with defaults and meanings, as text."""
    group, _, option = target.partition("=")
    found = option_keys(group, option)
    if found.text:  # a config-only option: its YAML as it stands
        where = found.yaml if found.yaml is not None else "composed"
        return f"{group}={found.option} ({where}):\n" + found.text
    lines = [f"{group}={found.option}: {found.title}", f"keys (set with {group}.<key>=<value>):"]
    lines += [f"  {key:<26} {value:<16} {meaning}" for key, value, meaning in found.keys]
    return "\n".join(lines + ([found.note] if found.note else []))


def _show(node: Any) -> str:
    """A config value as it would be typed on the command line."""
    if isinstance(node, DictConfig | ListConfig):
        value = OmegaConf.to_container(node, resolve=False, enum_to_str=True)
    else:
        value = node._value()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value.value if isinstance(value, Enum) else value)


__all__ = ["GROUP_SCHEMAS", "OptionKeys", "describe", "group_options", "option_keys", "overview"]
