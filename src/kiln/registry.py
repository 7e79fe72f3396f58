"""Registries: a dict plus a decorator, one per kind of part. Each entry has a name (the config
option that selects it), its typed config schema, and its builder.

    @register_model("my_mlp", config=MyMlpConfig)
    def build_my_mlp(spec, cfg, *, aux_head=False): ...

kiln's own entries are declared with the import path of their builder
(`MODELS.declare("mlp", "kiln.models.mlp:build_mlp", config=MlpConfig)`, next to the schema in
`kiln.config`), so listing options, composing a config or printing `--help` never imports torch;
the builder's module is imported when the entry is first built. The registries fill themselves
on first use (`load_builtins`), whatever was imported before, and a user's modules are imported
by `load_plugins` (config key `plugins`, or the `kiln.plugins` entry-point group). A plugin that
ships option YAMLs declares their folder with `register_config_dir`, so no hydra.searchpath is
needed. A checkpoint records its run's plugins (and where each was imported from,
`plugin_sources`), but never chooses code to import: inference checks that the command imported
them (`check_plugins`: infer.py plugins=[...]) and says what to add when it did not."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import shlex
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from kiln.errors import UserError, attempt, did_you_mean, first_few

BUILTIN_MODULES = (  # where kiln's own entries are declared (torch-free)
    "kiln.config.data",
    "kiln.config.model",
    "kiln.config.optim",
    "kiln.config.run",
)
ENTRY_POINT_GROUP = "kiln.plugins"


class UnknownNameError(UserError):
    """A name that is not in a registry; the message lists the known names."""


@dataclass(frozen=True)
class Entry:
    name: str
    target: Callable | str | None  # the builder, or "module:attribute" imported on first use
    config: type | None  # the option's typed schema (a dataclass), if it has one
    # What the entry declares about itself, e.g. a model's accepted input kinds
    # (inputs=("image",)) or the input kind a dataset provides (provides="tokens").
    meta: dict = field(default_factory=dict)

    def load(self) -> Callable:
        if not isinstance(self.target, str):
            return self.target
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)


class Registry:
    def __init__(self, kind: str, group: str | None = None):
        self.kind = kind  # "model", "logger backend", ...
        self.group = group  # the config group whose options these are, if any
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, *, config: type | None = None, **meta) -> Callable:
        """Decorator: register a builder (a function or class) under `name`."""

        def decorator(fn):
            self._add(Entry(name, fn, config, meta))
            return fn

        return decorator

    def declare(self, name: str, target: str, *, config: type | None = None, **meta) -> None:
        """Register a builder by its import path, loaded when first used."""
        self._add(Entry(name, target, config, meta))

    def _add(self, entry: Entry) -> None:
        if entry.name in self._entries:
            raise ValueError(f"{self.kind} {entry.name!r} is already registered")
        config = entry.config
        if dataclasses.is_dataclass(config) and not config.__dataclass_params__.frozen:
            raise PluginConfigError(
                f"{self.kind} {entry.name!r}: its config {config.__qualname__} "
                f"({_defined_at(config)}) is a plain @dataclass: {FROZEN_HOWTO}"
            )
        self._entries[entry.name] = entry

    def entry(self, name: str) -> Entry:
        load_builtins()
        try:
            return self._entries[name]
        except KeyError:
            raise self.unknown(name) from None

    def get(self, name: str) -> Callable:
        """The builder registered as `name` (its module imported if it was declared lazily)."""
        return self.entry(name).load()

    def names(self) -> list[str]:
        load_builtins()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        load_builtins()
        return name in self._entries

    def unknown(self, name: str) -> UnknownNameError:
        return UnknownNameError(
            f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._entries))}"
            f"{did_you_mean(name, self._entries)}{skipped_plugins(name)}"
        )


MODELS = Registry("model", group="model")
DATASETS = Registry("dataset", group="data")
OPTIMIZERS = Registry("optimizer", group="optimizer")
SCHEDULERS = Registry("scheduler", group="scheduler")
PRECISIONS = Registry("precision", group="precision")
LOGGERS = Registry("logger backend")  # chosen by logger.backends, not by a group option
EVALUATORS = Registry("evaluator")  # one per task, chosen by the dataset's task

# Config groups whose options are registry entries: each option's schema comes from its entry.
GROUP_REGISTRIES = {r.group: r for r in (DATASETS, MODELS, OPTIMIZERS, SCHEDULERS, PRECISIONS)}

INPUT_KINDS = ("image", "tokens", "image_list")  # what DataSpec.input_kind can say


def model_inputs(name: str) -> tuple[str, ...]:
    """The input kinds a registered model declares it accepts (default: images)."""
    return tuple(MODELS.entry(name).meta.get("inputs", ("image",)))


def dataset_provides(name: str) -> str:
    """The input kind a registered dataset declares it provides (default: images)."""
    return DATASETS.entry(name).meta.get("provides", "image")


def compatible_pairs() -> list[tuple[str, str]]:
    """(model, dataset) for every registered model and every dataset whose inputs it accepts."""
    return [
        (model, data)
        for model in MODELS.names()
        for data in DATASETS.names()
        if dataset_provides(data) in model_inputs(model)
    ]


register_model = MODELS.register
register_dataset = DATASETS.register
register_optimizer = OPTIMIZERS.register
register_scheduler = SCHEDULERS.register
register_precision = PRECISIONS.register
register_logger = LOGGERS.register
register_evaluator = EVALUATORS.register

_builtins_loaded = False
_PLUGIN_SOURCES: dict[str, str] = {}  # module -> the sys.path folder it was imported from
_CONFIG_DIRS: list[str] = []  # search path entries ("file:///...") of plugins' option YAMLs
_PLUGIN_PACKAGES: dict[str, dict] = {}  # module -> its distribution, for entry-point plugins
_BROKEN_PLUGINS: dict[str, str] = {}  # entry point -> why it was skipped


def load_builtins() -> None:
    """Declare kiln's own entries, once. Called by every registry lookup."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def load_plugins(modules: Iterable[str] = ()) -> list[str]:
    """Import the user's modules (which register entries) and those advertised under the
    `kiln.plugins` entry-point group. The working directory is importable, as with `python -m`.
    `modules` come from the user (plugins=[...] of a command line), never from a checkpoint.
    Returns the module names imported."""
    load_builtins()
    if str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    imported = []
    for module in modules:
        if module not in sys.modules:
            _import_plugin(module)
        _PLUGIN_SOURCES.setdefault(module, _source_folder(module))
        imported.append(module)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in _BROKEN_PLUGINS:
            continue
        _, err = attempt(point.load)
        if err is not None:  # an installed package we do not control: skip it, say so
            _skip_broken(point, err)
            continue
        _PLUGIN_PACKAGES.setdefault(point.module, _package_of(point))
        imported.append(point.value)
    return imported


