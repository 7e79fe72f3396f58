"""The commands kiln prints -- at the end of a run, in a sweep's summary, in `kiln triage` --
work as printed: they call the script the way the user did, from the directory they ran it in,
with the run's own overrides and what its plugins need (`plugins=[...]` and
`hydra.searchpath=[...]`), and every path in them exists."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from kiln.config import REPO_ROOT

# Overrides a printed command sets itself, or that name this run's directory: never carried.
NOT_CARRIED = (
    "resume",
    "resume_override",
    "hydra.run.dir",
    "hydra.sweep.dir",
    "hydra.sweep.subdir",
    "hydra.output_subdir",
)
HYDRA_CARRIED = ("hydra.searchpath",)  # Hydra's own overrides that shape the config
# Where the libraries' caches are (the Hugging Face hub's, torch.hub's): a run whose model came
# from one needs them again; its printed train commands set those the run had set.
CACHE_VARIABLES = (
    "HF_HOME",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "TORCH_HOME",
    "XDG_CACHE_HOME",
)
INSTALLED = {"train.py": "kiln-train", "infer.py": "kiln-infer"}


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def shown(path: str | Path) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    path = Path(path)
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def script(name: str) -> str:
    """How to call kiln's `name` (train.py, infer.py) from here: beside the train.py the user
    typed, else ./name, else the checkout's file, else the installed command."""
    typed = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    candidates = []
    if typed is not None and typed.name in INSTALLED:
        candidates.append(typed.parent / name)
    candidates += [Path(name), REPO_ROOT / name]
    for candidate in candidates:
        if candidate.is_file():
            path = shown(candidate) if candidate.is_absolute() else str(candidate)
            if os.environ.get("WORLD_SIZE", "1") != "1" and name == "train.py":
                ranks = os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
                return f"torchrun --nproc_per_node={ranks} {path}"
            return f"python {path}"
    return INSTALLED[name]


def env_extras() -> set[str]:
    """KILN_OVERRIDES (appended to every train.py command line): not the user's, never printed."""
    return set(os.environ.get("KILN_OVERRIDES", "").split())


@dataclass(frozen=True)
class RunCommand:
    """The overrides that make a run what it is, as they must be typed again."""

    overrides: tuple[str, ...]
    # NAME=value set before the command: the caches a pretrained model was read from
    environment: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(
        cls, task: Iterable[str], hydra: Iterable[str] = (), environment: Iterable = ()
    ) -> RunCommand:
        """From Hydra's task overrides and its own (hydra.overrides.task / .hydra)."""
        extras = env_extras()
        kept = [o for o in task if key_of(o) not in NOT_CARRIED and o not in extras]
        kept += [o for o in hydra if key_of(o) in HYDRA_CARRIED]
        return cls(tuple(kept), tuple(environment))

    @classmethod
    def of_run(cls, run_dir: Path) -> RunCommand:
        """From what Hydra recorded in the run's .hydra/ folder (and the caches its model
        was read from, as its environment.json recorded them)."""
        from kiln.engine.environment import read_environment

        hydra_dir = Path(run_dir) / ".hydra"
        task = _read_yaml(hydra_dir / "overrides.yaml") or []
        hydra_cfg = (_read_yaml(hydra_dir / "hydra.yaml") or {}).get("hydra", {})
        model = (run_config(run_dir).get("model") or {}).get("name")
        environment = cache_environment(model, read_environment(run_dir) or {})
        return cls.of(task, (hydra_cfg.get("overrides") or {}).get("hydra") or [], environment)

    def train(self, *extra: str) -> str:
        """The train.py command line; `extra` overrides replace the run's own of the same key."""
        replaced = {key_of(o) for o in extra}
        kept = [o for o in self.overrides if key_of(o) not in replaced]
        prefix = [f"{name}={shlex.quote(value)}" for name, value in self.environment]
        return " ".join([*prefix, line(script("train.py"), [*kept, *extra])])


def cache_environment(model: str | None, environ) -> tuple[tuple[str, str], ...]:
    """The cache variables of `environ` a run of `model` needs again: those set, when the
    model reads pretrained weights (its schema has `weights`: the zoo's models, model=hf),
    else none."""
    import dataclasses

    from kiln.registry import MODELS

    if model is None or model not in MODELS.names():
        return ()
    schema = MODELS.entry(model).config
    if schema is None or "weights" not in {f.name for f in dataclasses.fields(schema)}:
        return ()
    return tuple((name, environ[name]) for name in CACHE_VARIABLES if environ.get(name))


def infer(*args: str) -> str:
    return line(script("infer.py"), list(args))


def plugin_override(config: dict | None) -> tuple[str, ...]:
    """infer.py's plugins=[...] for a run's checkpoint: the modules the run named (inference
    imports none on a checkpoint's word: kiln.registry.check_plugins)."""
    modules = list((config or {}).get("plugins") or [])
    return (f"plugins=[{','.join(modules)}]",) if modules else ()


def run_config(run_dir: Path) -> dict:
    """The run's resolved config as Hydra recorded it (.hydra/config.yaml), or {}."""
    return _read_yaml(Path(run_dir) / ".hydra" / "config.yaml") or {}


def line(program: str, args: list[str]) -> str:
    return " ".join([program, *(shlex.quote(a) for a in args)])


def _read_yaml(path: Path):
    return yaml.safe_load(path.read_text()) if path.is_file() else None
