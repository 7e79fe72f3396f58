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
NOT_CARRIED = ("resume", "resume_override", "hydra.run.dir", "hydra.sweep.dir",
               "hydra.sweep.subdir", "hydra.output_subdir")  # fmt: skip
HYDRA_CARRIED = ("hydra.searchpath",)  # Hydra's own overrides that shape the config
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

    @classmethod
    def of(cls, task: Iterable[str], hydra: Iterable[str] = ()) -> RunCommand:
        """From Hydra's task overrides and its own (hydra.overrides.task / .hydra)."""
        extras = env_extras()
        kept = [o for o in task if key_of(o) not in NOT_CARRIED and o not in extras]
        kept += [o for o in hydra if key_of(o) in HYDRA_CARRIED]
        return cls(tuple(kept))

    @classmethod
    def of_run(cls, run_dir: Path) -> RunCommand:
        """From what Hydra recorded in the run's .hydra/ folder."""
        hydra_dir = Path(run_dir) / ".hydra"
        task = _read_yaml(hydra_dir / "overrides.yaml") or []
        hydra_cfg = (_read_yaml(hydra_dir / "hydra.yaml") or {}).get("hydra", {})
        return cls.of(task, (hydra_cfg.get("overrides") or {}).get("hydra") or [])

    def train(self, *extra: str) -> str:
        """The train.py command line; `extra` overrides replace the run's own of the same key."""
        replaced = {key_of(o) for o in extra}
        kept = [o for o in self.overrides if key_of(o) not in replaced]
        return line(script("train.py"), [*kept, *extra])


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