def _package_of(point) -> dict[str, str | None]:
    """The installed distribution an entry point comes from: what a checkpoint records, so
    that a machine without it is told which package to install."""
    dist = getattr(point, "dist", None)
    return {
        "distribution": dist.name if dist else None,
        "version": dist.version if dist else None,
        "entry_point": point.name,
    }


def _skip_broken(point, err: Exception) -> None:
    """A plugin package that fails to import stops no command that does not need it (`--help`
    included); a lookup of a name it may have provided says why it is missing."""
    package = _package_of(point)
    where = f"{package['distribution']} {package['version']}" if package["distribution"] else ""
    why = f"{type(err).__name__}: {_first_line(err)}"
    if is_plain_dataclass_error(err):
        why = str(plain_dataclass_error(point.module, err))
    _BROKEN_PLUGINS[point.name] = (
        f"the installed plugin {point.name!r} ({', '.join(filter(None, [where, point.value]))}) "
        f"failed to import: {why}"
    )
    logging.getLogger(__name__).warning("%s; skipped", _BROKEN_PLUGINS[point.name])


def skipped_plugins(name: str) -> str:
    """What to add to an unknown-name error while an installed plugin failed to import."""
    return "".join(f"; {why} (it may provide {name!r})" for why in _BROKEN_PLUGINS.values())


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else ""


def _package_from_metadata(module: str) -> dict[str, str | None] | None:
    """A plugins=[...] module that belongs to an installed distribution (pip install -e
    my-parts, say): which one, so a checkpoint records it as it does an entry point's."""
    from importlib.metadata import packages_distributions, version

    names = packages_distributions().get(module.split(".")[0], [])
    if not names:
        return None
    return {"distribution": names[0], "version": version(names[0]), "entry_point": None}


def plugin_packages(modules: Iterable[str]) -> dict[str, dict[str, str | None]]:
    """{module: {distribution, version, entry_point}} for every plugin this process imported
    from an installed package: the entry-point ones and those plugins=[...] named."""
    found = dict(_PLUGIN_PACKAGES)
    for module in modules:
        package = _package_from_metadata(module) if module in sys.modules else None
        if package and module not in found:
            found[module] = package
    return found


