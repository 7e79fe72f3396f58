"""What every config schema shares: the user-error type, range checks that name the key, and the
one-line meaning of each field (the comment written beside it, shown by `--help GROUP=OPTION`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import io
import operator
import os
import textwrap
import tokenize
import types
import typing
from dataclasses import field, fields, is_dataclass
from typing import Any

from kiln.errors import UserError


class ConfigError(UserError, ValueError):
    """A user mistake in the config. Printed as one line: `error: <what> (<key>): <what to do>`."""

    def __init__(self, what: str, key: str = "", todo: str = ""):
        self.what, self.key, self.todo = what, key, todo
        where = f" ({key})" if key else ""
        super().__init__(f"{what}{where}" + (f": {todo}" if todo else ""))


def invalid(key: str, todo: str) -> ConfigError:
    return ConfigError("invalid value", key, todo)


def at_least(value: float, low: float, key: str, meaning: str = "") -> None:
    if value < low:
        raise invalid(
            key, f"must be >= {low:g}, got {value:g}" + (f" ({meaning})" if meaning else "")
        )


def in_range(value: float, low: float, high: float, key: str, *, open_low=False, open_high=False):
    too_low = value <= low if open_low else value < low
    too_high = value >= high if open_high else value > high
    if too_low or too_high:
        left, right = "(" if open_low else "[", ")" if open_high else "]"
        raise invalid(key, f"must be in {left}{low:g}, {high:g}{right}, got {value:g}")


def auto_or_count(value, low: int, key: str) -> None:
    """A setting that is "auto" (kiln decides, and logs why) or a count of at least `low`."""
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(key, f"must be auto or a whole number >= {low}, got {value!r}")
    at_least(value, low, key)


def limit_or_all(value: int, key: str) -> None:
    """-1 means no limit; 0 and other negatives are refused rather than read as 'no limit'."""
    if value != -1 and value < 1:
        raise invalid(key, f"must be -1 (no limit) or >= 1, got {value}")


def check_branch_defaults(schema: type, flags: tuple[str, ...], key: str, option: str = "") -> None:
    """Rule 2: every optional branch defaults to off in its schema, so a run gets a branch only
    when someone asked for it (a head built by default and trained by no loss, or a loss term
    nobody chose, changes the run silently)."""
    defaults = {f.name: f.default for f in fields(schema) if f.default is not dataclasses.MISSING}
    for flag in flags:
        if defaults.get(flag) is True:
            which = f"{key}={option}" if option else key
            raise ConfigError(
                f"rule 2 (every optional loss branch has a flag and must work): {which}'s "
                f"schema {schema.__name__} turns the branch {flag} on by default",
                f"{key}.{flag}",
                f"make {schema.__name__}.{flag} default to False and switch it on with "
                f"{key}.{flag}=true where a run wants it",
            )


def expand_user_paths(cfg: Any) -> Any:
    """The tree with `~` and `~user` expanded in every path key -- the keys a schema lists in its
    PATH_KEYS -- as the shell would, once, where the typed config is built: `init_from=~/w.pt`,
    'data.train_dir="~/photos"' and `resume=~/run/last.pt` mean the same home folder. A new
    tree: configs are frozen."""
    if not is_dataclass(cfg):
        return cfg
    changes = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in getattr(type(cfg), "PATH_KEYS", ()):
            if isinstance(value, str) and value.startswith("~"):
                changes[f.name] = os.path.expanduser(value)
        elif is_dataclass(value):
            expanded = expand_user_paths(value)
            if expanded is not value:
                changes[f.name] = expanded
    return dataclasses.replace(cfg, **changes) if changes else cfg


# OmegaConf makes the node of a frozen dataclass read-only the moment it is made, so Hydra could
# not set a key of one from a config file or the command line. kiln's schemas are frozen as the
# run holds them, not while they compose: Hydra composes each schema's mutable twin (the same
# name, fields, defaults and subclass relations, made with dataclasses.make_dataclass, its
# nested schemas twins too), and `frozen` turns what OmegaConf builds back into the schemas.
# A twin pickles (a joblib or submitit sweep sends the config to other processes): its
# __qualname__ names the schema it mirrors, which this module's __getattr__ rebuilds it from.
_TWINS: dict[type, type] = {}
_SCHEMAS: dict[type, type] = {}  # twin -> the frozen schema it mirrors
_TWIN_PREFIX = "mutable|"


def composable(schema: Any) -> Any:
    """The type Hydra composes for `schema`: its mutable twin when it is a frozen dataclass (a
    type annotation holding one, e.g. `X | None` or `list[X]`, with the twin in its place);
    anything else as it is."""
    if isinstance(schema, type) and is_dataclass(schema):
        if not schema.__dataclass_params__.frozen:
            return schema
        if schema not in _TWINS:
            _TWINS[schema] = _make_twin(schema)
        return _TWINS[schema]
    args = typing.get_args(schema)
    if not args:
        return schema
    twins = tuple(composable(arg) for arg in args)
    if twins == args:
        return schema
    origin = typing.get_origin(schema)
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, twins)
    return origin[twins]


def _make_twin(schema: type) -> type:
    try:
        hints = typing.get_type_hints(schema)
    except (NameError, TypeError):  # a plugin's annotation that names something unimported
        hints = {}
    spec = []
    for f in fields(schema):
        kind = composable(hints.get(f.name, f.type))
        if f.default_factory is not dataclasses.MISSING:
            default = field(default_factory=functools.partial(_thawed, f.default_factory))
        elif is_dataclass(f.default):  # a twin is mutable: a default instance is a factory
            default = field(default_factory=functools.partial(thaw, f.default))
        else:
            default = field(default=f.default)
        spec.append((f.name, kind, default))
    bases = tuple(composable(base) for base in schema.__bases__ if is_dataclass(base))
    twin = dataclasses.make_dataclass(
        schema.__name__, spec, bases=bases, kw_only=True, namespace={"__doc__": schema.__doc__}
    )
    twin.__module__ = __name__
    twin.__qualname__ = _TWIN_PREFIX + "|".join(
        part.replace(".", "/") for part in (schema.__module__, schema.__qualname__)
    )
    _SCHEMAS[twin] = schema
    return twin


def _thawed(factory) -> Any:
    return thaw(factory())


def __getattr__(name: str) -> type:
    """A twin by its __qualname__ (how pickle finds one), made if this process has not yet."""
    if not name.startswith(_TWIN_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, qualname = (part.replace("/", ".") for part in name[len(_TWIN_PREFIX) :].split("|"))
    schema: Any = importlib.import_module(module)
    for part in qualname.split("."):
        schema = getattr(schema, part)
    return composable(schema)


def schema_of(kind: type) -> type:
    """The frozen schema a twin mirrors (any other type: itself)."""
    return _SCHEMAS.get(kind, kind)


def frozen(value: Any) -> Any:
    """`value` with every twin instance in it (lists and dicts too) made its frozen schema."""
    return _remade(value, schema_of)


def thaw(value: Any) -> Any:
    """`value` with every frozen schema instance in it made its twin (what Hydra composes)."""
    return _remade(value, composable)


def _remade(value: Any, kind_of) -> Any:
    """`value` with each dataclass instance in it rebuilt as `kind_of(its type)`."""
    if is_dataclass(value) and not isinstance(value, type):
        kept = {f.name: getattr(value, f.name) for f in fields(value) if f.init}
        return kind_of(type(value))(**{k: _remade(v, kind_of) for k, v in kept.items()})
    if isinstance(value, list | tuple):
        return type(value)(_remade(item, kind_of) for item in value)
    if isinstance(value, dict):
        return {key: _remade(item, kind_of) for key, item in value.items()}
    return value


def check_tree(cfg: Any, path: str = "") -> None:
    """Run `check(path)` on every dataclass in the tree that defines one."""
    if not is_dataclass(cfg):
        return
    check = getattr(cfg, "check", None)
    if check is not None:
        check(path.rstrip("."))
    for f in fields(cfg):
        check_tree(getattr(cfg, f.name), f"{path}{f.name}.")


@functools.cache
def field_help(schema: type) -> dict[str, str]:
    """{field: the comment on the line that declares it}, for the schema and its bases."""
    help_text: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if not is_dataclass(cls) or cls is object:
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        help_text.update(_trailing_comments(source))
    return help_text


_LAYOUT = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT)


def _trailing_comments(source: str) -> dict[str, str]:
    """`name: type = default  # meaning` lines of a class body -> {name: meaning}; a field
    without a comment on its line takes the comment block right above it (a meaning too long
    for one line)."""
    comments: dict[str, str] = {}
    line_name: dict[int, str] = {}
    above: list[str] = []  # the comment lines since the last statement
    for token in tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline):
        if token.type == tokenize.NAME and token.start[1] == 4 and token.start[0] not in line_name:
            line_name[token.start[0]] = token.string
            if above:
                comments[token.string] = " ".join(above)
            above = []
        elif token.type == tokenize.COMMENT and token.start[0] in line_name:
            comments[line_name[token.start[0]]] = token.string.lstrip("# ").strip()
        elif token.type == tokenize.COMMENT and token.start[1] == 4:
            above.append(token.string.lstrip("# ").strip())
        elif token.type not in _LAYOUT:
            above = []  # code between the comment and the next field: not its meaning
    return comments
