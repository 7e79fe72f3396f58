"""`python train.py --help [GROUP[=OPTION]]`: the groups and their options, or one option's keys
with their defaults and meanings. Answered from the registries, the schemas and conf/, without
importing torch."""

from __future__ import annotations

from dataclasses import fields
from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from kiln.config import CONF_DIR, GROUP_SCHEMAS, ConfigError, KilnConfig, compose, field_help
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


def describe(target: str) -> str:
    """`group` or `group=option` -> its keys with defaults and meanings (a plugin's options
    too: their YAML folders are on the search path, kiln.registry.register_config_dir)."""
    group, _, option = target.partition("=")
    if group not in GROUP_ORDER:
        raise ConfigError(f"unknown group {group!r}", "--help", f"groups: {', '.join(GROUP_ORDER)}")
    option = option or defaults().get(group, "")
    cfg = compose([f"{group}={option}"] if option else [])
    node = cfg.get(group)
    if group in ("env", "debug", "experiment", "hparams_search") or not isinstance(
        node, DictConfig
    ):
        path = CONF_DIR / group / f"{option}.yaml"
        text = path.read_text() if path.is_file() else OmegaConf.to_yaml(node)
        return f"{group}={option} ({path if path.is_file() else 'composed'}):\n" + text
    schema = OmegaConf.get_type(node)
    meanings = field_help(schema)
    title = (schema.__doc__ or "").strip().splitlines()[0] if schema.__doc__ else ""
    lines = [f"{group}={option}: {title}", f"keys (set with {group}.<key>=<value>):"]
    for key in node:
        if key == "name" and group in GROUP_REGISTRIES:
            continue
        value = _show(node._get_node(key))
        lines.append(f"  {key:<26} {value:<16} {meanings.get(key, '')}")
    note = (
        GROUP_REGISTRIES[group].entry(option).meta.get("help")
        if group in GROUP_REGISTRIES
        else None
    )
    return "\n".join(lines + ([note] if note else []))


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


__all__ = ["GROUP_SCHEMAS", "describe", "group_options", "overview"]