def check_plugins(
    modules: list[str],
    packages: dict[str, dict],
    sources: dict[str, str],
    checkpoint: str,
) -> None:
    """What a checkpoint's run imported -- its plugins=[...] `modules` (found in `sources`
    folders) and installed plugin `packages` -- checked against what this process imported,
    never imported on the checkpoint's word: its record is data anyone can edit, and a module
    it names (with a folder to put on sys.path) would run as soon as it is imported. The
    installed packages' entry points are loaded here, as every command loads them; the
    plugins=[...] modules the user names (infer.py plugins=[...], or an `import` in Python).
    One PluginImportError says what is missing and what to add."""
    load_plugins()  # kiln's own entries and the installed entry points: this machine's choice
    missing = [m for m in modules if m not in sys.modules]
    if missing:
        override = shlex.quote(f"plugins=[{','.join(modules)}]")
        where = "; ".join(f"{m} was imported from {sources[m]}" for m in missing if sources.get(m))
        raise PluginImportError(
            f"checkpoint {checkpoint} was trained with {override}, and this command imported "
            f"no {first_few(missing)}: kiln imports no code a checkpoint names; add {override} "
            "to the command (from the folder the module is in, or with it on PYTHONPATH"
            + (f": {where})" if where else ")")
        )
    for module, package in packages.items():
        if module in sys.modules:
            continue
        dist, version = package.get("distribution"), package.get("version")
        pinned = f"{dist}=={version}" if version else dist
        entry = package.get("entry_point")
        point = f" (entry point {entry!r})" if entry else ""
        raise PluginImportError(
            f"checkpoint {checkpoint} was trained with the plugin {module!r} from the package "
            f"{pinned}{point}, which is not installed here; install it: pip install '{pinned}'"
        )


def _import_plugin(module: str) -> None:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise _not_importable(module, err) from None
    except TypeError as err:
        if not is_plain_dataclass_error(err):
            raise
        raise plain_dataclass_error(module, err) from None


class PluginImportError(UserError, ImportError):
    """plugins=[...] names a module that cannot be found."""


class PluginConfigError(UserError, TypeError):
    """A plugin's config class that is not a frozen dataclass."""


FROZEN_HOWTO = (
    "write @dataclass(frozen=True, kw_only=True) above it, as kiln's own configs are (a "
    "value derived from a config is a new value: dataclasses.replace(cfg, ...))"
)


def is_plain_dataclass_error(err: BaseException) -> bool:
    """The TypeError `dataclasses` raises for a plain @dataclass under a frozen one."""
    return isinstance(err, TypeError) and "non-frozen dataclass from a frozen one" in str(err)


def plain_dataclass_error(module: str, err: TypeError) -> PluginConfigError:
    """One line for a plugin whose config class is a plain @dataclass under one of kiln's
    frozen configs (dataclasses' own TypeError ends a 34-line traceback): the class, where it
    is, what to write instead."""
    import traceback

    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if not f.filename.endswith(("dataclasses.py", "importlib/__init__.py"))
        and "<frozen" not in f.filename
    ]
    where, name = "", "a config class"
    if frames:
        frame = frames[-1]
        where = f"{frame.filename}:{frame.lineno}"
        name = _class_named_at(frame.filename, frame.lineno) or name
    return PluginConfigError(
        f"plugins: {module}: {name} ({where or 'its module'}) is a plain @dataclass under one "
        f"of kiln's frozen configs: {FROZEN_HOWTO}"
    )


def _class_named_at(filename: str, lineno: int) -> str | None:
    """The class whose statement (or decorator) is at `lineno` of `filename`."""
    import linecache
    import re

    for number in range(lineno, lineno + 5):
        found = re.match(r"\s*class\s+(\w+)", linecache.getline(filename, number))
        if found:
            return found.group(1)
    return None


def _defined_at(cls: type) -> str:
    import inspect

    try:
        return f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        return cls.__module__


def _not_importable(module: str, err: Exception) -> ImportError:
    return PluginImportError(
        f"plugins: cannot import {module!r} ({err}); a plugin is a module name importable "
        "from the working directory or PYTHONPATH (my_model for ./my_model.py)"
    )


def _source_folder(module: str) -> str:
    """The folder to put on sys.path to import `module` again (its top package's parent)."""
    top = sys.modules[module.split(".")[0]]
    location = getattr(top, "__file__", None) or next(iter(getattr(top, "__path__", [])), "")
    path = Path(location).resolve()
    return str(path.parent.parent if path.name == "__init__.py" else path.parent)


def plugin_sources(modules: Iterable[str]) -> dict[str, str]:
    """{module: the folder it was imported from} for the given plugin modules."""
    return {m: _PLUGIN_SOURCES.get(m) or _source_folder(m) for m in modules if m in sys.modules}


def register_config_dir(path: str | Path) -> None:
    """Add a folder of option YAMLs (conf/<group>/<option>.yaml) to the config search path, as
    hydra.searchpath=[file://<path>] would. A plugin module calls it when imported:

        register_config_dir(Path(__file__).parent / "conf")
    """
    entry = str(path) if "://" in str(path) else f"file://{Path(path).resolve()}"
    if entry not in _CONFIG_DIRS:
        _CONFIG_DIRS.append(entry)


def config_dirs() -> list[str]:
    """The search path entries plugins registered (kiln's Hydra SearchPathPlugin adds them)."""
    return list(_CONFIG_DIRS)


def describe_registries() -> dict[str, Any]:
    """{kind: names} for every registry: what `kiln-train --help` and the tests list."""
    return {r.kind: r.names() for r in (*GROUP_REGISTRIES.values(), LOGGERS, EVALUATORS)}
